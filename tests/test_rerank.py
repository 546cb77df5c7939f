"""Re-ranking (lightning_dml/index/rerank.py) against slow loop references written from the papers' equations:
k-reciprocal re-ranking (Zhong et al., CVPR 2017, Eqs. 1-12), alpha-QE and DBA (Radenovic et al., TPAMI 2019)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_dml.index import rerank as R
from lightning_dml.metrics import functional as MF


# --------------------------------------------------------------------------------------------- references
def ref_k_reciprocal(dist: list[list[float]], k1: int, k2: int, lam: float) -> list[float]:
    """d*(p, g) for the probe (item 0) against items 1..n-1 of one universe, one set at a time (Zhong et al.)."""
    n = len(dist)
    # the item itself first (also among identical copies), then distance, ties by position
    order = [sorted(range(n), key=lambda j, i=i: (j != i, dist[i][j], j)) for i in range(n)]

    def nbhd(i: int, k: int) -> set[int]:  # Eq. 2, the item itself included (k + 1 items)
        return set(order[i][: k + 1])

    def recip(i: int, k: int) -> set[int]:  # Eq. 3
        return {j for j in nbhd(i, k) if i in nbhd(j, k)}

    half = round(k1 / 2)
    v = [[0.0] * n for _ in range(n)]
    for i in range(n):
        r = recip(i, k1)
        r_star = set(r)
        for q in r:  # Eq. 4
            rq = recip(q, half)
            if len(r & rq) >= 2 / 3 * len(rq):
                r_star |= rq
        for j in r_star:  # Eq. 9
            v[i][j] = math.exp(-dist[i][j])
    if k2 > 1:  # Eq. 11
        v = [[sum(v[t][j] for t in order[i][:k2]) / len(order[i][:k2]) for j in range(n)] for i in range(n)]
    out = []
    for g in range(1, n):
        num = sum(min(v[0][j], v[g][j]) for j in range(n))  # Eqs. 8, 10
        den = sum(max(v[0][j], v[g][j]) for j in range(n))
        d_j = 1 - num / den
        out.append((1 - lam) * d_j + lam * dist[0][g])  # Eq. 12
    return out


def ref_alpha_expand(
    x: torch.Tensor, db: torch.Tensor, n: int, alpha: float, exclude: int | None = None
) -> torch.Tensor:
    """x replaced by normalize(x + sum_{top n of db} sim^alpha d_i), one vector (Radenovic et al.)."""
    x = F.normalize(x.double(), dim=0)
    dbn = F.normalize(db.double(), dim=1)
    sims = [(float(dbn[j] @ x), j) for j in range(db.shape[0]) if j != exclude]
    top = sorted(sims, key=lambda t: (-round(t[0], 12), t[1]))[:n]  # ties (to rounding): smaller id
    out = x.clone()
    for s, j in top:
        out = out + max(s, 0.0) ** alpha * dbn[j]
    return F.normalize(out, dim=0)


def brute_search(gallery: torch.Tensor):
    """An exact cosine index: scores best first, ties by smaller id, -1 padding past the gallery; its vectors are
    stored L2-normalised, as an ``EmbeddingIndex`` stores them."""
    g = F.normalize(gallery.double(), dim=1)

    def search(q: torch.Tensor, k: int):
        s = F.normalize(q.double(), dim=1) @ g.T
        order = torch.sort(-torch.round(s, decimals=12), dim=1, stable=True).indices[:, :k]  # ties: smaller id
        sc, ids = s.gather(1, order), order
        if k > g.shape[0]:
            pad = k - g.shape[0]
            sc = torch.cat([sc, torch.full((q.shape[0], pad), float("-inf"), dtype=sc.dtype)], 1)
            ids = torch.cat([ids, torch.full((q.shape[0], pad), -1)], 1)
        return sc, ids

    return search, (lambda ids: g[ids])


def clustered(n: int, d: int, classes: int, seed: int, noise: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(classes, d, generator=gen)
    labels = torch.arange(n) % classes
    return centres[labels] + noise * torch.randn(n, d, generator=gen), labels


def tied(n: int, d: int, seed: int) -> torch.Tensor:
    """Vectors on a coarse integer grid with duplicates: many equal distances."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(-1, 2, (n, d), generator=gen).double()
    x[x.abs().sum(1) == 0, 0] = 1.0
    x[3] = x[1]  # an exact duplicate
    return x


