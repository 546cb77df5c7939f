"""Miners (:mod:`lightning_dml.miners`) at their edges: exact ties of the multi-similarity rule, the distance
weighted sampler's clip near 2, its ``dim`` range, its negatives exactly at the non-zero-loss cutoff, large
dimensions (weights over hundreds of e-folds), reference columns, label sets with one positive each and no anchors.

(The file is named ``test_losses_*`` so that ``tools/mutants.py`` runs it against the miners and the losses.)
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dml.miners import distance_weighted_log_weights, distance_weighted_sampling
from lightning_dml.miners.mining import multi_similarity_mining


def test_multi_similarity_rule_is_strict_at_its_ties():
    """MS Eqs. 11-12: a negative is kept if ``S > min_P S - eps`` and a positive if ``S < max_N S + eps``, both
    strict: pairs exactly at the bound are dropped. Values are exact binary fractions."""
    sim = torch.tensor([[1.0, 0.5, 0.25, 0.375, 0.125]])
    pos = torch.tensor([[False, True, False, False, False]])
    neg = torch.tensor([[False, False, True, True, True]])
    # hardest positive 0.5, eps 0.25: a negative at exactly 0.25 is dropped, 0.375 kept
    keep_pos, keep_neg = multi_similarity_mining(sim, pos, neg, 0.25)
    assert keep_neg.tolist() == [[False, False, False, True, False]]
    # hardest negative 0.375, eps 0.125: the positive at exactly 0.5 is dropped
    keep_pos, _ = multi_similarity_mining(sim, pos, neg, 0.125)
    assert not keep_pos.any()
    keep_pos, _ = multi_similarity_mining(sim, pos, neg, 0.25)
    assert keep_pos.tolist() == pos.tolist()


@pytest.mark.parametrize("dim", [4, 128])
def test_log_weights_are_clipped_just_under_two(dim):
    """Opposite points (distance exactly 2, or above by rounding) get the finite weight of the clip, as the
    authors' code (``1 - d^2 / 4`` would be 0 or negative)."""
    d = torch.tensor([2.0, 2.0 + 1e-6, 1.9999], dtype=torch.float64)
    w = distance_weighted_log_weights(d, dim)
    assert torch.isfinite(w).all()
    assert w[0] == w[1] and abs(float(w[0] - w[2])) < 1e-6 * max(1.0, abs(float(w[2])))


def test_dim_must_be_at_least_one():
    dist = torch.tensor([[0.0, 1.0, 1.2], [1.0, 0.0, 1.3], [1.2, 1.3, 0.0]])
    y = torch.tensor([0, 0, 1])
    a, p, n = distance_weighted_sampling(dist, y, dim=1, generator=torch.Generator().manual_seed(0))
    assert a.tolist() == [0, 1] and p.tolist() == [1, 0] and n.tolist() == [2, 2]
    for bad in (0, -1, None):
        with pytest.raises(ValueError, match="dim"):
            distance_weighted_sampling(dist, y, dim=bad)


def test_negatives_exactly_at_the_cutoff_are_not_near():
    """``nonzero_loss_cutoff`` keeps the negatives *closer* than it: with one negative exactly at 1.4 and one
    beyond, neither is near, so the anchor draws from both (inverse-density weights, both positive)."""
    dist = torch.tensor([[0.0, 0.5, 1.4, 1.6], [0.5, 0.0, 1.4, 1.6]], dtype=torch.float64)
    y, gy = torch.tensor([0, 0]), torch.tensor([0, 0, 1, 2])
    g = torch.Generator().manual_seed(0)
    drawn = set()
    for _ in range(200):
        _, _, n = distance_weighted_sampling(dist, y, gy, dim=3, generator=g)
        drawn.update(n.tolist())
    assert drawn == {2, 3}


def test_large_dimensions_draw_the_heaviest_negative_without_overflow():
    """``dim = 512``: the inverse density spans hundreds of e-folds between distances 0.5 and 1.39 (fp32 weights
    overflow unless shifted by each row's largest): the heaviest negative, the closest, is drawn every time."""
    g = torch.Generator().manual_seed(1)
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    dist = torch.full((6, 6), 1.39)
    dist.fill_diagonal_(0.0)
    closest = {0: 2, 1: 4, 2: 0, 3: 5, 4: 1, 5: 3}
    for a, n in closest.items():
        dist[a, n] = 0.5 + 0.01 * a
    for _ in range(20):
        anchors, _, negatives = distance_weighted_sampling(dist, y, dim=512, generator=g)
        assert [closest[int(a)] for a in anchors] == negatives.tolist()


def test_reference_columns_are_negatives_too():
    """A gallery longer than the batch (references): each anchor's negatives are read along its own row."""
    dist = torch.tensor([[0.0, 0.6, 1.0, 1.1, 0.9], [0.6, 0.0, 1.2, 0.8, 1.3]])
    y, gy = torch.tensor([0, 0]), torch.tensor([0, 0, 1, 2, 0])
    g = torch.Generator().manual_seed(2)
    for _ in range(20):
        a, p, n = distance_weighted_sampling(dist, y, gy, dim=8, generator=g)
        assert sorted(zip(a.tolist(), p.tolist())) == [(0, 1), (0, 4), (1, 0), (1, 4)]
        assert set(n.tolist()) <= {2, 3}


def test_label_sets_with_one_positive_each_give_their_triplets():
    """Label sets where every anchor has exactly one positive (the positive table is one column wide)."""
    labels = torch.tensor([[0, 5], [5, -1], [1, -1], [1, 7]])
    dist = torch.tensor([[0.0, 0.5, 1.0, 1.2], [0.5, 0.0, 1.1, 0.9], [1.0, 1.1, 0.0, 0.4], [1.2, 0.9, 0.4, 0.0]])
    a, p, n = distance_weighted_sampling(dist, labels, dim=8, generator=torch.Generator().manual_seed(3))
    assert sorted(zip(a.tolist(), p.tolist())) == [(0, 1), (1, 0), (2, 3), (3, 2)]
    for anchor, negative in zip(a.tolist(), n.tolist()):
        assert not set(labels[anchor].tolist()) & set(labels[negative].tolist()) - {-1}


def test_no_anchors_no_triplets():
    dist = torch.zeros(0, 3)
    a, p, n = distance_weighted_sampling(dist, torch.zeros(0, dtype=torch.long), torch.tensor([0, 1, 1]), dim=4)
    assert a.numel() == p.numel() == n.numel() == 0 and a.dtype == torch.long


def test_log_weights_follow_eq_3():
    """``log q(d)^-1 = (2 - n) log d - (n - 3) / 2 log(1 - d^2 / 4)`` (Sampling-Matters Eq. 3) above the cutoff."""
    d = torch.tensor([0.7, 1.0, 1.5], dtype=torch.float64)
    n = 16
    want = torch.tensor([(2 - n) * math.log(v) - (n - 3) / 2 * math.log(1 - v * v / 4) for v in d.tolist()],
                        dtype=torch.float64)
    torch.testing.assert_close(distance_weighted_log_weights(d, n), want, rtol=1e-12, atol=1e-12)
