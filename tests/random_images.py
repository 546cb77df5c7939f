"""An in-memory data module of random grey images, for tests that need a DMLDataModule but no image files."""

from __future__ import annotations

from typing import Any

import torch

from lightning_dml.data import DMLDataModule, TensorImageDataset


class RandomImages(DMLDataModule):
    """``train_classes`` training then ``test_classes`` test classes of random ``size`` x ``size`` grey images,
    ``per_class`` images each (seeded: the same images every time)."""

    def __init__(
        self, *args: Any, train_classes: int = 12, test_classes: int = 6, per_class: int = 6, size: int = 8, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        self.train_classes, self.test_classes, self.per_class, self.size = train_classes, test_classes, per_class, size

    def build_datasets(self) -> tuple[TensorImageDataset, TensorImageDataset]:
        n = (self.train_classes + self.test_classes) * self.per_class
        g = torch.Generator().manual_seed(0)
        images = torch.randint(0, 256, (n, 1, self.size, self.size), dtype=torch.uint8, generator=g)
        labels = torch.arange(n) // self.per_class
        train = labels < self.train_classes
        return TensorImageDataset(images[train], labels[train]), TensorImageDataset(images[~train], labels[~train])
