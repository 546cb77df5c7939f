"""Sampler properties: P x K structure, DDP sharding, reproducibility, replacement, resume, N-pair mining."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
import torch

from lightning_dml.data import BalancedClassSampler, EvalShardSampler, NPairSampler
from lightning_dml.data.samplers import SeededBatch, batch_seed


def _labels(num_classes: int = 20, per_class: int | list[int] = 6, seed: int = 0) -> np.ndarray:
    counts = per_class if isinstance(per_class, list) else [per_class] * num_classes
    labels = np.concatenate([np.full(n, 100 + c) for c, n in enumerate(counts)])
    return np.random.default_rng(seed).permutation(labels)  # classes interleaved, as in real list files


def _check_pk(batch: list[int], labels: np.ndarray, p: int, k: int) -> None:
    assert len(batch) == p * k
    counts = Counter(labels[batch].tolist())
    assert len(counts) == p, f"batch has {len(counts)} classes, expected {p}"
    assert set(counts.values()) == {k}
    # the K items of a class are contiguous in the batch (one class group)
    for start in range(0, p * k, k):
        assert len(set(labels[batch[start : start + k]].tolist())) == 1


@pytest.mark.parametrize("p,k", [(4, 3), (5, 2), (20, 1)])
def test_every_batch_is_p_classes_times_k_images(p, k):
    labels = _labels()
    sampler = BalancedClassSampler(labels, p, k, seed=3, num_replicas=1, rank=0)
    batches = list(sampler)
    assert len(batches) == len(sampler) == len(labels) // (p * k)
    for batch in batches:
        _check_pk(batch, labels, p, k)
        if k <= 6:  # no repeated item within a class group when the class has enough items
            assert len(set(batch)) == len(batch)


def test_classes_cycle_before_repeating():
    """Classes are drawn without replacement until all have been used (MS sampler)."""
    labels = _labels(num_classes=12, per_class=8)
    sampler = BalancedClassSampler(labels, 4, 2, seed=0, num_replicas=1, rank=0)
    batches = list(sampler)  # 96 // 8 = 12 batches = 4 full rounds over 12 classes
    rounds = [set() for _ in range(4)]
    for i, batch in enumerate(batches):
        rounds[i // 3] |= set(labels[batch].tolist())
    assert all(len(r) == 12 for r in rounds)


def test_small_classes_are_sampled_with_replacement():
    labels = _labels(num_classes=6, per_class=[1, 2, 5, 5, 5, 5])
    sampler = BalancedClassSampler(labels, 6, 4, seed=0, num_replicas=1, rank=0)
    for batch in sampler:
        _check_pk(batch, labels, 6, 4)
        groups = Counter(labels[batch].tolist())
        for cls in (100, 101):  # the classes with 1 and 2 images still give 4 items, all of that class
            assert groups[cls] == 4
        singleton = [i for i in batch if labels[i] == 100]
        assert len(set(singleton)) == 1  # the same image 4 times


def test_two_ranks_draw_disjoint_complete_batches_and_never_split_a_class_group():
    labels = _labels(num_classes=30, per_class=7)
    p, k = 5, 3
    ranks = [list(BalancedClassSampler(labels, p, k, seed=11, num_replicas=2, rank=r)) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == len(labels) // (p * k) // 2
    single = list(BalancedClassSampler(labels, p, k, seed=11, num_replicas=1, rank=0))
    for r in range(2):
        for batch in ranks[r]:
            _check_pk(batch, labels, p, k)
    # step i: rank 0 and rank 1 draw different batches; together they are the global sequence's batches 2i, 2i+1
    for step, (b0, b1) in enumerate(zip(*ranks)):
        assert b0 != b1
        assert b0 == single[2 * step] and b1 == single[2 * step + 1]
        # within one step the two processes' class groups are disjoint (drawn from one round of classes)
        assert not set(labels[b0].tolist()) & set(labels[b1].tolist()) or len(set(labels)) < 2 * p


def test_seed_and_epoch_reproducibility():
    labels = _labels()
    a = BalancedClassSampler(labels, 4, 3, seed=5, num_replicas=1, rank=0)
    b = BalancedClassSampler(labels, 4, 3, seed=5, num_replicas=1, rank=0)
    assert list(a) == list(b)
    assert list(a) == list(a)  # iterating twice in one epoch gives the same batches
    first = list(a)
    a.set_epoch(1)
    assert list(a) != first
    c = BalancedClassSampler(labels, 4, 3, seed=6, num_replicas=1, rank=0)
    assert list(c) != first


def test_resume_skips_consumed_batches():
    labels = _labels()
    full = BalancedClassSampler(labels, 4, 3, seed=1, num_replicas=2, rank=1)
    full.set_epoch(2)
    expected = list(full)
    resumed = BalancedClassSampler(labels, 4, 3, seed=1, num_replicas=2, rank=1)
    state = dict(full.state_dict(), position=3)
    assert state["epoch"] == 2
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # Lightning calls set_epoch again with the same epoch
    rest = list(resumed)
    assert rest == expected[3:]
    assert [b.seed for b in rest] == [b.seed for b in expected[3:]]  # the same augmentation seeds
    assert list(resumed) == expected  # the skip applies once
    with pytest.raises(ValueError, match="seed"):
        BalancedClassSampler(labels, 4, 3, seed=2, num_replicas=2, rank=1).load_state_dict(state)


def test_bad_arguments_are_explained():
    with pytest.raises(ValueError, match="only 3 classes"):
        BalancedClassSampler([0, 0, 1, 1, 2, 2], 4, 2)
    with pytest.raises(ValueError, match="integers"):
        BalancedClassSampler([0.5, 1.5], 1, 2)
    with pytest.raises(ValueError, match="rank"):
        BalancedClassSampler([0, 1], 1, 1, num_replicas=2, rank=2)


def test_eval_shards_cover_every_item_exactly_once():
    dataset = list(range(103))
    for world in (1, 2, 3, 4):
        shards = [list(EvalShardSampler(dataset, num_replicas=world, rank=r)) for r in range(world)]
        assert sorted(i for s in shards for i in s) == dataset
        assert max(map(len, shards)) - min(map(len, shards)) <= 1
        assert all(len(EvalShardSampler(dataset, num_replicas=world, rank=r)) == len(shards[r]) for r in range(world))


# ------------------------------------------------------------------------------------------------ N-pair
def test_npair_batches_are_n_distinct_classes_times_two():
    labels = _labels(num_classes=25, per_class=4)
    sampler = NPairSampler(labels, 8, seed=0, num_replicas=1, rank=0)
    for batch in sampler:
        _check_pk(batch, labels, 8, 2)


def _reference_greedy(emb: np.ndarray, candidates: list[int], first: int, n: int) -> list[int]:
    """Sec. 3.2.1 written out: repeatedly add the candidate most similar to any chosen class."""
    unit = emb / np.linalg.norm(emb, axis=1, keepdims=True)
    chosen = [first]
    while len(chosen) < n:
        best, best_score = None, -np.inf
        for c in candidates:
            if c in chosen:
                continue
            score = max(float(unit[c] @ unit[s]) for s in chosen)
            if score > best_score:
                best, best_score = c, score
        chosen.append(best)
    return chosen


def test_hard_class_mining_matches_the_greedy_reference():
    num_classes, n = 30, 6
    labels = _labels(num_classes=num_classes, per_class=3)
    emb = np.random.default_rng(0).normal(size=(num_classes, 8))
    sampler = NPairSampler(labels, n, seed=0, hard_class_mining=True, num_candidates=20, num_replicas=1, rank=0)
    sampler.set_class_embeddings(torch.from_numpy(emb))
    rng = np.random.default_rng(123)
    for _ in range(10):
        candidates = rng.choice(num_classes, size=20, replace=False).tolist()
        chosen = sampler.mine_classes(np.random.default_rng(int(rng.integers(1 << 30))), candidates)
        assert len(set(chosen)) == n and set(chosen) <= set(candidates)
        assert chosen == _reference_greedy(emb, candidates, chosen[0], n)
    for batch in sampler:
        _check_pk(batch, labels, n, 2)


def test_hard_class_mining_picks_close_classes():
    """With two well separated groups of classes, a mined batch stays inside the group of its first class."""
    labels = _labels(num_classes=20, per_class=2)
    emb = np.zeros((20, 2))
    emb[:10] = [1.0, 0.0]
    emb[10:] = [0.0, 1.0]
    emb += np.random.default_rng(1).normal(scale=0.01, size=emb.shape)
    sampler = NPairSampler(labels, 5, seed=0, hard_class_mining=True, num_candidates=20, num_replicas=1, rank=0)
    per_image = torch.from_numpy(emb[np.searchsorted(sampler.classes, labels)])
    sampler.set_class_embeddings(per_image, torch.from_numpy(labels))  # averaged per class
    for batch in sampler:
        groups = {int(c >= 110) for c in labels[batch]}
        assert len(groups) == 1
    random_sampler = NPairSampler(labels, 5, seed=0, num_replicas=1, rank=0)
    assert any(len({int(c >= 110) for c in labels[b]}) == 2 for b in random_sampler)


def test_class_embeddings_are_validated():
    sampler = NPairSampler(_labels(num_classes=5, per_class=2), 2, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match="one embedding per class"):
        sampler.set_class_embeddings(torch.zeros(4, 3))
    with pytest.raises(ValueError, match="not a class"):
        sampler.set_class_embeddings(torch.zeros(2, 3), torch.tensor([100, 7]))
    with pytest.raises(ValueError, match="NaN"):
        sampler.set_class_embeddings(torch.full((5, 3), float("nan")))


def test_lightning_reaches_set_epoch_through_the_data_loader():
    """Lightning calls ``set_epoch`` on ``loader.sampler`` and ``loader.batch_sampler.sampler`` only."""
    from lightning_fabric.utilities.data import _set_sampler_epoch
    from torch.utils.data import DataLoader

    labels = _labels()
    for sampler in (
        BalancedClassSampler(labels, 4, 3, num_replicas=1, rank=0),
        NPairSampler(labels, 4, num_replicas=1, rank=0),
    ):
        loader = DataLoader(list(range(len(labels))), batch_sampler=sampler)
        first = [b.tolist() for b in loader]
        _set_sampler_epoch(loader, 3)
        assert sampler.epoch == 3
        assert [b.tolist() for b in loader] != first


def test_batches_carry_augmentation_seeds_through_pickling():
    import pickle

    labels = _labels()
    for sampler in (BalancedClassSampler(labels, 4, 3, augmentation_seed=3, num_replicas=1, rank=0),
                    NPairSampler(labels, 4, augmentation_seed=3, num_replicas=1, rank=0)):
        batches = list(sampler)
        assert all(isinstance(b, SeededBatch) and isinstance(b, list) for b in batches)
        assert [b.seed for b in batches] == [batch_seed(3, 0, step) for step in range(len(batches))]
        copy = pickle.loads(pickle.dumps(batches[1]))  # as a DataLoader worker receives it
        assert copy == batches[1] and copy.seed == batches[1].seed and type(copy) is SeededBatch
    same = BalancedClassSampler(labels, 4, 3, augmentation_seed=3, num_replicas=1, rank=0)
    other = BalancedClassSampler(labels, 4, 3, augmentation_seed=4, num_replicas=1, rank=0)
    assert list(other) == list(same)  # the augmentation seed does not change the batches...
    assert {b.seed for b in other}.isdisjoint(b.seed for b in same)  # ...only their seeds


# ------------------------------------------------------------------------------------------------ P x K contract
def _global_sequence(labels, p: int, k: int, seed: int, world: int, epoch: int = 0) -> list[list[int]]:
    """The batches of all ``world`` ranks interleaved in global order (rank r takes steps r, r + W, ...), checked
    to be each rank's own complete share."""
    ranks = []
    for r in range(world):
        sampler = BalancedClassSampler(labels, p, k, seed=seed, num_replicas=world, rank=r)
        sampler.set_epoch(epoch)
        ranks.append(list(sampler))
        assert len(ranks[-1]) == len(sampler)
    assert len({len(batches) for batches in ranks}) == 1  # every rank gets the same number of batches
    return [ranks[step % world][step // world] for step in range(world * len(ranks[0]))]


def _check_distinct(batch: list[int], labels: np.ndarray, p: int, k: int) -> None:
    """``_check_pk``, and the K items of every class group are K different items."""
    _check_pk(batch, labels, p, k)
    for start in range(0, p * k, k):
        group = batch[start : start + k]
        assert len(set(group)) == k, f"class {labels[group[0]]} repeats an item: {group}"


@pytest.mark.parametrize("world", [1, 3])
@pytest.mark.parametrize("p,k", [(4, 3), (3, 5), (7, 2)])
def test_classes_of_exactly_k_items_give_k_distinct_items(p, k, world):
    """A class with exactly K items is sampled *without* replacement: its K items, each once (the replacement rule
    is ``len(items) < K``, not ``<=``), on every rank of a DDP split and in every epoch."""
    labels = _labels(num_classes=21, per_class=k, seed=p)
    for epoch in (0, 1):
        sequence = _global_sequence(labels, p, k, seed=2, world=world, epoch=epoch)
        assert len(sequence) == max(1, len(labels) // (p * k) // world) * world
        for batch in sequence:
            _check_distinct(batch, labels, p, k)
            assert len(set(batch)) == p * k  # no item twice in a batch


@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("p", [3, 4, 6])
def test_few_classes_and_a_long_epoch_never_repeat_a_class_in_a_batch(p, world):
    """7 classes, P not dividing 7, 60-100 items per class: the queue of classes is topped up with a new permutation
    while classes of the previous one are still pending, which must not put a pending class into the batch twice.
    Over the epoch the classes stay balanced: each class is drawn once per round of all classes, so the counts of
    any two classes differ by at most one after every batch."""
    k = 2
    labels = _labels(num_classes=7, per_class=[60, 70, 80, 90, 100, 60, 70], seed=p)
    sequence = _global_sequence(labels, p, k, seed=4, world=world)
    assert len(sequence) >= 40  # about 7 rounds of all classes or more
    uses = Counter()
    for batch in sequence:
        _check_distinct(batch, labels, p, k)
        uses.update(set(labels[batch].tolist()))
        counts = [uses[c] for c in np.unique(labels)]
        assert max(counts) - min(counts) <= 1, f"class uses {counts} after {sum(counts) // p} batches"


def test_single_process_and_ddp_split_draw_the_same_global_sequence():
    labels = _labels(num_classes=7, per_class=30)
    single = _global_sequence(labels, 3, 2, seed=9, world=1)
    for world in (2, 3):
        split = _global_sequence(labels, 3, 2, seed=9, world=world)
        assert split == single[: len(split)]


def test_a_dataset_smaller_than_a_batch_still_gives_one_batch_per_process():
    labels = np.array([0, 0, 1, 1, 2])  # 5 items, P x K = 6
    for world in (1, 2):
        samplers = [BalancedClassSampler(labels, 3, 2, num_replicas=world, rank=r) for r in range(world)]
        assert [len(s) for s in samplers] == [1] * world
        batches = [list(s) for s in samplers]
        assert [len(b) for b in batches] == [1] * world
        for (batch,) in batches:
            _check_pk(batch, labels, 3, 2)
    # len = items // (P K) // processes, at least 1
    assert len(BalancedClassSampler(_labels(per_class=6), 4, 3, num_replicas=1, rank=0)) == 120 // 12
    assert len(BalancedClassSampler(_labels(per_class=6), 4, 3, num_replicas=3, rank=2)) == 120 // 12 // 3
    assert len(BalancedClassSampler(_labels(per_class=6), 4, 3, num_replicas=4, rank=0)) == 2


def test_every_epoch_reshuffles_classes_and_items():
    labels = _labels(num_classes=12, per_class=10)
    sampler = BalancedClassSampler(labels, 4, 3, seed=0, num_replicas=1, rank=0)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        epochs.append(list(sampler))
        assert list(sampler) == epochs[-1]  # the same epoch twice: the same batches
    for a in range(3):
        for b in range(a + 1, 3):
            assert [labels[x[::3]].tolist() for x in epochs[a]] != [labels[x[::3]].tolist() for x in epochs[b]]
            assert epochs[a] != epochs[b]
    # the augmentation seeds follow (epoch, global batch number)
    assert [b.seed for b in epochs[2]] == [batch_seed(sampler.augmentation_seed, 2, s) for s in range(len(sampler))]


def test_batch_seeds_are_distinct_63_bit_numbers():
    seeds = [batch_seed(a, e, b) for a in (0, 1, 2**63 + 1) for e in range(4) for b in range(50)]
    assert len(set(seeds)) == len(seeds)
    assert all(0 <= s < 2**63 for s in seeds)
    assert max(seeds) >= 2**62  # the 63 bits are used
    assert batch_seed(2**63 + 1, 0, 0) != batch_seed(1, 0, 0)  # the augmentation seed modulo 2**64, not less


# ------------------------------------------------------------------------------------------------ resume
def test_resume_state_round_trip_and_edges():
    labels = _labels()
    full = BalancedClassSampler(labels, 4, 3, seed=1, num_replicas=1, rank=0, augmentation_seed=3)
    full.set_epoch(1)
    expected = list(full)
    assert full.state_dict() == {"epoch": 1, "position": 0, "seed": 1, "num_replicas": 1, "augmentation_seed": 3}

    resumed = BalancedClassSampler(labels, 4, 3, seed=1, num_replicas=1, rank=0, augmentation_seed=4)
    resumed.load_state_dict(dict(full.state_dict(), position=2))
    # saved again before iterating (a checkpoint right after resuming): still the loaded position
    assert resumed.state_dict() == {"epoch": 1, "position": 2, "seed": 1, "num_replicas": 1, "augmentation_seed": 3}
    rest = list(resumed)
    assert rest == expected[2:] and [b.seed for b in rest] == [b.seed for b in expected[2:]]
    assert resumed.state_dict()["position"] == 0  # consumed

    # a position of a whole epoch: nothing left of that epoch; the next epoch is complete
    done = BalancedClassSampler(labels, 4, 3, seed=1, num_replicas=1, rank=0)
    done.load_state_dict({"epoch": 1, "position": len(done)})
    assert list(done) == []
    done.set_epoch(2)
    full.set_epoch(2)
    assert list(done) == list(full)

    # the loaded position applies to the loaded epoch only: moved on to the next epoch, nothing is skipped
    moved = BalancedClassSampler(labels, 4, 3, seed=1, num_replicas=1, rank=0)
    moved.load_state_dict({"epoch": 1, "position": 3})
    moved.set_epoch(2)
    assert moved.state_dict()["position"] == 0
    assert list(moved) == list(full)

    for position in (-1, len(done) + 1):
        with pytest.raises(ValueError, match="position must be in"):
            BalancedClassSampler(labels, 4, 3, seed=1, num_replicas=1, rank=0).load_state_dict(
                {"epoch": 0, "position": position}
            )
    with pytest.raises(ValueError, match="num_replicas=2"):
        BalancedClassSampler(labels, 4, 3, seed=1, num_replicas=1, rank=0).load_state_dict(
            {"epoch": 0, "position": 0, "seed": 1, "num_replicas": 2}
        )


def test_distributed_arguments_are_checked():
    with pytest.raises(ValueError, match="num_replicas must be >= 1, got 0"):
        BalancedClassSampler([0, 1], 1, 1, num_replicas=0, rank=0)
    with pytest.raises(ValueError, match=r"rank must be in \[0, 1\], got -1"):
        BalancedClassSampler([0, 1], 1, 1, num_replicas=2, rank=-1)
    last = BalancedClassSampler([0, 1, 2, 3], 1, 1, num_replicas=2, rank=1)  # the last rank is valid
    assert (last.num_replicas, last.rank) == (2, 1)
    with pytest.raises(ValueError, match=">= 1"):
        BalancedClassSampler([0, 1], 1, 0)
    with pytest.raises(ValueError, match=">= 1"):
        BalancedClassSampler([0, 1], 0, 1)
    with pytest.raises(ValueError, match="non-empty 1-d"):
        BalancedClassSampler([], 1, 1)
    with pytest.raises(ValueError, match="non-empty 1-d"):
        BalancedClassSampler([[0, 1]], 1, 1)
    every = BalancedClassSampler([0, 0, 1, 1, 2, 2], 3, 2, num_replicas=1, rank=0)  # P = the number of classes
    for batch in every:
        _check_pk(batch, np.array([0, 0, 1, 1, 2, 2]), 3, 2)


# ------------------------------------------------------------------------------------------------ N-pair contract
def test_npair_candidates_default_and_bounds():
    labels = _labels(num_classes=25, per_class=4)
    assert NPairSampler(labels, 4, num_replicas=1, rank=0).num_candidates == 16  # 4 N
    assert NPairSampler(labels, 8, num_replicas=1, rank=0).num_candidates == 25  # at most the classes
    for ok in (8, 25):  # both ends of [N, classes]
        assert NPairSampler(labels, 8, num_candidates=ok, num_replicas=1, rank=0).num_candidates == ok
    for bad in (7, 26):
        with pytest.raises(ValueError, match="num_candidates must be between"):
            NPairSampler(labels, 8, num_candidates=bad, num_replicas=1, rank=0)
    sampler = NPairSampler(labels, 8, num_replicas=1, rank=0)
    assert (sampler.samples_per_class, sampler.batch_size) == (2, 16)


@pytest.mark.parametrize("world", [1, 2])
def test_npair_mined_batches_are_distinct_classes_on_every_rank(world):
    """With mining, each batch still holds N distinct classes x 2 distinct images (every class has exactly 2 here,
    so a class is never sampled with replacement), for every rank, and the ranks share one global sequence."""
    labels = _labels(num_classes=12, per_class=2)
    emb = torch.from_numpy(np.random.default_rng(5).normal(size=(12, 4)))
    per_rank = []
    for r in range(world):
        sampler = NPairSampler(labels, 5, seed=1, hard_class_mining=True, num_replicas=world, rank=r)
        sampler.set_class_embeddings(emb)
        per_rank.append(list(sampler))
        for batch in per_rank[-1]:
            _check_distinct(batch, labels, 5, 2)
    single = NPairSampler(labels, 5, seed=1, hard_class_mining=True, num_replicas=1, rank=0)
    single.set_class_embeddings(emb)
    sequence = list(single)
    for r in range(world):
        assert per_rank[r] == sequence[r::world][: len(per_rank[r])]


def test_npair_mining_breaks_ties_at_random():
    """Identical class embeddings: every candidate ties, so the greedy choice is random among them (not always the
    first candidates in order)."""
    labels = _labels(num_classes=10, per_class=2)
    sampler = NPairSampler(labels, 3, seed=0, hard_class_mining=True, num_candidates=10, num_replicas=1, rank=0)
    sampler.set_class_embeddings(torch.ones(10, 4))
    rng = np.random.default_rng(0)
    picks = {tuple(sampler.mine_classes(rng, list(range(10)))[1:]) for _ in range(30)}
    assert len(picks) > 5
    assert all(len(set(p)) == 2 for p in picks)


def test_class_embeddings_errors_name_the_problem():
    labels = _labels(num_classes=5, per_class=2)  # classes 100..104
    sampler = NPairSampler(labels, 2, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"must be 2-d, got shape \(5,\)"):
        sampler.set_class_embeddings(torch.zeros(5))
    with pytest.raises(ValueError, match=r"labels must have shape \(3,\), got \(2,\)"):
        sampler.set_class_embeddings(torch.zeros(3, 2), torch.tensor([100, 101]))
    with pytest.raises(ValueError, match="label 1000 is not a class"):  # beyond the largest class
        sampler.set_class_embeddings(torch.zeros(2, 3), torch.tensor([100, 1000]))
    with pytest.raises(ValueError, match=r"no embedding given for classes \[102, 103, 104\]"):
        sampler.set_class_embeddings(torch.ones(2, 3), torch.tensor([100, 101]))
    with pytest.raises(ValueError, match="NaN or Inf"):
        sampler.set_class_embeddings(torch.full((5, 3), float("inf")))
    # per-image embeddings are averaged per class, in the order of sampler.classes
    images = torch.tensor(
        [[1.0, 0.0], [3.0, 0.0], [0.0, 2.0], [0.0, 4.0], [1.0, 1.0], [1.0, -1.0], [5.0, 5.0], [-1.0, 0.0], [2.0, 2.0]]
    )
    owners = torch.tensor([100, 100, 101, 101, 102, 102, 103, 104, 104])
    sampler.set_class_embeddings(images, owners)
    expected = torch.nn.functional.normalize(
        torch.tensor([[2.0, 0.0], [0.0, 3.0], [1.0, 0.0], [5.0, 5.0], [0.5, 1.0]], dtype=torch.float64), dim=1
    )
    torch.testing.assert_close(sampler.class_embeddings, expected)


# ------------------------------------------------------------------------------------------------ defaults, edges
def test_documented_defaults():
    """docs/datasets.md: ``BalancedClassSampler(..., seed=0)``, ``NPairSampler(..., seed=0, hard_class_mining=False)``;
    a ``SeededBatch`` without a seed has seed 0."""
    labels = _labels()
    assert list(BalancedClassSampler(labels, 4, 3, num_replicas=1, rank=0)) == list(
        BalancedClassSampler(labels, 4, 3, seed=0, num_replicas=1, rank=0)
    )
    default = NPairSampler(labels, 4, num_replicas=1, rank=0)
    assert default.hard_class_mining is False
    assert list(default) == list(NPairSampler(labels, 4, seed=0, hard_class_mining=False, num_replicas=1, rank=0))
    assert SeededBatch([1, 2]).seed == 0 and SeededBatch().seed == 0 and SeededBatch() == []


def test_augmentation_seeds_follow_torchs_seed_convention():
    """``torch.manual_seed(-1)`` is seed 2**64 - 1 (torch takes seeds modulo 2**64): ``batch_seed`` agrees, so a run
    seeded with a negative number gets the augmentation of its ``torch.initial_seed()``."""
    torch_seed = torch.initial_seed()
    try:
        torch.manual_seed(-1)
        assert torch.initial_seed() == 2**64 - 1
        for epoch, batch in ((0, 0), (3, 17)):
            assert batch_seed(-1, epoch, batch) == batch_seed(2**64 - 1, epoch, batch)
            assert batch_seed(-5, epoch, batch) == batch_seed(2**64 - 5, epoch, batch)
    finally:
        torch.manual_seed(torch_seed)


def test_a_state_without_position_resumes_at_the_start_of_its_epoch():
    labels = _labels()
    full = BalancedClassSampler(labels, 4, 3, seed=1, num_replicas=1, rank=0)
    full.set_epoch(2)
    sampler = BalancedClassSampler(labels, 4, 3, seed=1, num_replicas=1, rank=0)
    sampler.load_state_dict({"epoch": 2})  # only the epoch (a minimal or hand-written state)
    assert sampler.epoch == 2 and list(sampler) == list(full)


def test_eval_shard_sampler_is_an_unshuffled_distributed_sampler():
    """Lightning reads ``shuffle`` of a ``DistributedSampler`` (it warns about shuffled evaluation loaders); the
    shard is neither shuffled nor padded nor truncated."""
    sampler = EvalShardSampler(list(range(10)), num_replicas=3, rank=2)
    assert sampler.shuffle is False and sampler.drop_last is False
    assert list(sampler) == [2, 5, 8] and len(sampler) == 3


def test_class_embeddings_reject_a_single_non_finite_value():
    sampler = NPairSampler(_labels(num_classes=5, per_class=2), 2, num_replicas=1, rank=0)
    emb = torch.ones(5, 3)
    emb[3, 1] = float("nan")
    with pytest.raises(ValueError, match="NaN or Inf"):
        sampler.set_class_embeddings(emb)


def test_missing_class_embeddings_name_the_first_five():
    sampler = NPairSampler(_labels(num_classes=10, per_class=2), 2, num_replicas=1, rank=0)
    with pytest.raises(ValueError, match=r"no embedding given for classes \[102, 103, 104, 105, 106\]\.\.\."):
        sampler.set_class_embeddings(torch.ones(2, 3), torch.tensor([100, 101]))


def test_class_embeddings_without_mining_change_nothing():
    """``hard_class_mining=False``: embeddings given to the sampler (the refresh callback may do so) are not used."""
    labels = _labels(num_classes=12, per_class=2)
    plain = NPairSampler(labels, 4, seed=3, num_replicas=1, rank=0)
    given = NPairSampler(labels, 4, seed=3, num_replicas=1, rank=0)
    emb = torch.zeros(12, 2)
    emb[:6, 0], emb[6:, 1] = 1.0, 1.0
    given.set_class_embeddings(emb)
    assert list(given) == list(plain)
    mined = NPairSampler(labels, 4, seed=3, hard_class_mining=True, num_candidates=12, num_replicas=1, rank=0)
    mined.set_class_embeddings(emb)
    assert list(mined) != list(plain)


def test_npair_mining_breaks_a_tie_of_two_at_random():
    """Two candidates exactly as close to the first class: either may be chosen (not always the first listed)."""
    labels = _labels(num_classes=4, per_class=2)
    sampler = NPairSampler(labels, 2, seed=0, hard_class_mining=True, num_candidates=4, num_replicas=1, rank=0)
    sampler.set_class_embeddings(torch.tensor([[1.0, 0.0], [2.0, 1.0], [2.0, 1.0], [-1.0, 0.0]]))
    seconds = Counter()
    for seed in range(60):
        first, second = sampler.mine_classes(np.random.default_rng(seed), [0, 1, 2, 3])
        if first == 0:
            seconds[second] += 1
    assert set(seconds) == {1, 2}  # class 3 (opposite) is never chosen after class 0; 1 and 2 tie
