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
from typing import Any

import numpy as np
import torch
from pytorch_lightning.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from lightning_dml.data.base import DMLDataModule
from lightning_dml.data.decoded_cache import DecodedImageListDataset, DecodedImages, cache_mode, open_decoded_cache
from lightning_dml.data.resources import dataset_resource
from lightning_dml.download import fetch_dataset
from lightning_dml.errors import MissingFileError, UserInputError
from lightning_dml.data.image_list import CorruptImageError, ImageListDataset, collate_skipping
from lightning_dml.data.verify import verify_image_files, verify_level
from lightning_dml.models.input_spec import TORCHVISION_IMAGENET, InputSpec
from lightning_dml.data.transforms import (
    DeviceImage,
    FinishingCollate,
    ToInputSpec,
    default_resize_size,
    eval_transform,
    finish_on_device,
    tensor_eval_transform,
    tensor_train_transform,
    train_transform,
)


class DatasetLayoutError(MissingFileError):
    """A dataset folder does not have the expected layout (a list file or image is missing)."""


@dataclass
class SplitFiles:
    """One split read from a dataset's list files: image paths, labels (``[N]``, or label sets ``[N, L]`` padded
    with -1), optional boxes, query/gallery masks, and sequence and category ids (-1: none)."""

    paths: list[Path]
    labels: np.ndarray
    boxes: np.ndarray | None = None
    query_mask: np.ndarray | None = None
    gallery_mask: np.ndarray | None = None
    sequence: np.ndarray | None = None
    category: np.ndarray | None = None

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
            sequence=pick(self.sequence),
            category=pick(self.category),
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
        categories_per_batch: C of ``sampler="category"`` (see :class:`DMLDataModule`; data modules with
            categories: SOP, :class:`~lightning_dml.data.CSVDataModule`).
        cache: ``None``/``"none"`` (default): every image is decoded from its file whenever it is read;
            ``"decoded"``: in ``prepare_data`` (once per node, under a file lock, with a progress bar) every image of
            every split is decoded once, its crop box applied, its shorter side resized to ``cache_size``, and the
            uint8 pixels stored in one memory-mapped file per split in the user cache folder
            (:mod:`lightning_dml.data.decoded_cache`); the transforms then run on uint8 tensors
            (torchvision.transforms.v2), with no file read or decode in the loop. Rebuilt when a source file (size,
            mtime), ``cache_size``, the mode, the interpolation, Pillow or the format version change.
        cache_size: shorter side of the cached images (default 256, the test-time resize of 224 crops). Evaluation
            from the cache equals the uncached evaluation bit for bit when ``cache_size == resize_size``; otherwise
            the cached image is resized again.
        augment_on_device: training workers only cut and resize the random crop (uint8) and draw the flip; the
            flip, the conversion to float and the normalisation run batched on the device after the transfer
            (:meth:`on_after_batch_transfer`), with the same per-sample random decisions (the batch's seed), so the
            batches are bit-identical to ``augment_on_device=False`` and mid-epoch resume stays exact. Without a
            trainer, call ``datamodule.on_after_batch_transfer(batch, 0)`` on each training batch.
        views: ``V`` views of every training item, each its own random crop and flip, labelled by item (see
            :class:`DMLDataModule`; for :class:`~lightning_dml.losses.SelfSupervisedLoss`).

    :meth:`read_splits` may return more splits than ``"train"`` and ``"test"`` (a table's ``"validation"``):
    they are checked and verified like the others, and every built dataset is in :attr:`split_datasets`.
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
        categories_per_batch: int | None = None,
        cache: str | None = None,
        cache_size: int = 256,
        augment_on_device: bool = False,
        views: int = 1,
    ) -> None:
        super().__init__(
            classes_per_batch, samples_per_class, eval_batch_size, num_workers, seed, sampler, hard_class_mining,
            val_classes_fraction, input_spec, fold, num_folds, fold_seed, categories_per_batch=categories_per_batch,
            views=views,
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
        self.cache = cache_mode(cache)
        if int(cache_size) != cache_size or cache_size < 8:
            raise ValueError(f"cache_size must be an integer of at least 8 pixels, got {cache_size!r}")
        self.cache_size = int(cache_size)
        self.augment_on_device = bool(augment_on_device)
        self._device_converter: ToInputSpec | None = None
        self._logged_caches: set[Path] = set()
        self.top: Path | None = None
        self.count_warnings: list[str] = []
        #: the datasets of every split :meth:`read_splits` gave (``"train"``, ``"test"``, ...), set by set-up
        self.split_datasets: dict[str, ImageListDataset] = {}

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
        """The training transform: on PIL images, or on the cache's uint8 tensors with ``cache="decoded"``; with
        ``augment_on_device`` it returns :class:`~lightning_dml.data.transforms.DeviceImage` items."""
        if self.cache == "decoded":
            deferred = self.augment_on_device or self._finish_in_collate
            return tensor_train_transform(self.spec, self.image_size, self.crop_scale, deferred)
        return train_transform(self.spec, self.image_size, self.crop_scale, self.augment_on_device)

    @property
    def _finish_in_collate(self) -> bool:
        """Whether the cached training path flips and converts each batch in the collate function, image by image
        into the batch's one output tensor, rather than in the transform (the same values): with ``num_workers=0``
        this saves a copy of every batch (about 30% more images/s, ``bench/data.py``); a worker's batch is
        collated into shared memory by ``default_collate``, which the per-image path keeps."""
        return self.cache == "decoded" and not self.augment_on_device and self.num_workers == 0

    def train_collate_fn(self):
        """:func:`collate_skipping`, finishing the batch's flip and conversion there on the cached path (see
        :attr:`_finish_in_collate`)."""
        if self._finish_in_collate:
            return FinishingCollate(collate_skipping, self.spec)
        return collate_skipping

    @property
    def eval_transform(self):
        if self.cache == "decoded":
            return tensor_eval_transform(self.spec, self.image_size, self.resize_size, self.cache_size)
        return eval_transform(self.spec, self.image_size, self.resize_size)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """With ``augment_on_device``: flip the chosen images of a training batch and convert it to the input spec,
        batched, on the device the batch was moved to (Lightning calls this hook after the transfer). Any other
        batch is returned as it is.

        Lightning calls the data module's hook instead of the LightningModule's when both define it (with a
        warning): a module that needs its own ``on_after_batch_transfer`` should call this one on the batch.
        """
        if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], DeviceImage):
            if self._device_converter is None or self._device_converter.spec != self.spec:
                self._device_converter = ToInputSpec(self.spec)
            return [finish_on_device(batch[0], self._device_converter), *batch[1:]]
        return batch

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

        With ``cache="decoded"``: build the decoded-image cache of every split unless it is there and current.

        Lightning calls this on one process per node; the file lock in ``root`` makes nodes sharing a file system
        download once (and the cache's file lock builds it once). The other processes wait at Lightning's barrier
        before ``setup``, where they find the verification and the decoded images cached.
        """
        if self.download:
            self._download()
        if (self.verify_images is not None or self.cache is not None) and self.is_present():
            top = self.find_top()
            try:
                splits = self.read_splits(top)
            except (UserInputError, ValueError):
                return  # a layout error: setup raises it on every process
            if self.verify_images is not None:
                self._verify_files(splits, top, report=False)
            if self.cache == "decoded":
                try:
                    if self.check_files:
                        check_images_exist([p for s in splits.values() for p in s.paths], self.dataset_name, self.layout)
                    if self.trainer is not None and self.trainer.lightning_module is not None:
                        self.adopt_input_spec(self.trainer.lightning_module)  # the cache's mode and interpolation
                except (UserInputError, ValueError):
                    return  # setup raises it on every process
                self._open_caches(splits, top)

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
        names = tuple(splits)
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

    def _open_caches(self, splits: dict[str, SplitFiles], top: Path) -> dict[str, DecodedImages]:
        """The decoded images of every split (built first where missing or stale; see
        :func:`~lightning_dml.data.decoded_cache.open_decoded_cache`)."""
        trainer = getattr(self, "trainer", None)
        rank = trainer.global_rank if trainer is not None else getattr(rank_zero_only, "rank", 0)
        views = {}
        for name, split in splits.items():
            lines: list[str] = []
            views[name], info = open_decoded_cache(
                split.paths, top, name, self.cache_size, self.mode, self.spec.interpolation, split.boxes,
                progress=rank == 0, description=f"decoded-image cache ({self.dataset_name} {name})", log=lines.append,
            )
            if info.built or info.index_file not in self._logged_caches:
                self._logged_caches.add(info.index_file)
                rank_zero_info(lines[0])
        return views

    def _cached_datasets(self, read: dict[str, SplitFiles], kept: dict[str, SplitFiles]) -> None:
        """Make every dataset of :attr:`split_datasets` read its images from the decoded-image cache of its split
        (``read``: the splits as listed, which name the caches; ``kept``: after ``verify_images`` dropped files)."""
        if self.cache_size != self.resize_size:
            rank_zero_warn(
                f"{type(self).__name__}: cache_size={self.cache_size} differs from resize_size={self.resize_size}: "
                "evaluation resizes the cached images a second time (set cache_size to resize_size for the uncached "
                "evaluation's pixels)"
            )
        views = self._open_caches(read, self.top)
        for name, dataset in self.split_datasets.items():
            view = views[name]
            if kept[name] is not read[name]:  # some files dropped: match the rest by path and box

                def keys(split: SplitFiles) -> list[tuple]:  # a box's bytes: NaN (no box) equals itself
                    boxes = [None] * len(split.paths) if split.boxes is None else np.asarray(split.boxes, np.float64)
                    return [(str(p), None if b is None else b.tobytes()) for p, b in zip(split.paths, boxes)]

                position = {key: i for i, key in enumerate(keys(read[name]))}
                view = view.subset([position[key] for key in keys(kept[name])])
            self.split_datasets[name] = DecodedImageListDataset.wrap(dataset, view)

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
        splits = read = self.read_splits(top)
        for name in splits:
            if len(splits[name].paths) == 0:
                raise DatasetLayoutError(f"{self.dataset_name} at {top}: the {name} split is empty. Expected layout:\n{self.layout}")
        if self.check_files:
            check_images_exist([p for files in splits.values() for p in files.paths], self.dataset_name, self.layout)
        if self.verify_images is not None:
            splits = self._verify_files(splits, top)
        if self.check_counts:
            self._check_counts(splits, top)
        self.split_datasets = {name: self.split_dataset(files, name) for name, files in splits.items()}
        if self.cache == "decoded":
            self._cached_datasets(read, splits)
        return self.split_datasets["train"], self.split_datasets["test"]

    def split_dataset(self, files: SplitFiles, name: str) -> ImageListDataset:
        """The dataset of split ``name``: training transforms for ``"train"``, evaluation for every other split."""
        evaluation = name != "train"

        def mask(values: np.ndarray | None) -> torch.Tensor | None:
            return None if values is None else torch.from_numpy(np.asarray(values, dtype=bool))

        return ImageListDataset(
            files.paths, files.labels, self.eval_transform if evaluation else self.train_transform, files.boxes,
            self.mode, f"{self.dataset_name} {name}", self.on_corrupt, evaluation=evaluation,
            query_mask=mask(files.query_mask), gallery_mask=mask(files.gallery_mask), sequence=files.sequence,
            category=files.category,
        )


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
