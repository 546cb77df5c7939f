"""Batch samplers that build the P x K batches pair losses need.

Every pair-based paper in this library trains on batches of ``P`` classes with ``K`` images each (MS: K = 5,
GPW: P = 16, K = 5, RLL: P = 60, K = 3, TML: P = 32, K = 8). A uniformly random batch of a dataset with
thousands of classes holds almost no positive pairs, so the sampler is what makes a pair loss trainable.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import Sampler


def _distributed_context(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """Return ``(num_replicas, rank)``, read from ``torch.distributed`` where not given."""
    dist = torch.distributed
    initialized = dist.is_available() and dist.is_initialized()
    if num_replicas is None:
        num_replicas = dist.get_world_size() if initialized else 1
    if rank is None:
        rank = dist.get_rank() if initialized else 0
    if num_replicas < 1:
        raise ValueError(f"num_replicas must be >= 1, got {num_replicas}")
    if not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in [0, {num_replicas - 1}], got {rank}")
    return num_replicas, rank


class BalancedClassSampler(Sampler[list[int]]):
    """Batch sampler of ``classes_per_batch`` (P) classes x ``samples_per_class`` (K) items.

    Classes are drawn without replacement until every class has been used once, then reshuffled (as the MS
    authors' sampler does). Within a class, K items are drawn without replacement; a class with fewer than K
    items is sampled with replacement so every batch keeps its P x K shape.

    The sampler is epoch-aware (``set_epoch``, which Lightning calls every epoch) and DDP-aware: all processes
    draw the same global sequence of batches from ``seed + epoch`` and process ``rank`` takes every
    ``num_replicas``-th *batch*, so each process gets its own distinct, complete P x K batches, no class group is
    split across processes, and every process gets the same number of batches. An epoch has
    ``len(labels) // (P * K)`` batches in total across all processes (at least one per process).

    Args:
        labels: class label of every item of the dataset (position = dataset index).
        classes_per_batch: P, distinct classes in each batch (at least 1, at most the number of classes).
        samples_per_class: K, items of each class in each batch.
        seed: base seed; batches depend only on ``(seed, epoch)`` and the rank.
        num_replicas: number of processes; read from ``torch.distributed`` when ``None``.
        rank: this process's rank; read from ``torch.distributed`` when ``None``.
    """

    def __init__(
        self,
        labels: Sequence[int] | torch.Tensor | np.ndarray,
        classes_per_batch: int,
        samples_per_class: int,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
    ) -> None:
        labels = np.asarray(torch.as_tensor(labels).cpu().numpy())
        if labels.ndim != 1 or labels.size == 0:
            raise ValueError(f"labels must be a non-empty 1-d sequence, got shape {labels.shape}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
        if classes_per_batch < 1 or samples_per_class < 1:
            raise ValueError(
                f"classes_per_batch and samples_per_class must be >= 1, got {classes_per_batch} and {samples_per_class}"
            )
        self.classes, inverse = np.unique(labels, return_inverse=True)
        if classes_per_batch > len(self.classes):
            raise ValueError(
                f"classes_per_batch={classes_per_batch} but the dataset has only {len(self.classes)} classes"
            )
        order = np.argsort(inverse, kind="stable")
        bounds = np.cumsum(np.bincount(inverse, minlength=len(self.classes)))[:-1]
        self.members: list[np.ndarray] = np.split(order, bounds)
        self.classes_per_batch = int(classes_per_batch)
        self.samples_per_class = int(samples_per_class)
        self.batch_size = self.classes_per_batch * self.samples_per_class
        self.seed = int(seed)
        self.num_replicas, self.rank = _distributed_context(num_replicas, rank)
        self.num_items = len(labels)
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration draw the batches of ``epoch`` (called by Lightning at each epoch start)."""
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return max(1, self.num_items // self.batch_size // self.num_replicas)

    def _global_batches(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        class_queue: list[int] = []
        while True:
            if len(class_queue) < self.classes_per_batch:
                # Top up with a fresh permutation; never put the same class twice in one batch.
                fresh = [c for c in rng.permutation(len(self.members)) if c not in class_queue[:]]
                class_queue.extend(fresh)
            chosen, class_queue = class_queue[: self.classes_per_batch], class_queue[self.classes_per_batch :]
            batch: list[int] = []
            for c in chosen:
                items = self.members[c]
                replace = len(items) < self.samples_per_class
                batch.extend(rng.choice(items, size=self.samples_per_class, replace=replace).tolist())
            yield batch

    def __iter__(self) -> Iterator[list[int]]:
        batches = self._global_batches()
        for step in range(len(self) * self.num_replicas):
            batch = next(batches)
            if step % self.num_replicas == self.rank:
                yield batch
