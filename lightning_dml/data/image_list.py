"""A dataset of image files listed with their labels (and optional bounding boxes).

Items are ``(image, label, index)``, ``index`` being the item's position in its split. A test split of a
query/gallery benchmark (In-Shop) additionally yields ``(is_query, is_gallery)`` and exposes ``query_mask`` /
``gallery_mask`` tensors, so evaluation ranks queries against the gallery. An evaluation split with ``sequence``
or ``category`` ids (tables of :class:`~lightning_dml.data.CSVDataModule`) yields
``(image, label, index, is_query, is_gallery, sequence, category)`` (-1: none). ``labels`` may be label sets
``[N, L]`` padded with -1: an item's label is then its row, a tensor ``[L]`` (batches collate to ``[B, L]``).

Images are read by :func:`load_image`, which brings every PIL mode to 8 bits per channel first (16-bit, 32-bit
integer and float images are scaled by the documented rule of :func:`to_8bit`, never clipped) and then converts
to ``"RGB"`` or ``"L"``.

A file that cannot be decoded raises :class:`CorruptImageError` (a
:class:`~lightning_dml.errors.UserInputError`, printed by the CLI as one line) naming the file, the split, the item
and the ``on_corrupt`` option; the DataLoader re-raises it in the main process, wrapped in a message that holds
the worker's traceback, which :func:`lightning_dml.errors.user_error_message` strips again. With
``on_corrupt="skip"`` the item is replaced, with a warning naming the file: in a training split by another image
of the same class (the P x K batch keeps its shape), in an evaluation split by nothing (the collate function
:func:`collate_skipping` drops it, so the evaluated set excludes the file).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch.utils.data import Dataset, default_collate

from lightning_dml.errors import UserInputError


class CorruptImageError(UserInputError, OSError):
    """An image file that exists in the dataset's list could not be read or decoded (or failed ``verify_images``).

    A :class:`~lightning_dml.errors.UserInputError` (the CLI prints it as one line, also when a DataLoader worker
    raised it) and an ``OSError``.
    """


#: How to skip unreadable images instead, appended to the messages of :class:`CorruptImageError`.
ON_CORRUPT_HINT = (
    "to skip unreadable images with a warning instead, set on_corrupt: skip (--data.init_args.on_corrupt skip)"
)

#: Modes holding 16-bit unsigned samples (``I;16`` little-endian, ``I;16B`` big-endian, ``I;16L``, ``I;16N``).
_MODES_16BIT = ("I;16", "I;16B", "I;16L", "I;16N")


#: What ``__getitem__`` returns for a skipped item of an evaluation split; dropped by :func:`collate_skipping`.
SKIPPED = None


def collate_skipping(batch: list[Any]) -> Any:
    """``default_collate`` without the items skipped as corrupt (``None``); an all-skipped batch is empty."""
    kept = [item for item in batch if item is not SKIPPED]
    if not kept:
        raise CorruptImageError(f"every image of a batch of {len(batch)} was corrupt and skipped")
    return default_collate(kept)


def to_8bit(image: Image.Image) -> Image.Image:
    """``image`` with 8 bits per sample: the high-bit-depth modes become ``"L"``, every other mode is returned as
    it is (PIL's own conversions of the 8-bit modes are exact).

    The rule, one fixed scale per mode (never per image, so every image of a data set is read alike):

    * ``I;16``, ``I;16B``, ``I;16L``, ``I;16N`` (16-bit grey PNG, TIFF, PGM): the full range [0, 65535] maps to
      [0, 255] by ``v >> 8`` (the high byte). This is what PIL itself does to 16-bit *colour* PNGs and what
      torchvision's ``to_dtype(uint16 -> uint8, scale=True)`` does, and an 8-bit value stored as 16 bits either way
      (``v * 257`` or ``v << 8``) comes back unchanged. PIL's ``convert`` instead clips at 255, which turns nearly
      every pixel white.
    * ``I`` (32-bit integer): PIL opens 16-bit PGM/PPM (rescaled from their ``maxval`` to [0, 65535]) and, in
      Pillow < 10, 16-bit PNGs in this mode, so the same 16-bit range is assumed: ``v >> 8``. Values outside
      [0, 65535] (a genuine 32-bit image) have no agreed scale: ``ValueError`` naming the range found.
    * ``F`` (32-bit float, e.g. a float TIFF): the [0, 1] convention of float images in torchvision
      (``ToTensor``), scikit-image and NumPy pipelines: ``round(v * 255)``, the inverse of ``v / 255``, so an 8-bit
      image saved as ``v / 255`` comes back unchanged. A value that does not round into [0, 255] (outside about
      [-0.002, 1.002]), NaN or infinity is a ``ValueError`` naming the range found: PIL's own ``convert`` assumes
      [0, 255] for ``F`` and would clip a [0, 1] image to black, and no scale can be guessed for other ranges.

    No per-pixel Python: one vectorised NumPy pass over the image.
    """
    mode = image.mode
    if mode not in (*_MODES_16BIT, "I", "F"):
        return image
    values = np.asarray(image)
    if mode == "F":
        scaled = np.rint(values.astype(np.float64) * 255.0)
        if not bool(np.all((scaled >= 0.0) & (scaled <= 255.0))):  # also false for NaN
            finite = values[np.isfinite(values)]
            found = f"[{finite.min():g}, {finite.max():g}]" if finite.size else "no finite value"
            extra = "" if finite.size == values.size else f" and {values.size - finite.size} NaN/infinite values"
            raise ValueError(
                f"a float (mode F) image must hold values in [0, 1] (read as round(v * 255)); this one has {found}"
                f"{extra}: convert it to 8 or 16 bits with the scale you intend"
            )
        return Image.fromarray(scaled.astype(np.uint8), "L")
    if mode == "I":
        low, high = int(values.min()), int(values.max())
        if low < 0 or high > 65535:
            raise ValueError(
                f"a 32-bit integer (mode I) image is read as 16-bit data in [0, 65535] (v >> 8); this one has values "
                f"in [{low}, {high}]: convert it to 8 or 16 bits with the scale you intend"
            )
    return Image.fromarray((values >> 8).astype(np.uint8), "L")


#: Environment variable choosing the JPEG decoder of :func:`load_image`: ``simplejpeg`` or ``pil`` (default: simplejpeg
#: where it is installed, ``pip install lightning-dml[jpeg]``, else PIL).
JPEG_DECODER_ENV = "LIGHTNING_DML_JPEG_DECODER"

_simplejpeg: Any = None


def jpeg_decoder() -> str:
    """The JPEG decoder :func:`load_image` uses: ``"simplejpeg"`` when the package is installed, unless
    ``LIGHTNING_DML_JPEG_DECODER=pil``; else ``"pil"``. ``LIGHTNING_DML_JPEG_DECODER=simplejpeg`` without the package
    is an ``ImportError`` saying how to install it."""
    global _simplejpeg
    choice = os.environ.get(JPEG_DECODER_ENV, "").strip().lower()
    if choice not in ("", "simplejpeg", "pil"):
        raise ValueError(f"{JPEG_DECODER_ENV} must be 'simplejpeg' or 'pil', got {choice!r}")
    if choice == "pil":
        return "pil"
    if _simplejpeg is None:
        try:
            import simplejpeg
        except ImportError as error:
            if choice == "simplejpeg":
                raise ImportError(
                    f"{JPEG_DECODER_ENV}=simplejpeg but simplejpeg is not installed: pip install 'lightning-dml[jpeg]'"
                ) from error
            _simplejpeg = False
        else:
            _simplejpeg = simplejpeg
    return "simplejpeg" if _simplejpeg else "pil"


def _decode_jpeg(path: Path, mode: str) -> Image.Image | None:
    """``path`` decoded by simplejpeg (libjpeg-turbo, 5-17% less CPU per decode than PIL here) when it is an 8-bit
    YCbCr or greyscale JPEG, converted to ``mode`` exactly as PIL converts; ``None`` for anything else (another
    format, CMYK/YCCK, 12-bit, a damaged file), which PIL then reads, so a damaged file fails with PIL's message.

    The pixels are PIL's: both use libjpeg-turbo's default decoding (accurate integer IDCT, fancy upsampling),
    which is exact, and the colour to grey conversion is PIL's own (tests/test_decoded_cache.py compares them)."""
    with open(path, "rb") as handle:
        data = handle.read()
    if data[:3] != b"\xff\xd8\xff":
        return None
    try:
        colorspace = _simplejpeg.decode_jpeg_header(data)[2]
        if colorspace == "Gray":
            pixels = _simplejpeg.decode_jpeg(data, colorspace="GRAY")
            image = Image.fromarray(pixels.reshape(pixels.shape[:2]), "L")
        elif colorspace == "YCbCr":
            image = Image.fromarray(_simplejpeg.decode_jpeg(data, colorspace="RGB"), "RGB")
        else:
            return None
    except (ValueError, RuntimeError, OSError):  # damaged or unsupported: PIL reads it (and names the problem)
        return None
    return image if image.mode == mode else image.convert(mode)


def load_image(path: Path, mode: str = "RGB", box: Sequence[float] | None = None) -> Image.Image:
    """Open ``path`` fully decoded in ``mode`` (``"RGB"`` or ``"L"``), cropped to ``box`` = (left, top, right,
    bottom) in PIL pixel coordinates (clipped to the image) when given.

    Every mode is first brought to 8 bits by :func:`to_8bit` (16-bit, ``I`` and ``F`` images), then converted by
    PIL: grey (``1``, ``L``, the scaled high-bit-depth modes) is replicated into three channels for ``"RGB"``;
    alpha (``LA``, ``RGBA``, ``P`` with transparency) is dropped, keeping the colour the file stores under a
    transparent pixel, as torchvision's ``ImageFolder`` loader does; ``P`` takes its palette colours; ``CMYK``
    uses PIL's conversion ``(255 - c) * (255 - k) / 255``; ``"L"`` from colour is PIL's ITU-R 601-2 luma
    ``(19595 R + 38470 G + 7471 B + 2^15) >> 16``. A palette image with per-entry transparency goes through
    ``RGBA`` (the same pixels, without PIL's warning about it for every such image).

    8-bit YCbCr and greyscale JPEGs are decoded by simplejpeg where it is installed (:func:`jpeg_decoder`), to the
    same pixels; everything else by PIL.
    """
    image = _decode_jpeg(path, mode) if jpeg_decoder() == "simplejpeg" else None
    if image is None:
        with Image.open(path) as handle:
            handle.load()  # a full decode: truncated files fail here, not later
            image = to_8bit(handle)
            if image.mode in ("P", "PA") and "transparency" in image.info:
                image = image.convert("RGBA")
            image = image.convert(mode)  # a copy even in the same mode: nothing refers to the closed file
    if box is not None:
        left, top, right, bottom = (float(v) for v in box)
        left, top = max(0.0, left), max(0.0, top)
        right, bottom = min(float(image.width), right), min(float(image.height), bottom)
        if right - left < 1 or bottom - top < 1:
            raise ValueError(f"bounding box {tuple(box)} is empty inside the {image.width}x{image.height} image")
        image = image.crop((int(left), int(top), int(round(right)), int(round(bottom))))
    return image


class ImageListDataset(Dataset):
    """Images given as file paths with integer labels.

    Args:
        paths: image files, in split order (position = ``index``).
        labels: class label of each image (any integers; they are kept as given), or label sets ``[N, L]``
            padded with -1.
        transform: callable applied to the PIL image (see :mod:`lightning_dml.data.transforms`).
        boxes: optional ``[N, 4]`` crop boxes (left, top, right, bottom) in PIL coordinates.
        mode: ``"RGB"`` or ``"L"`` (grey).
        split: name used in error messages (``"CUB-200-2011 train"``).
        on_corrupt: ``"error"`` (default) or ``"skip"`` (see the module docstring).
        evaluation: an evaluation split (skipped items are dropped rather than replaced).
        query_mask, gallery_mask: optional boolean masks (query/gallery benchmarks); when given, items are
            ``(image, label, index, is_query, is_gallery)``.
        sequence, category: optional int ids per item (-1: none). An evaluation split with either yields
            ``(image, label, index, is_query, is_gallery, sequence, category)`` (masks default to true); a training
            split keeps ``(image, label, index)`` and exposes them (``category`` feeds the category sampler).
    """

    def __init__(
        self,
        paths: Sequence[str | Path],
        labels: Sequence[int] | np.ndarray | torch.Tensor,
        transform: Callable | None = None,
        boxes: np.ndarray | None = None,
        mode: str = "RGB",
        split: str = "split",
        on_corrupt: str = "error",
        evaluation: bool = False,
        query_mask: torch.Tensor | None = None,
        gallery_mask: torch.Tensor | None = None,
        sequence: np.ndarray | torch.Tensor | None = None,
        category: np.ndarray | torch.Tensor | None = None,
    ) -> None:
        self.paths = [Path(p) for p in paths]
        self.labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
        if self.labels.ndim not in (1, 2) or self.labels.shape[0] != len(self.paths):
            raise ValueError(f"{split}: {len(self.paths)} paths but labels of shape {tuple(self.labels.shape)}")
        if boxes is not None:
            boxes = np.asarray(boxes, dtype=np.float64)
            if boxes.shape != (len(self.paths), 4):
                raise ValueError(f"{split}: boxes must have shape ({len(self.paths)}, 4), got {boxes.shape}")
        if mode not in ("RGB", "L"):
            raise ValueError(f"mode must be 'RGB' or 'L', got {mode!r}")
        if on_corrupt not in ("error", "skip"):
            raise ValueError(f"on_corrupt must be 'error' or 'skip', got {on_corrupt!r}")
        if (query_mask is None) != (gallery_mask is None):
            raise ValueError("query_mask and gallery_mask must be given together")
        self.boxes = boxes
        self.transform = transform
        self.mode = mode
        self.split = split
        self.on_corrupt = on_corrupt
        self.evaluation = evaluation
        self.query_mask = None if query_mask is None else torch.as_tensor(query_mask, dtype=torch.bool)
        self.gallery_mask = None if gallery_mask is None else torch.as_tensor(gallery_mask, dtype=torch.bool)
        self.sequence = None if sequence is None else torch.as_tensor(np.asarray(sequence), dtype=torch.long)
        self.category = None if category is None else torch.as_tensor(np.asarray(category), dtype=torch.long)
        for name, mask in (("query_mask", self.query_mask), ("gallery_mask", self.gallery_mask),
                           ("sequence", self.sequence), ("category", self.category)):
            if mask is not None and mask.shape != (len(self.paths),):
                raise ValueError(f"{split}: {name} must have shape ({len(self.paths)},), got {tuple(mask.shape)}")
        self._warned: set[int] = set()

    def __len__(self) -> int:
        return len(self.paths)

    def _read(self, index: int) -> Any:
        box = None if self.boxes is None else self.boxes[index]
        image = load_image(self.paths[index], self.mode, box)
        return image if self.transform is None else self.transform(image)

    def _describe(self, index: int, error: Exception) -> str:
        """One line: the file, the item and split, and what failed."""
        what = " ".join(str(error).split())  # a decoder's multi-line message on one line
        return f"cannot read image {self.paths[index]} (item {index} of {self.split}): {type(error).__name__}: {what}"

    def __getitem__(self, index: int) -> Any:
        index = int(index)
        tried = [index]
        target = index
        while True:
            try:
                image = self._read(target)
                break
            except Exception as error:  # noqa: BLE001 - any decoder failure becomes a named error
                if self.on_corrupt == "error":
                    raise CorruptImageError(f"{self._describe(target, error)}; {ON_CORRUPT_HINT}") from error
                if target not in self._warned:
                    self._warned.add(target)
                    warnings.warn(f"skipping {self._describe(target, error)}", RuntimeWarning, stacklevel=2)
                if self.evaluation:
                    return SKIPPED
                same = self.labels == self.labels[index]
                candidates = (same.all(1) if same.ndim == 2 else same).nonzero().squeeze(1).tolist()
                remaining = [c for c in candidates if c not in tried]
                if not remaining:
                    raise CorruptImageError(
                        f"every image of class {self.labels[index].tolist()} in {self.split} is unreadable "
                        f"(first: {self.paths[index]})"
                    ) from error
                target = remaining[0]
                tried.append(target)
        # A replaced training item reports the replacement's index, so it is never mistaken for the corrupt one.
        label = int(self.labels[target]) if self.labels.ndim == 1 else self.labels[target]
        if self.evaluation and (self.sequence is not None or self.category is not None):
            is_query = True if self.query_mask is None else bool(self.query_mask[target])
            is_gallery = True if self.gallery_mask is None else bool(self.gallery_mask[target])
            sequence = -1 if self.sequence is None else int(self.sequence[target])
            category = -1 if self.category is None else int(self.category[target])
            return image, label, target, is_query, is_gallery, sequence, category
        if self.query_mask is not None:
            return image, label, target, bool(self.query_mask[target]), bool(self.gallery_mask[target])
        return image, label, target

    def subset(self, indices: Sequence[int] | np.ndarray, transform: Callable | None, evaluation: bool) -> "ImageListDataset":
        """A new dataset of the items ``indices`` (renumbered from 0) with another transform."""
        idx = np.asarray(indices, dtype=np.int64)
        return ImageListDataset(
            [self.paths[i] for i in idx],
            self.labels[torch.from_numpy(idx)],
            transform,
            None if self.boxes is None else self.boxes[idx],
            self.mode,
            self.split,
            self.on_corrupt,
            evaluation,
            None if self.query_mask is None else self.query_mask[torch.from_numpy(idx)],
            None if self.gallery_mask is None else self.gallery_mask[torch.from_numpy(idx)],
            None if self.sequence is None else self.sequence[torch.from_numpy(idx)],
            None if self.category is None else self.category[torch.from_numpy(idx)],
        )


__all__ = [
    "CorruptImageError",
    "ImageListDataset",
    "JPEG_DECODER_ENV",
    "ON_CORRUPT_HINT",
    "collate_skipping",
    "jpeg_decoder",
    "load_image",
    "to_8bit",
]
