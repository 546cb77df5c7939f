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


# --------------------------------------------------------------------------- miner objects (pml's contract, issue 29)
# Our miners against pytorch-metric-learning 2.9's on the same inputs, as sets of tuples. Conventions: pml's default
# distance (LpDistance, normalised; MultiSimilarity: cosine) on fp64 unit vectors (pml's AngularMiner reads the raw
# embeddings, so the inputs are unit-norm); with references our gallery is the batch followed by them, so the
# reference is pml on the concatenation, restricted to the batch's anchors.
import math  # noqa: E402

from lightning_dml.losses import CircleLoss, ContrastiveLoss, LiftedStructureLoss, MultiSimilarityLoss  # noqa: E402
from lightning_dml.losses import TripletLoss  # noqa: E402
from lightning_dml.miners import (  # noqa: E402
    MINERS,
    AngularMiner,
    BatchEasyHardMiner,
    BatchHardMiner,
    DistanceWeightedMiner,
    HDCMiner,
    MultiSimilarityMiner,
    PairMarginMiner,
    TripletMarginMiner,
    UniformHistogramMiner,
    build_miner,
)
from lightning_dml.miners.distance_weighted import distance_weighted_probabilities  # noqa: E402
from lightning_dml.miners.uniform_histogram import uniform_histogram_draw  # noqa: E402


def _pml():
    return pytest.importorskip("pytorch_metric_learning.miners")


def _unit(x):
    return torch.nn.functional.normalize(x, dim=1)


