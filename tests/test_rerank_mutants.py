"""Re-ranking (lightning_dml/index/rerank.py): the cases the mutation check (issue 26, docs/testing.md) found
untested: the documented defaults, shape and option checks, exact symmetry, ties, padding and tiny galleries, and
``rerank_metrics`` as a whole (every ranked position, every re-ranker, leave-one-out and query/gallery) against
loop references written from the papers' equations (those of tests/test_rerank.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from lightning_dml.index import rerank as R
from tests.test_rerank import brute_search, clustered, ref_alpha_expand, ref_k_reciprocal


def _strict(gallery: torch.Tensor):
    """``vectors_fn`` as the real index's (``EmbeddingIndex.vectors``): an id outside the gallery is a KeyError."""

    def vectors(ids: torch.Tensor) -> torch.Tensor:
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= gallery.shape[0]):
            raise KeyError(f"ids not in the index: {ids.tolist()}")
        return gallery[ids]

    return vectors


def _random(n: int, d: int, seed: int) -> torch.Tensor:
    return torch.randn(n, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


# --------------------------------------------------------------------------------------------- defaults
def test_documented_defaults() -> None:
    """The defaults parse_rerank's docstring (and the module's) documents, on the classes."""
    assert R.KReciprocal() == R.KReciprocal(k1=20, k2=6, lambda_=0.3, candidates=100)
    assert R.AlphaQueryExpansion() == R.AlphaQueryExpansion(alpha=3.0, n=2)
    assert R.DatabaseSideAugmentation() == R.DatabaseSideAugmentation(alpha=3.0, n=2, candidates=100)
    assert R.parse_rerank("kreciprocal").spec() == "kreciprocal:k1=20,k2=6,lambda=0.3,candidates=100"


def test_k_reciprocal_functions_default_to_the_papers_values() -> None:
    """k1=20, k2=6, lambda=0.3 (Zhong et al.): on a 32-item universe, where k1 = 19 or 21 gives other values."""
    x = _random(32, 4, seed=1)
    dist = R.squared_distances(x)
    want = torch.tensor(ref_k_reciprocal(dist.tolist(), 20, 6, 0.3), dtype=torch.float64)
    for other in ((19, 6, 0.3), (21, 6, 0.3), (20, 5, 0.3), (20, 7, 0.3)):  # the reference can tell them apart
        assert not torch.allclose(torch.tensor(ref_k_reciprocal(dist.tolist(), *other), dtype=torch.float64), want)
    torch.testing.assert_close(R.k_reciprocal_distance(dist.unsqueeze(0))[0], want, rtol=0, atol=1e-12)
    queries, gallery = x[:3], x[3:]
    ids = torch.arange(29).repeat(3, 1)
    got = R.k_reciprocal_rerank(queries, gallery[ids], ids)
    explicit = R.k_reciprocal_rerank(queries, gallery[ids], ids, k1=20, k2=6, lambda_=0.3)
    assert torch.equal(got[1], explicit[1]) and torch.equal(got[0], explicit[0])
    other = R.k_reciprocal_rerank(queries, gallery[ids], ids, k1=21, k2=6, lambda_=0.3)
    assert not torch.equal(got[0], other[0])


def test_alpha_functions_default_to_alpha_three() -> None:
    v, nb = _random(4, 5, seed=2), _random(12, 5, seed=3).reshape(4, 3, 5)
    sims = torch.einsum("qd,qnd->qn", F.normalize(v, dim=-1), F.normalize(nb, dim=-1)).abs()
    want = R.alpha_weighted_average(v, nb, sims, alpha=3.0)
    assert not torch.allclose(R.alpha_weighted_average(v, nb, sims, alpha=2.0), want)
    torch.testing.assert_close(R.alpha_query_expansion(v, nb, sims), want, rtol=0, atol=0)
    torch.testing.assert_close(R.database_side_augmentation(v, nb, sims), want, rtol=0, atol=0)


def test_rerank_metrics_default_recall_at() -> None:
    x, y = clustered(20, 4, 3, seed=4)
    assert list(R.rerank_metrics(None, x, y)) == ["recall@1", "recall@2", "recall@4", "recall@8", "map@r"]


# --------------------------------------------------------------------------------------------- checks
@pytest.mark.parametrize("shape", [(4, 4), (1, 3, 4), (2, 3, 3, 3)])
def test_k_reciprocal_distance_refuses_a_non_square_batch(shape) -> None:
    with pytest.raises(ValueError, match=r"dist must be \[B, M, M\]"):
        R.k_reciprocal_distance(torch.zeros(shape, dtype=torch.float64))


@pytest.mark.parametrize("q_shape,c_shape,i_shape", [
    ((3,), (3, 4, 3), (3, 4)),  # queries 1-D, the rest right
    ((3, 3), (3, 4), (3, 4)),  # candidates 2-D
    ((3, 3), (3, 4, 3), (3, 5)),  # ids of another shape
])
def test_k_reciprocal_rerank_refuses_mismatched_shapes(q_shape, c_shape, i_shape) -> None:
    with pytest.raises(ValueError, match=r"queries \[Q, D\], candidates \[Q, K, D\]"):
        R.k_reciprocal_rerank(torch.ones(q_shape), torch.ones(c_shape), torch.zeros(i_shape, dtype=torch.long))


@pytest.mark.parametrize("text", [
    "kreciprocal:k1=0", "kreciprocal:k2=0", "kreciprocal:candidates=0", "kreciprocal:lambda=-0.1",
    "dba:candidates=0", "dba:n=0", "dba:alpha=-1", "aqe:alpha=-0.5",
])
def test_parse_rerank_refuses_values_below_their_lower_limit(text) -> None:
    key = text.split(":")[1].split("=")[0]
    with pytest.raises(R.RerankOptionError, match=key):
        R.parse_rerank(text)


@pytest.mark.parametrize("text,want", [
    ("kreciprocal:lambda=1", R.KReciprocal(lambda_=1.0)), ("kreciprocal:lambda=0", R.KReciprocal(lambda_=0.0)),
    ("kreciprocal:k1=1,k2=1,candidates=1", R.KReciprocal(k1=1, k2=1, candidates=1)),
    ("aqe:alpha=0,n=1", R.AlphaQueryExpansion(alpha=0.0, n=1)), ("dba:n=1,candidates=1", R.DatabaseSideAugmentation(n=1, candidates=1)),
    ("kreciprocal:k1=1000,k2=1000,candidates=10000", R.KReciprocal(k1=1000, k2=1000, candidates=10_000)),
    ("aqe:alpha=100,n=1000", R.AlphaQueryExpansion(alpha=100.0, n=1000)),
])
def test_parse_rerank_accepts_the_limits_themselves(text, want) -> None:
    assert R.parse_rerank(text) == want


def test_squared_distances_are_exactly_symmetric_with_a_zero_diagonal() -> None:
    """The docstring's promise (a matrix product alone is not bitwise symmetric)."""
    x = _random(96, 33, seed=5)
    for d in (R.squared_distances(x), R.squared_distances(x.reshape(3, 32, 33))[1]):
        assert torch.equal(d, d.transpose(-1, -2))
        assert torch.equal(torch.diagonal(d), torch.zeros(d.shape[0], dtype=torch.float64))

def test_squared_distances_against_y_equal_the_brute_force_and_are_never_negative() -> None:
    x, y = 3.0 * _random(7, 5, seed=20), _random(7, 5, seed=21) - 1.0  # raw norms, as many rows as x
    for a, b in ((x, y), (x, y[:4]), (x[:2], y)):
        want = ((a[:, None, :] - b[None, :, :]) ** 2).sum(-1)
        torch.testing.assert_close(R.squared_distances(a, b), want, rtol=1e-12, atol=1e-12)
    # near-copies (one direction at several scales, normalised): the Gram form rounds below 0, the result is 0
    dup = F.normalize(x[:1].repeat(64, 1) * torch.logspace(-3, 3, 64, dtype=torch.float64)[:, None], dim=1)
    raw = (dup * dup).sum(-1)[:, None] + (dup * dup).sum(-1)[None, :] - 2.0 * dup @ dup.T
    assert (raw < 0).any()  # the case the clamp exists for
    for d in (R.squared_distances(dup, dup), R.squared_distances(dup)):
        assert (d >= 0).all()


# --------------------------------------------------------------------------------------------- ties, padding
def test_k_reciprocal_rerank_ties_go_to_the_smaller_id() -> None:
    """40 exact copies of one vector at lambda = 1 (d* = d: equal for the copies; below 1 their neighbour sets, built
    by position, differ): the ids in increasing order, whatever order the index gave."""
    base = _random(1, 4, seed=6)
    gallery = torch.cat([base.repeat(40, 1), _random(3, 4, seed=7)])
    ids = torch.randperm(43, generator=torch.Generator().manual_seed(8)).unsqueeze(0)
    _, got = R.k_reciprocal_rerank(base * 2.0, gallery[ids], ids, k=43, k1=5, k2=3, lambda_=1.0)
    copies = [i for i in got[0].tolist() if i < 40]
    assert copies == list(range(40))


def test_rerankers_never_ask_the_index_for_a_padding_id() -> None:
    """Fewer gallery items than candidates (or than n): ``vectors_fn`` (a KeyError for an unknown id, as the real
    index) only ever sees gallery ids, and the results are the reference's."""
    gallery = _random(5, 4, seed=9)
    search, _ = brute_search(gallery)
    vectors = _strict(gallery)
    queries = _random(3, 4, seed=10)
    s, i = R.KReciprocal(k1=3, k2=2, candidates=9).search(search, vectors, queries, 7)
    assert (i[:, 5:] == -1).all() and sorted(i[0, :5].tolist()) == list(range(5))
    R.AlphaQueryExpansion(n=8).search(search, vectors, queries, 4)
    R.DatabaseSideAugmentation(n=8, candidates=9).search(search, vectors, queries, 4)


@pytest.mark.parametrize("ng,n", [(1, 3), (3, 4), (4, 2)])
def test_dba_with_fewer_neighbours_than_n_matches_the_reference(ng, n) -> None:
    """A gallery of ``ng`` items, each augmented by its top ``n`` others: with ``n >= ng`` by all the others."""
    gallery, queries = _random(ng, 3, seed=11), _random(2, 3, seed=12)
    search, _ = brute_search(gallery)
    scores, ids = R.DatabaseSideAugmentation(alpha=2.0, n=n, candidates=ng).search(
        search, _strict(gallery), queries, ng)
    aug = torch.stack([ref_alpha_expand(gallery[j], gallery, n, 2.0, exclude=j) for j in range(ng)])
    for qi in range(2):
        sims = aug @ F.normalize(queries[qi], dim=0)
        want = sorted(range(ng), key=lambda j: (-round(float(sims[j]), 12), j))
        assert ids[qi].tolist() == want
        torch.testing.assert_close(scores[qi], sims[want], rtol=0, atol=1e-12)


def test_dba_returns_k_results_when_k_exceeds_candidates() -> None:
    """The candidate set holds max(candidates, k) results (module docstring)."""
    gallery, queries = _random(10, 3, seed=13), _random(2, 3, seed=14)
    search, vectors = brute_search(gallery)
    s, i = R.DatabaseSideAugmentation(n=2, candidates=3).search(search, vectors, queries, 7)
    full_s, full_i = R.DatabaseSideAugmentation(n=2, candidates=7).search(search, vectors, queries, 7)
    assert i.shape == (2, 7) and torch.equal(i, full_i)
    torch.testing.assert_close(s, full_s, rtol=0, atol=0)


def test_ranked_list_metrics_ignore_padding() -> None:
    """-1 padding is never relevant (not even when the last gallery item has the query's label)."""
    gl = torch.tensor([0, 1, 1, 0])
    ranked = torch.tensor([[1, -1, -1], [0, 3, -1]])
    got = R.ranked_list_metrics(ranked, torch.tensor([0, 0]), gl, torch.tensor([2, 2]), (1, 3))
    assert got["recall@1"] == 0.5 and got["recall@3"] == 0.5
    assert got["map@r"] == pytest.approx((0.0 + 1.0) / 2, abs=1e-15)


# --------------------------------------------------------------------------------------------- rerank_metrics
def _exact_order(q: torch.Tensor, gallery: torch.Tensor, metric: str, exclude: int | None) -> list[int]:
    if metric == "cosine":
        s = F.normalize(gallery.double(), dim=1) @ F.normalize(q.double(), dim=0)
    else:
        s = -((gallery.double() - q.double()) ** 2).sum(1)
    return sorted((j for j in range(gallery.shape[0]) if j != exclude), key=lambda j: (-round(float(s[j]), 12), j))


def _ref_ranking(reranker, gallery, q, exclude, metric) -> list[int]:
    order = _exact_order(q, gallery, metric, exclude)
    if reranker is None:
        return order
    if isinstance(reranker, R.KReciprocal):
        cands = sorted(order[: reranker.candidates])
        u = torch.cat([q.double().unsqueeze(0), gallery[cands].double()])
        if metric == "cosine":
            u = F.normalize(u, dim=1)
        d = ref_k_reciprocal(R.squared_distances(u).tolist(), reranker.k1, reranker.k2, reranker.lambda_)
        head = [cands[t] for t in sorted(range(len(cands)), key=lambda t: (round(d[t], 9), cands[t]))]
        return head + order[reranker.candidates :]
    if isinstance(reranker, R.AlphaQueryExpansion):
        qe = ref_alpha_expand(q, gallery, reranker.n, reranker.alpha, exclude=exclude)
        sims = F.normalize(gallery.double(), dim=1) @ qe
        return sorted((j for j in range(gallery.shape[0]) if j != exclude), key=lambda j: (-round(float(sims[j]), 12), j))
    aug = torch.stack([ref_alpha_expand(gallery[j], gallery, reranker.n, reranker.alpha, exclude=j)
                       for j in range(gallery.shape[0])])
    sims = aug @ F.normalize(q.double(), dim=0)
    return sorted((j for j in range(gallery.shape[0]) if j != exclude), key=lambda j: (-round(float(sims[j]), 12), j))


def _ref_metrics(reranker, gallery, gl, queries, ql, recall_at, metric) -> dict[str, float]:
    loo = queries is None
    qs, qls = (gallery, gl) if loo else (queries, ql)
    hits = {k: 0 for k in recall_at}
    aps = []
    for i in range(qs.shape[0]):
        ranking = _ref_ranking(reranker, gallery, qs[i], i if loo else None, metric)
        rel = [int(gl[j]) == int(qls[i]) for j in ranking]
        for k in recall_at:
            hits[k] += any(rel[:k])
        r = sum(rel)
        if r:
            found, acc = 0, 0.0
            for p in range(r):
                if rel[p]:
                    found += 1
                    acc += found / (p + 1)
            aps.append(acc / r)
    out = {f"recall@{k}": hits[k] / qs.shape[0] for k in recall_at}
    out["map@r"] = sum(aps) / len(aps) if aps else 0.0
    return out


RERANKERS = {
    "none": None,
    "kreciprocal-head": R.KReciprocal(k1=3, k2=2, lambda_=0.3, candidates=8),
    "kreciprocal-one": R.KReciprocal(k1=3, k2=2, candidates=1),
    "aqe": R.AlphaQueryExpansion(alpha=2.0, n=3),
    "dba": R.DatabaseSideAugmentation(alpha=2.0, n=3),
    "dba-n-past-gallery": R.DatabaseSideAugmentation(alpha=1.0, n=30),
    # alpha = 0: every neighbour weighs 1, also those of negative similarity (0^0 = 1), none of the padding
    "dba-alpha-0-n-past-gallery": R.DatabaseSideAugmentation(alpha=0.0, n=30),
}


@pytest.mark.parametrize("name", list(RERANKERS))
@pytest.mark.parametrize("with_queries", [False, True], ids=["leave-one-out", "queries"])
def test_rerank_metrics_equal_the_reference_at_every_position(name, with_queries) -> None:
    """Recall@K up to past the gallery size and MAP@R (every relevant position) equal a loop reference; a class of
    one item (no relevant item) included."""
    x, y = clustered(22, 4, 4, seed=15, noise=0.7)
    y[5] = 9  # a class of one item
    reranker = RERANKERS[name]
    recall_at = (1, 3, 21, 40)
    if with_queries:
        args = (x[6:], y[6:], x[:6], y[:6])
    else:
        args = (x, y, None, None)
    got = R.rerank_metrics(reranker, *args, recall_at=recall_at)
    want = _ref_metrics(reranker, *args, recall_at, "cosine")
    assert got == pytest.approx(want, abs=1e-12)


@pytest.mark.parametrize("name", ["none", "kreciprocal-head"])
def test_rerank_metrics_euclidean_equal_the_reference(name) -> None:
    x, y = clustered(18, 3, 3, seed=16, noise=0.8)
    got = R.rerank_metrics(RERANKERS[name], x * 3.0, y, recall_at=(1, 2, 17), metric="euclidean")
    assert got == pytest.approx(_ref_metrics(RERANKERS[name], x * 3.0, y, None, None, (1, 2, 17), "euclidean"),
                                abs=1e-12)


def test_k_reciprocal_with_one_candidate_is_the_exact_ranking() -> None:
    """candidates=1: nothing to re-rank, the lists (and figures) are the exact engine's (pure Jaccard distances,
    lambda = 0, with small k1: re-ranking two candidates would reorder some of these lists)."""
    for seed in (17, 0):
        x, y = clustered(30, 4, 5, seed=seed, noise=1.2)
        for rr in (R.KReciprocal(k1=3, k2=2, candidates=1), R.KReciprocal(k1=1, k2=1, lambda_=0.0, candidates=1),
                   R.KReciprocal(k1=2, k2=1, lambda_=0.0, candidates=1)):
            assert R.rerank_metrics(rr, x, y) == R.rerank_metrics(None, x, y)


def test_negative_similarities_weigh_nothing() -> None:
    """``w_i = max(s_i, 0)^alpha`` (docstring): a neighbour of negative similarity leaves the vector as it is, at an
    odd alpha too."""
    x = torch.tensor([[1.0, 0.0, 0.0]])
    nb = torch.tensor([[[-1.0, 1.0, 0.0], [0.0, 0.0, 1.0]]])
    for alpha in (3.0, 1.0, 0.5):
        out = R.alpha_weighted_average(x, nb, torch.tensor([[-0.5, -0.25]]), alpha=alpha)
        torch.testing.assert_close(out, x.double(), rtol=0, atol=0)


class _Index:
    """The parts of an EmbeddingIndex that rerank_search uses: search, vectors, metric and len."""

    def __init__(self, gallery: torch.Tensor) -> None:
        self.search, _ = brute_search(gallery)
        self.vectors = _strict(gallery)
        self.metric = "cosine"
        self.size = gallery.shape[0]

    def __len__(self) -> int:
        return self.size


def test_rerank_search_is_the_plain_search_without_a_reranker_and_the_reranked_one_with() -> None:
    gallery, queries = _random(12, 4, seed=18), _random(3, 4, seed=19)
    index = _Index(gallery)
    plain = R.rerank_search(index, queries, 5)
    want = index.search(queries, 5)
    assert torch.equal(plain[1], want[1]) and torch.equal(plain[0], want[0])
    rr = R.AlphaQueryExpansion(alpha=1.0, n=3)
    got = R.rerank_search(index, queries, 5, rr)
    direct = rr.search(index.search, index.vectors, queries, 5)
    assert torch.equal(got[1], direct[1]) and not torch.equal(got[1], plain[1])


def test_dba_ties_go_to_the_smaller_id() -> None:
    """20 copies of one vector: each is augmented by other copies, so their scores are equal; smaller id first."""
    gallery = torch.cat([_random(1, 4, seed=22).repeat(20, 1), _random(4, 4, seed=23)])
    search, vectors = brute_search(gallery)
    _, ids = R.DatabaseSideAugmentation(n=2, candidates=24).search(search, vectors, _random(2, 4, seed=24), 24)
    for row in ids.tolist():
        assert [i for i in row if i < 20] == list(range(20))


@pytest.mark.parametrize("reranker", [R.KReciprocal(k1=3, k2=2, candidates=4), R.AlphaQueryExpansion(alpha=1.0, n=2),
                                      R.DatabaseSideAugmentation(alpha=1.0, n=2, candidates=4)],
                         ids=["kreciprocal", "aqe", "dba"])
def test_rerank_search_pads_past_the_gallery(reranker) -> None:
    """k = N + 1 on an index of N items (candidates clamped to N): k columns, the last one padding."""
    gallery, queries = _random(5, 4, seed=25), _random(3, 4, seed=26)
    scores, ids = R.rerank_search(_Index(gallery), queries, 6, reranker)
    assert ids.shape == (3, 6) and (ids[:, 5] == -1).all() and torch.isinf(scores[:, 5]).all()
    assert all(sorted(row[:5]) == list(range(5)) for row in ids.tolist())


@pytest.mark.parametrize("through_index", [False, True])
def test_alpha_zero_with_n_past_the_gallery_matches_the_reference(through_index) -> None:
    """n past the gallery: at most the N (AQE) or N - 1 (DBA, itself excluded) neighbours there are, called with or
    without the index's size; padding weighs nothing, also at alpha = 0 (where every neighbour weighs 1). Vectors
    of positive entries: every similarity is positive, so every neighbour counts (DBA at alpha = 0 would make
    every augmented vector the same sum, a tie to rounding)."""
    gallery, queries = _random(5, 4, seed=27).abs() + 0.1, _random(2, 4, seed=28).abs() + 0.1
    search, _ = brute_search(gallery)
    for rr in (R.AlphaQueryExpansion(alpha=0.0, n=8), R.DatabaseSideAugmentation(alpha=1.0, n=8, candidates=5)):
        if through_index:
            scores, ids = R.rerank_search(_Index(gallery), queries, 5, rr)
        else:
            scores, ids = rr.search(search, _strict(gallery), queries, 5)
        for qi in range(2):
            if isinstance(rr, R.AlphaQueryExpansion):
                sims = F.normalize(gallery, dim=1) @ ref_alpha_expand(queries[qi], gallery, 8, 0.0)
            else:
                aug = torch.stack([ref_alpha_expand(gallery[j], gallery, 8, 1.0, exclude=j) for j in range(5)])
                sims = aug @ F.normalize(queries[qi], dim=0)
            want = sorted(range(5), key=lambda j: (-round(float(sims[j]), 12), j))
            assert ids[qi].tolist() == want
            torch.testing.assert_close(scores[qi].double(), sims[want], rtol=0, atol=1e-6)


def test_k_reciprocal_jaccard_denominator_of_exactly_one() -> None:
    """Points on a line with shrinking gaps (10, 9, 8, 7, 6), k1 = 1, k2 = 3: no nearest-neighbour pair of the first
    three is mutual, so each of them has R* = {itself}; the probe and its nearest item have the same 3 nearest
    items, hence equal expanded rows whose max-sum is exactly 1: d_J = 0, not the fallback 1."""
    x = torch.tensor([[0.0], [10.0], [19.0], [27.0], [34.0], [40.0]], dtype=torch.float64)
    dist = R.squared_distances(x)
    want = torch.tensor(ref_k_reciprocal(dist.tolist(), 1, 3, 0.0), dtype=torch.float64)
    assert float(want[0]) == 0.0
    got = R.k_reciprocal_distance(dist.unsqueeze(0), k1=1, k2=3, lambda_=0.0)[0]
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
