"""Several augmented views of every training item, labelled by item (the data modules' ``views`` option, for
:class:`~lightning_dml.losses.SelfSupervisedLoss`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

__all__ = ["ViewsDataset", "ViewsCollate", "check_views"]


def check_views(views: int) -> int:
    """``views`` must be an integer ``>= 1`` (1: the plain batch); ``ValueError`` otherwise."""
    if isinstance(views, bool) or not isinstance(views, int) or views < 1:
        raise ValueError(f"views must be an integer >= 1 (1: one view per item, no self-supervised views), got {views!r}")
    return views


class ViewsDataset(Dataset):
    """``dataset[i]`` drawn ``views`` times: a tuple of ``views`` items, each through the dataset's own (random)
    training transform, so the views differ as much as that transform makes them (none: identical views).

    ``labels`` (and every other attribute) are the wrapped dataset's: the batch samplers draw items as before."""

    def __init__(self, dataset: Dataset, views: int) -> None:
        self.dataset = dataset
        self.views = check_views(views)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        return tuple(self.dataset[index] for _ in range(self.views))

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not yet set (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


class ViewsCollate:
    """Collate ``ViewsDataset`` items view-major (the first view of every item, then the second, ...) with
    ``collate_fn``, then replace the labels (field 1) by the items' ids (field 2, the index in the training split):
    the ``V`` views of an item share its id, the id of no other item. Items skipped as corrupt (``None``) are
    dropped with all their views. Picklable (DataLoader workers)."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any], views: int) -> None:
        self.collate_fn = collate_fn
        self.views = check_views(views)

    def __call__(self, batch: Sequence[tuple[Any, ...] | None]) -> Any:
        kept = [item for item in batch if item is not None and all(view is not None for view in item)]
        out = self.collate_fn([item[v] for v in range(self.views) for item in kept])
        if not isinstance(out, (list, tuple)) or len(out) < 3:
            raise ValueError("views: the training items must be (image, label, index) to be labelled by item")
        fields = list(out)
        fields[1] = torch.as_tensor(fields[2]).clone()
        return type(out)(fields) if isinstance(out, tuple) else fields
