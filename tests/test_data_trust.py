"""Image files under real conditions (issue 19, sections 3 and 4): every PIL mode read at the right scale, one
line per corrupt file (also from a DataLoader worker, also through the CLI), ``verify_images`` at set-up with its
cache, and hidden files / empty class folders in image folders.

Every fixture is written into ``tmp_path`` with PIL/NumPy; expected pixels are computed here from the arrays the
files were written from, not by the loader under test.
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import warnings
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torch.utils.data import DataLoader

from lightning_dml.data import ImageFolderDataModule
from lightning_dml.data.image_list import CorruptImageError, ImageListDataset, load_image
from lightning_dml.errors import UserInputError
from tests.fixtures_data import class_color, make_image_folder, write_jpeg

SMALL = {"image_size": 16, "num_workers": 0, "eval_batch_size": 8, "check_counts": False,
         "classes_per_batch": 2, "samples_per_class": 2}


# ============================================================================ 1. every PIL mode at 8 bits
def _luma(rgb: np.ndarray) -> np.ndarray:
    """ITU-R 601-2 luma as PIL computes it in integers (``convert("L")`` of an RGB image)."""
    r, g, b = (rgb[..., i].astype(np.int64) for i in range(3))
    return ((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16).astype(np.uint8)


def _grey_to(grey: np.ndarray, mode: str) -> np.ndarray:
    return grey if mode == "L" else np.repeat(grey[..., None], 3, axis=2)


def _rgb_to(rgb: np.ndarray, mode: str) -> np.ndarray:
    return _luma(rgb) if mode == "L" else rgb


def _values16() -> np.ndarray:
    """7 x 9 16-bit samples: random, plus the ends and the byte boundaries."""
    values = np.random.default_rng(0).integers(0, 65536, size=(7, 9)).astype(np.uint16)
    values.flat[:8] = [0, 1, 255, 256, 257, 32767, 65280, 65535]
    return values


def _png16(path: Path, samples: np.ndarray, color_type: int) -> Path:
    """A 16-bit PNG written byte by byte (PIL cannot write 16-bit colour PNGs): grey (0), RGB (2) or RGBA (6)."""
    height, width = samples.shape[:2]

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    rows = samples.astype(">u2").reshape(height, -1)
    raw = b"".join(b"\x00" + row.tobytes() for row in rows)  # filter type 0 on every row
    header = struct.pack(">IIBBBBB", width, height, 16, color_type, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))
    return path


def _write_mode_fixtures(folder: Path) -> dict[str, tuple[Path, str, dict[str, np.ndarray]]]:
    """``{case: (file, PIL mode it opens as, {"RGB": expected, "L": expected})}``."""
    rng = np.random.default_rng(1)
    cases: dict[str, tuple[Path, str, dict[str, np.ndarray]]] = {}

    def add(case: str, path: Path, mode: str, rgb: np.ndarray | None = None, grey: np.ndarray | None = None):
        expected = {m: (_rgb_to(rgb, m) if rgb is not None else _grey_to(grey, m)) for m in ("RGB", "L")}
        cases[case] = (path, mode, expected)

    v16 = _values16()
    high_byte = (v16 // 256).astype(np.uint8)  # the rule: [0, 65535] -> [0, 255] by the high byte
    path = folder / "grey16.png"
    Image.fromarray(v16).save(path)
    add("I;16 png", path, "I;16", grey=high_byte)
    path = folder / "grey16_big_endian.tif"
    Image.frombytes("I;16B", (9, 7), v16.astype(">u2").tobytes()).save(path)
    add("I;16B tiff", path, "I;16B", grey=high_byte)
    path = folder / "grey16.pgm"  # 16-bit PGM: PIL opens it as mode I
    path.write_bytes(b"P5\n9 7\n65535\n" + v16.astype(">u2").tobytes())
    add("I pgm", path, "I", grey=high_byte)
    path = folder / "int32.tif"
    Image.fromarray(v16.astype(np.int32)).save(path)
    add("I tiff", path, "I", grey=high_byte)
    rgb16 = np.stack([v16, v16[::-1], 65535 - v16], axis=2)
    add("RGB 16-bit png", _png16(folder / "rgb16.png", rgb16, 2), "RGB", rgb=(rgb16 // 256).astype(np.uint8))

    u8 = rng.integers(0, 256, size=(7, 9)).astype(np.uint8)
    u8.flat[:2] = [0, 255]
    path = folder / "float_of_8bit.tif"  # an 8-bit image stored as v / 255 comes back exactly
    Image.fromarray((u8 / 255.0).astype(np.float32)).save(path)
    add("F tiff (v/255)", path, "F", grey=u8)
    floats = rng.uniform(0, 1, size=(7, 9)).astype(np.float32)
    floats.flat[:2] = [0.0, 1.0]
    path = folder / "float.tif"
    Image.fromarray(floats).save(path)
    add("F tiff", path, "F", grey=np.floor(floats.astype(np.float64) * 255 + 0.5).astype(np.uint8))

    rgb = rng.integers(0, 256, size=(7, 9, 3)).astype(np.uint8)
    path = folder / "rgb.png"
    Image.fromarray(rgb).save(path)
    add("RGB png", path, "RGB", rgb=rgb)
    bits = rng.integers(0, 2, size=(7, 9)).astype(bool)
    path = folder / "bits.png"
    Image.fromarray(bits).save(path)
    add("1 png", path, "1", grey=np.where(bits, 255, 0).astype(np.uint8))
    path = folder / "grey.png"
    Image.fromarray(u8).save(path)
    add("L png", path, "L", grey=u8)
    alpha = rng.integers(0, 256, size=(7, 9)).astype(np.uint8)
    path = folder / "grey_alpha.png"
    Image.fromarray(np.stack([u8, alpha], axis=2), "LA").save(path)
    add("LA png", path, "LA", grey=u8)  # alpha dropped, the stored grey kept
    path = folder / "rgba.png"
    Image.fromarray(np.concatenate([rgb, alpha[..., None]], axis=2), "RGBA").save(path)
    add("RGBA png", path, "RGBA", rgb=rgb)
    palette = rng.integers(0, 256, size=(4, 3)).astype(np.uint8)
    index = rng.integers(0, 4, size=(7, 9)).astype(np.uint8)
    image = Image.fromarray(index, "P")
    image.putpalette(palette.ravel().tolist())
    path = folder / "palette_transparent.png"
    image.save(path, transparency=bytes([255, 128, 0, 255]))  # per-entry alpha (a tRNS chunk)
    add("P png, transparency", path, "P", rgb=palette[index])
    cmyk = rng.integers(0, 256, size=(7, 9, 4)).astype(np.uint8)
    path = folder / "cmyk.tif"
    Image.fromarray(cmyk, "CMYK").save(path)
    c, k = cmyk[..., :3].astype(np.int64), cmyk[..., 3:].astype(np.int64)
    add("CMYK tiff", path, "CMYK", rgb=(((255 - c) * (255 - k) + 127) // 255).astype(np.uint8))
    path = write_jpeg(folder / "grey.jpg", (90, 90, 90), size=(9, 7), mode="L")
    with Image.open(path) as opened:
        add("L jpeg", path, "L", grey=np.asarray(opened).copy())
    return cases


@pytest.fixture(scope="module")
def mode_files(tmp_path_factory):
    return _write_mode_fixtures(tmp_path_factory.mktemp("modes"))


MODE_CASES = [
    "I;16 png", "I;16B tiff", "I pgm", "I tiff", "RGB 16-bit png", "F tiff (v/255)", "F tiff",
    "RGB png", "1 png", "L png", "LA png", "RGBA png", "P png, transparency", "CMYK tiff", "L jpeg",
]


@pytest.mark.parametrize("output", ["RGB", "L"])
@pytest.mark.parametrize("case", MODE_CASES)
def test_every_mode_is_read_at_its_scale(mode_files, case, output):
    path, opened_as, expected = mode_files[case]
    with Image.open(path) as image:
        assert image.mode == opened_as  # the fixture exercises the mode it is named after
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # e.g. PIL's "Palette images with Transparency ... should be converted"
        loaded = load_image(path, output)
    assert loaded.mode == output
    np.testing.assert_array_equal(np.asarray(loaded), expected[output])


def test_sixteen_bit_png_is_not_saturated(mode_files):
    """The headline of the bug: PIL's convert("RGB") of a 16-bit PNG makes almost every pixel white."""
    path, _, _ = mode_files["I;16 png"]
    loaded = np.asarray(load_image(path, "RGB"))
    assert (loaded == 255).mean() < 0.05
    assert loaded.min() == 0 and loaded.max() == 255