def copies(n: int, d: int, seed: int, count: int = 6) -> torch.Tensor:
    """Random vectors whose items 0 (the probe), 2, 5, 6, 9, 11 are identical: more identical copies than a small k1
    keeps (each item must still be in its own neighbour set, Eq. 2)."""
    x = torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).double()
    x[[2, 5, 6, 9, 11][: count - 1]] = x[0].clone()
    return x


DATA = {
    "random": lambda: torch.randn(14, 5, generator=torch.Generator().manual_seed(0)).double(),
    "clustered": lambda: clustered(14, 5, 3, seed=1)[0].double(),
    "ties": lambda: tied(14, 3, seed=2),
    "copies": lambda: copies(14, 4, seed=3),
}


# --------------------------------------------------------------------------------------------- k-reciprocal
@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize("k1,k2,lam", [(20, 6, 0.3), (3, 2, 0.3), (4, 1, 0.0), (5, 3, 0.7), (2, 4, 1.0)])
def test_k_reciprocal_distance_matches_reference(data, k1, k2, lam):
    x = DATA[data]()
    dist = R.squared_distances(x)
    got = R.k_reciprocal_distance(dist.unsqueeze(0), k1=k1, k2=k2, lambda_=lam)[0]
    want = torch.tensor(ref_k_reciprocal(dist.tolist(), k1, k2, lam), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


@pytest.mark.parametrize("data", list(DATA))
def test_k_reciprocal_distance_universe_smaller_than_k(data):
    """A universe of 5 items with k1=20, k2=6: every neighbour set is the whole universe, padded or not."""
    dist = R.squared_distances(DATA[data]()[:5])
    want = torch.tensor(ref_k_reciprocal(dist.tolist(), 20, 6, 0.3), dtype=torch.float64)
    padded = torch.zeros(9, 9, dtype=torch.float64)
    padded[:5, :5] = dist
    valid = torch.arange(9) < 5
    for d, v in ((dist, None), (padded, valid.unsqueeze(0))):
        got = R.k_reciprocal_distance(d.unsqueeze(0), v, k1=20, k2=6, lambda_=0.3)[0, :4]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_k_reciprocal_distance_is_not_plain_distance():
    """Guard against a reference and an implementation that both degenerate to d: the Jaccard part matters."""
    x = DATA["clustered"]()
    dist = R.squared_distances(x)
    got = R.k_reciprocal_distance(dist.unsqueeze(0), k1=3, k2=2, lambda_=0.3)[0]
    assert not torch.allclose(got, 0.3 * dist[0, 1:], atol=1e-3)
    assert ((got >= 0.3 * dist[0, 1:] - 1e-12) & (got <= 0.7 + 0.3 * dist[0, 1:] + 1e-12)).all()


@pytest.mark.parametrize("data", list(DATA))
def test_k_reciprocal_padding_is_ignored(data):
    """A universe padded with invalid items (a query with fewer candidates) gives the unpadded values."""
    x = DATA[data]()
    dist = R.squared_distances(x)
    m = dist.shape[0]
    padded = torch.full((m + 3, m + 3), 7.0, dtype=torch.float64)
    padded[:m, :m] = dist
    valid = torch.zeros(m + 3, dtype=torch.bool)
    valid[:m] = True
    got = R.k_reciprocal_distance(padded.unsqueeze(0), valid.unsqueeze(0), k1=20, k2=6, lambda_=0.3)[0]
    want = R.k_reciprocal_distance(dist.unsqueeze(0), k1=20, k2=6, lambda_=0.3)[0]
    torch.testing.assert_close(got[: m - 1], want, rtol=0, atol=1e-12)
    assert torch.isinf(got[m - 1 :]).all()


@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_k_reciprocal_rerank_full_candidate_set_matches_reference(data, metric, device):
    """With every gallery item a candidate, the batched re-ranking equals the paper's full-gallery formulation:
    each query's universe {p} ∪ G, ranked by d* then id."""
    x = DATA[data]()
    queries, gallery = x[:4], x[4:]
    # the candidates as an index stores them (normalised for cosine); the raw queries become the same form
    stored = F.normalize(gallery, dim=1) if metric == "cosine" else gallery
    ng = gallery.shape[0]
    # candidates in a scrambled order: the result must not depend on it
    perm = torch.randperm(ng, generator=torch.Generator().manual_seed(5))
    ids = perm.unsqueeze(0).repeat(4, 1)
    scores, got_ids = R.k_reciprocal_rerank(
        queries.to(device), stored[ids].to(device), ids.to(device), k=ng, k1=5, k2=3, lambda_=0.3, metric=metric
    )
    assert scores.device.type == device.type
    for qi in range(4):
        u = torch.cat([queries[qi : qi + 1], gallery])
        if metric == "cosine":  # stored form, then the float64 normalisation of both
            u = F.normalize(F.normalize(u, dim=1), dim=1)
        d_star = ref_k_reciprocal(R.squared_distances(u).tolist(), 5, 3, 0.3)
        got = got_ids[qi].tolist()
        assert sorted(got) == list(range(ng))
        # ordered by the reference's d*; items whose d* are equal in exact arithmetic (identical copies) differ
        # in the last bits of either computation, so their relative order is not checked
        keys = [round(d_star[g], 9) for g in got]
        assert keys == sorted(keys), (got, keys)
        want_scores = [(1 - d_star[g] / 2) if metric == "cosine" else -d_star[g] for g in got]
        torch.testing.assert_close(scores[qi].cpu(), torch.tensor(want_scores, dtype=torch.float64), rtol=0, atol=1e-9)
        if data != "copies":  # no exact ties of d*: the order is the reference's, ties by the smaller id
            assert got == sorted(range(ng), key=lambda g: (round(d_star[g], 9), g))


def test_k_reciprocal_rerank_lambda_one_keeps_the_original_order_and_scores():
    x = clustered(30, 6, 4, seed=3)[0].double()  # a float64 "index": the queries are normalised in float64 too
    search, vectors = brute_search(x[5:])
    s0, i0 = search(x[:5], 25)
    s1, i1 = R.KReciprocal(lambda_=1.0, candidates=25).search(search, vectors, x[:5], 10)
    assert torch.equal(i1, i0[:, :10])
    torch.testing.assert_close(s1, s0[:, :10], rtol=0, atol=1e-12)


def test_k_reciprocal_rerank_independent_of_batching_and_block(monkeypatch):
    x, _ = clustered(60, 6, 5, seed=4)
    search, vectors = brute_search(x[10:])
    rr = R.KReciprocal(k1=6, k2=3, candidates=30)
    s_all, i_all = rr.search(search, vectors, x[:10], 8)
    monkeypatch.setattr(R, "QUERY_BLOCK", 3)
    for q in range(10):
        s, i = rr.search(search, vectors, x[q : q + 1], 8)
        assert torch.equal(i[0], i_all[q])
        torch.testing.assert_close(s[0], s_all[q], rtol=0, atol=0)


def test_k_reciprocal_rerank_pads_small_candidate_sets():
    """Fewer gallery items than candidates: -1 padding from the index is kept out of every set."""
    x, _ = clustered(12, 4, 3, seed=6)
    search, vectors = brute_search(x[4:])  # 8 gallery items
    s, i = R.KReciprocal(k1=4, k2=2, candidates=12).search(search, vectors, x[:4], 10)
    assert (i[:, 8:] == -1).all() and torch.isinf(s[:, 8:]).all()
    assert sorted(i[0, :8].tolist()) == list(range(8))
    s_full, i_full = R.KReciprocal(k1=4, k2=2, candidates=8).search(search, vectors, x[:4], 8)
    assert torch.equal(i[:, :8], i_full)
    torch.testing.assert_close(s[:, :8], s_full, rtol=0, atol=1e-12)


def test_k_reciprocal_improves_clustered_retrieval():
    """On clustered data with label noise in the ranking, re-ranking does not make Recall@1 worse and changes
    the lists (so the option is not a no-op)."""
    x, y = clustered(120, 8, 6, seed=7, noise=0.9)
    base = R.rerank_metrics(None, x, y, recall_at=(1,))
    rr = R.rerank_metrics(R.KReciprocal(k1=10, k2=3, candidates=40), x, y, recall_at=(1,))
    assert rr["map@r"] > base["map@r"]


# --------------------------------------------------------------------------------------------- alpha-QE, DBA
@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize("alpha,n", [(3.0, 2), (0.0, 3), (1.5, 1)])
def test_alpha_query_expansion_matches_reference(data, alpha, n):
    x = DATA[data]()
    queries, gallery = x[:4], x[4:]
    search, vectors = brute_search(gallery)
    scores, ids = R.AlphaQueryExpansion(alpha=alpha, n=n).search(search, vectors, queries, 6)
    for qi in range(4):
        qe = ref_alpha_expand(queries[qi], gallery, n, alpha)
        sims = F.normalize(gallery, dim=1) @ qe
        want = sorted(range(gallery.shape[0]), key=lambda j: (-round(float(sims[j]), 12), j))[:6]
        assert ids[qi].tolist() == want
        torch.testing.assert_close(scores[qi], sims[want], rtol=0, atol=1e-12)


@pytest.mark.parametrize("data", list(DATA))
@pytest.mark.parametrize("alpha,n", [(3.0, 2), (0.0, 1)])
def test_database_side_augmentation_matches_reference(data, alpha, n):
    """DBA over every gallery item (candidates >= gallery size) is the paper's: each database vector augmented
    by its top n neighbours (itself excluded), queries scored against the augmented database."""
    x = DATA[data]()
    queries, gallery = x[:4], x[4:]
    ng = gallery.shape[0]
    search, vectors = brute_search(gallery)
    scores, ids = R.DatabaseSideAugmentation(alpha=alpha, n=n, candidates=ng).search(search, vectors, queries, ng)
    aug = torch.stack([ref_alpha_expand(gallery[j], gallery, n, alpha, exclude=j) for j in range(ng)])
    for qi in range(4):
        sims = aug @ F.normalize(queries[qi].double(), dim=0)
        want = sorted(range(ng), key=lambda j: (-round(float(sims[j]), 12), j))
        assert ids[qi].tolist() == want
        torch.testing.assert_close(scores[qi], sims[want], rtol=0, atol=1e-12)


def test_alpha_weighted_average_masks_padding_even_at_alpha_zero():
    q = torch.tensor([[1.0, 0.0]])
    nb = torch.tensor([[[0.0, 1.0], [1.0, 1.0]]])
    out = R.alpha_weighted_average(q, nb, torch.tensor([[0.5, 0.9]]), alpha=0.0, valid=torch.tensor([[False, True]]))
    want = F.normalize(torch.tensor([1.0, 0.0]).double() + F.normalize(torch.tensor([1.0, 1.0]).double(), dim=0), dim=0)
    torch.testing.assert_close(out[0], want)


def test_aqe_and_dba_need_cosine():
    search, vectors = brute_search(torch.randn(5, 3))
    for rr in (R.AlphaQueryExpansion(), R.DatabaseSideAugmentation()):
        with pytest.raises(R.RerankOptionError, match="cosine"):
            rr.search(search, vectors, torch.randn(2, 3), 3, metric="euclidean")


# --------------------------------------------------------------------------------------------- parser
@pytest.mark.parametrize(
    "text,want",
    [
        ("kreciprocal", R.KReciprocal()),
        ("kreciprocal:k1=20,k2=6,lambda=0.3", R.KReciprocal(20, 6, 0.3)),
        (" kreciprocal : k1=10 , lambda=0.5,candidates=50", R.KReciprocal(k1=10, lambda_=0.5, candidates=50)),
        ("aqe:alpha=3,n=2", R.AlphaQueryExpansion(3.0, 2)),
        ("aqe:n=5", R.AlphaQueryExpansion(n=5)),
        ("dba:alpha=1,n=4,candidates=20", R.DatabaseSideAugmentation(1.0, 4, 20)),
        ("none", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_rerank(text, want):
    assert R.parse_rerank(text) == want
    if want is not None:
        assert R.parse_rerank(want.spec()) == want


@pytest.mark.parametrize(
    "text,match",
    [
        ("kreciprokal", "unknown method 'kreciprokal'.*kreciprocal, aqe, dba"),
        ("aqe:beta=3", "unknown key 'beta' for aqe; expected alpha, n"),
        ("kreciprocal:lambda_=0.3", "unknown key 'lambda_'"),
        ("kreciprocal:k1=2.5", "k1='2.5' is not an integer"),
        ("aqe:alpha=x", "alpha='x' is not a number"),
        ("kreciprocal:lambda=1.5", r"lambda=1.5 outside \[0, 1\]"),
        ("aqe:n=0", "n=0 outside"),
        ("aqe:alpha=nan", "alpha=nan outside"),
        ("aqe:n", "'n' is not KEY=VALUE"),
        ("aqe:n=2,n=3", "given twice"),
    ],
)
def test_parse_rerank_errors_name_the_problem(text, match):
    with pytest.raises(R.RerankOptionError, match=match):
        R.parse_rerank(text)


# --------------------------------------------------------------------------------------------- evaluation
@pytest.mark.parametrize("with_queries", [False, True])
def test_rerank_metrics_without_reranker_equal_the_exact_engine(with_queries):
    x, y = clustered(90, 6, 7, seed=8, noise=0.8)
    if with_queries:
        got = R.rerank_metrics(None, x[30:], y[30:], x[:30], y[:30], recall_at=(1, 2, 4))
        qm = torch.zeros(90, dtype=torch.bool)
        qm[:30] = True
        want = MF.retrieval_metrics(x, y, recall_at=(1, 2, 4), query_mask=qm, gallery_mask=~qm)
    else:
        got = R.rerank_metrics(None, x, y, recall_at=(1, 2, 4))
        want = MF.retrieval_metrics(x, y, recall_at=(1, 2, 4))
    for key, value in got.items():
        assert value == pytest.approx(want[key], abs=1e-12), key


def test_rerank_metrics_aqe_leave_one_out_matches_reference():
    x, y = clustered(40, 5, 4, seed=9, noise=0.9)
    got = R.rerank_metrics(R.AlphaQueryExpansion(alpha=3.0, n=2), x, y, recall_at=(1,))
    hits = 0
    for i in range(40):
        qe = ref_alpha_expand(x[i], x, 2, 3.0, exclude=i)
        sims = F.normalize(x.double(), dim=1) @ qe
        order = sorted((j for j in range(40) if j != i), key=lambda j: (-round(float(sims[j]), 12), j))
        hits += int(y[order[0]] == y[i])
    assert got["recall@1"] == pytest.approx(hits / 40)


def test_rerank_metrics_kreciprocal_leave_one_out_matches_reference(monkeypatch):
    """All-vs-all with every other item a candidate: each probe's universe is itself plus the rest of the gallery
    (Zhong et al.'s full formulation); Recall@1 and MAP@R computed by hand from the reference ranking."""
    monkeypatch.setattr(R, "QUERY_BLOCK", 7)  # several blocks
    x, y = clustered(30, 5, 4, seed=11, noise=0.8)
    got = R.rerank_metrics(R.KReciprocal(k1=4, k2=2, candidates=40), x, y, recall_at=(1, 2))
    xn = F.normalize(x.double(), dim=1)
    r1, r2, maps = 0, 0, []
    for i in range(30):
        others = [j for j in range(30) if j != i]
        d_star = ref_k_reciprocal(R.squared_distances(xn[[i, *others]]).tolist(), 4, 2, 0.3)
        order = [others[t] for t in sorted(range(29), key=lambda t: (round(d_star[t], 9), others[t]))]
        rel = [bool(y[j] == y[i]) for j in order]
        r1 += rel[0]
        r2 += any(rel[:2])
        big_r = sum(rel)
        maps.append(sum(sum(rel[: p + 1]) / (p + 1) for p in range(big_r) if rel[p]) / big_r)
    assert got["recall@1"] == pytest.approx(r1 / 30, abs=1e-12)
    assert got["recall@2"] == pytest.approx(r2 / 30, abs=1e-12)
    assert got["map@r"] == pytest.approx(sum(maps) / 30, abs=1e-12)


def test_rerank_metrics_dba_leave_one_out_matches_reference():
    """DBA in evaluation augments the whole gallery (each item by its n nearest others) and ranks each raw item
    against the augmented others."""
    x, y = clustered(36, 5, 4, seed=12, noise=0.9)
    got = R.rerank_metrics(R.DatabaseSideAugmentation(alpha=3.0, n=2), x, y, recall_at=(1,))
    aug = torch.stack([ref_alpha_expand(x[j], x, 2, 3.0, exclude=j) for j in range(36)])
    hits = 0
    for i in range(36):
        sims = aug @ F.normalize(x[i].double(), dim=0)
        best = min((j for j in range(36) if j != i), key=lambda j: (-round(float(sims[j]), 12), j))
        hits += int(y[best] == y[i])
    assert got["recall@1"] == pytest.approx(hits / 36)


# --------------------------------------------------------------------------------------------- one normalisation path
def float32_index(raw: torch.Tensor):
    """A stand-in for an ``EmbeddingIndex`` of raw float32 embeddings: stores ``F.normalize`` of them in float32
    and normalises a query the same way before its inner products (``EmbeddingIndex._prepare`` / ``search``)."""
    stored = F.normalize(raw.float(), dim=1)

    def search(q: torch.Tensor, k: int):
        s = F.normalize(q.float(), dim=1) @ stored.T
        order = torch.sort(-s, dim=1, stable=True).indices[:, :k]
        return s.gather(1, order), order

    return search, (lambda ids: stored[ids])


def test_k_reciprocal_query_in_the_gallery_is_its_stored_copy():
    """Issue 26 s.4: a query that is itself in the gallery (its raw embedding equals a gallery item's) was
    normalised in float64 from the raw vector and landed ~1e-8 from its stored copy (normalised in float32), so it
    was not its own nearest neighbour: the copies scored 0.8 instead of 1.0. Now it gives exactly the answer of its
    stored vector, and the copies (items 2 and 5) come first with score 1."""
    raw = torch.randn(12, 8, generator=torch.Generator().manual_seed(0)) * 3
    raw[5] = raw[2]
    search, vectors = float32_index(raw)
    rr = R.KReciprocal(k1=2, k2=2, candidates=12)
    s_raw, i_raw = rr.search(search, vectors, raw[2:3], 6)
    s_stored, i_stored = rr.search(search, vectors, vectors(torch.tensor([2])), 6)
    assert torch.equal(i_raw, i_stored)
    torch.testing.assert_close(s_raw, s_stored, rtol=0, atol=0)
    assert i_raw[0, :2].tolist() == [2, 5]
    assert s_raw[0, :2].tolist() == pytest.approx([1.0, 1.0], abs=1e-12)
    assert (s_raw[0, 2:] < 0.9).all()


def test_k_reciprocal_more_copies_than_k1_each_copy_in_its_own_set():
    """Four identical items and k1=1 (neighbour sets of 2): with ties by position alone, the copies at positions 2
    and 3 were not in their own neighbour sets N(x, k1); each item now ranks itself first (Eq. 2 with x ∈ N(x, k)),
    as the reference does."""
    x = copies(8, 3, seed=4, count=4)  # items 0, 2, 5, 6 identical
    dist = R.squared_distances(x)
    got = R.k_reciprocal_distance(dist.unsqueeze(0), k1=1, k2=2, lambda_=0.3)[0]
    want = torch.tensor(ref_k_reciprocal(dist.tolist(), 1, 2, 0.3), dtype=torch.float64)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


# --------------------------------------------------------------------------------------------- bounds
@pytest.mark.parametrize(
    "text,match",
    [
        ("kreciprocal:candidates=1000000", r"candidates=1000000 outside \[1, 10000\]"),
        ("kreciprocal:k1=1001", r"k1=1001 outside \[1, 1000\]"),
        ("kreciprocal:k2=5000", r"k2=5000 outside \[1, 1000\]"),
        ("aqe:n=1000000", r"n=1000000 outside \[1, 1000\]"),
        ("dba:n=1001", r"n=1001 outside \[1, 1000\]"),
        ("dba:candidates=10001", r"candidates=10001 outside \[1, 10000\]"),
        ("aqe:alpha=100.5", r"alpha=100.5 outside \[0, 100\]"),
        ("kreciprocal:candidates=" + "9" * 5000, "is not an integer"),
    ],
)
def test_parse_rerank_refuses_values_above_the_documented_maxima(text, match):
    with pytest.raises(R.RerankOptionError, match=match):
        R.parse_rerank(text)
    # the maxima themselves are accepted
    assert R.parse_rerank("kreciprocal:k1=1000,k2=1000,candidates=10000") == \
        R.KReciprocal(k1=1000, k2=1000, candidates=10_000)
    assert R.parse_rerank("aqe:n=1000,alpha=100") == R.AlphaQueryExpansion(alpha=100.0, n=1000)


def counting(search):
    """``search`` that records the largest k it was asked for."""
    asked = []

    def wrapped(q, k):
        asked.append(int(k))
        return search(q, k)

    return wrapped, asked


@pytest.mark.parametrize("k", [4, 15])
@pytest.mark.parametrize(
    "rr,unclamped",
    [
        (R.KReciprocal(k1=3, k2=2, candidates=10_000), R.KReciprocal(k1=3, k2=2, candidates=13)),
        (R.AlphaQueryExpansion(n=1000), R.AlphaQueryExpansion(n=13)),
        (R.DatabaseSideAugmentation(n=1000, candidates=10_000), R.DatabaseSideAugmentation(n=13, candidates=13)),
    ],
    ids=["kr", "aqe", "dba"],
)
def test_rerank_options_are_clamped_to_the_gallery_size(rr, unclamped, k):
    """Issue 26 s.3: memory followed the option's value, not the gallery (aqe:n=1000000 on 15 items: +200 MiB).
    With the gallery size, the index is never asked for more than the gallery (or k), and the answer is that of
    options past the gallery without the clamp (whose padding carries no item), padded to k."""
    x = clustered(18, 5, 3, seed=13)[0].double()
    gallery = x[6:]  # 12 items
    search, vectors = brute_search(gallery)
    counted, asked = counting(search)
    s, i = rr.search(counted, vectors, x[:6], k, gallery_size=12)
    assert max(asked) <= max(12, k if isinstance(rr, R.AlphaQueryExpansion) else 0), asked
    s_ref, i_ref = unclamped.search(search, vectors, x[:6], k)
    assert s.shape == (6, k) and i.shape == (6, k)
    assert torch.equal(i, i_ref)
    torch.testing.assert_close(s, s_ref.to(s.dtype), rtol=0, atol=0)
    assert (i[:, 12:] == -1).all() and torch.isinf(s[:, 12:]).all()


@pytest.mark.parametrize(
    "rr", [R.KReciprocal(k1=4, k2=3, candidates=20), R.DatabaseSideAugmentation(n=3, candidates=20)], ids=["kr", "dba"]
)
def test_rerank_blocks_bounded_by_elements_do_not_change_results(rr, monkeypatch):
    """Large candidate sets are processed in fewer queries per block (BLOCK_ELEMENTS); one query (and, DBA, one
    candidate) per block gives the same answer (bit for bit for k-reciprocal; DBA's matrix products over other row
    counts may differ in the last bit)."""
    x = clustered(40, 6, 4, seed=14)[0].double()
    search, vectors = brute_search(x[10:])
    s_all, i_all = rr.search(search, vectors, x[:10], 8)
    monkeypatch.setattr(R, "BLOCK_ELEMENTS", 1)
    assert R._block(10**6) == 1
    s_one, i_one = rr.search(search, vectors, x[:10], 8)
    assert torch.equal(i_one, i_all)
    torch.testing.assert_close(s_one, s_all, rtol=0, atol=0 if rr.name == "kreciprocal" else 1e-15)


def test_rerank_metrics_kreciprocal_duplicates_take_one_normalisation_path(monkeypatch):
    """Leave-one-out over float32 embeddings with an exact duplicate pair (items 3 and 7): the candidates reach
    k-reciprocal re-ranking in the form the query is brought to (as_stored: float32 normalisation, as the index
    stores vectors), so a query and its duplicate are the same vector bit for bit, not ~1e-8 apart."""
    x, y = clustered(30, 5, 4, seed=11, noise=0.8)
    x[7] = x[3]
    seen = []
    original = R.k_reciprocal_rerank

    def spy(queries, candidates, candidate_ids, **kw):
        seen.append((queries, candidates, candidate_ids))
        return original(queries, candidates, candidate_ids, **kw)

    monkeypatch.setattr(R, "k_reciprocal_rerank", spy)
    R.rerank_metrics(R.KReciprocal(k1=4, k2=2, candidates=40), x, y, recall_at=(1,))
    queries = torch.cat([q for q, _, _ in seen])
    candidates = torch.cat([c for _, c, _ in seen])
    ids = torch.cat([i for _, _, i in seen])
    for q, dup in ((3, 7), (7, 3)):
        pos = int((ids[q] == dup).nonzero())
        assert torch.equal(R.as_stored(queries[q], "cosine"), candidates[q, pos])
