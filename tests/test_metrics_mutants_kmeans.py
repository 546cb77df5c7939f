"""k-means, the clustering metrics and the small functional helpers: cases the mutation check (issue 26,
docs/testing.md) found untested, each against a loop / float64 brute force or the documented rule (the clustering
F1 itself is checked against the pair loop in tests/test_metrics.py)."""

from __future__ import annotations

import importlib

import pytest
import torch

from lightning_dml.metrics import functional as F
from tests.metrics_reference import brute_rankings

km = importlib.import_module("lightning_dml.metrics.kmeans")  # the module (the package exports its function `kmeans`)


# ------------------------------------------------------------------------------------------------------ k-means
def test_assign_covers_every_point_whatever_the_chunk() -> None:
    """Chunked assignment (chunks of 3 of 10 points, then 1, then one chunk past the end) is the brute-force
    nearest centroid (lowest index on ties) and its squared distance, for every point."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 4, generator=g)
    c = torch.randn(3, 4, generator=g)
    for chunk in (3, 1, 16):
        labels, dist = km._assign(x, c, chunk)
        d64 = ((x.double().unsqueeze(1) - c.double().unsqueeze(0)) ** 2).sum(dim=2)
        want = [min(range(3), key=lambda j: (float(d64[i, j]), j)) for i in range(10)]
        assert labels.tolist() == want, chunk
        assert torch.allclose(dist.double(), d64.min(dim=1).values, atol=1e-5), chunk


def test_torch_kmeans_does_not_depend_on_the_chunk() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 5, generator=g)
    ref = km.torch_kmeans(x, 4, iters=5, seed=2)
    assert torch.equal(km.torch_kmeans(x, 4, iters=5, seed=2, chunk=7), ref)


@pytest.mark.parametrize("seed", range(6))
def test_kmeans_plus_plus_never_draws_a_point_on_a_centre_while_others_remain(seed: int) -> None:
    """D^2 sampling gives a point that coincides with a centre probability 0: with 3 distinct points among 5
    (two duplicates), k = 3 centres are the 3 distinct points, also when every D^2 is far below 1."""
    x = 1e-3 * torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0], [1.0, 0.0], [0.0, 1.0]])
    c = km._kmeans_plus_plus(x, 3, torch.Generator().manual_seed(seed))
    assert {tuple(row.tolist()) for row in c} == {tuple(row.tolist()) for row in x}


def test_an_emptied_cluster_is_reseeded_with_the_farthest_point(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two coincident initial centres (the second gets no point: ties go to the lower index): the empty cluster
    is re-seeded with the point farthest from its centre, so the three separated groups end in three clusters
    (an empty centre left at the origin, far from every point, would merge two groups for good)."""
    a = [[0.9, 0.9], [0.92, 0.9], [0.9, 0.92], [0.88, 0.9]]
    b = [[0.9, 0.5], [0.92, 0.5], [0.9, 0.52]]
    c = [[0.5, 0.9], [0.5, 0.92], [0.52, 0.9]]
    x = torch.tensor(a + b + c)
    monkeypatch.setattr(km, "_kmeans_plus_plus", lambda x, k, g: x[[0, 0, 4]].clone())
    labels = km.torch_kmeans(x, 3, iters=5).tolist()
    groups = [labels[:4], labels[4:7], labels[7:]]
    assert all(len(set(grp)) == 1 for grp in groups), labels
    assert len({grp[0] for grp in groups}) == 3, labels


@pytest.mark.parametrize(("n", "d", "k", "want"), [
    (10, 10**6, 10, "torch"),  # N k = 100: small, however wide the rows (d k = 1e7)
    (10**4, 2, 1000, "faiss"),  # N k = 1e7: large
    (10**4, 2, 999, "torch"),
])
def test_auto_backend_is_chosen_by_points_times_clusters(
    monkeypatch: pytest.MonkeyPatch, n: int, d: int, k: int, want: str
) -> None:
    """``backend="auto"``: faiss (when installed, on the CPU) iff N * k >= 1e7; the width does not count."""
    used = []
    monkeypatch.setattr(km, "faiss_available", lambda: True)
    monkeypatch.setattr(km, "_faiss_kmeans", lambda x, k, **kw: used.append("faiss"))
    monkeypatch.setattr(km, "torch_kmeans", lambda x, k, **kw: used.append("torch"))
    km.kmeans(torch.zeros(1, 1).expand(n, d), k, backend="auto")  # no memory: the choice only reads the shape
    assert used == [want]


def test_kmeans_plus_plus_only_when_cheap(monkeypatch: pytest.MonkeyPatch) -> None:
    """k-means++ seeds only when N k D <= 5e8 (it is sequential in k); above, k distinct points drawn uniformly."""
    calls = []
    real = km._kmeans_plus_plus
    monkeypatch.setattr(km, "_kmeans_plus_plus", lambda x, k, g: calls.append((x.shape, k)) or real(x, k, g))
    g = torch.Generator().manual_seed(3)
    small = torch.randn(20, 4, generator=g)
    km.torch_kmeans(small, 5, iters=1)
    assert calls == [((20, 4), 5)]
    calls.clear()
    big = torch.randn(1000, 1001, generator=g)  # N k D = 1000 * 500 * 1001 > 5e8
    labels = km.torch_kmeans(big, 500, iters=1)
    assert calls == [] and labels.shape == (1000,) and 0 <= int(labels.min()) and int(labels.max()) < 500


