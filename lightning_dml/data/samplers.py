"""Batch samplers that build the P x K batches pair losses need, and the evaluation shard sampler.

Every pair-based paper in this library trains on batches of ``P`` classes with ``K`` images each (MS: K = 5,
GPW: P = 16, K = 5, RLL: P = 60, K = 3, TML: P = 32, K = 8). A uniformly random batch of a dataset with
thousands of classes holds almost no positive pairs, so the sampler is what makes a pair loss trainable.
The N-pair paper (Sohn 2016, Sec. 3.2) uses N classes x 2 images and, for large label sets, chooses the N
classes by greedy hard negative *class* mining (Sec. 3.2.1): :class:`NPairSampler`.

DDP: the samplers are *batch* samplers that shard themselves (see :class:`BalancedClassSampler`). Lightning's
automatic sampler replacement must be off for them (``Trainer(use_distributed_sampler=False)``; the data modules
turn it off, see :class:`~lightning_dml.data.base.DMLDataModule`). Evaluation splits are sharded with
:class:`EvalShardSampler`: every item is evaluated exactly once across processes, without padding.

Random augmentation: every training batch is a :class:`SeededBatch`, a list of indices carrying the seed of its
random augmentation, derived from ``(augmentation_seed, epoch, batch number)`` alone.
:class:`~lightning_dml.data.resumable.ResumableDataLoader` seeds the generators with it while it loads the batch,
so a batch's augmentation is the same whichever worker process (or the main process) loads it, and a resumed run
draws exactly the augmentation of the uninterrupted one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, Sampler


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


class SeededBatch(list):
    """A batch of dataset indices (a ``list[int]``) with ``seed``, the seed of the batch's random augmentation.

    A plain ``list`` subclass: it compares equal to the list of its indices and keeps ``seed`` through pickling
    (DataLoader workers receive it so).
    """

    def __init__(self, indices: Sequence[int] = (), seed: int = 0) -> None:
        super().__init__(indices)
        self.seed = int(seed)

    def __repr__(self) -> str:
        return f"SeededBatch({list.__repr__(self)}, seed={self.seed})"


def batch_seed(augmentation_seed: int, epoch: int, batch: int) -> int:
    """The augmentation seed of global batch number ``batch`` of ``epoch``: a 63-bit hash of the three numbers
    (``numpy.random.SeedSequence``), so that nearby epochs and batches get unrelated streams."""
    words = np.random.SeedSequence([int(augmentation_seed) % 2**64, int(epoch), int(batch)]).generate_state(2)
    return (int(words[0]) << 31) ^ int(words[1])


class BalancedClassSampler(Sampler[list[int]]):
    """Batch sampler of ``classes_per_batch`` (P) classes x ``samples_per_class`` (K) items.

    Classes are drawn without replacement until every class has been used once, then reshuffled (as the MS
    authors' sampler does). Within a class, K items are drawn without replacement; a class with fewer than K
    items is sampled with replacement so every batch keeps its P x K shape.

    The sampler is epoch-aware (``set_epoch``, which Lightning calls every epoch) and DDP-aware: all processes
    draw the same global sequence of batches from ``(seed, epoch)`` and process ``rank`` takes every
    ``num_replicas``-th *batch*, so each process gets its own distinct, complete P x K batches, no class group is
    split across processes, and every process gets the same number of batches. An epoch has
    ``len(labels) // (P * K)`` batches in total across all processes (at least one per process).

    Mid-epoch resume: :meth:`state_dict` / :meth:`load_state_dict` carry ``epoch`` and ``position`` (this
    process's batches of that epoch already consumed); after loading, the next iteration of that epoch skips
    the consumed batches and yields exactly the ones an uninterrupted run would have yielded next.

    Every batch is a :class:`SeededBatch` whose ``seed`` (see :func:`batch_seed`) depends only on
    ``augmentation_seed``, the epoch and the batch's number in the global sequence (so it differs between
    processes and batches), never on which worker loads it.

    Args:
        labels: class label of every item of the dataset (position = dataset index).
        classes_per_batch: P, distinct classes in each batch (at least 1, at most the number of classes).
        samples_per_class: K, items of each class in each batch.
        seed: base seed; batches depend only on ``(seed, epoch)`` and the rank.
        num_replicas: number of processes; read from ``torch.distributed`` when ``None``.
        rank: this process's rank; read from ``torch.distributed`` when ``None``.
        augmentation_seed: base of the batches' augmentation seeds; default ``torch.initial_seed()`` (the seed
            given to ``seed_everything``). Saved by :meth:`state_dict`, so a resumed run keeps it.
    """

    def __init__(
        self,
        labels: Sequence[int] | torch.Tensor | np.ndarray,
        classes_per_batch: int,
        samples_per_class: int,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        augmentation_seed: int | None = None,
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
        self.augmentation_seed = int(torch.initial_seed() if augmentation_seed is None else augmentation_seed)
        self.epoch = 0
        self._resume_epoch: int | None = None
        self._resume_batches = 0

    def set_epoch(self, epoch: int) -> None:
        """Make the next iteration draw the batches of ``epoch`` (called by Lightning at each epoch start)."""
        self.epoch = int(epoch)

    @property
    def sampler(self) -> "BalancedClassSampler":
        """This sampler itself: Lightning's ``_set_sampler_epoch`` calls ``set_epoch`` on ``loader.sampler`` and
        ``loader.batch_sampler.sampler``, never on ``loader.batch_sampler``; without this every epoch would draw
        the batches of epoch 0."""
        return self

    def __len__(self) -> int:
        return max(1, self.num_items // self.batch_size // self.num_replicas)

    # ------------------------------------------------------------------ batch construction
    def _next_classes(self, rng: np.random.Generator, queue: list[int]) -> list[int]:
        """Take P classes from ``queue`` (class positions), topping it up with a fresh permutation."""
        if len(queue) < self.classes_per_batch:
            pending = set(queue)
            # never put the same class twice in one batch
            queue.extend(int(c) for c in rng.permutation(len(self.members)) if c not in pending)
        chosen = queue[: self.classes_per_batch]
        del queue[: self.classes_per_batch]
        return chosen

    def _items(self, rng: np.random.Generator, chosen: Sequence[int]) -> list[int]:
        batch: list[int] = []
        for c in chosen:
            items = self.members[c]
            replace = len(items) < self.samples_per_class
            batch.extend(rng.choice(items, size=self.samples_per_class, replace=replace).tolist())
        return batch

    def _global_batches(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        queue: list[int] = []
        while True:
            yield self._items(rng, self._next_classes(rng, queue))

    def __iter__(self) -> Iterator[SeededBatch]:
        skip = self._resume_batches if self._resume_epoch == self.epoch else 0
        self._resume_epoch, self._resume_batches = None, 0
        batches = self._global_batches()
        mine = 0
        for step in range(len(self) * self.num_replicas):
            batch = next(batches)
            if step % self.num_replicas == self.rank:
                mine += 1
                if mine > skip:
                    yield SeededBatch(batch, batch_seed(self.augmentation_seed, self.epoch, step))

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict[str, int]:
        """``{"epoch", "position", "seed", "num_replicas", "augmentation_seed"}``: ``position`` is the number of this
        process's batches of ``epoch`` the next iteration skips (0 unless a state was loaded). The caller that knows
        how many batches were consumed (the loop, or :class:`~lightning_dml.data.resumable.ResumableDataLoader`; the
        sampler itself runs ahead of the loop in the DataLoader's prefetch) overwrites ``position`` when it saves."""
        position = self._resume_batches if self._resume_epoch == self.epoch else 0
        return {
            "epoch": self.epoch,
            "position": position,
            "seed": self.seed,
            "num_replicas": self.num_replicas,
            "augmentation_seed": self.augmentation_seed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: the next iteration of ``state["epoch"]`` skips its first ``state["position"]`` batches and
        yields exactly the batches an uninterrupted run would have yielded next (nothing is loaded for the
        skipped ones: batches depend only on seed, epoch and rank). The saved ``augmentation_seed`` replaces this
        sampler's (a resumed process may have been seeded differently; the run's augmentation continues)."""
        seed = int(state.get("seed", self.seed))
        replicas = int(state.get("num_replicas", self.num_replicas))
        if seed != self.seed or replicas != self.num_replicas:
            raise ValueError(
                f"cannot resume a sampler saved with seed={seed}, num_replicas={replicas} into one with "
                f"seed={self.seed}, num_replicas={self.num_replicas}: the batches would differ"
            )
        position = int(state.get("position", 0))
        if not 0 <= position <= len(self):
            raise ValueError(f"position must be in [0, {len(self)}] (batches per epoch), got {position}")
        self.epoch = int(state["epoch"])
        self.augmentation_seed = int(state.get("augmentation_seed", self.augmentation_seed))
        self._resume_epoch = self.epoch
        self._resume_batches = position


class NPairSampler(BalancedClassSampler):
    """N-pair batches (Sohn 2016, Sec. 3.2): N distinct classes x 2 images, optionally hard-negative-class mined.

    Without mining the N classes are drawn like :class:`BalancedClassSampler` with K = 2. With
    ``hard_class_mining`` (Sec. 3.2.1, the "-nm" models): for each batch, ``num_candidates`` classes are drawn at
    random; starting from one random candidate, the candidate that most violates the triplet constraint with
    respect to the classes already chosen is added greedily until there are N. The paper does not define the
    violation score (SPEC 5.2, [I]); here a class is represented by the mean of its embeddings (L2-normalised) and
    a candidate's score is its largest cosine similarity to any chosen class; ties are broken at random. Class
    embeddings come from the model through :meth:`set_class_embeddings` (e.g. refreshed by
    :class:`~lightning_dml.callbacks.ClassEmbeddingRefresh` every epoch). Until they are set, batches are drawn
    without mining.

    Under DDP every process must receive the same class embeddings (the refresh callback all-gathers them), so
    that all processes derive the same global batch sequence and take disjoint batches of it.

    Args:
        labels, seed, num_replicas, rank, augmentation_seed: as in :class:`BalancedClassSampler`.
        classes_per_batch: N, the number of pairs per batch (batch size 2N).
        hard_class_mining: choose the classes greedily from the class embeddings.
        num_candidates: classes drawn at random per batch before the greedy selection (default ``4 * N``,
            at most the number of classes).
    """

    def __init__(
        self,
        labels: Sequence[int] | torch.Tensor | np.ndarray,
        classes_per_batch: int,
        seed: int = 0,
        hard_class_mining: bool = False,
        num_candidates: int | None = None,
        num_replicas: int | None = None,
        rank: int | None = None,
        augmentation_seed: int | None = None,
    ) -> None:
        super().__init__(labels, classes_per_batch, 2, seed, num_replicas, rank, augmentation_seed)
        num_classes = len(self.classes)
        if num_candidates is None:
            num_candidates = min(num_classes, 4 * self.classes_per_batch)
        if not self.classes_per_batch <= num_candidates <= num_classes:
            raise ValueError(
                f"num_candidates must be between classes_per_batch ({self.classes_per_batch}) and the number of "
                f"classes ({num_classes}), got {num_candidates}"
            )
        self.hard_class_mining = bool(hard_class_mining)
        self.num_candidates = int(num_candidates)
        self.class_embeddings: torch.Tensor | None = None

    def set_class_embeddings(self, embeddings: torch.Tensor, labels: torch.Tensor | None = None) -> None:
        """Give the sampler the model's embeddings of its classes.

        Either ``embeddings [num_classes, D]`` in the order of ``self.classes`` (``labels=None``), or
        ``embeddings [M, D]`` of individual images with their ``labels [M]`` (averaged per class; every class
        of the sampler must appear).
        """
        x = torch.as_tensor(embeddings).detach().to("cpu", torch.float64)
        if x.ndim != 2:
            raise ValueError(f"embeddings must be 2-d, got shape {tuple(x.shape)}")
        if labels is not None:
            y = torch.as_tensor(labels).cpu().long()
            if y.shape != (x.shape[0],):
                raise ValueError(f"labels must have shape ({x.shape[0]},), got {tuple(y.shape)}")
            classes = torch.as_tensor(self.classes, dtype=torch.long)
            position = torch.searchsorted(classes, y)
            valid = (position < len(classes)) & (classes[position.clamp(max=len(classes) - 1)] == y)
            if not bool(valid.all()):
                raise ValueError(f"label {int(y[~valid][0])} is not a class of this sampler")
            sums = torch.zeros(len(classes), x.shape[1], dtype=torch.float64).index_add_(0, position, x)
            counts = torch.bincount(position, minlength=len(classes))
            if bool((counts == 0).any()):
                missing = self.classes[(counts == 0).numpy()][:5].tolist()
                raise ValueError(f"no embedding given for classes {missing}... (every class needs one)")
            x = sums / counts.unsqueeze(1)
        elif x.shape[0] != len(self.classes):
            raise ValueError(f"expected one embedding per class ({len(self.classes)}), got {x.shape[0]}")
        if not bool(torch.isfinite(x).all()):
            raise ValueError("class embeddings contain NaN or Inf")
        self.class_embeddings = torch.nn.functional.normalize(x, dim=1)

    def mine_classes(self, rng: np.random.Generator, candidates: Sequence[int]) -> list[int]:
        """Greedy hard negative class selection (Sec. 3.2.1) among ``candidates`` (class positions)."""
        assert self.class_embeddings is not None
        cand = np.asarray(candidates)
        emb = self.class_embeddings[torch.from_numpy(cand)]
        sim = (emb @ emb.T).numpy()
        first = int(rng.integers(len(cand)))
        chosen = [first]
        closest = sim[first].copy()  # largest similarity of each candidate to the chosen classes
        available = np.ones(len(cand), dtype=bool)
        available[first] = False
        while len(chosen) < self.classes_per_batch:
            scores = np.where(available, closest, -np.inf)
            best = np.flatnonzero(scores == scores.max())
            pick = int(best[rng.integers(len(best))]) if len(best) > 1 else int(best[0])
            chosen.append(pick)
            available[pick] = False
            closest = np.maximum(closest, sim[pick])
        return [int(cand[i]) for i in chosen]

    def _global_batches(self) -> Iterator[list[int]]:
        if not self.hard_class_mining or self.class_embeddings is None:
            yield from super()._global_batches()
            return
        rng = np.random.default_rng([self.seed, self.epoch])
        while True:
            candidates = rng.choice(len(self.members), size=self.num_candidates, replace=False)
            yield self._items(rng, self.mine_classes(rng, candidates))


class EvalShardSampler(DistributedSampler):
    """Ordered evaluation shard of process ``rank``: items ``rank, rank + W, rank + 2W, ...`` (no padding).

    Every item is evaluated exactly once across the ``W`` processes; shards differ in length by at most one.
    A :class:`~torch.utils.data.DistributedSampler` subclass, so Lightning never replaces it with its padding one.
    """

    def __init__(self, dataset: Dataset, num_replicas: int | None = None, rank: int | None = None) -> None:
        num_replicas, rank = _distributed_context(num_replicas, rank)
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=False, drop_last=False)
        self.total_size = len(dataset)  # type: ignore[arg-type]
        self.num_samples = len(range(rank, self.total_size, num_replicas))

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.rank, self.total_size, self.num_replicas))

    def __len__(self) -> int:
        return self.num_samples


__all__ = ["BalancedClassSampler", "EvalShardSampler", "NPairSampler", "SeededBatch", "batch_seed"]