def miner_batch(kind: str, seed: int = 0, classes: int = 6, per_class: int = 4, d: int = 8):
    """fp64 unit embeddings and labels: ``random``; ``clustered`` (class centres plus noise: pairs near the margins
    of a trained network); ``ties`` (exact duplicates within and across classes: equal distances)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(classes).repeat_interleave(per_class)[torch.randperm(classes * per_class, generator=g)]
    if kind == "random":
        z = torch.randn(len(y), d, generator=g, dtype=torch.float64)
    elif kind == "clustered":
        centres = _unit(torch.randn(classes, d, generator=g, dtype=torch.float64))
        z = centres[y] + 0.35 * torch.randn(len(y), d, generator=g, dtype=torch.float64)
    else:
        base = torch.randn(classes * 2, d, generator=g, dtype=torch.float64)
        z = base[torch.randint(0, classes * 2, (len(y),), generator=g)]  # duplicates, some across classes
    return _unit(z), y


def _as_set(t):
    return sorted(zip(*[x.tolist() for x in t]))


def _same_tuples(ours, theirs):
    assert len(ours) == len(theirs)
    assert all(x.dtype == torch.long for x in ours)
    if len(ours) == 3:
        assert _as_set(ours) == _as_set(theirs)
    else:
        assert _as_set(ours[:2]) == _as_set(theirs[:2])
        assert _as_set(ours[2:]) == _as_set(theirs[2:])


# (our miner, pml's miner) - the deterministic miners
DETERMINISTIC = {
    "batch_hard": (lambda: BatchHardMiner(), lambda M: M.BatchHardMiner()),
    "batch_easy_hard": (lambda: BatchEasyHardMiner(), lambda M: M.BatchEasyHardMiner()),
    "beh_hard_semihard": (
        lambda: BatchEasyHardMiner("hard", "semihard"), lambda M: M.BatchEasyHardMiner("hard", "semihard")
    ),
    "beh_semihard_easy": (
        lambda: BatchEasyHardMiner("semihard", "easy"), lambda M: M.BatchEasyHardMiner("semihard", "easy")
    ),
    "beh_all_hard": (lambda: BatchEasyHardMiner("all", "hard"), lambda M: M.BatchEasyHardMiner("all", "hard")),
    "beh_easy_all_ranges": (
        lambda: BatchEasyHardMiner("easy", "all", allowed_pos_range=(0.3, 1.2)),
        lambda M: M.BatchEasyHardMiner("easy", "all", allowed_pos_range=(0.3, 1.2)),
    ),
    **{
        f"triplet_margin_{t}": (
            (lambda t=t: TripletMarginMiner(0.2, t)), (lambda M, t=t: M.TripletMarginMiner(0.2, type_of_triplets=t))
        )
        for t in ("all", "hard", "semihard", "easy")
    },
    "pair_margin": (lambda: PairMarginMiner(0.3, 0.9), lambda M: M.PairMarginMiner(0.3, 0.9)),
    "multi_similarity": (lambda: MultiSimilarityMiner(0.1), lambda M: M.MultiSimilarityMiner(0.1)),
    "angular": (lambda: AngularMiner(35), lambda M: M.AngularMiner(35)),
    "hdc": (lambda: HDCMiner(0.3), lambda M: M.HDCMiner(0.3)),
}


@pytest.mark.parametrize("kind", ["random", "clustered", "ties"])
@pytest.mark.parametrize("name", sorted(DETERMINISTIC))
def test_miner_equals_pml_as_sets(name, kind):
    if name == "hdc" and kind == "ties":
        pytest.skip("pml's cut among exactly tied distances is torch.topk's choice: test_hdc_cut_among_ties")
    M = _pml()
    ours_f, theirs_f = DETERMINISTIC[name]
    for seed in (0, 1):
        z, y = miner_batch(kind, seed)
        ours, theirs = ours_f()(z, y), theirs_f(M)(z, y)
        _same_tuples(ours, theirs)
        assert len(ours[0]) > 0 or name.startswith("triplet_margin_hard")


@pytest.mark.parametrize("name", sorted(n for n in DETERMINISTIC if n != "hdc"))
def test_miner_with_references_is_pml_on_the_concatenation(name):
    """References are extra gallery columns after the batch (pml's ref_emb would be them alone)."""
    M = _pml()
    ours_f, theirs_f = DETERMINISTIC[name]
    z, y = miner_batch("clustered", 3, per_class=5)
    b = 18
    ours = ours_f()(z[:b], y[:b], z[b:], y[b:])
    theirs = theirs_f(M)(z, y)
    groups = [(0, 3)] if len(theirs) == 3 else [(0, 2), (2, 4)]
    keep = []
    for lo, hi in groups:
        rows = theirs[lo] < b
        keep += [t[rows] for t in theirs[lo:hi]]
    _same_tuples(ours, tuple(keep))


def test_miners_take_label_sets_where_they_only_ask_is_positive():
    z, y = miner_batch("clustered", 4)
    for name, (ours_f, _) in DETERMINISTIC.items():
        _same_tuples(ours_f()(z, y[:, None]), ours_f()(z, y))  # one label per item as [B, 1] sets
    # real label sets: a pair is positive when the sets intersect (brute force)
    g = torch.Generator().manual_seed(5)
    sets = torch.randint(-1, 5, (len(y), 2), generator=g)
    sets[:, 0] = sets[:, 0].clamp(min=0)
    a1, p, a2, n = PairMarginMiner(0.3, 0.9)(z, sets)
    d = torch.cdist(z, z)
    want_pos, want_neg = set(), set()
    for i in range(len(y)):
        for j in range(len(y)):
            share = bool(set(sets[i][sets[i] >= 0].tolist()) & set(sets[j][sets[j] >= 0].tolist()))
            if i != j and share and d[i, j] > 0.3:
                want_pos.add((i, j))
            if i != j and not share and d[i, j] < 0.9:
                want_neg.add((i, j))
    assert set(zip(a1.tolist(), p.tolist())) == want_pos and set(zip(a2.tolist(), n.tolist())) == want_neg


def test_degenerate_batches_give_empty_long_tuples():
    z = _unit(torch.randn(6, 4, dtype=torch.float64))
    for name, cls in MINERS.items():
        miner = cls()
        for labels in (torch.zeros(6, dtype=torch.long), torch.arange(6), None):  # one class, singletons, identical
            emb = z if labels is not None else z[:1].expand(6, 4).contiguous()
            labels = labels if labels is not None else torch.tensor([0, 0, 1, 1, 2, 2])
            out = miner(emb, labels)
            assert len(out) == (3 if miner.output == "triplets" else 4), name
            assert all(t.dtype == torch.long and t.ndim == 1 for t in out), name
        one_class = miner(z, torch.zeros(6, dtype=torch.long))
        if miner.output == "triplets":
            assert one_class[0].numel() == 0, name  # no negative: no triplet
        else:
            assert one_class[2].numel() == 0, name


def test_miner_bad_input_is_one_clear_error():
    z, y = miner_batch("random")
    with pytest.raises(ValueError, match=r"BatchHardMiner: labels"):
        BatchHardMiner()(z, y[:-1])
    with pytest.raises(ValueError, match=r"TripletMarginMiner: embeddings"):
        TripletMarginMiner()(z.clone().fill_(float("nan")), y)
    with pytest.raises(ValueError, match="ref_emb and ref_labels must be given together"):
        PairMarginMiner()(z, y, z)
    with pytest.raises(ValueError, match="type_of_triplets"):
        TripletMarginMiner(type_of_triplets="semi")
    with pytest.raises(ValueError, match="both be"):
        BatchEasyHardMiner("semihard", "semihard")
    with pytest.raises(ValueError, match=r"unknown miner 'batch_hardd'.*Did you mean 'batch_hard'"):
        build_miner("batch_hardd")


def test_uniform_histogram_draws_per_bin_as_pml_bins():
    """Random: the deterministic parts - ``per_bin`` draws from each non-empty bin of pml's histogram (its
    ``filter_by_bin`` bins), every drawn pair of the right kind, repeatable with ``seed`` - and uniform draws within
    a bin (frequencies of many draws)."""
    M = _pml()
    z, y = miner_batch("clustered", 6)
    miner = UniformHistogramMiner(num_bins=7, pos_per_bin=3, neg_per_bin=4, seed=1)
    a1, p, a2, n = miner(z, y)
    d = torch.cdist(z, z)
    assert (y[a1] == y[p]).all() and (a1 != p).all() and (y[a2] != y[n]).all()
    ref = M.UniformHistogramMiner(num_bins=7)
    for anchors, others, per_bin, same in ((a1, p, 3, True), (a2, n, 4, False)):
        mask = (y[:, None] == y[None, :]) if same else (y[:, None] != y[None, :])
        mask.fill_diagonal_(False)
        values = d[mask]
        bins = ref.get_bins(values)
        drawn = d[anchors, others]
        for i in range(7):
            hi = drawn <= bins[i + 1] if i == 6 else drawn < bins[i + 1]
            in_bin = ((values >= bins[i]) & ((values <= bins[i + 1]) if i == 6 else (values < bins[i + 1]))).sum()
            assert int(((drawn >= bins[i]) & hi).sum()) == (per_bin if in_bin > 0 else 0)
    again = UniformHistogramMiner(num_bins=7, pos_per_bin=3, neg_per_bin=4, seed=1)(z, y)
    assert all(torch.equal(u, v) for u, v in zip(again, (a1, p, a2, n)))
    # uniform within a bin: one bin of 5 values, 20000 draws
    values = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 2.0], dtype=torch.float64)
    idx = uniform_histogram_draw(values, 2, 20000, torch.Generator().manual_seed(0))
    counts = torch.bincount(idx, minlength=7).double()
    assert counts[0] == 20000  # bin [0, 1) holds 0.0 alone
    assert counts[1:].sum() == 20000 and (counts[1:] / 20000 - 1 / 6).abs().max() < 0.02  # bin [1, 2]: six values