@pytest.mark.parametrize(
    ("name", "array", "message"),
    [
        ("float_0_255.tif", np.linspace(0, 255, 63, dtype=np.float32).reshape(7, 9), r"values in \[0, 1\].*\[0, 255\]"),
        ("float_negative.tif", np.linspace(-0.5, 0.5, 63, dtype=np.float32).reshape(7, 9), r"\[-0.5, 0.5\]"),
        ("float_nan.tif", np.where(np.eye(7, 9) > 0, np.nan, 0.5).astype(np.float32), r"7 NaN/infinite"),
        ("int32_large.tif", np.arange(63, dtype=np.int32).reshape(7, 9) * 2000, r"\[0, 65535\].*\[0, 124000\]"),
        ("int32_negative.tif", np.arange(63, dtype=np.int32).reshape(7, 9) - 5, r"\[-5, 57\]"),
    ],
)
def test_out_of_range_high_bit_depth_images_fail_with_a_message(tmp_path, name, array, message):
    """No fixed scale fits these: an error naming the file and the range found, never a silently clipped image."""
    path = tmp_path / name
    Image.fromarray(array).save(path)
    with pytest.raises(ValueError, match=message):
        load_image(path)
    dataset = ImageListDataset([path], [0], split="my split")
    with pytest.raises(CorruptImageError, match=rf"cannot read image .*{name} \(item 0 of my split\): ValueError"):
        dataset[0]


