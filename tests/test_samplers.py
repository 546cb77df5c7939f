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