def test_distance_weighted_negatives_follow_pmls_distribution(monkeypatch):
    """Random: pml's per-anchor negative probabilities (the ``weights`` its DistanceWeightedMiner hands to
    ``get_random_triplet_indices``, captured) equal ours where pml's are defined; our triplets are every positive
    pair once (pml draws positives at random) with a negative drawn from that distribution."""
    M = _pml()
    import pytorch_metric_learning.miners.distance_weighted_miner as dwm

    captured = {}

    def capture(labels, ref_labels=None, t_per_anchor=None, weights=None):
        captured["w"] = weights
        e = torch.zeros(0, dtype=torch.long)
        return e, e, e

    monkeypatch.setattr(dwm.lmu, "get_random_triplet_indices", capture)
    z, y = miner_batch("clustered", 7, d=16)
    M.DistanceWeightedMiner(cutoff=0.5, nonzero_loss_cutoff=1.4)(z, y)
    w = captured["w"]
    defined = w.sum(dim=1) > 0
    assert defined.sum() >= len(y) // 2
    d = torch.sqrt((2 - 2 * (z @ z.T)).clamp(min=1e-12))
    ours = distance_weighted_probabilities(d, y, dim=16, cutoff=0.5, nonzero_loss_cutoff=1.4)
    torch.testing.assert_close(ours[defined], w[defined], rtol=1e-9, atol=1e-12)
    a, p, n = DistanceWeightedMiner(seed=3)(z, y)
    positives = (y[:, None] == y[None, :]) & ~torch.eye(len(y), dtype=torch.bool)
    assert _as_set((a, p)) == sorted(map(tuple, positives.nonzero().tolist()))
    assert (y[a] != y[n]).all() and (ours[a, n] > 0).all()
    again = DistanceWeightedMiner(seed=3)(z, y)
    assert torch.equal(again[2], n)


@pytest.mark.parametrize("percentage", [0.3, 0.5, 1.0])
def test_hdc_cut_among_ties_keeps_the_first_pairs(percentage):
    """HDC on exact ties: the k hardest pairs by a stable sort (the tied pairs first in row-major order)."""
    z, y = miner_batch("ties", 2)
    a1, p, a2, n = HDCMiner(percentage)(z, y)
    d = torch.sqrt((2 - 2 * (z @ z.T)).clamp(min=1e-12))
    pos = (y[:, None] == y[None, :]) & ~torch.eye(len(y), dtype=torch.bool)
    neg = y[:, None] != y[None, :]
    for mask, got, largest in ((pos, (a1, p), True), (neg, (a2, n), False)):
        rows, cols = mask.nonzero(as_tuple=True)
        values = d[rows, cols]
        assert len(values.unique()) < len(values)  # there are ties
        k = math.ceil(percentage * len(values))
        order = torch.sort(values, descending=largest, stable=True).indices[:k]
        assert _as_set(got) == _as_set((rows[order], cols[order]))
