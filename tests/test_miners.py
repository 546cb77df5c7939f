"""The public mining functions against brute-force loops over the papers' rules."""

import pytest
import torch

from lightning_dml.miners import (
    batch_hard_mining,
    label_masks,
    multi_similarity_mining,
    positive_index,
    positive_pairs,
    self_pair_mask,
    threshold_mining,
    triplet_margin_mining,
    triplet_margin_pair_mining,
)


def _data(seed=0, b=14, m=5, classes=4):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (b,), generator=g)
    ry = torch.randint(0, classes + 1, (m,), generator=g)
    f = torch.nn.functional.normalize(torch.randn(b + m, 6, generator=g), dim=1)
    sim = f[:b] @ f.T
    return sim, torch.sqrt((2 - 2 * sim).clamp(min=1e-12)), y, torch.cat([y, ry])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_label_masks_and_positive_lists(seed):
    _, _, y, gy = _data(seed)
    pos, neg = label_masks(y, gy)
    B, N = len(y), len(gy)
    for i in range(B):
        for j in range(N):
            assert bool(pos[i, j]) == (j != i and int(y[i]) == int(gy[j]))
            assert bool(neg[i, j]) == (int(y[i]) != int(gy[j]))
    rows, cols = positive_pairs(y, gy)
    assert sorted(zip(rows.tolist(), cols.tolist())) == sorted(map(tuple, pos.nonzero().tolist()))
    index, valid = positive_index(pos)
    for i in range(B):
        assert sorted(index[i][valid[i]].tolist()) == pos[i].nonzero().flatten().tolist()
    assert self_pair_mask(3, 5)[:, :3].equal(torch.eye(3, dtype=torch.bool))


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("strict", [False, True])
def test_threshold_mining(seed, strict):
    _, D, y, gy = _data(seed)
    pos, neg = label_masks(y, gy)
    kp, kn = threshold_mining(D, pos, neg, 1.2, 1.3, strict=strict)
    for i in range(len(y)):
        for j in range(len(gy)):
            d = float(D[i, j])
            assert bool(kp[i, j]) == (bool(pos[i, j]) and (d > 1.2 if strict else d >= 1.2))
            assert bool(kn[i, j]) == (bool(neg[i, j]) and (d < 1.3 if strict else d <= 1.3))


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_multi_similarity_mining_is_ms_eqs_11_12(seed):
    S, _, y, gy = _data(seed)
    pos, neg = label_masks(y, gy)
    kp, kn = multi_similarity_mining(S, pos, neg, 0.1)
    for i in range(len(y)):
        P = [j for j in range(len(gy)) if pos[i, j]]
        N = [j for j in range(len(gy)) if neg[i, j]]
        for j in P:
            assert bool(kp[i, j]) == (bool(N) and float(S[i, j]) < max(float(S[i, k]) for k in N) + 0.1)
        for j in N:
            assert bool(kn[i, j]) == (bool(P) and float(S[i, j]) > min(float(S[i, k]) for k in P) - 0.1)
    assert not (kp & ~pos).any() and not (kn & ~neg).any()


@pytest.mark.parametrize("seed", [0, 1])
def test_triplet_margin_mining_is_gpw_eq_19(seed):
    _, D, y, gy = _data(seed)
    pos, neg = label_masks(y, gy)
    index, valid, keep = triplet_margin_mining(D, pos, neg, 0.1)
    mined = set()
    for i in range(len(y)):
        for r in range(index.shape[1]):
            for k in range(len(gy)):
                if keep[i, r, k]:
                    mined.add((i, int(index[i, r]), k))
    expected = {(i, j, k) for i in range(len(y)) for j in range(len(gy)) for k in range(len(gy))
                if pos[i, j] and neg[i, k] and float(D[i, j]) + 0.1 >= float(D[i, k])}
    assert mined == expected
    kp, kn = triplet_margin_pair_mining(D, pos, neg, 0.1)
    assert set(map(tuple, kp.nonzero().tolist())) == {(i, j) for i, j, _ in expected}
    assert set(map(tuple, kn.nonzero().tolist())) == {(i, k) for i, _, k in expected}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batch_hard_mining_is_gpw_eq_20(seed):
    _, D, y, gy = _data(seed)
    pos, neg = label_masks(y, gy)
    hp, hn = batch_hard_mining(D, pos, neg)
    for i in range(len(y)):
        P = [j for j in range(len(gy)) if pos[i, j]]
        N = [j for j in range(len(gy)) if neg[i, j]]
        assert hp[i].sum() == (1 if P else 0) and hn[i].sum() == (1 if N else 0)
        if P:
            assert float(D[i][hp[i]]) == max(float(D[i, j]) for j in P)
        if N:
            assert float(D[i][hn[i]]) == min(float(D[i, k]) for k in N)  # closest negative ([R] correction)


# ------------------------------------------------------------------------------------------------ exact ties, edges
def test_threshold_and_triplet_margin_rules_keep_exact_ties():
    """GPW Eqs. 16-17 and 19 are inclusive: a positive at exactly ``m1``, a negative at exactly ``m2``, a positive
    exactly ``margin`` closer than the hardest negative are kept (the strict RLL form drops them). The distances are
    exact binary fractions."""
    dist = torch.tensor([[0.0, 0.25, 0.5, 0.75], [0.25, 0.0, 0.75, 0.5]])
    pos = torch.tensor([[False, True, False, False], [True, False, False, False]])
    neg = torch.tensor([[False, False, True, True], [False, False, True, True]])
    kp, kn = threshold_mining(dist, pos, neg, 0.25, 0.5)
    assert kp.tolist() == pos.tolist() and kn.tolist() == [[False, False, True, False], [False, False, False, True]]
    kp, kn = threshold_mining(dist, pos, neg, 0.25, 0.5, strict=True)
    assert not kp.any() and not kn.any()
    # anchor 0: D_pos = 0.25, hardest negative 0.5: kept at margin 0.25 (0.25 + 0.25 >= 0.5), the 0.75 negative is
    # within 0.25 + margin only for margin >= 0.5
    kp, kn = triplet_margin_pair_mining(dist, pos, neg, 0.25)
    assert kp[0].tolist() == [False, True, False, False]
    assert kn[0].tolist() == [False, False, True, False]
    kp, kn = triplet_margin_pair_mining(dist, pos, neg, 0.125)
    assert not kp[0].any()


def test_positive_index_pads_with_zero_and_positive_pairs_of_an_empty_batch():
    pos = torch.tensor([[False, True, True, False], [False, False, False, False], [True, False, False, True]])
    index, valid = positive_index(pos)
    assert index.tolist() == [[1, 2], [0, 0], [0, 3]]  # padding: column 0, never read where valid is False
    assert valid.tolist() == [[True, True], [False, False], [True, True]]
    empty = torch.zeros(0, dtype=torch.long)
    rows, cols = positive_pairs(empty)
    assert rows.numel() == 0 and cols.numel() == 0
    rows, cols = positive_pairs(empty, torch.tensor([3, 3]))  # anchors none, gallery two
    assert rows.numel() == 0 and cols.numel() == 0
