"""The base of the data modules that read a benchmark's image files from disk.

Each data module reads the official on-disk layout of its dataset (see ``docs/datasets.md``); with
``download=True`` it first fetches and unpacks the official archive into ``root`` (``prepare_data``). ``root`` may be the folder that holds the dataset's top folder or that top folder itself.
What is found is checked against the papers' counts (SPEC 1.1): a different count is a warning naming the
difference, a missing list file or image is an error naming it and describing the expected layout.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
from pytorch_lightning.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from lightning_dml.data.base import DMLDataModule
from lightning_dml.data.resources import dataset_resource
from lightning_dml.download import fetch_dataset
from lightning_dml.errors import MissingFileError, UserInputError
from lightning_dml.data.image_list import CorruptImageError, ImageListDataset
from lightning_dml.data.verify import verify_image_files, verify_level
from lightning_dml.models.input_spec import TORCHVISION_IMAGENET, InputSpec
from lightning_dml.data.transforms import default_resize_size, eval_transform, train_transform


class DatasetLayoutError(MissingFileError):
    """A dataset folder does not have the expected layout (a list file or image is missing)."""


@dataclass
class SplitFiles:
    """One split read from a dataset's list files: image paths, labels, optional boxes and query/gallery masks."""

    paths: list[Path]
    labels: np.ndarray
    boxes: np.ndarray | None = None
    query_mask: np.ndarray | None = None
    gallery_mask: np.ndarray | None = None

    def without(self, drop: Sequence[int]) -> "SplitFiles":
        """This split without the items at positions ``drop``."""
        keep = np.setdiff1d(np.arange(len(self.paths)), np.asarray(drop, dtype=np.int64))

        def pick(values: np.ndarray | None) -> np.ndarray | None:
            return None if values is None else np.asarray(values)[keep]

        return replace(
            self,
            paths=[self.paths[i] for i in keep],
            labels=np.asarray(self.labels)[keep],
            boxes=pick(self.boxes),
            query_mask=pick(self.query_mask),
            gallery_mask=pick(self.gallery_mask),
        )


def find_top_folder(root: str | os.PathLike, names: Sequence[str], markers: Sequence[str], dataset: str, layout: str) -> Path:
    """Return the dataset's top folder: ``root`` itself or ``root/<name>`` for a name in ``names``, whichever
    contains one of ``markers`` (relative paths). Raise :class:`DatasetLayoutError` describing ``layout`` otherwise."""
    root = Path(root).expanduser()
    if not root.is_dir():
        raise DatasetLayoutError(f"{dataset}: root folder {root} does not exist. Expected layout:\n{layout}")
    for candidate in [root, *(root / name for name in names)]:
        if any((candidate / marker).is_file() for marker in markers):
            return candidate
    looked = ", ".join(str(root / name) for name in names)
    raise DatasetLayoutError(
        f"{dataset}: none of {list(markers)} found in {root}" + (f" or in {looked}" if names else "")
        + f". Expected layout:\n{layout}"
    )


def require_file(path: Path, dataset: str, layout: str) -> Path:
    """``path`` if it is a file, else :class:`DatasetLayoutError` naming it and describing ``layout``."""
    if not path.is_file():
        raise DatasetLayoutError(f"{dataset}: missing file {path}. Expected layout:\n{layout}")
    return path


def check_images_exist(paths: Sequence[Path], dataset: str, layout: str) -> None:
    """Raise :class:`DatasetLayoutError` naming the first missing images, if any."""
    missing = [p for p in paths if not p.is_file()]
    if missing:
        shown = "\n  ".join(str(p) for p in missing[:5])
        raise DatasetLayoutError(
            f"{dataset}: {len(missing)} of {len(paths)} listed images are missing, e.g.\n  {shown}\n"
            f"Expected layout:\n{layout}"
        )


def count_differences(found: dict[str, int], expected: dict[str, int]) -> list[str]:
    """One ``"<found> <what> instead of <expected> (<difference>)"`` line per count that differs from the papers'."""
    lines = []
    for key, value in expected.items():
        if found[key] != value:
            what = key if "classes" in key else f"{key} images"
            lines.append(f"{found[key]:,} {what} instead of {value:,} ({found[key] - value:+,})")
    return lines


