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
