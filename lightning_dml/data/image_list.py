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

import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from lightning_dml.data.image_decode import (  # noqa: F401 - re-exported: their historical home
    JPEG_DECODER_ENV,
    _decode_jpeg,
    jpeg_decoder,
    load_image,
    to_8bit,
)
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


#: What ``__getitem__`` returns for a skipped item of an evaluation split; dropped by :func:`collate_skipping`.
SKIPPED = None


def collate_skipping(batch: list[Any]) -> Any:
    """``default_collate`` without the items skipped as corrupt (``None``); an all-skipped batch is empty."""
    kept = [item for item in batch if item is not SKIPPED]
    if not kept:
        raise CorruptImageError(f"every image of a batch of {len(batch)} was corrupt and skipped")
    return default_collate(kept)


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
