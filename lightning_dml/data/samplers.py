"""Batch samplers that build the P x K batches pair losses need, and the evaluation shard sampler.

Every pair-based paper in this library trains on batches of ``P`` classes with ``K`` images each (MS: K = 5,
GPW: P = 16, K = 5, RLL: P = 60, K = 3, TML: P = 32, K = 8). A uniformly random batch of a dataset with
thousands of classes holds almost no positive pairs, so the sampler is what makes a pair loss trainable.
The N-pair paper (Sohn 2016, Sec. 3.2) uses N classes x 2 images and, for large label sets, chooses the N
classes by greedy hard negative *class* mining (Sec. 3.2.1): :class:`NPairSampler`. Data with categories (SOP's 12
super-categories, a product catalogue's departments) can draw C categories x P classes x K items, so that every
batch holds classes of one category side by side, the hard negatives (OML's ``CategoryBalanceSampler``):
:class:`CategoryBalancedSampler`. Items with label sets (several labels each) are drawn P labels x K items, each
item counted under each of its labels: :class:`LabelSetSampler`.

All of them are :class:`BalancedClassSampler` subclasses and share its machinery: the global batch sequence drawn
from ``(seed, epoch)``, the DDP sharding by batch, the batch seeds, :meth:`~BalancedClassSampler.state_dict` and
:meth:`~BalancedClassSampler.load_state_dict`; each only says how one global batch is drawn. The draws of classes
(and categories) in rounds are one function, :func:`take_distinct`.

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


def take_distinct(rng: np.random.Generator, queue: list[int], count: int, population: int) -> list[int]:
    """Take the first ``count`` distinct entries of ``queue`` (positions ``0 .. population - 1``), topping it up
    with a fresh permutation of *all* ``population`` positions when fewer than ``count`` are left.

    ``queue`` is a sequence of rounds, each a permutation of every position, so every position is drawn once per
    round and the number of draws of any two positions differs by at most one after every call. A position still
    pending from the previous round when the next one is appended may appear twice among the first ``count``
    entries: its second entry is skipped for this call and stays first in the queue (never the same position twice
    in one call), not dropped from its round. ``count`` must be at most ``population``."""
    if len(queue) < count:
        queue.extend(int(c) for c in rng.permutation(population))
    chosen: list[int] = []
    deferred: list[int] = []
    taken = 0
    while len(chosen) < count:
        c = queue[taken]
        taken += 1
        if c in chosen:  # already taken by this call: keep it for the next one
            deferred.append(c)
        else:
            chosen.append(c)
    queue[:taken] = deferred
    return chosen


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
        if classes_per_batch < 1 or samples_per_class < 1:
            raise ValueError(
                f"classes_per_batch and samples_per_class must be >= 1, got {classes_per_batch} and {samples_per_class}"
            )
        #: ``classes``: the distinct labels, sorted; ``members[c]``: the items of class position ``c``
        self.classes, self.members, self.num_items = self._groups(labels)
        if classes_per_batch > len(self.classes):
            raise ValueError(
                f"classes_per_batch={classes_per_batch} but the dataset has only {len(self.classes)} classes"
            )
        self.classes_per_batch = int(classes_per_batch)
        self.samples_per_class = int(samples_per_class)
        self.batch_size = self.classes_per_batch * self.samples_per_class
        self.seed = int(seed)
        self.num_replicas, self.rank = _distributed_context(num_replicas, rank)
        self.augmentation_seed = int(torch.initial_seed() if augmentation_seed is None else augmentation_seed)
        self.epoch = 0
        self._resume_epoch: int | None = None
        self._resume_batches = 0

    @staticmethod
    def _groups(labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], int]:
        """``(classes, members, num_items)``: the sorted distinct labels, the items of each (ascending) and the
        number of items an epoch counts. Subclasses with another notion of "class" override this."""
        if labels.ndim != 1 or labels.size == 0:
            raise ValueError(f"labels must be a non-empty 1-d sequence, got shape {labels.shape}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
        classes, inverse = np.unique(labels, return_inverse=True)
        order = np.argsort(inverse, kind="stable")
        bounds = np.cumsum(np.bincount(inverse, minlength=len(classes)))[:-1]
        return classes, np.split(order, bounds), len(labels)

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
        """Take P distinct classes (positions) from ``queue``, a sequence of rounds of all classes
        (:func:`take_distinct`): every class is drawn once per round, never twice in one batch."""
        return take_distinct(rng, queue, self.classes_per_batch, len(self.members))

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


class CategoryBalancedSampler(BalancedClassSampler):
    """Batch sampler of ``categories_per_batch`` (C) categories x ``classes_per_batch`` (P) classes of each x
    ``samples_per_class`` (K) items: batches of C * P * K items.

    For data whose classes fall into categories (Stanford Online Products' 12 super-categories, a catalogue's
    departments), as open-metric-learning's ``CategoryBalanceSampler`` draws them (``n_categories``, ``n_labels``,
    ``n_instances``): the P classes of one category sit side by side in a batch, so the negatives a pair loss sees
    are mostly the hard ones of the same category. Every class must belong to exactly one category.

    Draws, per global batch:

    * C distinct categories: ``category_weights="classes"`` (default, OML's ``weight_categories=True``) draws them
      without replacement with probability proportional to their number of classes, so every class is drawn about
      equally often whatever the category sizes; ``"uniform"`` takes them in rounds of all categories
      (:func:`take_distinct`: every category once per round, the counts of any two categories differ by at most one).
    * P distinct classes of each drawn category, in rounds of that category's classes (:func:`take_distinct`: the
      classes of a category are drawn equally often).
    * K items of each class, without replacement (with replacement for a class of fewer than K items), as
      :class:`BalancedClassSampler` does.

    A batch is laid out category by category, class by class: ``[category 1: class 1 x K, ..., class P x K],
    [category 2: ...]``. An epoch has ``len(labels) // (C * P * K)`` batches across all processes (at least one per
    process). Epochs, DDP sharding (every process takes every ``num_replicas``-th batch of one global sequence),
    batch seeds and exact mid-epoch resume (:meth:`state_dict` / :meth:`load_state_dict`) are those of
    :class:`BalancedClassSampler`.

    Args:
        labels: class label of every item (position = dataset index).
        categories: category id of every item (integers; every item of a class has the same one).
        categories_per_batch: C, distinct categories per batch (at most the number of categories).
        classes_per_batch: P, distinct classes of each category per batch: every category needs at least P
            classes (an error names the ones with fewer).
        samples_per_class: K, items of each class.
        category_weights: ``"classes"`` or ``"uniform"`` (see above).
        seed, num_replicas, rank, augmentation_seed: as in :class:`BalancedClassSampler`.
    """

    def __init__(
        self,
        labels: Sequence[int] | torch.Tensor | np.ndarray,
        categories: Sequence[int] | torch.Tensor | np.ndarray,
        categories_per_batch: int,
        classes_per_batch: int,
        samples_per_class: int,
        seed: int = 0,
        num_replicas: int | None = None,
        rank: int | None = None,
        augmentation_seed: int | None = None,
        category_weights: str = "classes",
    ) -> None:
        super().__init__(labels, classes_per_batch, samples_per_class, seed, num_replicas, rank, augmentation_seed)
        categories = np.asarray(torch.as_tensor(categories).cpu().numpy())
        if categories.shape != (self.num_items,):
            raise ValueError(f"categories must have shape ({self.num_items},) like labels, got {categories.shape}")
        if not np.issubdtype(categories.dtype, np.integer):
            raise ValueError(f"categories must be integers, got dtype {categories.dtype}")
        if category_weights not in ("classes", "uniform"):
            raise ValueError(f"category_weights must be 'classes' or 'uniform', got {category_weights!r}")
        if categories_per_batch < 1:
            raise ValueError(f"categories_per_batch must be >= 1, got {categories_per_batch}")
        class_category = np.empty(len(self.classes), dtype=categories.dtype)
        for c, items in enumerate(self.members):
            found = np.unique(categories[items])
            if len(found) > 1:
                raise ValueError(
                    f"class {self.classes[c]} has items in {len(found)} categories ({found[:4].tolist()}): every "
                    "class must belong to one category"
                )
            class_category[c] = found[0]
        #: the distinct category ids, sorted; ``category_classes[j]``: the class positions of category ``j``
        self.categories, owner = np.unique(class_category, return_inverse=True)
        self.category_classes: list[np.ndarray] = [np.flatnonzero(owner == j) for j in range(len(self.categories))]
        if categories_per_batch > len(self.categories):
            raise ValueError(
                f"categories_per_batch={categories_per_batch} but the data has only {len(self.categories)} categories"
            )
        small = [(int(self.categories[j]), len(c)) for j, c in enumerate(self.category_classes) if len(c) < self.classes_per_batch]
        if small:
            shown = ", ".join(f"category {cat}: {n} classes" for cat, n in small[:5])
            more = f" and {len(small) - 5} more" if len(small) > 5 else ""
            raise ValueError(
                f"classes_per_batch={self.classes_per_batch} distinct classes per category, but {len(small)} "
                f"categories have fewer ({shown}{more}): lower classes_per_batch or merge the small categories"
            )
        self.categories_per_batch = int(categories_per_batch)
        self.category_weights = category_weights
        sizes = np.array([len(c) for c in self.category_classes], dtype=np.float64)
        self._weights = sizes / sizes.sum() if category_weights == "classes" else None
        self.batch_size = self.categories_per_batch * self.classes_per_batch * self.samples_per_class

    def _global_batches(self) -> Iterator[list[int]]:
        rng = np.random.default_rng([self.seed, self.epoch])
        category_queue: list[int] = []
        class_queues: list[list[int]] = [[] for _ in self.category_classes]
        while True:
            if self._weights is None:
                drawn = take_distinct(rng, category_queue, self.categories_per_batch, len(self.category_classes))
            else:
                drawn = rng.choice(
                    len(self.category_classes), size=self.categories_per_batch, replace=False, p=self._weights
                ).tolist()
            chosen: list[int] = []
            for j in drawn:
                classes = self.category_classes[j]
                chosen.extend(int(classes[i]) for i in take_distinct(rng, class_queues[j], self.classes_per_batch, len(classes)))
            yield self._items(rng, chosen)


class LabelSetSampler(BalancedClassSampler):
    """P x K batches for items with label sets: ``classes_per_batch`` (P) labels x ``samples_per_class`` (K) items
    carrying each.

    ``labels`` is ``[N, L]``, each row an item's labels padded with -1 (a 1-d ``[N]`` is one label per item). Each
    item is counted under each of its labels: the members of label ``l`` are all items whose set holds ``l``. The
    P labels of a batch are drawn like :class:`BalancedClassSampler`'s classes (in rounds of all labels, never twice
    in one batch), then K items of each label, avoiding items already in the batch: K distinct items of a label
    that has at least K, and every item at most once in the batch when the label has K items not yet drawn for an
    earlier label of the batch; otherwise the label's remaining items are taken and the rest is drawn from its items
    already in the batch (so such an item appears twice), and a label of fewer than K items is drawn with
    replacement.

    What "a class of the batch" means here: each of the P drawn labels, with the K items drawn for it, in that
    order (``[label 1 x K, ..., label P x K]``). The batch may hold more positive pairs than the P groups give:
    two items are positive when their sets intersect, and an item drawn for one label may carry another of the
    batch's labels (or a label not drawn that another item also carries). Items without any label (all -1) are
    never drawn. An epoch has ``(items with a label) // (P * K)`` batches across all processes. Epochs, DDP
    sharding, batch seeds and exact resume are those of :class:`BalancedClassSampler`.

    Args:
        labels: ``[N, L]`` label sets padded with -1 (or ``[N]`` labels).
        classes_per_batch: P, distinct labels per batch. samples_per_class: K, items per label.
        seed, num_replicas, rank, augmentation_seed: as in :class:`BalancedClassSampler`.
    """

    @staticmethod
    def _groups(labels: np.ndarray) -> tuple[np.ndarray, list[np.ndarray], int]:
        if labels.ndim == 1:
            labels = labels[:, None]
        if labels.ndim != 2 or labels.size == 0:
            raise ValueError(f"labels must be [N, L] label sets padded with -1 (or [N]), got shape {labels.shape}")
        if not np.issubdtype(labels.dtype, np.integer):
            raise ValueError(f"labels must be integers, got dtype {labels.dtype}")
        if bool((labels < -1).any()):
            raise ValueError(f"labels must be >= 0, or -1 for padding; found {int(labels.min())}")
        rows, slots = np.nonzero(labels >= 0)
        if rows.size == 0:
            raise ValueError("no item has a label (every row is -1)")
        values = labels[rows, slots]
        pairs = np.unique(np.stack([values, rows], axis=1), axis=0)  # (label, item) once each, label-major
        classes, starts = np.unique(pairs[:, 0], return_index=True)
        return classes, np.split(pairs[:, 1], starts[1:]), len(np.unique(rows))

    def _items(self, rng: np.random.Generator, chosen: Sequence[int]) -> list[int]:
        batch: list[int] = []
        k = self.samples_per_class
        for c in chosen:
            items = self.members[c]
            if len(items) < k:
                batch.extend(rng.choice(items, size=k, replace=True).tolist())
                continue
            used = np.isin(items, batch)
            fresh = items[~used]
            if len(fresh) >= k:
                batch.extend(rng.choice(fresh, size=k, replace=False).tolist())
            else:
                batch.extend(fresh.tolist())
                batch.extend(rng.choice(items[used], size=k - len(fresh), replace=False).tolist())
        return batch


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


__all__ = [
    "BalancedClassSampler",
    "CategoryBalancedSampler",
    "EvalShardSampler",
    "LabelSetSampler",
    "NPairSampler",
    "SeededBatch",
    "batch_seed",
    "take_distinct",
]
