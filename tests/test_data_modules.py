"""Benchmark data modules on fixture trees in the official formats: splits, counts, layouts, boxes, errors."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_dml.data import (
    CorruptImageError,
    Cars196DataModule,
    CUB200DataModule,
    DatasetLayoutError,
    DMLDataModule,
    ImageFolderDataModule,
    InShopDataModule,
    SOPDataModule,
)
from lightning_dml.models import InputSpec
from tests.fixtures_data import (
    BOX_COLOR,
    class_color,
    corrupt_file,
    make_cars196,
    make_cub200,
    make_image_csv,
    make_image_folder,
    make_inshop,
    make_sop,
)

SMALL = {"classes_per_batch": 3, "samples_per_class": 2, "num_workers": 0, "image_size": 16, "eval_batch_size": 16}


@pytest.fixture(scope="module")
def trees(tmp_path_factory):
    base = tmp_path_factory.mktemp("data")
    cub_counts = [1 + (c % 3) for c in range(200)]  # 1, 2 or 3 images per class
    return {
        "cub": make_cub200(base / "cub", images_per_class=cub_counts, grayscale_ids=(1,)),
        "cub_counts": cub_counts,
        "cars_annos": make_cars196(base / "cars_annos", layout="annos", images_per_class=2),
        "cars_devkit": make_cars196(base / "cars_devkit", layout="devkit", images_per_class=2),
        "cars_devkit_root_labels": make_cars196(
            base / "cars_devkit2", layout="devkit", images_per_class=2, test_labels_in="root"
        ),
        "sop": make_sop(base / "sop"),
        "inshop": make_inshop(base / "inshop"),
        "inshop_eval": make_inshop(base / "inshop_eval", list_in_eval_folder=True, top_name="In-shop Clothes Retrieval Benchmark"),
        "folder": make_image_folder(base / "folder"),
        "csv": make_image_csv(base / "csv"),
        "base": base,
    }


def _setup(module):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.setup("fit")
    return [str(w.message) for w in caught]


def _pixels(dataset, index: int) -> np.ndarray:
    """The decoded (and box-cropped) image of an item, before any transform."""
    transform, dataset.transform = dataset.transform, None
    try:
        return np.asarray(dataset[index][0], dtype=np.int64)
    finally:
        dataset.transform = transform


# ------------------------------------------------------------------------------------------------ CUB
@pytest.mark.parametrize("which", ["parent", "top"])
def test_cub_zero_shot_split_and_count_warning(trees, which):
    root = trees["cub"].parent if which == "parent" else trees["cub"]
    dm = CUB200DataModule(root, **SMALL)
    messages = _setup(dm)
    counts = trees["cub_counts"]
    assert len(dm.train_dataset) == sum(counts[:100]) and len(dm.test_dataset) == sum(counts[100:])
    assert set(dm.train_dataset.labels.tolist()) == set(range(1, 101))
    assert set(dm.test_dataset.labels.tolist()) == set(range(101, 201))
    # the label of each item is the class folder it lives in (read independently from the path)
    for ds in (dm.train_dataset, dm.test_dataset):
        assert [int(p.parent.name[:3]) for p in ds.paths] == ds.labels.tolist()
    assert any("5,864" in m and f"{sum(counts[:100]) - 5864:+,}" in m for m in messages), messages


def test_cub_grey_jpeg_becomes_three_channels(trees):
    dm = CUB200DataModule(trees["cub"], **SMALL)
    _setup(dm)
    assert _pixels(dm.train_dataset, 0).shape == (30, 40, 3)  # image id 1 is a single-channel JPEG
    assert dm.train_dataset[0][0].shape == (3, 16, 16)
    assert dm.hparams["test_as_val"] is True


def test_cub_paper_counts_give_no_warning(trees):
    dm = CUB200DataModule(trees["cub"], **SMALL)
    counts = trees["cub_counts"]
    dm.expected_counts = {"train": sum(counts[:100]), "test": sum(counts[100:]), "train classes": 100, "test classes": 100}
    assert not [m for m in _setup(dm) if "differs" in m]


def test_cub_bounding_box_crop(trees):
    whole = CUB200DataModule(trees["cub"], **SMALL)
    cropped = CUB200DataModule(trees["cub"], crop_to_box=True, **SMALL)
    _setup(whole), _setup(cropped)
    names = dict(line.split() for line in (trees["cub"] / "images.txt").read_text().splitlines())
    boxes = {Path(names[r[0]]).name: r[1:] for r in (line.split() for line in (trees["cub"] / "bounding_boxes.txt").read_text().splitlines())}
    for i in (0, 5, len(whole.test_dataset) - 1):
        full = _pixels(whole.test_dataset, i)
        box = _pixels(cropped.test_dataset, i)
        x, y, w, h = (float(v) for v in boxes[cropped.test_dataset.paths[i].name])
        assert box.shape[:2] == (int(h), int(w))  # exactly the box of bounding_boxes.txt
        assert np.abs(box[2:-2, 2:-2] - np.array(BOX_COLOR)).max() <= 12  # only the box colour (JPEG tolerance)
        label = int(whole.test_dataset.labels[i])
        assert np.abs(full[0, 0] - np.array(class_color(label))).max() <= 12  # the corner is background


def test_cub_missing_list_file_and_image_are_named(trees, tmp_path):
    copy = Path(shutil.copytree(trees["cub"], tmp_path / "CUB_200_2011"))
    (copy / "image_class_labels.txt").unlink()
    with pytest.raises(DatasetLayoutError, match=r"image_class_labels.txt[\s\S]*Expected layout"):
        CUB200DataModule(tmp_path, **SMALL).setup()
    shutil.copy(trees["cub"] / "image_class_labels.txt", copy)
    victim = next((copy / "images").rglob("*.jpg"))
    victim.unlink()
    with pytest.raises(DatasetLayoutError, match=victim.name):
        CUB200DataModule(tmp_path, **SMALL).setup()
    with pytest.raises(DatasetLayoutError, match="images.txt"):
        CUB200DataModule(tmp_path / "nowhere", **SMALL).setup()


# ------------------------------------------------------------------------------------------------ Cars196
def test_cars_both_layouts_give_the_same_split(trees):
    modules = {}
    for key in ("cars_annos", "cars_devkit", "cars_devkit_root_labels"):
        dm = Cars196DataModule(trees[key], **SMALL)
        messages = _setup(dm)
        assert any("8,054" in m for m in messages)
        modules[key] = dm
    assert modules["cars_annos"].layout_found == "annos" and modules["cars_devkit"].layout_found == "devkit"
    for dm in modules.values():
        assert len(dm.train_dataset) == 98 * 2 and len(dm.test_dataset) == 98 * 2
        assert set(dm.train_dataset.labels.tolist()) == set(range(1, 99))
        assert set(dm.test_dataset.labels.tolist()) == set(range(99, 197))
        for i in (0, len(dm.train_dataset) - 1):  # the pixels match the label the .mat file gives
            label = int(dm.train_dataset.labels[i])
            assert np.abs(_pixels(dm.train_dataset, i)[0, 0] - np.array(class_color(label))).max() <= 12


@pytest.mark.parametrize("key", ["cars_annos", "cars_devkit"])
def test_cars_bounding_box_crop(trees, key):
    dm = Cars196DataModule(trees[key], crop_to_box=True, **SMALL)
    _setup(dm)
    for i in (0, 7, len(dm.test_dataset) - 1):
        pixels = _pixels(dm.test_dataset, i)
        assert np.abs(pixels[2:-2, 2:-2] - np.array(BOX_COLOR)).max() <= 12
        assert pixels.shape[0] < 30 and pixels.shape[1] < 40


def test_cars_devkit_without_test_labels_names_the_file(trees, tmp_path):
    copy = Path(shutil.copytree(trees["cars_devkit"], tmp_path / "stanford_cars"))
    (copy / "devkit" / "cars_test_annos_withlabels.mat").unlink()
    with pytest.raises(DatasetLayoutError, match="cars_test_annos_withlabels.mat"):
        Cars196DataModule(tmp_path, **SMALL).setup()  # found through the parent folder


# ------------------------------------------------------------------------------------------------ SOP
def test_sop_split_follows_the_ebay_files(trees):
    dm = SOPDataModule(trees["sop"].parent, **SMALL)
    messages = _setup(dm)
    assert any("59,551" in m and "11,318" in m for m in messages)
    for split, ds in (("train", dm.train_dataset), ("test", dm.test_dataset)):
        rows = (trees["sop"] / f"Ebay_{split}.txt").read_text().split("\n")[1:]
        rows = [r.split() for r in rows if r]
        assert [int(r[1]) for r in rows] == ds.labels.tolist()
        assert [trees["sop"] / r[3] for r in rows] == ds.paths
    assert dm.train_dataset.labels.max() < dm.test_dataset.labels.min()


def test_sop_overlapping_classes_are_an_error(trees, tmp_path):
    copy = Path(shutil.copytree(trees["sop"], tmp_path / "Stanford_Online_Products"))
    train = (copy / "Ebay_train.txt").read_text()
    first_test = (copy / "Ebay_test.txt").read_text().split("\n")[1]
    (copy / "Ebay_train.txt").write_text(train + first_test + "\n")
    with pytest.raises(ValueError, match="both Ebay_train.txt and Ebay_test.txt"):
        SOPDataModule(copy, **SMALL).setup()


# ------------------------------------------------------------------------------------------------ In-Shop
@pytest.mark.parametrize("key", ["inshop", "inshop_eval"])
def test_inshop_query_and_gallery_flags(trees, key):
    dm = InShopDataModule(trees[key].parent, **SMALL)
    messages = _setup(dm)
    assert any("14,218" in m for m in messages)
    listing = next(trees[key].rglob("list_eval_partition.txt")).read_text().split("\n")[2:]
    rows = [r.split() for r in listing if r]
    status = {trees[key] / r[0]: r[2] for r in rows}
    test = dm.test_dataset
    assert len(dm.train_dataset) == sum(s == "train" for s in status.values())
    assert [status[p] == "query" for p in test.paths] == test.query_mask.tolist()
    assert [status[p] == "gallery" for p in test.paths] == test.gallery_mask.tolist()
    assert bool((test.query_mask ^ test.gallery_mask).all())
    # every query item has gallery images of the same item id, and no train item is a test item
    assert set(test.labels[test.query_mask].tolist()) <= set(test.labels[test.gallery_mask].tolist())
    assert not set(test.labels.tolist()) & set(dm.train_dataset.labels.tolist())
    image, label, index, is_query, is_gallery = test[0]
    assert index == 0 and is_query == bool(test.query_mask[0]) and is_gallery == bool(test.gallery_mask[0])
    batch = next(iter(dm.test_dataloader()))
    assert len(batch) == 5 and batch[3].dtype == torch.bool
    assert torch.equal(batch[3], test.query_mask[batch[2]]) and torch.equal(batch[4], test.gallery_mask[batch[2]])


# ------------------------------------------------------------------------------------------------ own images
def test_image_folder_and_csv_give_the_same_structure(trees):
    folder = ImageFolderDataModule(trees["folder"], **SMALL)
    table = ImageFolderDataModule(trees["csv"], **SMALL)  # root = the CSV file
    table_arg = ImageFolderDataModule(trees["csv"].parent, csv_file=trees["csv"].name, **SMALL)
    for dm in (folder, table, table_arg):
        assert not [m for m in _setup(dm) if "both train and test" in m]
        assert len(dm.train_dataset) == 6 * 3 and len(dm.test_dataset) == 5 * 3
        assert len(set(dm.train_dataset.labels.tolist())) == 6 and len(set(dm.test_dataset.labels.tolist())) == 5
    assert folder.class_names[0] == "test_class_00" and table.class_names[0] == "cls_01"
    for i, path in enumerate(folder.train_dataset.paths):
        assert folder.class_names[int(folder.train_dataset.labels[i])] == path.parent.name
    assert table.train_dataset.labels.tolist() == table_arg.train_dataset.labels.tolist()


def test_csv_without_header_and_with_query_gallery(trees, tmp_path):
    csv_path = make_image_csv(tmp_path, header=False)
    dm = ImageFolderDataModule(csv_path, **SMALL)
    _setup(dm)
    assert len(dm.train_dataset) == 18
    lines = csv_path.read_text().splitlines()
    rows = [line.split(",") for line in lines]
    query_gallery = [
        f"{p},{label},{'query' if p.endswith('_0.jpg') else 'gallery'}" if split == "test" else f"{p},{label},{split}"
        for p, label, split in rows
    ]
    (tmp_path / "qg.csv").write_text("\n".join(query_gallery) + "\n")
    dm = ImageFolderDataModule(tmp_path / "qg.csv", **SMALL)
    _setup(dm)
    assert int(dm.test_dataset.query_mask.sum()) == 5 and int(dm.test_dataset.gallery_mask.sum()) == 10
    (tmp_path / "bad.csv").write_text(lines[0].rsplit(",", 1)[0] + ",validation\n")
    with pytest.raises(ValueError, match="row 1, column 'split': unknown split 'validation'; expected train, test"):
        ImageFolderDataModule(tmp_path / "bad.csv", **SMALL).setup()


def test_image_folder_missing_split_folder(tmp_path):
    (tmp_path / "train" / "a").mkdir(parents=True)
    with pytest.raises(DatasetLayoutError, match="test"):
        ImageFolderDataModule(tmp_path, **SMALL).setup()


# ------------------------------------------------------------------------------------------------ corrupt images
@pytest.mark.parametrize("workers", [0, 1])
def test_corrupt_image_error_names_the_file(trees, tmp_path, workers):
    top = Path(shutil.copytree(trees["sop"], tmp_path / "Stanford_Online_Products"))
    dm = SOPDataModule(top, **{**SMALL, "num_workers": workers, "eval_batch_size": 64})
    _setup(dm)
    victim = dm.test_dataset.paths[4]
    corrupt_file(victim)
    with pytest.raises(Exception, match=victim.name) as info:
        for _ in dm.test_dataloader():
            pass
    assert "item 4 of Stanford Online Products test" in str(info.value)
    if workers == 0:
        assert isinstance(info.value, CorruptImageError)


def test_corrupt_images_skipped_when_opted_in(trees, tmp_path):
    top = Path(shutil.copytree(trees["sop"], tmp_path / "Stanford_Online_Products"))
    dm = SOPDataModule(top, on_corrupt="skip", **{**SMALL, "eval_batch_size": 64})
    _setup(dm)
    test_victim, train_victim = dm.test_dataset.paths[4], dm.train_dataset.paths[0]
    corrupt_file(test_victim), corrupt_file(train_victim)
    with pytest.warns(RuntimeWarning, match=test_victim.name):
        indices = torch.cat([batch[2] for batch in dm.test_dataloader()]).tolist()
    assert indices == [i for i in range(len(dm.test_dataset)) if i != 4]  # evaluated without the corrupt file
    with pytest.warns(RuntimeWarning, match=train_victim.name):
        image, label, index = dm.train_dataset[0]
    assert index != 0 and label == int(dm.train_dataset.labels[0])  # another image of the same class


# ------------------------------------------------------------------------------------------------ validation split
def test_held_out_validation_classes(trees):
    dm = CUB200DataModule(trees["cub"], val_classes_fraction=0.2, **SMALL)
    _setup(dm)
    assert not dm.test_as_val
    train_classes = set(dm.train_dataset.labels.tolist())
    val_classes = set(dm.val_dataset.labels.tolist())
    assert len(val_classes) == 20 and len(train_classes) == 80
    assert not train_classes & val_classes and train_classes | val_classes == set(range(1, 101))
    assert dm.val_dataset.evaluation and not dm.train_dataset.evaluation
    assert [item[2] for item in (dm.val_dataset[i] for i in range(3))] == [0, 1, 2]
    default = CUB200DataModule(trees["cub"], **SMALL)
    _setup(default)
    assert default.test_as_val and default.val_dataset is default.test_dataset


def test_training_batches_are_pk_and_eval_covers_the_split(trees):
    dm = Cars196DataModule(trees["cars_annos"], **SMALL)
    _setup(dm)
    loader = dm.train_dataloader()
    for images, labels, indices in loader:
        assert images.shape == (6, 3, 16, 16)
        assert sorted(torch.bincount(labels)[torch.bincount(labels) > 0].tolist()) == [2, 2, 2]
        assert torch.equal(labels, dm.train_dataset.labels[indices])
    seen = torch.cat([batch[2] for batch in dm.val_dataloader()])
    assert seen.tolist() == list(range(len(dm.test_dataset)))


# ----------------------------------------------------------------------------------------- one signature
@pytest.mark.parametrize(
    "cls, key, own",
    [
        (CUB200DataModule, "cub", {"crop_to_box": True}),
        (Cars196DataModule, "cars_annos", {"crop_to_box": True}),
        (ImageFolderDataModule, "folder", {"csv_file": "list.csv"}),
    ],
    ids=["cub", "cars", "folder"],
)
def test_file_data_modules_take_the_base_signature(trees, cls, key, own):
    """CUB, Cars and image folders restate none of ImageFilesDataModule's parameters: positional and keyword
    arguments reach the base in its order, and the CLI's parser sees them next to the module's own."""
    from jsonargparse import ArgumentParser

    spec = InputSpec(color="BGR", scale=255.0, mean=(1.0, 2.0, 3.0), std=(1.0, 1.0, 1.0), crop_size=16, resize_size=20)
    dm = cls(trees[key], 3, 2, 0, 12, spec, resize_size=18, seed=7, val_classes_fraction=0.25, **own)
    got = (dm.root, dm.classes_per_batch, dm.samples_per_class, dm.num_workers, dm.image_size, dm.input_spec)
    assert got == (Path(trees[key]), 3, 2, 0, 12, spec)
    assert (dm.resize_size, dm.seed, dm.val_classes_fraction) == (18, 7, 0.25)
    assert all(getattr(dm, name) == value for name, value in own.items())
    parser = ArgumentParser(exit_on_error=False)
    parser.add_subclass_arguments(DMLDataModule, "data")
    args = [f"--data={cls.__module__}.{cls.__name__}", f"--data.init_args.root={trees[key]}"]
    args += ["--data.init_args.eval_batch_size=8", "--data.init_args.input_spec={\"color\": \"BGR\", \"scale\": 255.0, "
             "\"mean\": [1.0, 2.0, 3.0], \"std\": [1.0, 1.0, 1.0], \"crop_size\": 16, \"resize_size\": 20}"]
    args += [f"--data.init_args.{name}={value}" for name, value in own.items()]
    built = parser.instantiate(parser.parse_args(args)).data
    assert type(built) is cls and built.eval_batch_size == 8 and built.input_spec == spec
    assert all(getattr(built, name) == value for name, value in own.items())
