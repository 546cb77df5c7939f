"""The embedded Glyphs dataset: real glyphs only, distinct classes, deterministic, disjoint zero-shot split."""

import numpy as np
import pytest
import torch
from matplotlib.ft2font import FT2Font

from lightning_dml.data import GlyphsDataModule
from lightning_dml.data.glyphs import CHARACTERS, _clean_renderings, font_dir, render_glyphs


@pytest.fixture(scope="module")
def glyphs():
    return render_glyphs(image_size=32, seed=0)


def test_every_image_comes_from_a_font_that_maps_the_character(glyphs):
    images, labels, names, fonts = glyphs
    cmaps = {f: FT2Font(str(font_dir() / f)).get_charmap() for f in set(fonts)}
    for label, font in zip(labels.tolist(), fonts):
        assert ord(names[label]) in cmaps[font]


def test_placeholder_font_is_skipped(glyphs):
    # LastResort draws a box for every character: it must contribute nothing.
    assert (font_dir() / "LastResortHE-Regular.ttf").exists()
    assert "LastResortHE-Regular.ttf" not in glyphs[3]
    assert all(font != "LastResortHE-Regular.ttf" for font, _ in _clean_renderings())


def test_one_image_per_font_and_class_and_many_classes(glyphs):
    images, labels, names, fonts = glyphs
    pairs = list(zip(labels.tolist(), fonts))
    assert len(pairs) == len(set(pairs))
    assert len(names) == len(set(names)) >= 150
    scripts = {"latin": "A", "greek": "λ", "cyrillic": "Ж", "digit": "7", "symbol": "@"}
    assert all(ch in names for ch in scripts.values())
    counts = torch.bincount(labels)
    assert counts.min() >= 5
    assert images.dtype == torch.uint8 and images.shape[1:] == (1, 32, 32)


def test_homoglyphs_are_not_separate_classes(glyphs):
    names = glyphs[2]
    assert "A" in names and "\u0410" not in names and "\u0391" not in names  # Cyrillic A, Greek Alpha
    assert "O" in names and "\u041e" not in names


def test_rendering_is_deterministic_given_the_seed():
    uncached = render_glyphs.__wrapped__
    a = uncached(image_size=16, seed=3)
    b = uncached(image_size=16, seed=3)
    c = uncached(image_size=16, seed=4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])


def test_split_is_half_the_classes_and_disjoint():
    dm = GlyphsDataModule(seed=0)
    dm.setup()
    train_labels = set(dm.train_dataset.labels.tolist())
    test_labels = set(dm.test_dataset.labels.tolist())
    assert not train_labels & test_labels
    assert abs(len(train_labels) - len(test_labels)) <= 1
    image, label, index = dm.test_dataset[5]
    assert image.shape == (1, 32, 32) and index == 5 and label == int(dm.test_dataset.labels[5])


def test_raw_pixels_are_far_from_solving_the_task():
    # The calibration the demo relies on: nearest neighbours in pixel space find the class only sometimes.
    dm = GlyphsDataModule(seed=0)
    dm.setup()
    x = torch.nn.functional.normalize(dm.test_dataset.images.flatten(1).double(), dim=1)
    y = dm.test_dataset.labels
    sim = x @ x.T
    sim.fill_diagonal_(-np.inf)
    recall_at_1 = (y[sim.argmax(1)] == y).double().mean().item()
    assert 0.25 < recall_at_1 < 0.6


def test_invalid_arguments_raise():
    with pytest.raises(ValueError, match="train_fraction"):
        GlyphsDataModule(train_fraction=1.0)
    with pytest.raises(ValueError, match="channels"):
        GlyphsDataModule(channels=2)


def test_three_channel_option():
    dm = GlyphsDataModule(channels=3, image_size=16)
    dm.setup()
    assert dm.train_dataset[0][0].shape == (3, 16, 16)


def test_character_list_has_no_duplicates():
    assert len(CHARACTERS) == len(set(CHARACTERS))