# ============================================================================ 2. a corrupt file is one line
def _damaged_files(folder: Path) -> dict[str, Path]:
    folder.mkdir(parents=True, exist_ok=True)
    empty = folder / "zero_bytes.jpg"
    empty.write_bytes(b"")
    truncated = folder / "truncated.jpg"
    noise = np.random.default_rng(0).integers(0, 256, size=(48, 64, 3)).astype(np.uint8)
    Image.fromarray(noise).save(truncated, quality=90)
    data = truncated.read_bytes()
    truncated.write_bytes(data[: int(len(data) * 0.6)])  # cut inside the scan data: the header is intact
    return {"zero-byte": empty, "truncated": truncated}


def test_corrupt_image_error_is_a_user_error():
    assert issubclass(CorruptImageError, UserInputError) and issubclass(CorruptImageError, OSError)


@pytest.mark.parametrize("damage", ["zero-byte", "truncated"])
def test_corrupt_image_message_names_file_item_split_and_option(tmp_path, damage):
    victim = _damaged_files(tmp_path)[damage]
    good = write_jpeg(tmp_path / "good.jpg", (10, 20, 30))
    dataset = ImageListDataset([good, victim], [0, 0], split="image folder train")
    with pytest.raises(UserInputError) as info:
        dataset[1]
    message = str(info.value)
    assert isinstance(info.value, CorruptImageError)
    assert f"cannot read image {victim} (item 1 of image folder train)" in message
    assert "on_corrupt: skip" in message and "--data.init_args.on_corrupt skip" in message
    assert "\n" not in message


