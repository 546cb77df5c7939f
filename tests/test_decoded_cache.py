"""The decoded-image cache (``cache="decoded"``), device-side augmentation and the JPEG decoder (issue 21).

* The cache stores, per split, exactly what the uncached evaluation transform resizes (``load_image`` + torchvision's
  ``Resize`` on the PIL image), is rebuilt when a source file, the size or the format version changes, pickles
  without its pixels (DataLoader workers map the file themselves), records undecodable files so that they fail
  (or are skipped) as an uncached read does, and is built once by ``prepare_data``.
* Cached and uncached training loaders give the same batches of items, with crops of the same statistics;
  evaluation from the cache is bit-identical when ``cache_size == resize_size``.
* ``augment_on_device=True`` gives the batches of ``augment_on_device=False`` bit for bit (the flip and the
  conversion only move after the transfer), with and without the cache, with worker processes too, and a
  resumed loader continues bit-identically.
* simplejpeg decodes the JPEGs PIL decodes to the same pixels, falls back to PIL for everything else and keeps
  PIL's error messages.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as TF

import lightning_dml.data.decoded_cache as decoded_cache
from lightning_dml.data import CUB200DataModule, ImageFolderDataModule
from lightning_dml.data.decoded_cache import DecodedImageListDataset, open_decoded_cache
from lightning_dml.data.image_list import JPEG_DECODER_ENV, CorruptImageError, _decode_jpeg, jpeg_decoder, load_image
from lightning_dml.data.resumable import ResumableDataLoader
from lightning_dml.data.transforms import DeviceImage
from lightning_dml.errors import NotEnoughDiskSpaceError
from lightning_dml.models import BNINCEPTION
from tests.fixtures_data import corrupt_file, make_cub200


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    """Every test gets its own cache root (tests may run in parallel)."""
    monkeypatch.setenv("LIGHTNING_DML_CACHE", str(tmp_path / "cache"))


def gradient_folder(root: Path, train_classes: int = 6, test_classes: int = 3, per_class: int = 8,
                    size: tuple[int, int] = (48, 36)) -> Path:
    """``root/train/<class>/*.png`` + ``root/test/<class>/*.png``: a left-to-right brightness ramp (so that crops
    and flips change the statistics), a class tint and noise; sizes vary a little (the cache stores each shape)."""
    rng = np.random.default_rng(0)
    for split, count in (("train", train_classes), ("test", test_classes)):
        for c in range(count):
            tint = rng.integers(0, 80, size=3)
            for k in range(per_class):
                width, height = size[0] + 4 * (k % 3), size[1] + 2 * (k % 2)
                ramp = np.linspace(0, 170, width)[None, :, None]
                pixels = np.clip(ramp + tint + rng.normal(0, 10, size=(height, width, 3)), 0, 255).astype(np.uint8)
                folder = root / split / f"{split}_{c}"
                folder.mkdir(parents=True, exist_ok=True)
                Image.fromarray(pixels).save(folder / f"{k}.png")
    return root


def folder_module(root: Path, **kwargs) -> ImageFolderDataModule:
    options = dict(classes_per_batch=3, samples_per_class=4, image_size=24, num_workers=0, check_counts=False)
    options.update(kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm = ImageFolderDataModule(root, **options)
        dm.prepare_data()
        dm.setup()
    return dm


def finished(dm, batch):
    """A training batch as the model sees it (the data module's hook after the transfer; here on the CPU)."""
    return dm.on_after_batch_transfer(batch, 0)


def epoch_batches(dm, epochs=(0,)):
    loader = dm.train_dataloader()
    out = []
    for epoch in epochs:
        loader.batch_sampler.set_epoch(epoch)
        out += [finished(dm, b) for b in loader]
    return out


# ============================================================================ the JPEG decoder
def _jpeg_variants(folder: Path) -> dict[str, Path]:
    rng = np.random.default_rng(3)
    colour = Image.fromarray(np.clip(rng.normal(128, 60, (37, 53, 3)), 0, 255).astype(np.uint8))
    big = Image.fromarray(rng.integers(0, 256, (203, 301, 3), dtype=np.uint8))
    variants = {
        "4:2:0": (colour, dict(quality=90)),
        "4:4:4": (colour, dict(quality=90, subsampling=0)),
        "4:2:2": (colour, dict(quality=75, subsampling=1)),
        "progressive": (colour, dict(quality=85, progressive=True)),
        "quality 100": (big, dict(quality=100)),
        "grey": (colour.convert("L"), dict(quality=90)),
    }
    folder.mkdir(parents=True, exist_ok=True)
    paths = {}
    for name, (image, options) in variants.items():
        paths[name] = folder / f"{name.replace(':', '').replace(' ', '_')}.jpg"
        image.save(paths[name], format="JPEG", **options)
    return paths


@pytest.mark.parametrize("box", [None, (3.5, 2.0, 40.2, 30.0)])
@pytest.mark.parametrize("mode", ["RGB", "L"])
@pytest.mark.parametrize("variant", ["4:2:0", "4:4:4", "4:2:2", "progressive", "quality 100", "grey"])
def test_simplejpeg_decodes_the_pixels_pil_decodes(tmp_path, monkeypatch, variant, mode, box):
    pytest.importorskip("simplejpeg")
    path = _jpeg_variants(tmp_path)[variant]
    monkeypatch.setenv(JPEG_DECODER_ENV, "simplejpeg")
    assert jpeg_decoder() == "simplejpeg"
    assert _decode_jpeg(path, mode) is not None  # the fast path did decode it (no silent fallback)
    fast = load_image(path, mode, box)
    monkeypatch.setenv(JPEG_DECODER_ENV, "pil")
    assert jpeg_decoder() == "pil"
    reference = load_image(path, mode, box)
    assert fast.mode == reference.mode == mode and fast.size == reference.size
    np.testing.assert_array_equal(np.asarray(fast), np.asarray(reference))


def test_other_jpegs_and_formats_are_left_to_pil(tmp_path, monkeypatch):
    pytest.importorskip("simplejpeg")
    monkeypatch.setenv(JPEG_DECODER_ENV, "simplejpeg")
    rng = np.random.default_rng(4)
    pixels = rng.integers(0, 256, (20, 30, 4), dtype=np.uint8)
    cmyk = tmp_path / "cmyk.jpg"
    Image.fromarray(pixels, "CMYK").save(cmyk, format="JPEG", quality=90)
    png_named_jpg = tmp_path / "png.jpg"
    Image.fromarray(pixels[..., :3]).save(png_named_jpg, format="PNG")
    for path in (cmyk, png_named_jpg):
        assert _decode_jpeg(path, "RGB") is None
        with Image.open(path) as image:
            expected = np.asarray(image.convert("RGB"))
        np.testing.assert_array_equal(np.asarray(load_image(path)), expected)


def test_a_damaged_jpeg_fails_with_pils_message(tmp_path, monkeypatch):
    pytest.importorskip("simplejpeg")
    path = _jpeg_variants(tmp_path)["quality 100"]
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * 0.6)])
    messages = []
    for decoder in ("simplejpeg", "pil"):
        monkeypatch.setenv(JPEG_DECODER_ENV, decoder)
        with pytest.raises(OSError) as error:
            load_image(path)
        messages.append(f"{type(error.value).__name__}: {error.value}")
    assert messages[0] == messages[1] and "truncated" in messages[0]


def test_decoder_choice_is_checked(monkeypatch):
    monkeypatch.setenv(JPEG_DECODER_ENV, "libjpeg")
    with pytest.raises(ValueError, match="LIGHTNING_DML_JPEG_DECODER must be 'simplejpeg' or 'pil', got 'libjpeg'"):
        jpeg_decoder()


# ============================================================================ the store
def _split(tmp_path: Path) -> tuple[Path, list[Path]]:
    top = gradient_folder(tmp_path / "images", train_classes=2, test_classes=1, per_class=3)
    return top, sorted((top / "train").rglob("*.png"))


@pytest.mark.parametrize(("mode", "interpolation", "boxes"), [
    ("RGB", "bilinear", False), ("L", "bicubic", False), ("RGB", "bilinear", True),
])
def test_cache_holds_the_resized_decode_of_every_image(tmp_path, mode, interpolation, boxes):
    top, paths = _split(tmp_path)
    box = np.tile([[2.0, 1.5, 30.0, 25.0]], (len(paths), 1)) + np.arange(len(paths))[:, None] if boxes else None
    lines = []
    view, info = open_decoded_cache(paths, top, "train", 20, mode, interpolation, box, progress=False, log=lines.append)
    assert info.built and len(view) == len(paths)
    for i, path in enumerate(paths):
        image = load_image(path, mode, None if box is None else box[i])
        expected = np.asarray(TF.resize(image, [20], interpolation=InterpolationMode(interpolation), antialias=True))
        got = view.pixels(i)
        assert got.dtype == torch.uint8 and got.shape[0] == (1 if mode == "L" else 3) and min(got.shape[1:]) == 20
        np.testing.assert_array_equal(got.permute(1, 2, 0).numpy().reshape(expected.shape), expected)
    # the size is printed and right
    assert info.nbytes == sum(int(np.prod(view.pixels(i).shape)) for i in range(len(view))) == view.nbytes
    assert f"built {len(paths)} images at 20 px" in lines[0] and decoded_cache.format_bytes(info.nbytes) in lines[0]
    index = json.loads(info.index_file.read_text())
    assert index["size"] == 20 and index["mode"] == mode and len(index["files"]) == len(paths)


def test_cache_is_reused_and_rebuilt_when_a_source_or_setting_changes(tmp_path, monkeypatch):
    top, paths = _split(tmp_path)
    view, info = open_decoded_cache(paths, top, "train", 20, progress=False)
    first = view.pixels(0).clone()
    again, info2 = open_decoded_cache(paths, top, "train", 20, progress=False)
    assert info.built and not info2.built and info2.index_file == info.index_file
    data_file = again.data_file
    del view, again  # no view of the old data file lives any more (a live one keeps it: test_decoded_cache_readers)
    # a changed source file (new content, new mtime): rebuilt, with its new pixels; the old data file removed
    Image.fromarray(np.full((30, 40, 3), 7, dtype=np.uint8)).save(paths[0])
    os.utime(paths[0], ns=(10**18, 10**18))
    view3, info3 = open_decoded_cache(paths, top, "train", 20, progress=False)
    assert info3.built and not torch.equal(view3.pixels(0), first) and int(view3.pixels(0).max()) == 7
    assert not data_file.exists() and view3.data_file.exists()
    # another cache_size is another cache; a new format version rebuilds
    assert open_decoded_cache(paths, top, "train", 22, progress=False)[1].built
    assert not open_decoded_cache(paths, top, "train", 20, progress=False)[1].built
    monkeypatch.setattr(decoded_cache, "FORMAT_VERSION", decoded_cache.FORMAT_VERSION + 1)
    assert open_decoded_cache(paths, top, "train", 20, progress=False)[1].built
    # a deleted data file (the cache cleared by hand) rebuilds
    view3 = open_decoded_cache(paths, top, "train", 20, progress=False)[0]
    view3.data_file.unlink()
    assert open_decoded_cache(paths, top, "train", 20, progress=False)[1].built


def test_a_view_pickles_without_its_pixels(tmp_path):
    top, paths = _split(tmp_path)
    view, info = open_decoded_cache(paths, top, "train", 64, progress=False)
    expected = [view.pixels(i).clone() for i in range(len(view))]  # maps the file in this process
    data = pickle.dumps(view)
    assert info.nbytes > 50_000 and len(data) < 2_000  # a worker receives the file name and the index only
    clone = pickle.loads(data)
    assert all(torch.equal(clone.pixels(i), expected[i]) for i in range(len(view)))
    part = view.subset([2, 0])
    assert torch.equal(part.pixels(0), expected[2]) and torch.equal(part.pixels(1), expected[0])


def test_too_little_disk_space_is_one_error_naming_the_folder(tmp_path, monkeypatch):
    top, paths = _split(tmp_path)

    class Usage:
        free = 1000

    monkeypatch.setattr(decoded_cache.shutil, "disk_usage", lambda folder: Usage)
    with pytest.raises(NotEnoughDiskSpaceError, match=r"needs about .* free; .*LIGHTNING_DML_CACHE"):
        open_decoded_cache(paths, top, "train", 20, progress=False)
    assert not list((tmp_path / "cache").rglob("*.u8*"))  # nothing half-written left


@pytest.mark.parametrize("on_corrupt", ["error", "skip"])
def test_an_undecodable_file_fails_or_is_skipped_as_uncached(tmp_path, on_corrupt):
    top = gradient_folder(tmp_path / "images")
    victim = top / "train" / "train_1" / "2.png"
    corrupt_file(victim)
    dm = folder_module(top, cache="decoded", on_corrupt=on_corrupt, check_files=True)
    assert isinstance(dm.train_dataset, DecodedImageListDataset) and len(dm.train_dataset.decoded.failed) == 1
    position = dm.train_dataset.paths.index(victim)
    if on_corrupt == "error":
        with pytest.raises(CorruptImageError, match=rf"cannot read image {victim} \(item {position} of image folder "
                                                     r"train\): OSError: .*decoded-image cache.*on_corrupt: skip"):
            dm.train_dataset[position]
    else:
        with pytest.warns(RuntimeWarning, match=f"skipping cannot read image {victim}"):
            image, label, index = dm.train_dataset[position]
        assert index != position and label == int(dm.train_dataset.labels[position])
        assert dm.train_dataset.paths[index].parent == victim.parent  # another image of the same class


# ============================================================================ the data modules
def test_prepare_data_builds_once_and_setup_finds_it(tmp_path, monkeypatch):
    top = gradient_folder(tmp_path / "images")
    builds = []
    real = decoded_cache._build
    monkeypatch.setattr(decoded_cache, "_build", lambda *a, **k: builds.append(a[-4]) or real(*a, **k))
    dm = folder_module(top, cache="decoded")
    assert len(builds) == 2  # train and test, in prepare_data; setup found them
    folder_module(top, cache="decoded")
    assert len(builds) == 2
    folder_module(top, cache="decoded", cache_size=30)
    assert len(builds) == 4
    assert {type(dm.train_dataset), type(dm.test_dataset)} == {DecodedImageListDataset}


def test_cached_and_uncached_training_batches_have_the_same_items_and_crop_statistics(tmp_path):
    top = gradient_folder(tmp_path / "images")
    plain = folder_module(top)
    cached = folder_module(top, cache="decoded", cache_size=plain.resize_size)
    a, b = epoch_batches(plain, range(6)), epoch_batches(cached, range(6))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b):
        assert torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])  # the same items in the same order
        assert x[0].shape == y[0].shape and x[0].dtype == y[0].dtype == torch.float32
    images_a, images_b = torch.cat([x[0] for x in a]), torch.cat([y[0] for y in b])
    assert not torch.equal(images_a, images_b)  # the crops are cut from other pixels
    # the same statistics: per channel, and the left-to-right profile (the ramp: crop positions and flips)
    for dims in ((0, 2, 3), (0, 1, 2)):
        mean_a, mean_b = images_a.mean(dims), images_b.mean(dims)
        assert torch.allclose(mean_a, mean_b, atol=0.08), (mean_a, mean_b)
    assert torch.allclose(images_a.std((0, 2, 3)), images_b.std((0, 2, 3)), rtol=0.05)
    # the same flips (the same seeds): the ramp rises to the right unless the crop was flipped. Not every item: the
    # random resized crop redraws a box that does not fit, and on the smaller cached image a box near the limit
    # may fit where it did not (or the reverse), after which the rest of that batch draws from another point of
    # the stream (96% agree here, 50% would be independent flips)
    def rises(images: torch.Tensor) -> torch.Tensor:
        half = images.shape[-1] // 2
        return images[..., half:].mean((1, 2, 3)) > images[..., :half].mean((1, 2, 3))

    assert 0.2 < rises(images_a).float().mean() < 0.8
    assert (rises(images_a) == rises(images_b)).float().mean() > 0.85


@pytest.mark.parametrize("crop_to_box", [False, True])
def test_evaluation_from_the_cache_is_bit_identical(tmp_path, crop_to_box):
    make_cub200(tmp_path, images_per_class=2, num_classes=8, size=(61, 47))

    class SmallCUB(CUB200DataModule):
        last_train_class = 4  # classes 1-4 train, 5-8 test

    def module(**kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dm = SmallCUB(tmp_path, classes_per_batch=2, samples_per_class=2, image_size=32, resize_size=40,
                                  input_spec=BNINCEPTION, check_counts=False, num_workers=0, crop_to_box=crop_to_box,
                                  eval_batch_size=5, **kwargs)
            dm.prepare_data()
            dm.setup()
        return dm

    plain, cached = module(), module(cache="decoded", cache_size=40)
    for x, y in zip(plain.test_dataloader(), cached.test_dataloader(), strict=True):
        assert torch.equal(x[0], y[0]) and torch.equal(x[2], y[2])
    other = module(cache="decoded", cache_size=48)  # resized a second time: close, not equal
    x, y = next(iter(plain.test_dataloader())), next(iter(other.test_dataloader()))
    assert x[0].shape == y[0].shape and (x[0] - y[0]).abs().mean() < 3.0  # BN-Inception: 0-255 scale


@pytest.mark.parametrize("cache", [None, "decoded"])
def test_device_augmentation_gives_the_workers_batches_bit_for_bit(tmp_path, cache):
    top = gradient_folder(tmp_path / "images")
    reference = epoch_batches(folder_module(top, cache=cache), range(2))
    device = folder_module(top, cache=cache, augment_on_device=True)
    raw = next(iter(device.train_dataloader()))
    assert isinstance(raw[0], DeviceImage) and raw[0].pixels.dtype == torch.uint8 and raw[0].flip.dtype == torch.bool
    assert 0 < int(raw[0].flip.sum()) < len(raw[0].flip)  # some flipped, some not
    moved = epoch_batches(device, range(2))
    assert len(moved) == len(reference)
    for x, y in zip(reference, moved):
        assert torch.equal(x[0], y[0]) and torch.equal(x[2], y[2])


def test_device_augmentation_and_cache_with_worker_processes(tmp_path):
    top = gradient_folder(tmp_path / "images")
    reference = epoch_batches(folder_module(top, cache="decoded"), range(2))
    for options in (dict(cache="decoded", num_workers=2), dict(cache="decoded", num_workers=2, augment_on_device=True)):
        batches = epoch_batches(folder_module(top, **options), range(2))
        assert all(torch.equal(x[0], y[0]) and torch.equal(x[2], y[2]) for x, y in zip(reference, batches, strict=True))


@pytest.mark.parametrize(("options", "workers"), [
    (dict(cache="decoded"), 0),
    (dict(cache="decoded", augment_on_device=True), 0),
    (dict(cache="decoded", augment_on_device=True), 2),
])
def test_a_resumed_loader_continues_bit_identically(tmp_path, options, workers):
    top = gradient_folder(tmp_path / "images")
    dm = folder_module(top, num_workers=workers, **options)
    loader = dm.train_dataloader()
    assert isinstance(loader, ResumableDataLoader)
    loader.batch_sampler.set_epoch(1)
    full = [finished(dm, b) for b in loader]
    assert len(full) >= 4
    loader.batch_sampler.set_epoch(1)
    iterator = iter(loader)
    for _ in range(2):
        next(iterator)
    state = loader.state_dict()
    del iterator
    resumed_dm = folder_module(top, num_workers=workers, **options)  # a new process would build it anew
    resumed = resumed_dm.train_dataloader()
    resumed.load_state_dict(state)
    rest = [finished(resumed_dm, b) for b in resumed]
    assert len(rest) == len(full) - 2
    for x, y in zip(full[2:], rest):
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and torch.equal(x[2], y[2])


def test_cache_options_are_checked(tmp_path):
    with pytest.raises(ValueError, match="cache must be 'none' or 'decoded', got 'pixels'"):
        ImageFolderDataModule(tmp_path, cache="pixels")
    with pytest.raises(ValueError, match="cache_size must be an integer of at least 8 pixels, got 4"):
        ImageFolderDataModule(tmp_path, cache="decoded", cache_size=4)
    assert ImageFolderDataModule(tmp_path, cache="none").cache is None


def test_csv_data_module_inherits_the_cache(tmp_path):
    """``CSVDataModule`` (issue 20) gets ``cache="decoded"`` from ``ImageFilesDataModule``: a cache per split of the
    table (rows with and without boxes), evaluation items (with sequence and category) bit-identical to uncached."""
    from lightning_dml.data import CSVDataModule
    from tests.fixtures_table import make_oml_table

    table = make_oml_table(tmp_path / "table", train_labels=4, validation_labels=3, per_label=4)
    rng = np.random.default_rng(5)
    for row in table.rows:  # textured images (the fixture's are plain colours), so that a crop box shows
        path = table.file.parent / row["path"]
        with Image.open(path) as image:
            size = image.size
        Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path, quality=95)
    assert any(row["x_1"] is not None and row["split"] != "train" for row in table.rows)
    options = dict(classes_per_batch=2, samples_per_class=2, num_workers=0, image_size=16, eval_batch_size=5)

    def module(**kwargs):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dm = CSVDataModule(table.file, **options, **kwargs)
            dm.prepare_data()
            dm.setup()
        return dm

    plain = module()
    cached = module(cache="decoded", cache_size=plain.resize_size)
    assert all(isinstance(ds, DecodedImageListDataset) for ds in cached.split_datasets.values())
    built = sorted(p.name.split("-")[1] for p in (tmp_path / "cache").rglob("decoded-*.json"))
    assert built == sorted(cached.split_datasets)  # one cache per split of the table
    for x, y in zip(plain.test_dataloader(), cached.test_dataloader(), strict=True):
        assert len(x) == len(y) == 7  # image, label, index, is_query, is_gallery, sequence, category
        assert torch.equal(x[0], y[0]) and all(torch.equal(a, b) for a, b in zip(x[1:], y[1:]))
    a, b = next(iter(plain.train_dataloader())), next(iter(cached.train_dataloader()))
    assert torch.equal(a[2], b[2]) and a[0].shape == b[0].shape  # the same items


def test_other_batches_pass_the_hook_unchanged(tmp_path):
    dm = ImageFolderDataModule(tmp_path)
    batch = [torch.zeros(2, 3, 4, 4), torch.tensor([1, 2]), torch.tensor([0, 1])]
    assert dm.on_after_batch_transfer(batch, 0) is batch


# ============================================================================ the benchmark configs through the CLI
CONFIG = Path(__file__).resolve().parents[1] / "configs" / "cub200" / "multi_similarity.yaml"


def _cli_args(root: Path, cache_args: list[str]) -> list[str]:
    return [
        "--config", str(CONFIG), "--data.init_args.root", str(root), "--data.init_args.image_size", "32",
        "--data.init_args.resize_size", "36", "--data.init_args.classes_per_batch", "4",
        "--data.init_args.samples_per_class", "2", "--data.init_args.num_workers", "0",
        "--data.init_args.check_counts", "false", "--model.backbone.init_args.pretrained", "false",
        "--model.embedding_dim", "8", "--model.clustering", "false", "--trainer.accelerator", "cpu",
        "--trainer.max_steps", "2", "--trainer.limit_val_batches", "2", "--trainer.val_check_interval", "2",
        "--trainer.logger", "false", "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false", "--trainer.enable_model_summary", "false", *cache_args,
    ]


def test_benchmark_config_accepts_the_cache_options(tmp_path, monkeypatch):
    from lightning_dml.cli import build_cli

    make_cub200(tmp_path / "data", images_per_class=2)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dml"])
    cli = build_cli(_cli_args(tmp_path / "data", ["--data.init_args.cache", "decoded",
                                                  "--data.init_args.cache_size", "36"]), run=False)
    assert cli.datamodule.cache == "decoded" and cli.datamodule.cache_size == 36
    assert cli.datamodule.augment_on_device is False


@pytest.mark.slow
def test_benchmark_config_trains_from_the_cache_with_device_augmentation(tmp_path, monkeypatch):
    from lightning_dml.cli import build_cli

    make_cub200(tmp_path / "data", images_per_class=2)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dml"])
    cli = build_cli(_cli_args(tmp_path / "data", ["--data.init_args.cache", "decoded", "--data.init_args.cache_size",
                                                  "36", "--data.init_args.augment_on_device", "true"]), run=False)
    seen = []
    step = cli.model.training_step

    def spy(batch, batch_idx):  # what training_step receives: float images in the backbone's convention
        seen.append((batch[0].dtype, tuple(batch[0].shape), float(batch[0].max())))
        return step(batch, batch_idx)

    cli.model.training_step = spy
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.trainer.global_step == 2 and isinstance(cli.datamodule.train_dataset, DecodedImageListDataset)
    assert cli.datamodule.input_spec == cli.model.backbone.input_spec  # BN-Inception: BGR, 0-255
    assert seen and all(dtype == torch.float32 and shape[1:] == (3, 32, 32) for dtype, shape, _ in seen)
    assert max(top for *_, top in seen) > 50  # the 0-255 scale, converted on the device


# ============================================================================ bench/data.py
@pytest.mark.slow
def test_data_benchmark_prints_cached_and_uncached_rows_as_json(tmp_path):
    import subprocess

    script = Path(__file__).resolve().parents[1] / "bench" / "data.py"
    command = [
        sys.executable, str(script), "--json", "--workers", "0", "--device-augment", "--images-per-class", "1",
        "--width", "40", "--height", "30", "--crop", "16", "--cache-size", "18", "--classes-per-batch", "4",
        "--samples-per-class", "1", "--batches", "2", "--warmup", "1", "--root", str(tmp_path / "fixture"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LIGHTNING_DML_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["loader"], r["cache"], r["augment"]) for r in rows] == [
        ("train", "none", "workers"), ("eval", "none", "workers"), ("train", "decoded", "workers"),
        ("eval", "decoded", "workers"), ("train", "decoded", "device"),
    ]
    assert all(r["workers"] == 0 and r["images_per_s"] > 0 and r["images"] == 8 for r in rows)
    assert all(r["images_per_cpu_s"] is None or r["images_per_cpu_s"] > 0 for r in rows)
    assert "side by side" in done.stderr and "decoded-image cache at 18 px" in done.stderr
    side = done.stderr[done.stderr.index("side by side"):].splitlines()
    shown = [line.split()[:3] for line in side[2:]]
    optional = ["0", "train", "decoded+device,loader"]  # needs measurable CPU time outside the device step
    assert [row for row in shown if row != optional] == [["0", "train", "decoded"], ["0", "train", "decoded+device"],
                                                         ["0", "eval", "decoded"]]
    # a fixture of another size in --root is refused (it would be reused as it is, silently)
    other = [*command[: command.index("--images-per-class") + 1], "2", *command[command.index("--images-per-class") + 2 :]]
    done = subprocess.run(other, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 2 and "holds a fixture of 200 images, not 200 x 2" in done.stderr


@pytest.mark.slow
def test_gpu_check_script_runs_on_the_cpu(tmp_path):
    """bench/data_gpu.py (the GPU check, which needs a GPU to mean anything) runs end to end as a CPU smoke test:
    one synthetic row and a cached row per worker count and augmentation, each with its ratio."""
    import subprocess

    pytest.importorskip("timm")
    script = Path(__file__).resolve().parents[1] / "bench" / "data_gpu.py"
    command = [
        sys.executable, str(script), "--json", "--device", "cpu", "--model", "vit_tiny_patch16_224", "--crop", "32",
        "--cache-size", "36", "--workers", "0", "--classes-per-batch", "4", "--samples-per-class", "2", "--steps",
        "2", "--warmup", "1", "--images-per-class", "1", "--width", "40", "--height", "30",
        "--root", str(tmp_path / "fixture"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LIGHTNING_DML_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert [(r["feed"], r["workers"], r["augment"]) for r in rows] == [
        ("synthetic", None, None), ("cache", 0, "workers"), ("cache", 0, "device"),
    ]
    assert all(r["images_per_s"] > 0 for r in rows) and rows[0]["ratio"] == 1.0
    assert all(r["ratio"] == pytest.approx(r["images_per_s"] / rows[0]["images_per_s"], rel=0.01) for r in rows)


# ============================================================================ a killed run resumes exactly
from tests.test_resume import glyph_renders  # noqa: E402,F401 - the session fixture of the resume test


@pytest.mark.slow
def test_killed_run_with_cache_and_device_augmentation_resumes_to_identical_metrics(tmp_path, glyph_renders,
                                                                                    monkeypatch):
    """tests/test_resume.py's kill-and-resume run (two worker processes) with the cache and device augmentation."""
    import tests.test_resume as resume

    def data_args(num_workers: int, path: Path) -> list[str]:
        folder = resume.noise_image_folder(path / "images")
        return [*resume.noise_folder_args(folder, num_workers), "--data.init_args.cache=decoded",
                "--data.init_args.cache_size=18", "--data.init_args.augment_on_device=true"]

    monkeypatch.setattr(resume, "_data_args", data_args)
    resume.test_killed_run_resumes_to_identical_metrics(tmp_path, glyph_renders, 2)
    assert list((tmp_path / "cache").rglob("decoded-train-18-*.json"))  # the runs did read from the cache
