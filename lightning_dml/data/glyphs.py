"""Glyphs: an embedded zero-shot retrieval dataset rendered from the fonts matplotlib ships.

One class per character (Latin, Greek and Cyrillic letters, digits, symbols), one image per font that really
contains the glyph, each with a mild random affine / stroke / noise variation. Half of the classes train, the
other half test, disjoint as in CUB-200-2011 and Cars196, so the task is zero-shot retrieval: the network must
learn what makes two renderings the same character without seeing the test characters.

Nothing is downloaded: matplotlib's font files are read with Pillow's FreeType renderer, and matplotlib's
``FT2Font`` tells which fonts map a code point to a real glyph. A font can map a code point and still draw its
placeholder box (``LastResortHE`` draws one for everything); such glyphs are recognised by comparing the
rendering with the font's rendering of an unassigned code point, and skipped. Characters that render like an
earlier character (Cyrillic ``А`` after Latin ``A``, Greek ``Ο`` after Latin ``O``) are dropped,
so no two classes are visually identical.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageChops, ImageDraw, ImageFilter, ImageFont

from lightning_dml.data.base import DMLDataModule, TensorImageDataset
from lightning_dml.models.input_spec import InputSpec

#: Characters in class order: an earlier character wins when two render alike.
CHARACTERS: str = (
    "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
    + "".join(chr(c) for c in range(0x391, 0x3AA) if c != 0x3A2)  # Greek capitals
    + "".join(chr(c) for c in range(0x3B1, 0x3CA))  # Greek small letters (with final sigma)
    + "".join(chr(c) for c in range(0x410, 0x450))  # Cyrillic А..я
    + "ЁёЄєІіЇїЎў"
    + "!#$%&?@*+<=>[]{}()/\\|^~§¶©®°±×÷µ¿¡€£¥¢"
)

#: Latin letters and digits only: TeX's Computer Modern fonts map ASCII symbol positions to other glyphs.
_ALNUM = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789")

#: Font files used (all shipped in ``matplotlib/mpl-data/fonts/ttf``) and which characters each may provide.
#: The STIX size variants hold only large delimiters and ``cmex10``/``cmsy10`` map letters to math symbols.
_FONT_FILES: dict[str, frozenset[str] | None] = {
    **{
        name: None
        for name in (
            "DejaVuSans.ttf", "DejaVuSans-Bold.ttf", "DejaVuSans-Oblique.ttf", "DejaVuSans-BoldOblique.ttf",
            "DejaVuSansMono.ttf", "DejaVuSansMono-Bold.ttf", "DejaVuSansMono-Oblique.ttf",
            "DejaVuSansMono-BoldOblique.ttf", "DejaVuSerif.ttf", "DejaVuSerif-Bold.ttf", "DejaVuSerif-Italic.ttf",
            "DejaVuSerif-BoldItalic.ttf", "DejaVuSansDisplay.ttf", "DejaVuSerifDisplay.ttf",
            "STIXGeneral.ttf", "STIXGeneralBol.ttf", "STIXGeneralItalic.ttf", "STIXGeneralBolIta.ttf",
            "STIXNonUni.ttf", "STIXNonUniBol.ttf", "STIXNonUniIta.ttf", "STIXNonUniBolIta.ttf",
            "LastResortHE-Regular.ttf",
        )
    },
    **{name: _ALNUM for name in ("cmr10.ttf", "cmb10.ttf", "cmti10.ttf", "cmss10.ttf", "cmtt10.ttf", "cmmi10.ttf")},
}

_RENDER_SIZE = 64  # glyphs are drawn and distorted at this resolution, then downsampled
_UNASSIGNED = "\U0010fffd"
_MAX_SHARED_GLYPH = 16  # a private-use code point no font here defines: its rendering is the placeholder


def font_dir() -> Path:
    """The folder of the TrueType fonts bundled with matplotlib."""
    import matplotlib

    return Path(matplotlib.get_data_path()) / "fonts" / "ttf"


def _render(font: ImageFont.FreeTypeFont, char: str) -> Image.Image:
    canvas = Image.new("L", (_RENDER_SIZE, _RENDER_SIZE), 0)
    draw = ImageDraw.Draw(canvas)
    # Horizontally centred on the baseline, so relative glyph size (x-height, descenders) is preserved.
    draw.text((_RENDER_SIZE / 2, _RENDER_SIZE * 0.70), char, fill=255, font=font, anchor="ms")
    return canvas


def _same_image(a: Image.Image, b: Image.Image) -> bool:
    return ImageChops.difference(a, b).getbbox() is None


@lru_cache(maxsize=1)
def _clean_renderings() -> dict[tuple[str, str], np.ndarray]:
    """Render every (font, character) pair that has a real glyph, as uint8 arrays (no distortion)."""
    from matplotlib.ft2font import FT2Font

    renders: dict[tuple[str, str], np.ndarray] = {}
    directory = font_dir()
    for filename, allowed in _FONT_FILES.items():
        path = directory / filename
        if not path.exists():  # a matplotlib release without this font: use the others
            continue
        cmap = FT2Font(str(path)).get_charmap()
        # A placeholder font maps whole Unicode blocks to one box glyph: a glyph that many code points of the
        # font share (more than homoglyphs and space variants ever do) is a placeholder.
        sharing = Counter(cmap.values())
        font = ImageFont.truetype(str(path), size=int(_RENDER_SIZE * 0.6))
        placeholder = _render(font, _UNASSIGNED)
        for char in CHARACTERS:
            if (allowed is not None and char not in allowed) or ord(char) not in cmap:
                continue
            if sharing[cmap[ord(char)]] > _MAX_SHARED_GLYPH:
                continue
            image = _render(font, char)
            if image.getbbox() is None or _same_image(image, placeholder):
                continue
            renders[(filename, char)] = np.asarray(image)
    if not renders:
        raise RuntimeError(f"no glyph could be rendered from the fonts in {directory}")
    return renders


def _distinct_characters(renders: dict[tuple[str, str], np.ndarray], threshold: float) -> list[str]:
    """The characters kept as classes: a character that looks like an earlier one (a homoglyph) is dropped.

    Two characters look alike when their DejaVu Sans renderings have a correlation above ``threshold``.
    """
    reference = "DejaVuSans.ttf"
    kept: list[tuple[str, np.ndarray]] = []
    for char in CHARACTERS:
        if (reference, char) not in renders:
            continue
        x = renders[(reference, char)].astype(np.float64).ravel()
        x = (x - x.mean()) / (x.std() + 1e-12)
        if all(float(x @ y) / x.size <= threshold for _, y in kept):
            kept.append((char, x))
    return [char for char, _ in kept]


def homoglyph_groups(threshold: float = 0.97) -> list[tuple[str, ...]]:
    """The groups of look-alike characters (homoglyphs: Latin ``A``, Greek ``Α``, Cyrillic ``А``): the connected
    components of "the DejaVu Sans renderings correlate above ``threshold``", the rule by which
    :func:`render_glyphs` keeps only the first character of each group as a class. Groups of two or more, each in
    :data:`CHARACTERS` order."""
    renders = _clean_renderings()
    reference = "DejaVuSans.ttf"
    chars = [char for char in CHARACTERS if (reference, char) in renders]
    x = np.stack([renders[(reference, char)].astype(np.float64).ravel() for char in chars])
    x = (x - x.mean(axis=1, keepdims=True)) / (x.std(axis=1, keepdims=True) + 1e-12)
    alike = (x @ x.T) / x.shape[1] > threshold
    parent = list(range(len(chars)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    for i, j in zip(*np.nonzero(np.triu(alike, k=1))):
        parent[root(int(j))] = root(int(i))
    groups: dict[int, list[str]] = {}
    for i, char in enumerate(chars):
        groups.setdefault(root(i), []).append(char)
    return [tuple(group) for group in groups.values() if len(group) > 1]


def _distort(image: np.ndarray, rng: np.random.Generator, size: int) -> np.ndarray:
    """Mild random affine, stroke-width and noise variation of one clean rendering."""
    pil = Image.fromarray(image)
    stroke = rng.integers(3)  # unchanged, bolder or softer stroke (thinning would erase thin serif strokes)
    if stroke == 1:
        pil = pil.filter(ImageFilter.MaxFilter(3))
    elif stroke == 2:
        pil = pil.filter(ImageFilter.GaussianBlur(1.0))
    angle = np.deg2rad(rng.uniform(-12.0, 12.0))
    scale = rng.uniform(0.85, 1.12)
    shear = rng.uniform(-0.2, 0.2)
    tx, ty = rng.uniform(-0.07, 0.07, size=2) * _RENDER_SIZE
    # Inverse map (output -> input) of: scale, shear, rotate about the centre, translate.
    c, s = np.cos(angle), np.sin(angle)
    forward = scale * np.array([[c, -s], [s, c]]) @ np.array([[1.0, shear], [0.0, 1.0]])
    inverse = np.linalg.inv(forward)
    centre = np.array([_RENDER_SIZE / 2, _RENDER_SIZE / 2])
    offset = centre - inverse @ (centre + np.array([tx, ty]))
    coeffs = (inverse[0, 0], inverse[0, 1], offset[0], inverse[1, 0], inverse[1, 1], offset[1])
    pil = pil.transform(pil.size, Image.Transform.AFFINE, coeffs, resample=Image.Resampling.BILINEAR)
    pil = pil.resize((size, size), Image.Resampling.LANCZOS)
    array = np.asarray(pil, dtype=np.float32) / 255.0
    array = array + rng.normal(0.0, rng.uniform(0.03, 0.12), size=array.shape)
    return (np.clip(array, 0.0, 1.0) * 255.0).round().astype(np.uint8)


def _stable_int(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:8], "little")


@lru_cache(maxsize=4)
def render_glyphs(
    image_size: int = 32, seed: int = 0, min_fonts: int = 5, homoglyph_threshold: float = 0.97
) -> tuple[torch.Tensor, torch.Tensor, list[str], list[str]]:
    """Render the whole Glyphs dataset.

    Returns ``(images uint8 [N, 1, S, S], labels int64 [N], class_names, fonts)`` where ``labels`` index
    ``class_names`` (one character each) and ``fonts[i]`` is the font of image ``i``. Classes with fewer than
    ``min_fonts`` images are dropped. Deterministic given ``seed``: each image's variation is seeded by
    ``(seed, font, character)``. Results are memoised per arguments (treat the tensors as read-only).
    """
    renders = _clean_renderings()
    by_class: dict[str, list[str]] = {char: [] for char in _distinct_characters(renders, homoglyph_threshold)}
    for font_name, char in sorted(renders):
        if char in by_class:
            by_class[char].append(font_name)
    class_names = [char for char, font_names in by_class.items() if len(font_names) >= min_fonts]
    images, labels, fonts = [], [], []
    for label, char in enumerate(class_names):
        for font_name in by_class[char]:
            rng = np.random.default_rng(_stable_int(seed, font_name, char))
            images.append(_distort(renders[(font_name, char)], rng, image_size))
            labels.append(label)
            fonts.append(font_name)
    tensor = torch.from_numpy(np.stack(images)).unsqueeze(1)
    return tensor, torch.tensor(labels, dtype=torch.long), class_names, fonts


class GlyphsDataModule(DMLDataModule):
    """The embedded zero-shot dataset: characters rendered from matplotlib's fonts (see the module docstring).

    Half of the classes (chosen by ``seed``) train, the other half test. Images are single-channel
    ``image_size`` x ``image_size``, scaled to [0, 1] and standardised with ``mean``/``std``; ``channels=3``
    repeats the channel for backbones that expect RGB input.

    Args:
        image_size: side of the square images.
        seed: seed of the rendering variations, the class split and the training sampler.
        train_fraction: fraction of the classes used for training.
        channels: 1, or 3 to repeat the grey channel.
        mean: value subtracted from the [0, 1] pixels.
        std: divisor applied after subtracting ``mean``.
        classes_per_batch, samples_per_class, eval_batch_size, num_workers, sampler, hard_class_mining,
            val_classes_fraction, fold, num_folds, fold_seed: see :class:`DMLDataModule` (validation classes,
            held out or a fold, are taken from the training half; the test half is never touched).
        views: see :class:`DMLDataModule`; the glyphs have no random augmentation, so their views are identical.
        input_spec: the input convention; default the backbone's, read at set-up (see :class:`DMLDataModule`).
            When set it replaces ``channels``, ``mean`` and ``std``: the grey glyph is repeated to the spec's
            channels and converted to its value scale and per-channel mean/std. ``image_size`` stays the rendering
            size.
    """

    def __init__(
        self,
        image_size: int = 32,
        seed: int = 0,
        train_fraction: float = 0.5,
        channels: int = 1,
        mean: float = 0.1,
        std: float = 0.25,
        classes_per_batch: int = 16,
        samples_per_class: int = 4,
        eval_batch_size: int = 512,
        num_workers: int = 0,
        input_spec: InputSpec | None = None,
        sampler: str = "balanced",
        hard_class_mining: bool = False,
        val_classes_fraction: float = 0.0,
        fold: int | None = None,
        num_folds: int | None = None,
        fold_seed: int = 0,
        views: int = 1,
    ) -> None:
        super().__init__(
            classes_per_batch, samples_per_class, eval_batch_size, num_workers, seed, sampler, hard_class_mining,
            val_classes_fraction, input_spec, fold, num_folds, fold_seed, views=views,
        )
        if not 0.0 < train_fraction < 1.0:
            raise ValueError(f"train_fraction must be in (0, 1), got {train_fraction}")
        if channels not in (1, 3):
            raise ValueError(f"channels must be 1 or 3, got {channels}")
        if image_size < 8:
            raise ValueError(f"image_size must be at least 8, got {image_size}")
        self.image_size = image_size
        self.train_fraction = train_fraction
        self.channels = channels
        self.mean = mean
        self.std = std
        self.class_names: list[str] = []
        self.train_classes: list[str] = []
        self.test_classes: list[str] = []

    def build_datasets(self) -> tuple[TensorImageDataset, TensorImageDataset]:
        images, labels, self.class_names, _ = render_glyphs(self.image_size, self.seed)
        spec = self.input_spec  # the backbone's convention (or a given one) replaces channels, mean and std
        channels, mean, std, scale = (
            (self.channels, self.mean, self.std, 1.0) if spec is None else (spec.channels, spec.mean, spec.std, spec.scale)
        )
        if channels == 3:
            images = images.expand(-1, 3, -1, -1).contiguous()
        num_classes = len(self.class_names)
        order = torch.randperm(num_classes, generator=torch.Generator().manual_seed(self.seed))
        num_train = int(round(num_classes * self.train_fraction))
        is_train_class = torch.zeros(num_classes, dtype=torch.bool)
        is_train_class[order[:num_train]] = True
        self.train_classes = [c for c, t in zip(self.class_names, is_train_class.tolist()) if t]
        self.test_classes = [c for c, t in zip(self.class_names, is_train_class.tolist()) if not t]
        train = is_train_class[labels]
        return (
            TensorImageDataset(images[train], labels[train], mean, std, scale),
            TensorImageDataset(images[~train], labels[~train], mean, std, scale),
        )