def _first_error(loader: DataLoader) -> BaseException:
    iterator = iter(loader)
    try:
        for _ in iterator:
            pass
    except Exception as error:  # noqa: BLE001 - the test inspects whatever the loader raised
        # without the traceback nothing refers to the iterator any more: its workers shut down when this returns,
        # not in a later garbage collection (where torch waits 5 s per worker for them)
        error.__traceback__ = None
        return error
    raise AssertionError("the loader raised nothing")


@pytest.mark.parametrize("damage", ["zero-byte", "truncated"])
def test_worker_error_gives_the_same_one_line_as_the_main_process(tmp_path, damage):
    victim = _damaged_files(tmp_path)[damage]
    dataset = ImageListDataset([victim], [0], split="image folder train")
    in_main = _first_error(DataLoader(dataset, batch_size=1, num_workers=0))
    in_worker = _first_error(DataLoader(dataset, batch_size=1, num_workers=2))
    assert "DataLoader worker process" in str(in_worker) and "Traceback" in str(in_worker)  # torch's wrapper
    assert isinstance(in_worker, UserInputError)  # what the CLI catches
    from lightning_dml.errors import user_error_message

    line = user_error_message(in_worker)
    assert line == user_error_message(in_main) == str(in_main)
    assert "Traceback" not in line and "\n" not in line and str(victim) in line


def test_user_error_message_of_other_errors():
    from lightning_dml.errors import MissingFileError, user_error_message

    plain = MissingFileError("cub: missing file x.txt. Expected layout:\n  images.txt")
    assert user_error_message(plain) == str(plain)  # not wrapped: unchanged (a layout description keeps its lines)
    wrapped = MissingFileError(
        "Caught MissingFileError in DataLoader worker process 3.\nOriginal Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n    f()\n'
        "lightning_dml.errors.MissingFileError: the message\n  on two lines\n"
    )
    assert user_error_message(wrapped) == "the message\n  on two lines"


CLI_ARGS = [
    "--seed_everything=0",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.max_steps=2",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--trainer.enable_checkpointing=false",
    "--model.backbone=lightning_dml.models.SmallConvNet",
    "--model.backbone.init_args.width=4",
    "--model.backbone.init_args.in_channels=3",
    "--model.embedding_dim=8",
    "--model.clustering=false",
    "--data=lightning_dml.data.ImageFolderDataModule",
    "--data.init_args.image_size=16",
    "--data.init_args.classes_per_batch=4",
    "--data.init_args.samples_per_class=2",
    "--data.init_args.eval_batch_size=4",
    "--data.init_args.check_counts=false",
]


def _damaged_folder(root: Path) -> tuple[Path, list[Path]]:
    """4 train classes x 2 images (so the first P x K = 4 x 2 batch holds every training image, the two damaged
    ones among them) and 2 test classes x 2 images."""
    top = make_image_folder(root, train_classes=4, test_classes=2, images_per_class=2, size=(20, 16))
    damaged = _damaged_files(root / "damaged")
    victims = [top / "train" / "train_class_00" / "img_001.jpg", top / "train" / "train_class_02" / "img_000.jpg"]
    for source, target in zip(damaged.values(), victims):
        target.write_bytes(source.read_bytes())
    return top, victims


