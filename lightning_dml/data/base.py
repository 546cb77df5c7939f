"""The shared base of every data module: P x K training batches, ordered evaluation over the test split."""

from __future__ import annotations

from typing import Any

import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_dml.data.samplers import BalancedClassSampler


class DMLDataModule(pl.LightningDataModule):
    """Base class of the zero-shot retrieval data modules.

    Subclasses implement :meth:`build_datasets`, returning the training and test datasets. Each dataset yields
    ``(image, label, index)`` with ``index`` the item's position in its split, and exposes ``labels`` (one int per
    item). Training batches are P x K batches from :class:`BalancedClassSampler`; validation and test iterate the
    test split in order (the papers select the best epoch on the test split: it is logged as ``val/`` and named
    ``test_as_val`` in the hyper-parameters).

    Args:
        classes_per_batch: P, classes per training batch.
        samples_per_class: K, images per class in a training batch. The batch size is P * K.
        eval_batch_size: batch size of validation, test and predict.
        num_workers: DataLoader worker processes.
        seed: seed of the training sampler (batches depend on seed, epoch and rank).
    """

    def __init__(
        self,
        classes_per_batch: int = 16,
        samples_per_class: int = 4,
        eval_batch_size: int = 256,
        num_workers: int = 0,
        seed: int = 0,
    ) -> None:
        super().__init__()
        self.classes_per_batch = classes_per_batch
        self.samples_per_class = samples_per_class
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.seed = seed
        self.train_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None

    @property
    def batch_size(self) -> int:
        return self.classes_per_batch * self.samples_per_class

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """Return ``(train_dataset, test_dataset)``; implemented by every concrete data module."""
        raise NotImplementedError(f"{type(self).__name__} must implement build_datasets()")

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is None or self.test_dataset is None:
            self.train_dataset, self.test_dataset = self.build_datasets()

    def _loader_kwargs(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "persistent_workers": self.num_workers > 0}

    def train_dataloader(self) -> DataLoader:
        self.setup("fit")
        sampler = BalancedClassSampler(
            self.train_dataset.labels, self.classes_per_batch, self.samples_per_class, seed=self.seed
        )
        return DataLoader(self.train_dataset, batch_sampler=sampler, **self._loader_kwargs())

    def _eval_dataloader(self) -> DataLoader:
        self.setup("test")
        return DataLoader(self.test_dataset, batch_size=self.eval_batch_size, shuffle=False, **self._loader_kwargs())

    def val_dataloader(self) -> DataLoader:
        return self._eval_dataloader()

    def test_dataloader(self) -> DataLoader:
        return self._eval_dataloader()

    def predict_dataloader(self) -> DataLoader:
        return self._eval_dataloader()


class TensorImageDataset(Dataset):
    """Images held in memory as one uint8 tensor ``[N, C, H, W]``; items are ``(image, label, index)``.

    ``image`` is float, scaled to [0, 1] and standardised with ``mean``/``std``.
    """

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean: float = 0.0, std: float = 1.0) -> None:
        if images.ndim != 4 or images.dtype != torch.uint8:
            raise ValueError(f"images must be a uint8 tensor [N, C, H, W], got {images.dtype} {tuple(images.shape)}")
        if labels.shape != (images.shape[0],):
            raise ValueError(f"labels must have shape ({images.shape[0]},), got {tuple(labels.shape)}")
        self.images = images
        self.labels = labels.long()
        self.mean = mean
        self.std = std

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, int]:
        image = (self.images[index].float() / 255.0 - self.mean) / self.std
        return image, int(self.labels[index]), index