@pytest.mark.parametrize("k", [0, 4])
def test_faiss_kmeans_refuses_k_outside_one_to_the_number_of_points(k: int) -> None:
    """k = 0, and k above N (3 points) though not above the width (8): one clear ValueError, not faiss' error."""
    if not km.faiss_available():
        pytest.skip("faiss is not installed (the faiss extra)")
    with pytest.raises(ValueError, match="1 <= k <= number of points"):
        km.kmeans(torch.randn(3, 8), k, backend="faiss")


# ----------------------------------------------------------------------------------------- clustering metrics
def test_clustering_metrics_average_over_the_seeds_from_the_offset() -> None:
    """Seed s runs k-means with seed ``seed_offset + s``: the figures are the mean of those runs' NMI and F1
    (data without cluster structure, so the seeds give different clusterings)."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(40, 3, generator=g)
    y = torch.arange(4).repeat(10)
    runs = [km.kmeans(x, 4, iters=3, seed=7 + s, backend="torch") for s in range(3)]
    nmis = [F.nmi(y, a) for a in runs]
    f1s = [F.f1_score(y, a) for a in runs]
    assert len(set(nmis)) > 1  # the test can tell the seeds apart
    got = F.clustering_metrics(x, y, metric="euclidean", seeds=3, iters=3, seed_offset=7, backend="torch")
    assert got["nmi"] == pytest.approx(sum(nmis) / 3, abs=1e-12)
    assert got["f1"] == pytest.approx(sum(f1s) / 3, abs=1e-12)


# ------------------------------------------------------------------------------------------ functional helpers
def _relevance_lists() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Brute-force rankings of a small set with a class of one item (a query without a relevant item)."""
    g = torch.Generator().manual_seed(6)
    y = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    x = torch.randn(10, 3, generator=g)
    rk = brute_rankings(x, y)
    rel = torch.tensor([r for _, _, r, _ in rk])
    num = torch.tensor([n for _, _, _, n in rk])
    fpr = torch.tensor([r.index(True) if any(r) else -1 for _, _, r, _ in rk])
    return rel, num, fpr


def test_list_helpers_match_the_definitions() -> None:
    """``recall_at_k``, ``precision_at_1``, ``r_precision`` and ``map_at_r`` from ranks / relevance lists, against
    loops over the lists (queries with R = 0 count for Recall, not for R-Precision / MAP@R)."""
    rel, num, fpr = _relevance_lists()
    assert int((num == 0).sum()) == 1
    for k in (1, 2, 4):
        assert F.recall_at_k(fpr, k) == pytest.approx(sum(0 <= int(f) < k for f in fpr) / 10, abs=1e-15)
    assert F.precision_at_1(fpr) == pytest.approx(sum(bool(r[0]) for r in rel) / 10, abs=1e-15)
    rp, ap = [], []
    for r, n in zip(rel.tolist(), num.tolist()):
        if n == 0:
            continue
        rp.append(sum(r[:n]) / n)
        ap.append(sum(sum(r[: i + 1]) / (i + 1) for i in range(n) if r[i]) / n)
    assert F.r_precision(rel, num) == pytest.approx(sum(rp) / len(rp), abs=1e-15)
    assert F.map_at_r(rel, num) == pytest.approx(sum(ap) / len(ap), abs=1e-15)


@pytest.mark.parametrize("name", ["r_precision", "map@r", "map", "ndcg@3"])
def test_per_query_gives_zero_not_nan_to_queries_without_a_relevant_item(name: str) -> None:
    """``per_query``: a value for every query; a query with R = 0 (left out of the mean) gets 0.0, never NaN."""
    g = torch.Generator().manual_seed(7)
    y = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3])
    x = torch.randn(10, 3, generator=g)
    stats = F.retrieval_stats(x, y, metrics=[name])
    values, included = F.per_query(stats, F.parse_metric(name))
    assert torch.isfinite(values).all()
    assert included.tolist() == [int(c) != 3 for c in y]
    assert values[~included].tolist() == [0.0]
    assert F.retrieval_metrics(x, y, metrics=[name])[name] == pytest.approx(float(values[included].mean()), abs=1e-15)


def test_a_process_evaluating_alone_joins_no_collective(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under a process group of 2 with ``distributed=False`` (each process its own set), the search settings
    are not agreed with the other processes (a collective the others would not join) and the figures are the
    plain ones."""
    x = torch.randn(12, 3, generator=torch.Generator().manual_seed(8))
    y = torch.arange(3).repeat(4)
    want = F.retrieval_metrics(x, y)

    def no_collective(*args: object, **kwargs: object) -> None:
        raise AssertionError("a collective was entered without distributed=True")

    monkeypatch.setattr(F, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(F, "agree_search_settings", no_collective)
    monkeypatch.setattr(F, "run_distributed", no_collective)
    assert F.retrieval_metrics(x, y, distributed=False) == want
