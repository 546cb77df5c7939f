"""Class-disjoint cross-validation folds (issue 15): whole classes, every training class validated exactly once,
deterministic per seed, balanced, never a test class; on the benchmark fixtures and on a Glyphs subset."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_dml.data import CUB200DataModule, GlyphsDataModule, ImageFolderDataModule, SOPDataModule
from lightning_dml.data import glyphs as glyphs_module
from lightning_dml.protocol import class_folds
from tests import glyph_cache
from tests.fixtures_data import make_cub200, make_image_folder, make_sop

#: characters of the small Glyphs subset the protocol tests use (the first ones of glyphs.CHARACTERS)
SUBSET_CHARACTERS = 24


def glyph_subset_file(base: Path, num_characters: int = SUBSET_CHARACTERS) -> Path:
    """A glyph-renderings pickle (tests/glyph_cache.py format) holding only the first ``num_characters``
    characters: ``glyph_cache.install(path)`` then serves a small Glyphs dataset (here and in subprocesses)."""
    path = base / f"glyph_subset_{num_characters}.pkl"
    if not path.exists():
        full = base / glyph_cache.FILENAME
        if not full.exists():
            glyph_cache.install(full)  # renders once per session and writes the shared cache
        renders = pickle.loads(full.read_bytes())
        keep = set(glyphs_module.CHARACTERS[:num_characters])
        path.write_bytes(pickle.dumps({key: value for key, value in renders.items() if key[1] in keep}))
    return path


@pytest.fixture
def glyph_subset(tmp_path_factory, monkeypatch) -> Path:
    """Serve the small Glyphs subset in this process for one test (restored afterwards)."""
    path = glyph_subset_file(tmp_path_factory.getbasetemp())
    renders = pickle.loads(path.read_bytes())
    monkeypatch.setattr(glyphs_module, "_clean_renderings", lambda: renders)
    glyphs_module.render_glyphs.cache_clear()
    yield path
    glyphs_module.render_glyphs.cache_clear()


# ------------------------------------------------------------------------------------------- class_folds
def test_folds_partition_the_classes_into_balanced_folds():
    labels = np.repeat(np.arange(3, 26), 4)  # 23 classes
    folds = class_folds(labels, 4, seed=0)
    assert len(folds) == 4
    assert sorted(len(f) for f in folds) == [5, 6, 6, 6]
    together = np.concatenate(folds)
    assert sorted(together.tolist()) == list(range(3, 26))  # every class in exactly one fold


def test_folds_are_deterministic_per_seed_and_independent_of_item_order():
    labels = torch.arange(40).repeat_interleave(3)
    a = class_folds(labels, 5, seed=1)
    b = class_folds(labels.flip(0), 5, seed=1)
    c = class_folds(labels, 5, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize("num_folds", [1, 0, 2.5, True])
def test_bad_num_folds_is_an_error(num_folds):
    with pytest.raises(ValueError, match="num_folds"):
        class_folds([0, 1, 2], num_folds, 0)


def test_more_folds_than_classes_is_an_error():
    with pytest.raises(ValueError, match="3 classes"):
        class_folds([0, 1, 2, 2], 4, 0)


# ------------------------------------------------------------------------------------------- data modules
def _check_folds(make_dm, num_folds: int) -> None:
    """Every fold: validation classes disjoint from training and test classes; the folds' validation classes
    cover the training classes exactly once; training + validation = the full training split; test untouched."""
    full = make_dm()
    full.setup("fit")
    train_classes = set(torch.as_tensor(full.train_dataset.labels).tolist())
    test_labels = torch.as_tensor(full.test_dataset.labels)
    seen: list[int] = []
    for fold in range(num_folds):
        dm = make_dm(fold=fold, num_folds=num_folds, fold_seed=3)
        dm.setup("fit")
        assert not dm.test_as_val
        train = set(torch.as_tensor(dm.train_dataset.labels).tolist())
        val = set(torch.as_tensor(dm.val_dataset.labels).tolist())
        assert not train & val and train | val == train_classes
        assert not val & set(test_labels.tolist())
        assert len(dm.train_dataset) + len(dm.val_dataset) == len(full.train_dataset)
        assert torch.equal(torch.as_tensor(dm.test_dataset.labels), test_labels)
        assert dm.val_dataset[0][2] == 0  # the validation view is renumbered for evaluation
        seen += sorted(val)
    assert sorted(seen) == sorted(train_classes)


def test_folds_on_the_benchmark_fixtures(tmp_path):
    sop = make_sop(tmp_path / "sop", train_classes=9, test_classes=4, images_per_class=2)
    folder = make_image_folder(tmp_path / "folder", train_classes=6, test_classes=3, images_per_class=2)
    cub = make_cub200(tmp_path / "cub", images_per_class=1)
    common = {"classes_per_batch": 2, "samples_per_class": 1, "num_workers": 0, "check_counts": False}
    _check_folds(lambda **kw: SOPDataModule(sop, **common, **kw), 3)
    _check_folds(lambda **kw: ImageFolderDataModule(folder, **common, **kw), 2)
    _check_folds(lambda **kw: CUB200DataModule(cub, **common, **kw), 4)


def test_folds_on_glyphs(glyph_subset):
    _check_folds(lambda **kw: GlyphsDataModule(classes_per_batch=2, samples_per_class=2, **kw), 3)


def test_fold_seed_changes_the_folds_not_the_sampler_seed(glyph_subset):
    def val_classes(**kw) -> set[int]:
        dm = GlyphsDataModule(classes_per_batch=2, fold=0, num_folds=3, **kw)
        dm.setup("fit")
        return set(dm.val_dataset.labels.tolist())

    assert val_classes(fold_seed=0) == val_classes(fold_seed=0)
    assert val_classes(fold_seed=0) != val_classes(fold_seed=1)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"fold": 0, "num_folds": 3, "val_classes_fraction": 0.2}, "set one of them"),
        ({"fold": 0}, "set together"),
        ({"num_folds": 3}, "set together"),
        ({"fold": 3, "num_folds": 3}, "0 <= fold < num_folds"),
        ({"fold": 0, "num_folds": 1}, "num_folds >= 2"),
    ],
)
def test_bad_fold_arguments_are_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        GlyphsDataModule(**kwargs)


def test_a_fold_too_small_for_a_batch_is_an_error(glyph_subset):
    dm = GlyphsDataModule(classes_per_batch=16, fold=0, num_folds=2)
    with pytest.raises(ValueError, match="classes_per_batch=16"):
        dm.setup("fit")


def test_glyphs_takes_the_base_arguments(glyph_subset):
    dm = GlyphsDataModule(classes_per_batch=2, samples_per_class=2, val_classes_fraction=0.25, sampler="npair", seed=0)
    dm.setup("fit")
    assert dm.sampler == "npair" and not dm.test_as_val
    val, train = set(dm.val_dataset.labels.tolist()), set(dm.train_dataset.labels.tolist())
    assert val and not val & train and not val & set(dm.test_dataset.labels.tolist())
