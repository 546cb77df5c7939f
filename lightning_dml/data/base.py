"""The shared base of every data module: P x K training batches, sharded ordered evaluation over the test split."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info
from torch import nn
from torch.utils.data import DataLoader, Dataset

from lightning_dml.data.image_list import collate_skipping
from lightning_dml.data.resumable import ResumableDataLoader
from lightning_dml.data.views import ViewsCollate, ViewsDataset, check_views
from lightning_dml.data.samplers import (
    BalancedClassSampler,
    CategoryBalancedSampler,
    EvalShardSampler,
    LabelSetSampler,
    NPairSampler,
)
from lightning_dml.models.input_spec import InputSpec, InputSpecMismatchError, backbone_input_spec
from lightning_dml.protocol.folds import class_folds

#: the training batch samplers a data module can use (``sampler=...``)
SAMPLERS = ("balanced", "npair", "category", "label_sets")


class DMLDataModule(pl.LightningDataModule):
    """Base class of the zero-shot retrieval data modules.

    Subclasses implement :meth:`build_datasets`, returning the training and test datasets. Each dataset yields
    ``(image, label, index)`` with ``index`` the item's position in its split, and exposes ``labels`` (one int per
    item). Training batches are P x K batches from :class:`BalancedClassSampler` (or N x 2 from
    :class:`NPairSampler`); validation and test iterate the test split in order. The papers select the best
    epoch on the test split (SPEC 1.2, 9.3): with ``val_classes_fraction=0`` validation *is* the test split
    (:attr:`test_as_val` is ``True``); ``val_classes_fraction > 0`` holds out that fraction of the *training
    classes* (chosen by ``seed``) as an honest validation split, removed from training. ``num_folds``/``fold``
    instead validate on fold ``fold`` of :func:`~lightning_dml.protocol.class_folds` (the training classes in
    ``num_folds`` folds of whole classes, chosen by ``fold_seed``) and train on the other folds: the class-disjoint
    cross-validation of Musgrave et al. (ECCV 2020). The test split is never touched by either.

    DDP: the training batch sampler shards itself (each process draws its own complete P x K batches), so
    Lightning's automatic ``DistributedSampler`` replacement, which would deal every world-size-th index of a
    batch to each process, is turned off in :meth:`setup` (the equivalent of
    ``Trainer(use_distributed_sampler=False)``; a message says so), and validation/test/predict are sharded here
    with :class:`EvalShardSampler` (every item evaluated exactly once across processes, no padding).

    Args:
        classes_per_batch: P, classes per training batch.
        samples_per_class: K, images per class in a training batch. The batch size is P * K.
        eval_batch_size: batch size of validation, test and predict.
        num_workers: DataLoader worker processes.
        seed: seed of the training sampler (batches depend on seed, epoch and rank) and of the validation split.
        sampler: ``"balanced"`` (P x K, :class:`BalancedClassSampler`), ``"npair"`` (N x 2,
            ``samples_per_class`` must be 2), ``"category"`` (C categories x P classes x K items,
            :class:`CategoryBalancedSampler`; needs ``categories_per_batch`` and a training split with categories)
            or ``"label_sets"`` (P labels x K items for label sets, :class:`LabelSetSampler`).
        hard_class_mining: with ``sampler="npair"``, the N-pair paper's hard negative class mining (needs class
            embeddings, see :class:`~lightning_dml.callbacks.ClassEmbeddingRefresh`).
        val_classes_fraction: fraction of the training classes held out as the validation split (0: validate on
            the test split, as the papers do).
        input_spec: the input convention the images are converted to (colour order, value scale, mean/std, crop
            size). ``None`` (the default): the backbone's (``model.backbone.input_spec``), read when a trainer sets
            the data module up (:meth:`adopt_input_spec`); without a model, the data module's own default. A given
            ``input_spec`` that differs from the backbone's is an error naming both, never silently replaced.
        fold: the validation fold (0 .. num_folds - 1) of class-disjoint cross-validation; set with ``num_folds``.
            Exclusive with ``val_classes_fraction``.
        num_folds: number of class-disjoint folds of the training classes (>= 2), or ``None`` (no folds).
        fold_seed: seed of the fold assignment (apart from ``seed``, so the sampler's seed can change while the
            folds stay the same).
        categories_per_batch: C of ``sampler="category"`` (the batch size is then C * P * K); only with it.
        views: ``V`` augmented views of every training item (1: none). With ``V >= 2`` each drawn item is read ``V``
            times through the training transform and the batch holds ``V * P * K`` images, view-major, labelled by
            the item's index in the training split (not its class): the batches of
            :class:`~lightning_dml.losses.SelfSupervisedLoss` (:mod:`lightning_dml.data.views`). Evaluation is
            unchanged.
    """

    def __init__(
        self,
        classes_per_batch: int = 16,
        samples_per_class: int = 4,
        eval_batch_size: int = 256,
        num_workers: int = 0,
        seed: int = 0,
        sampler: str = "balanced",
        hard_class_mining: bool = False,
        val_classes_fraction: float = 0.0,
        input_spec: InputSpec | None = None,
        fold: int | None = None,
        num_folds: int | None = None,
        fold_seed: int = 0,
        categories_per_batch: int | None = None,
        views: int = 1,
    ) -> None:
        super().__init__()
        self.views = check_views(views)
        if classes_per_batch < 1 or samples_per_class < 1:
            raise ValueError(
                f"classes_per_batch and samples_per_class must be >= 1, got {classes_per_batch} and {samples_per_class}"
            )
        if eval_batch_size < 1 or num_workers < 0:
            raise ValueError(f"need eval_batch_size >= 1 and num_workers >= 0, got {eval_batch_size}, {num_workers}")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {', '.join(map(repr, SAMPLERS))}, got {sampler!r}")
        if (sampler == "category") != (categories_per_batch is not None):
            raise ValueError(
                "sampler='category' and categories_per_batch are set together (C categories x P classes x K items), "
                f"got sampler={sampler!r}, categories_per_batch={categories_per_batch}"
            )
        if categories_per_batch is not None and categories_per_batch < 1:
            raise ValueError(f"categories_per_batch must be >= 1, got {categories_per_batch}")
        if sampler == "npair" and samples_per_class != 2:
            raise ValueError(f"sampler='npair' draws 2 images per class: set samples_per_class=2, got {samples_per_class}")
        if hard_class_mining and sampler != "npair":
            raise ValueError("hard_class_mining is the N-pair paper's class mining: it needs sampler='npair'")
        if not 0.0 <= val_classes_fraction < 1.0:
            raise ValueError(f"val_classes_fraction must be in [0, 1), got {val_classes_fraction}")
        if (fold is None) != (num_folds is None):
            raise ValueError(f"fold and num_folds are set together (got fold={fold}, num_folds={num_folds})")
        if num_folds is not None:
            if num_folds < 2 or not 0 <= fold < num_folds:
                raise ValueError(
                    f"need num_folds >= 2 and 0 <= fold < num_folds, got fold={fold}, num_folds={num_folds}"
                )
            if val_classes_fraction > 0:
                raise ValueError(
                    f"val_classes_fraction={val_classes_fraction} and fold/num_folds both choose the validation "
                    "classes: set one of them (val_classes_fraction=0 with folds)"
                )
        if input_spec is not None and not isinstance(input_spec, InputSpec):
            raise TypeError(f"input_spec must be an InputSpec or None, got {type(input_spec).__name__}")
        self.classes_per_batch = classes_per_batch
        self.samples_per_class = samples_per_class
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.sampler = sampler
        self.hard_class_mining = hard_class_mining
        self.val_classes_fraction = val_classes_fraction
        self.input_spec = input_spec
        self.fold = fold
        self.num_folds = num_folds
        self.fold_seed = fold_seed
        self.categories_per_batch = categories_per_batch
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self.train_sampler: BalancedClassSampler | None = None
        # logged with the run's hyper-parameters: whether the validation numbers are test-split numbers
        self.save_hyperparameters(
            {
                "test_as_val": self.test_as_val,
                "val_classes_fraction": val_classes_fraction,
                "fold": fold,
                "num_folds": num_folds,
                "fold_seed": fold_seed,
            }
        )

    @property
    def batch_size(self) -> int:
        return self.classes_per_batch * self.samples_per_class * (self.categories_per_batch or 1)

    @property
    def test_as_val(self) -> bool:
        """Whether validation runs on the test split (the papers' protocol) rather than held-out train classes."""
        return self.val_classes_fraction == 0.0 and self.num_folds is None

    @property
    def train_class_ids(self) -> torch.Tensor:
        """The distinct labels of the training split, sorted: the classes trained on, after any validation
        hold-out (builds the datasets if needed). A proxy loss's class ``i`` is ``train_class_ids[i]``."""
        if self.train_dataset is None:
            self.setup("fit")
        return torch.unique(torch.as_tensor(self.train_dataset.labels))

    @property
    def train_class_counts(self) -> torch.Tensor:
        """The number of training items of every class, in the order of :attr:`train_class_ids` (a loss with
        ``needs_class_counts``, such as :class:`~lightning_dml.losses.DynamicArcFaceLoss`, gets them from
        ``DMLModule`` when fit starts)."""
        if self.train_dataset is None:
            self.setup("fit")
        return torch.unique(torch.as_tensor(self.train_dataset.labels), return_counts=True)[1]

    @property
    def num_train_classes(self) -> int:
        """The number of classes trained on (after any validation hold-out): the ``num_classes`` of a proxy loss."""
        return int(self.train_class_ids.numel())

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """Return ``(train_dataset, test_dataset)``; implemented by every concrete data module."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_datasets()")

    def make_eval_view(self, dataset: Dataset, indices: np.ndarray) -> Dataset:
        """The items ``indices`` of a training dataset as an evaluation dataset (eval transforms, renumbered).

        Datasets implement ``subset(indices, transform, evaluation)``; file datasets pass their eval transform.
        """
        if not hasattr(dataset, "subset"):
            raise TypeError(
                f"{type(dataset).__name__} has no subset(): val_classes_fraction and num_folds are not supported"
            )
        return dataset.subset(indices, getattr(self, "eval_transform", None), True)

    def _hold_out_validation(self, train: Dataset) -> tuple[Dataset, Dataset]:
        labels = torch.as_tensor(train.labels).numpy()
        classes = np.unique(labels)
        num_val = int(round(len(classes) * self.val_classes_fraction))
        if num_val < 1 or len(classes) - num_val < self.classes_per_batch:
            raise ValueError(
                f"val_classes_fraction={self.val_classes_fraction} of {len(classes)} training classes leaves "
                f"{num_val} validation and {len(classes) - num_val} training classes (need >= 1 and >= "
                f"classes_per_batch={self.classes_per_batch})"
            )
        rng = np.random.default_rng([self.seed, 7])
        return self._split_off_classes(train, rng.choice(classes, size=num_val, replace=False))

    def _fold_validation(self, train: Dataset) -> tuple[Dataset, Dataset]:
        """Fold ``fold`` of the training classes validates, the other folds train."""
        folds = class_folds(train.labels, self.num_folds, self.fold_seed)
        num_train = sum(len(f) for f in folds) - len(folds[self.fold])
        if num_train < self.classes_per_batch:
            raise ValueError(
                f"fold {self.fold} of num_folds={self.num_folds} leaves {num_train} training classes, fewer than "
                f"classes_per_batch={self.classes_per_batch}"
            )
        return self._split_off_classes(train, folds[self.fold])

    def _split_off_classes(self, train: Dataset, val_classes: np.ndarray) -> tuple[Dataset, Dataset]:
        """The training items outside ``val_classes`` (training view) and inside them (evaluation view)."""
        labels = torch.as_tensor(train.labels).numpy()
        is_val = np.isin(labels, val_classes)
        train_idx, val_idx = np.flatnonzero(~is_val), np.flatnonzero(is_val)
        if not hasattr(train, "subset"):
            raise TypeError(
                f"{type(train).__name__} has no subset(): val_classes_fraction and num_folds are not supported"
            )
        return train.subset(train_idx, getattr(train, "transform", None), False), self.make_eval_view(train, val_idx)

    def adopt_input_spec(self, model: nn.Module) -> None:
        """Take the input convention of ``model``'s backbone (``model.backbone.input_spec``) when no
        ``input_spec`` is set; a set one that differs is an :class:`~lightning_dml.models.InputSpecMismatchError`
        (a ``ValueError``, printed without traceback by the CLI) naming both. A backbone that declares none
        changes nothing.

        :meth:`setup` calls it with the trainer's model; code that sets the data module up without a trainer
        (export) calls it first. Adopting a spec drops datasets built before (by a set-up without a model, with the
        default conversion), so they are rebuilt with the backbone's.
        """
        spec = backbone_input_spec(model)
        if spec is None or spec == self.input_spec:
            return
        if self.input_spec is not None:
            backbone = type(getattr(model, "backbone", model)).__name__
            raise InputSpecMismatchError(
                f"{type(self).__name__}: input_spec {self.input_spec} disagrees with {backbone}'s input_spec "
                f"{spec}. Leave the data module's input_spec unset to use the backbone's, or use a backbone that "
                "expects this input."
            )
        self.input_spec = spec
        self.train_dataset = self.val_dataset = self.test_dataset = None

    def setup(self, stage: str | None = None) -> None:
        self._turn_off_distributed_sampler_replacement()
        if self.trainer is not None and self.trainer.lightning_module is not None:
            self.adopt_input_spec(self.trainer.lightning_module)
        if self.train_dataset is None or self.test_dataset is None:
            train, test = self.build_datasets()
            if self.num_folds is not None:
                train, self.val_dataset = self._fold_validation(train)
            elif self.val_classes_fraction > 0:
                train, self.val_dataset = self._hold_out_validation(train)
            else:
                self.val_dataset = test
            self.train_dataset, self.test_dataset = train, test

    # ------------------------------------------------------------------ DDP
    def _turn_off_distributed_sampler_replacement(self) -> None:
        """Lightning would wrap the training batch sampler into a ``DistributedSampler`` scheme that splits the
        class groups; our samplers shard themselves, so the replacement is switched off (as
        ``Trainer(use_distributed_sampler=False)`` would)."""
        trainer = getattr(self, "trainer", None)
        connector = getattr(trainer, "_accelerator_connector", None) if trainer is not None else None
        if connector is None or not getattr(connector, "is_distributed", False):
            return
        if getattr(connector, "use_distributed_sampler", False):
            connector.use_distributed_sampler = False
            rank_zero_info(
                f"{type(self).__name__}: switched off Lightning's distributed sampler replacement "
                "(use_distributed_sampler=False): P x K batches are sharded by the batch sampler, evaluation "
                "by the data module"
            )

    def _check_no_replacement(self) -> None:
        trainer = getattr(self, "trainer", None)
        connector = getattr(trainer, "_accelerator_connector", None) if trainer is not None else None
        if connector is not None and getattr(connector, "is_distributed", False):
            if getattr(connector, "use_distributed_sampler", False):
                raise RuntimeError(
                    f"{type(self).__name__}: Lightning's distributed sampler replacement is on under DDP; it would "
                    "split every P x K batch across processes. Pass Trainer(use_distributed_sampler=False)."
                )

    # ------------------------------------------------------------------ loaders
    def _loader_kwargs(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}

    def build_train_sampler(self) -> BalancedClassSampler:
        """The training batch sampler (seeded by ``seed``; rank and world size read from ``torch.distributed``).

        A training split with label sets (``labels`` ``[N, L]``) needs ``sampler="label_sets"``; the category
        sampler reads the training dataset's ``category`` ids (``-1``: none, not allowed)."""
        labels = torch.as_tensor(self.train_dataset.labels)
        name = type(self).__name__
        if labels.ndim == 2 and self.sampler != "label_sets":
            raise ValueError(
                f"{name}: the training split has label sets (several labels per item), which sampler={self.sampler!r} "
                "cannot draw: use sampler: label_sets (P labels x K items, --data.init_args.sampler label_sets)"
            )
        if self.sampler == "label_sets":
            return LabelSetSampler(labels, self.classes_per_batch, self.samples_per_class, seed=self.seed)
        if self.sampler == "category":
            categories = getattr(self.train_dataset, "category", None)
            if categories is None:
                raise ValueError(
                    f"{name}: sampler='category' needs the category of every training item, and this data module "
                    "gives none (CSVDataModule with a category column and SOPDataModule do)"
                )
            categories = torch.as_tensor(categories)
            if bool((categories < 0).any()):
                missing = int((categories < 0).sum())
                raise ValueError(
                    f"{name}: sampler='category' needs the category of every training item; {missing} of "
                    f"{categories.numel()} training items have none"
                )
            return CategoryBalancedSampler(
                labels, categories, self.categories_per_batch, self.classes_per_batch, self.samples_per_class,
                seed=self.seed,
            )
        if self.sampler == "npair":
            return NPairSampler(labels, self.classes_per_batch, seed=self.seed, hard_class_mining=self.hard_class_mining)
        return BalancedClassSampler(labels, self.classes_per_batch, self.samples_per_class, seed=self.seed)

    def train_collate_fn(self) -> Callable[[list[Any]], Any]:
        """The collate function of the training loader: :func:`collate_skipping` (subclasses may finish the batch)."""
        return collate_skipping

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        self._check_no_replacement()
        self.train_sampler = self.build_train_sampler()
        dataset, collate = self.train_dataset, self.train_collate_fn()
        if self.views > 1:  # V views of each item, labelled by item (lightning_dml.data.views)
            dataset, collate = ViewsDataset(dataset, self.views), ViewsCollate(collate, self.views)
        # Resumable: a run restarted from a mid-epoch checkpoint continues the epoch's batch sequence.
        return ResumableDataLoader(dataset, batch_sampler=self.train_sampler, collate_fn=collate, **self._loader_kwargs())

    def _eval_loader(self, dataset: Dataset) -> DataLoader:
        sampler = EvalShardSampler(dataset)
        return DataLoader(
            dataset,
            batch_size=self.eval_batch_size,
            sampler=sampler,
            shuffle=False,
            collate_fn=collate_skipping,
            **self._loader_kwargs(),
        )

    def val_dataloader(self) -> DataLoader:
        self.setup("validate")
        return self._eval_loader(self.val_dataset)

    def test_dataloader(self) -> DataLoader:
        self.setup("test")
        return self._eval_loader(self.test_dataset)

    def predict_dataloader(self) -> DataLoader:
        self.setup("predict")
        return self._eval_loader(self.test_dataset)

    def full_test_dataloader(self) -> DataLoader:
        """The whole test split in order, unsharded (for evaluation done by one process outside the loops)."""
        self.setup("test")
        return DataLoader(
            self.test_dataset,
            batch_size=self.eval_batch_size,
            shuffle=False,
            collate_fn=collate_skipping,
            num_workers=self.num_workers,
        )


class TensorImageDataset(Dataset):
    """Images held in memory as one uint8 tensor ``[N, C, H, W]``; items are ``(image, label, index)``.

    ``image = (pixels * scale / 255 - mean) / std`` as float; ``mean``/``std`` are scalars or one value per channel
    (``scale`` 1 gives [0, 1] pixels, 255 the Caffe convention).
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        mean: float | Sequence[float] = 0.0,
        std: float | Sequence[float] = 1.0,
        scale: float = 1.0,
    ) -> None:
        if images.ndim != 4 or images.dtype != torch.uint8:
            raise ValueError(f"images must be a uint8 tensor [N, C, H, W], got {images.dtype} {tuple(images.shape)}")
        if labels.shape != (images.shape[0],):
            raise ValueError(f"labels must have shape ({images.shape[0]},), got {tuple(labels.shape)}")
        channels = images.shape[1]
        self._mean = torch.as_tensor(mean, dtype=torch.float32).reshape(-1, 1, 1)
        self._std = torch.as_tensor(std, dtype=torch.float32).reshape(-1, 1, 1)
        for name, value in (("mean", self._mean), ("std", self._std)):
            if value.shape[0] not in (1, channels):
                raise ValueError(f"{name} must be a scalar or have {channels} values, got {value.shape[0]}")
        if bool((self._std <= 0).any()):
            raise ValueError(f"std must be positive, got {std}")
        self.images = images
        self.labels = labels.long()
        self.mean = mean
        self.std = std
        self.scale = float(scale)

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        image = (self.images[index].float() * (self.scale / 255.0) - self._mean) / self._std
        return image, int(self.labels[index]), int(index)

    def subset(self, indices: Any, transform: Any = None, evaluation: bool = False) -> "TensorImageDataset":
        """The items ``indices`` renumbered from 0 (no transform: the images are already tensors)."""
        idx = torch.as_tensor(np.asarray(indices), dtype=torch.long)
        return TensorImageDataset(self.images[idx], self.labels[idx], self.mean, self.std, self.scale)