class ImageFilesDataModule(DMLDataModule):
    """Shared base of the benchmark data modules reading image files (CUB, Cars196, SOP, In-Shop, own images).

    Subclasses implement :meth:`read_splits` (returning ``{"train": SplitFiles, "test": SplitFiles}``) and set
    ``dataset_name``, ``layout`` (a description of the expected files) and ``expected_counts``.

    Images go through the paper-standard transforms (:mod:`lightning_dml.data.transforms`): training: random
    resized crop ``image_size`` + horizontal flip; test: resize ``resize_size`` + centre crop ``image_size``;
    both end with the conversion to ``input_spec`` (colour order, value scale, mean/std of the backbone, read from
    ``model.backbone.input_spec`` at set-up unless given, see :class:`DMLDataModule`).

    Args:
        root: the folder holding the dataset's top folder, or that top folder itself.
        classes_per_batch: P. samples_per_class: K (batch size P * K).
        num_workers: DataLoader worker processes.
        image_size: side of the crop the network sees; default ``input_spec.crop_size`` (224).
        input_spec: the input convention; default the backbone's (see :class:`DMLDataModule`), and without a
            model torchvision's ImageNet convention (RGB, [0, 1], ImageNet mean/std).
        resize_size: test-time shorter-side resize; default 256 for crops 224-256, else scaled with the crop.
        crop_scale: area range of the training random resized crop (torchvision's default (0.08, 1)).
        eval_batch_size, seed, sampler, hard_class_mining, val_classes_fraction, fold, num_folds, fold_seed: see
            :class:`DMLDataModule`.
        on_corrupt: ``"error"``: an unreadable image raises an error naming the file; ``"skip"``: warn and skip.
            With ``verify_images``, the files that fail the check at set-up: ``"error"`` raises one
            :class:`~lightning_dml.data.image_list.CorruptImageError` giving their number and the first few;
            ``"skip"`` drops them from their split with one warning.
        check_counts: compare the numbers of images (and classes) with the papers' and warn on a difference.
        check_files: check at setup that every listed image exists (an error names the missing ones).
        download: in ``prepare_data`` (once per node, under a file lock), download the dataset's official archive
            (:data:`~lightning_dml.data.resources.RESOURCES`), verify it and unpack it into ``root`` unless the
            dataset is already there; datasets without an automatic download raise an error naming the files to
            place. Off by default.
        verify_images: check every image file at set-up, before any training step (:mod:`lightning_dml.data.verify`):
            ``False`` (default) or ``"none"``: no check, an unreadable file fails when first read; ``True`` or
            ``"header"``: PIL opens every file and verifies it (format and header; PNGs' chunk checksums; a JPEG's
            truncated body is *not* found); ``"decode"``: every file is fully decoded once. In parallel (threads),
            with a progress bar on rank 0, in ``prepare_data`` (once per node) and again (from the cache) in
            ``setup``; files that pass are cached by path, size and mtime in the user cache folder
            (:mod:`lightning_dml.data.cache_dir`, ``$LIGHTNING_DML_CACHE``), so a second set-up only ``stat``s them.
    """

    dataset_name: str = "dataset"
    layout: str = ""
    expected_counts: dict[str, int] = {}
    #: key of the dataset's entry in :data:`~lightning_dml.data.resources.RESOURCES` (``None``: not downloadable)
    resource_name: str | None = None

    def __init__(
        self,
        root: str | os.PathLike,
        classes_per_batch: int = 16,
        samples_per_class: int = 4,
        num_workers: int = 4,
        image_size: int | None = None,
        input_spec: InputSpec | None = None,
        resize_size: int | None = None,
        crop_scale: tuple[float, float] = (0.08, 1.0),
        eval_batch_size: int = 128,
        seed: int = 0,
        sampler: str = "balanced",
        hard_class_mining: bool = False,
        val_classes_fraction: float = 0.0,
        on_corrupt: str = "error",
        check_counts: bool = True,
        check_files: bool = True,
        download: bool = False,
        fold: int | None = None,
        num_folds: int | None = None,
        fold_seed: int = 0,
        verify_images: bool | str = False,
    ) -> None:
        super().__init__(
            classes_per_batch, samples_per_class, eval_batch_size, num_workers, seed, sampler, hard_class_mining,
            val_classes_fraction, input_spec, fold, num_folds, fold_seed,
        )
        if on_corrupt not in ("error", "skip"):
            raise ValueError(f"on_corrupt must be 'error' or 'skip', got {on_corrupt!r}")
        if image_size is not None and image_size < 8:
            raise ValueError(f"image_size must be at least 8 pixels, got {image_size}")
        low, high = crop_scale
        if not 0 < low <= high <= 1:
            raise ValueError(f"crop_scale must satisfy 0 < low <= high <= 1, got {tuple(crop_scale)}")
        if image_size is not None and resize_size is not None and resize_size < image_size:
            raise ValueError(f"resize_size ({resize_size}) must be at least image_size ({image_size})")
        self.root = Path(root).expanduser()
        # None: derived from the input spec, which may be the backbone's (known at set-up)
        self.given_image_size = None if image_size is None else int(image_size)
        self.given_resize_size = None if resize_size is None else int(resize_size)
        self.crop_scale = (float(low), float(high))
        self.on_corrupt = on_corrupt
        self.check_counts = check_counts
        self.check_files = check_files
        self.download = download
        self.verify_images = verify_level(verify_images)
        self.top: Path | None = None
        self.count_warnings: list[str] = []

    # ------------------------------------------------------------------ transforms
    @property
    def spec(self) -> InputSpec:
        """The input convention in use: ``input_spec``, or torchvision's ImageNet convention while none is set."""
        return self.input_spec if self.input_spec is not None else TORCHVISION_IMAGENET

    @property
    def image_size(self) -> int:
        """Side of the crop the network sees: the given ``image_size``, else the input spec's ``crop_size``."""
        return self.given_image_size if self.given_image_size is not None else self.spec.crop_size

    @property
    def resize_size(self) -> int:
        """Test-time shorter side: the given ``resize_size``, else scaled from the input spec's."""
        if self.given_resize_size is not None:
            return self.given_resize_size
        return default_resize_size(self.image_size, self.spec)

    @property
    def mode(self) -> str:
        return "L" if self.spec.color == "L" else "RGB"

    @property
    def train_transform(self):
        return train_transform(self.spec, self.image_size, self.crop_scale)

    @property
    def eval_transform(self):
        return eval_transform(self.spec, self.image_size, self.resize_size)

    # ------------------------------------------------------------------ download
    def is_present(self) -> bool:
        """Whether the dataset's top folder is found under ``root`` (the layout checks run in ``setup``)."""
        try:
            self.find_top()
        except DatasetLayoutError:
            return False
        return True

    def prepare_data(self) -> None:
        """With ``download=True``: fetch, verify and unpack the dataset into ``root`` unless it is there. With
        ``verify_images``: check the image files and cache the result (the failures are reported by ``setup``).

        Lightning calls this on one process per node; the file lock in ``root`` makes nodes sharing a file system
        download once. The other processes wait at Lightning's barrier before ``setup``, where they find the
        verification cached.
        """
        if self.download:
            self._download()
        if self.verify_images is not None and self.is_present():
            top = self.find_top()
            try:
                splits = self.read_splits(top)
            except (UserInputError, ValueError):
                return  # a layout error: setup raises it on every process
            self._verify_files(splits, top, report=False)

    def _download(self) -> None:
        if self.resource_name is None:
            raise UserInputError(
                f"{type(self).__name__} has no public archive to download: set download: false and place the "
                f"files under {self.root}. Expected layout:\n{self.layout}"
            )
        fetch_dataset(dataset_resource(self.resource_name), self.root, self.is_present, self.layout)

    # ------------------------------------------------------------------ reading
    def find_top(self) -> Path:
        """The dataset's top folder (see :func:`find_top_folder`); subclasses say which names and markers."""
        raise NotImplementedError

    def read_splits(self, top: Path) -> dict[str, SplitFiles]:
        """``{"train": SplitFiles, "test": SplitFiles}`` read from the list files under ``top``."""
        raise NotImplementedError(f"{type(self).__name__} must implement read_splits()")

    def _check_counts(self, splits: dict[str, SplitFiles], top: Path) -> None:
        counts = {
            "train": len(splits["train"].paths),
            "test": len(splits["test"].paths),
            "train classes": len(np.unique(splits["train"].labels)),
            "test classes": len(np.unique(splits["test"].labels)),
        }
        test = splits["test"]
        if test.query_mask is not None:
            counts["query"] = int(np.sum(test.query_mask))
            counts["gallery"] = int(np.sum(test.gallery_mask))
        differences = count_differences(counts, self.expected_counts)
        if differences:
            message = (
                f"{self.dataset_name} at {top} differs from the copy the papers use (SPEC 1.1): "
                + "; ".join(differences)
                + ". Results are not comparable with the published numbers."
            )
            self.count_warnings.append(message)
            rank_zero_warn(message, category=UserWarning)

    def _verify_files(self, splits: dict[str, SplitFiles], top: Path, report: bool = True) -> dict[str, SplitFiles]:
        """Run ``verify_images`` over both splits. With ``report``: files that failed raise one
        :class:`CorruptImageError` (``on_corrupt="error"``) or are dropped with one warning (``"skip"``)."""
        names = ("train", "test")
        paths = [path for name in names for path in splits[name].paths]
        trainer = getattr(self, "trainer", None)
        rank = trainer.global_rank if trainer is not None else getattr(rank_zero_only, "rank", 0)
        began = time.perf_counter()
        result = verify_image_files(
            paths, self.verify_images, top, progress=rank == 0,
            description=f"verify_images={self.verify_images} ({self.dataset_name})",
        )
        if result.checked:
            seconds = time.perf_counter() - began
            rank_zero_info(
                f"{self.dataset_name}: verify_images={self.verify_images}: {len(paths):,} files, {result.checked:,} "
                f"checked, {result.cached:,} unchanged since they passed (cache {result.cache_file}), {seconds:.1f} s"
            )
        if not report or not result.failed:
            return splits
        failed = sorted(result.failed)
        shown = "; ".join(f"{paths[i]} ({result.failed[i]})" for i in failed[:5])
        more = f" and {len(failed) - 5} more" if len(failed) > 5 else ""
        level = f"verify_images={self.verify_images}"
        what = f"{len(failed)} of {len(paths):,} image files of {self.dataset_name} at {top} failed {level}"
        if self.on_corrupt == "error":
            raise CorruptImageError(
                f"{what}: {shown}{more}; replace or remove them, or set on_corrupt: skip "
                "(--data.init_args.on_corrupt skip) to drop them from their split with a warning"
            )
        rank_zero_warn(f"{what}; on_corrupt=skip drops them from their split: {shown}{more}")
        out, offset = dict(splits), 0
        for name in names:
            count = len(splits[name].paths)
            drop = [i - offset for i in failed if offset <= i < offset + count]
            out[name] = splits[name].without(drop) if drop else splits[name]
            offset += count
            if not out[name].paths:
                raise CorruptImageError(
                    f"{self.dataset_name} at {top}: every image of the {name} split failed {level} (first: {shown})"
                )
        return out

    def build_datasets(self) -> tuple[ImageListDataset, ImageListDataset]:
        try:
            top = self.find_top()
        except DatasetLayoutError as error:
            resource = dataset_resource(self.resource_name) if self.resource_name and not self.download else None
            if resource is None or not resource.archives:
                raise
            raise DatasetLayoutError(
                f"{error}\nOr set download: true (--data.init_args.download true) to download it from {resource.page}."
            ) from None
        self.top = top
        splits = self.read_splits(top)
        for name in ("train", "test"):
            if len(splits[name].paths) == 0:
                raise DatasetLayoutError(f"{self.dataset_name} at {top}: the {name} split is empty. Expected layout:\n{self.layout}")
        if self.check_files:
            check_images_exist(splits["train"].paths + splits["test"].paths, self.dataset_name, self.layout)
        if self.verify_images is not None:
            splits = self._verify_files(splits, top)
        if self.check_counts:
            self._check_counts(splits, top)
        train, test = splits["train"], splits["test"]
        train_ds = ImageListDataset(
            train.paths, train.labels, self.train_transform, train.boxes, self.mode,
            f"{self.dataset_name} train", self.on_corrupt, evaluation=False,
        )
        test_ds = ImageListDataset(
            test.paths, test.labels, self.eval_transform, test.boxes, self.mode, f"{self.dataset_name} test",
            self.on_corrupt, evaluation=True,
            query_mask=None if test.query_mask is None else torch.from_numpy(np.asarray(test.query_mask, dtype=bool)),
            gallery_mask=None if test.gallery_mask is None else torch.from_numpy(np.asarray(test.gallery_mask, dtype=bool)),
        )
        return train_ds, test_ds


def read_whitespace_table(path: Path, columns: int, dataset: str, skip: int = 0) -> list[list[str]]:
    """Rows of a whitespace-separated list file, each split into ``columns`` fields (the last keeps spaces).

    A malformed line raises ``ValueError`` naming the file and the line number.
    """
    rows: list[list[str]] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if number <= skip or not line.strip():
                continue
            fields = line.split(maxsplit=columns - 1)
            if len(fields) != columns:
                raise ValueError(f"{dataset}: {path} line {number}: expected {columns} fields, got {line.strip()!r}")
            rows.append([f.strip() for f in fields])
    return rows


__all__ = [
    "DatasetLayoutError",
    "ImageFilesDataModule",
    "SplitFiles",
    "count_differences",
    "check_images_exist",
    "find_top_folder",
    "read_whitespace_table",
    "require_file",
]