def _run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "lightning-dml"
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1", "LIGHTNING_DML_CACHE": str(cwd / "cache")}
    env.pop("LIGHTNING_DML_DEBUG", None)
    return subprocess.run([str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def _assert_one_error_line(proc: subprocess.CompletedProcess) -> str:
    output = proc.stdout + proc.stderr
    assert proc.returncode == 1, output[-3000:]
    assert "Traceback" not in output, output[-3000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("lightning-dml: error:")]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert "DataLoader worker" not in proc.stderr
    return lines[0]


@pytest.mark.slow
@pytest.mark.parametrize("workers", [0, 2])
def test_cli_prints_one_line_for_a_corrupt_image(tmp_path, workers):
    top, victims = _damaged_folder(tmp_path / "data")
    proc = _run_cli("fit", *CLI_ARGS, f"--data.init_args.root={top}", f"--data.init_args.num_workers={workers}",
                    cwd=tmp_path)
    line = _assert_one_error_line(proc)
    assert sum(str(victim) in line for victim in victims) == 1, line  # the first damaged file read
    assert "--data.init_args.on_corrupt skip" in line


@pytest.mark.slow
def test_cli_verify_images_lists_every_damaged_file_before_training(tmp_path):
    top, victims = _damaged_folder(tmp_path / "data")
    proc = _run_cli("fit", *CLI_ARGS, f"--data.init_args.root={top}", "--data.init_args.num_workers=2",
                    "--data.init_args.verify_images=decode", cwd=tmp_path)
    line = _assert_one_error_line(proc)
    assert "2 of 12 image files" in line and "verify_images=decode" in line
    assert all(str(victim) in line for victim in victims), line


# ============================================================================ 3. verify_images at set-up
def _folder_with(tmp_path: Path, damage: str | None = None) -> tuple[Path, Path | None]:
    top = make_image_folder(tmp_path / "data", train_classes=3, test_classes=2, images_per_class=3, size=(20, 16))
    if damage is None:
        return top, None
    victim = top / "train" / "train_class_01" / "img_002.jpg"
    victim.write_bytes(_damaged_files(tmp_path / "damaged")[damage].read_bytes())
    return top, victim


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    folder = tmp_path / "cache"
    monkeypatch.setenv("LIGHTNING_DML_CACHE", str(folder))
    return folder


@pytest.mark.parametrize(("damage", "level"), [("zero-byte", "header"), ("zero-byte", True), ("truncated", "decode")])
def test_verify_images_finds_a_corrupt_file_at_setup(tmp_path, cache, damage, level):
    top, victim = _folder_with(tmp_path, damage)
    data = ImageFolderDataModule(top, verify_images=level, **SMALL)
    with pytest.raises(CorruptImageError) as info:
        data.setup("fit")
    message = str(info.value)
    assert isinstance(info.value, UserInputError) and "\n" not in message
    assert f"1 of 15 image files of image folder at {top} failed verify_images=" in message
    assert str(victim) in message and "on_corrupt: skip" in message


def test_header_level_lets_a_truncated_jpeg_body_through(tmp_path, cache):
    """Documented: ``header`` does not decode, so a JPEG cut in its scan data passes; ``decode`` finds it."""
    top, victim = _folder_with(tmp_path, "truncated")
    ImageFolderDataModule(top, verify_images="header", **SMALL).setup("fit")
    with pytest.raises(CorruptImageError, match=victim.name):
        ImageFolderDataModule(top, verify_images="decode", **SMALL).setup("fit")


def test_verify_images_fails_before_the_first_training_step(tmp_path, cache):
    import pytorch_lightning as pl

    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule

    class Steps(pl.Callback):
        count = 0

        def on_train_batch_start(self, *args):
            Steps.count += 1

    top, victim = _folder_with(tmp_path, "zero-byte")
    data = ImageFolderDataModule(top, verify_images="header", **SMALL)
    module = DMLModule(SmallConvNet(width=4, in_channels=3), embedding_dim=8, clustering=False)
    trainer = pl.Trainer(max_steps=2, logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=False, default_root_dir=tmp_path, callbacks=[Steps()])
    with pytest.raises(CorruptImageError, match=victim.name):
        trainer.fit(module, datamodule=data)
    assert Steps.count == 0


def test_verify_images_skip_drops_the_files_with_one_warning(tmp_path, cache):
    top, victim = _folder_with(tmp_path, "zero-byte")
    data = ImageFolderDataModule(top, verify_images="header", on_corrupt="skip", **SMALL)
    with pytest.warns(UserWarning, match=rf"1 of 15 image files .*on_corrupt=skip drops them.*{victim.name}"):
        data.setup("fit")
    assert len(data.train_dataset) == 8 and victim not in data.train_dataset.paths
    assert len(data.test_dataset) == 6
    counts = {data.class_names[label]: n for label, n in zip(*np.unique(data.train_dataset.labels, return_counts=True))}
    assert counts == {"train_class_00": 3, "train_class_01": 2, "train_class_02": 3}  # the victim's class lost it
    for batch in data.train_dataloader():  # no corrupt file left to read
        assert batch[0].shape[0] == 4


def _counting_checks(monkeypatch) -> list[str]:
    from lightning_dml.data import verify

    opened: list[str] = []
    original = verify.check_image

    def counting(path, level):
        opened.append(os.fspath(path))
        return original(path, level)

    monkeypatch.setattr(verify, "check_image", counting)
    return opened


def test_verify_images_cache_is_reused_and_invalidated(tmp_path, cache, monkeypatch):
    from lightning_dml.data.cache_dir import dataset_cache_dir

    top, _ = _folder_with(tmp_path)
    opened = _counting_checks(monkeypatch)
    ImageFolderDataModule(top, verify_images="header", **SMALL).setup("fit")
    assert len(opened) == 15
    cache_file = dataset_cache_dir(top) / "verified-header.json"
    assert cache_file.is_file() and cache_file.is_relative_to(cache)  # in the user cache, nothing beside the data
    assert not list(top.rglob("*.json"))

    opened.clear()
    ImageFolderDataModule(top, verify_images="header", **SMALL).setup("fit")
    assert opened == []  # every file taken from the cache

    touched = top / "test" / "test_class_00" / "img_001.jpg"
    stat = touched.stat()
    os.utime(touched, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # same size, new mtime
    grown = top / "train" / "train_class_02" / "img_000.jpg"
    mtime = grown.stat().st_mtime_ns
    grown.write_bytes(grown.read_bytes() + b"\0")  # new size, the same mtime
    os.utime(grown, ns=(mtime, mtime))
    opened.clear()
    ImageFolderDataModule(top, verify_images="header", **SMALL).setup("fit")
    assert sorted(opened) == sorted([str(touched), str(grown)])

    opened.clear()
    ImageFolderDataModule(top, verify_images="decode", **SMALL).setup("fit")
    assert len(opened) == 15  # another level, another record


def test_a_failed_file_is_checked_again_and_passes_once_replaced(tmp_path, cache, monkeypatch):
    top, victim = _folder_with(tmp_path, "zero-byte")
    opened = _counting_checks(monkeypatch)
    for _ in range(2):
        with pytest.raises(CorruptImageError):
            ImageFolderDataModule(top, verify_images="header", **SMALL).setup("fit")
    assert opened[15:] == [str(victim)]  # the second set-up opened only the failed file
    write_jpeg(victim, class_color(1), (20, 16))
    ImageFolderDataModule(top, verify_images="header", **SMALL).setup("fit")


def test_unwritable_cache_is_a_warning(tmp_path, monkeypatch):
    top, _ = _folder_with(tmp_path)
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    monkeypatch.setenv("LIGHTNING_DML_CACHE", str(blocker))  # the cache folder cannot be created, even by root
    with pytest.warns(RuntimeWarning, match=r"cannot write the cache .*LIGHTNING_DML_CACHE"):
        ImageFolderDataModule(top, verify_images="header", **SMALL).setup("fit")


def test_progress_bar_only_on_rank_zero(tmp_path, cache, monkeypatch, capfd):
    from pytorch_lightning.utilities import rank_zero_only

    top, _ = _folder_with(tmp_path)
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    ImageFolderDataModule(top, verify_images="decode", **SMALL).setup("fit")
    assert "verify_images" not in capfd.readouterr().err
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    ImageFolderDataModule(top, verify_images="header", **SMALL).setup("fit")
    assert "verify_images=header (image folder)" in capfd.readouterr().err


def test_verify_images_rejects_unknown_levels(tmp_path):
    with pytest.raises(ValueError, match="verify_images must be false, true, 'header' or 'decode', got 'full'"):
        ImageFolderDataModule(tmp_path, verify_images="full")


def test_prepare_data_verifies_once_and_setup_reads_the_cache(tmp_path, cache, monkeypatch):
    top, _ = _folder_with(tmp_path)
    opened = _counting_checks(monkeypatch)
    data = ImageFolderDataModule(top, verify_images="header", **SMALL)
    data.prepare_data()
    assert len(opened) == 15
    data.setup("fit")
    assert len(opened) == 15


def test_cache_location(monkeypatch, tmp_path):
    from lightning_dml.data.cache_dir import cache_root, dataset_cache_dir

    monkeypatch.delenv("LIGHTNING_DML_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "lightning-dml"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "lightning-dml"
    monkeypatch.setenv("LIGHTNING_DML_CACHE", str(tmp_path / "mine"))
    one, two = dataset_cache_dir(tmp_path / "a" / "CUB_200_2011"), dataset_cache_dir(tmp_path / "b" / "CUB_200_2011")
    assert one.parent == two.parent == tmp_path / "mine" / "datasets"
    assert one.name.startswith("CUB_200_2011-") and one != two
    monkeypatch.chdir(tmp_path)
    assert dataset_cache_dir(Path("a") / "CUB_200_2011") == one


# ============================================================================ 4. hidden files, empty class folders
def test_hidden_files_and_folders_are_skipped(tmp_path):
    top = make_image_folder(tmp_path, train_classes=2, test_classes=2, images_per_class=2, size=(20, 16))
    apple_double = b"\x00\x05\x16\x07\x00\x02\x00\x00Mac OS X        " + bytes(64)  # a resource fork, not an image
    hidden = [
        top / "train" / "train_class_00" / "._img_000.jpg",  # macOS AppleDouble beside each copied file
        top / "train" / "train_class_00" / ".hidden.png",
        top / "test" / "test_class_01" / "._img_001.jpg",
        top / "train" / "train_class_01" / ".thumbnails" / "img_000.jpg",  # a dot-folder inside a class
        top / "train" / ".Trashes" / "img.jpg",  # a dot-folder beside the classes
        top / "train" / "__MACOSX" / "train_class_00" / "._img_000.jpg",  # macOS zip resource folder
    ]
    for path in hidden:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(apple_double)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = ImageFolderDataModule(top, **SMALL)
        data.setup("fit")
    assert not [str(w.message) for w in caught if "class" in str(w.message)]  # no empty-folder or overlap warning
    assert data.class_names == ["test_class_00", "test_class_01", "train_class_00", "train_class_01"]
    assert len(data.train_dataset) == len(data.test_dataset) == 4
    assert not set(data.train_dataset.paths + data.test_dataset.paths) & set(hidden)
    for loader in (data.train_dataloader(), data.test_dataloader()):
        for _ in loader:  # nothing unreadable left
            pass


def test_empty_class_folders_are_named_in_one_warning(tmp_path):
    top = make_image_folder(tmp_path, train_classes=3, test_classes=2, images_per_class=2, size=(20, 16))
    (top / "train" / "empty_class").mkdir()
    (top / "test" / "only_text").mkdir()
    (top / "test" / "only_text" / "notes.txt").write_text("no images here")
    (top / "train" / "only_hidden").mkdir()
    (top / "train" / "only_hidden" / "._img.jpg").write_bytes(b"\x00\x05\x16\x07")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = ImageFolderDataModule(top, **SMALL)
        data.setup("fit")
    about_empty = [str(w.message) for w in caught if "without any image file" in str(w.message)]
    assert len(about_empty) == 1, [str(w.message) for w in caught]
    assert "3 class folder(s)" in about_empty[0]
    for name in ("train/empty_class", "train/only_hidden", "test/only_text"):
        assert name in about_empty[0]
    assert "empty_class" not in data.class_names and len(data.class_names) == 5
