"""Retrieval metrics against a float64 brute force, scikit-learn and pytorch-metric-learning."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.metrics import functional as F
from lightning_dml.metrics import _candidates, _scan
from lightning_dml.metrics._candidates import SearchRequest, concat_results, merge_states
from lightning_dml.metrics._ranks import finish, run_search
from lightning_dml.metrics._scan import initial_state, scan_symmetric
from lightning_dml.metrics._scores import Scorer, tree_sum
from tests.metrics_reference import brute_metrics, brute_rankings, brute_scores

KEYS = ("recall@1", "recall@2", "recall@4", "recall@8", "recall@16", "precision@1", "r_precision", "map@r")


def _tricky_set(n: int = 360, d: int = 32, classes: int = 45, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random embeddings with exact duplicates, near-duplicates (1e-6) and singleton classes."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = torch.randint(0, classes, (n,), generator=g)
    x[10:20] = x[0]  # exact duplicates of row 0, mixed labels -> ties broken by index
    # near-duplicates of row 1: their scores differ by ~1e-9, far below the fp32/bf16 error of the
    # approximate pass (so the exact re-scoring decides) and far above float64 rounding
    x[20:40] = x[1] + 1e-4 * torch.randn(20, d, generator=g)
    # same direction, scaled by powers of two (exact in float): exact cosine ties, different distances
    x[40:50] = x[2] * (2.0 ** torch.arange(-5, 5, dtype=torch.float32)).unsqueeze(1)
    y[50] = 1000  # singleton classes: R = 0
    y[51] = 1001
    return x, y


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_metrics_equal_fp64_brute_force(metric: str, precision: str, device: torch.device) -> None:
    x, y = _tricky_set()
    ks = (1, 2, 4, 8, 16)
    ref = brute_metrics(x, y, ks, metric)
    got = F.retrieval_metrics(x.to(device), y.to(device), recall_at=ks, metric=metric, precision=precision)
    for key in KEYS:
        assert got[key] == pytest.approx(ref[key], abs=1e-12), key


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
@pytest.mark.parametrize("precision", ["fp32", "tf32", "bf16"])
def test_knn_lists_equal_fp64_brute_force_with_near_duplicates(metric: str, precision: str, device: torch.device) -> None:
    x, y = _tricky_set(seed=1)
    k = 25
    scores, idx = F.knn(x.to(device), k=k, metric=metric, precision=precision)
    assert idx.device.type == device.type
    scores, idx = scores.cpu(), idx.cpu()
    ref = brute_rankings(x, y, metric)
    s64 = brute_scores(x, metric)
    for q, cand, _, _ in ref:
        assert idx[q].tolist() == cand[:k], f"query {q}"
        assert torch.allclose(scores[q], s64[q, cand[:k]], rtol=0, atol=1e-12)


def test_knn_small_chunks_and_many_blocks() -> None:
    """Several query blocks and gallery chunks (and buffers that overflow) give the same exact lists."""
    x, y = _tricky_set(n=300, seed=2)
    ps = F.prepare(x, y)
    task, scorer, grid = F.build_search(ps, precision="fp32", query_block=37, gallery_chunk=23)
    ks = (1, 5, 50)
    res, _ = run_search(task, scorer, grid, SearchRequest(30, ks, exact_scores=True))
    ref = brute_rankings(x, y)
    for q, cand, rel, _ in ref:
        assert res.neighbors[q].tolist() == cand[:30]
        first = rel.index(True) if any(rel) else -1
        rank = int(res.first_positive_rank[q])
        assert (rank == -1) == (first == -1)
        for k in ks:  # the rank is resolved exactly wherever it decides rank < K
            assert (0 <= rank < k) == (0 <= first < k), (q, k)


def test_symmetric_pass_queries_below_the_shared_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    """Clusters of very different spreads: the candidate thresholds of the loose clusters' queries lie below a
    tile's shared threshold (its quantile raised here), so they take their candidates from their own rows and columns of the tile; the lists
    and the decided ranks still equal the fp64 brute force (exact duplicates included)."""
    g = torch.Generator().manual_seed(21)
    centres = torch.randn(12, 16, generator=g)
    spread = torch.linspace(0.01, 2.0, 12)
    y = torch.arange(12).repeat_interleave(25)
    x = centres[y] + spread[y, None] * torch.randn(300, 16, generator=g)
    x[:3] = x[3:6]
    sides = []
    below = _scan._below_shared
    monkeypatch.setattr(_scan, "_below_shared", lambda *args: sides.append(args[-1]) or below(*args))
    monkeypatch.setattr(_scan, "_SHARED_QUANTILE", 0.25)  # a quarter of each tile's queries lie below it
    task, scorer, grid = F.build_search(F.prepare(x, y), precision="fp32", query_block=32)
    assert grid.symmetric(task)
    ks = (1, 5, 50)
    res, _ = run_search(task, scorer, grid, SearchRequest(10, ks, exact_scores=True))
    assert {0, 1} <= set(sides)  # both sides of some tiles had queries below the shared threshold
    for q, cand, rel, _ in brute_rankings(x, y):
        assert res.neighbors[q].tolist() == cand[:10], f"query {q}"
        first = rel.index(True) if any(rel) else -1
        rank = int(res.first_positive_rank[q])
        for k in ks:
            assert (0 <= rank < k) == (0 <= first < k), (q, k)


def test_scorer_rows_by_view_and_by_gather_agree() -> None:
    """Consecutive positions are read as a view of the representation, others gathered: the same scores."""
    x, _ = _tricky_set(n=80, seed=4)
    sc = Scorer(x, "cosine", "fp32")
    run = torch.arange(10, 40)
    perm = run[torch.randperm(30, generator=torch.Generator().manual_seed(0))]
    gal = torch.arange(80)
    assert torch.equal(sc.approx(perm, gal), sc.approx(run, gal)[perm - 10])
    assert torch.equal(sc.approx(gal, perm), sc.approx(gal, run)[:, perm - 10])


def test_query_vs_gallery_knn() -> None:
    g = torch.Generator().manual_seed(3)
    q = torch.randn(40, 16, generator=g)
    gal = torch.randn(70, 16, generator=g)
    gal[5] = gal[6]  # tie inside the gallery
    q[0] = gal[5]
    scores, idx = F.knn(q, gal, k=10)
    f = torch.nn.functional.normalize(gal.double(), dim=1)
    fq = torch.nn.functional.normalize(q.double(), dim=1)
    for i in range(40):
        s = (f * fq[i]).sum(dim=1)
        order = sorted(range(70), key=lambda j: (-float(s[j]), j))[:10]
        assert idx[i].tolist() == order
    assert idx[0, :2].tolist() == [5, 6]


@pytest.mark.parametrize("with_gallery", [False, True])
def test_knn_lists_no_relevant_pairs(monkeypatch, with_gallery: bool) -> None:
    """A neighbour search has no labels: its task must list no relevant pairs. With one label for every item it
    listed all Q x M pairs (N^2 for a self-search: 20,000 items ran out of 24 GiB) and searched for R = all
    of them."""
    from lightning_dml.metrics._task import RetrievalTask

    seen = []
    init = RetrievalTask.__init__

    def spy(self, *args, **kwargs):
        init(self, *args, **kwargs)
        seen.append(int(self.pos_gpos.numel()))

    monkeypatch.setattr(RetrievalTask, "__init__", spy)
    x = torch.randn(30, 4, generator=torch.Generator().manual_seed(0))
    scores, idx = F.knn(x[:7], x, k=3) if with_gallery else F.knn(x, k=3)
    assert seen == [0] and idx.shape == (7 if with_gallery else 30, 3) and bool((idx >= 0).all())


def test_tie_rule_smaller_index_first() -> None:
    """Query 0 has a negative (index 1) and a positive (index 2) at identical similarity: R@1 = 0, R@2 = 1."""
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.0, 1.0], [-1.0, 0.0]])
    y = torch.tensor([0, 1, 0, 1])
    out = F.retrieval_metrics(x[:3], y[:3], recall_at=(1, 2), map_at_r=False)
    # query 0: items 1, 2 both at cosine 0 -> index 1 (negative) first
    # query 1: item 2 identical (cos 1) but negative... item 2 has label 0, item 1 label 1 -> no positive
    # query 2: item 1 identical (negative, cos 1) then item 0 (positive, cos 0)
    assert out["recall@1"] == pytest.approx(0.0)
    assert out["recall@2"] == pytest.approx(2 / 3)


def test_in_shop_hand_computed() -> None:
    """In-Shop mode: queries ranked against a separate gallery (nothing removed), computed by hand.

    Embeddings on the unit circle at angles (degrees). Gallery: g0 at 0 (class A), g1 at 10 (class B),
    g2 at 90 (class A), g3 at 180 (class B). Queries: q0 at 5 (class A), q1 at 170 (class A), q2 at 100
    (class C, no gallery item).
      q0 ranking: g0 (5 deg), g1 (5 deg: tie, g0 has the smaller index), g2, g3 -> first positive rank 0.
      q1 ranking: g3 (10), g2 (80), g1 (160), g0 (170) -> first positive (g2) at rank 1.
      q2: no positive -> counts as a miss in Recall@K, excluded from R-Precision / MAP@R.
    Recall@1 = 1/3, Recall@2 = 2/3. R = 2 for q0 and q1:
      q0 top-2 = [A, B] -> R-Precision 1/2, AP@R = (1/1) / 2 = 1/2.
      q1 top-2 = [B, A] -> R-Precision 1/2, AP@R = (1/2) / 2 = 1/4.
    R-Precision = 1/2, MAP@R = 3/8.
    """

    def unit(deg: float) -> list[float]:
        return [math.cos(math.radians(deg)), math.sin(math.radians(deg))]

    items = [(5, 0, "q"), (0, 0, "g"), (170, 0, "q"), (10, 1, "g"), (90, 0, "g"), (100, 2, "q"), (180, 1, "g")]
    x = torch.tensor([unit(a) for a, _, _ in items], dtype=torch.float32)
    y = torch.tensor([c for _, c, _ in items])
    qm = torch.tensor([k == "q" for _, _, k in items])
    out = F.retrieval_metrics(x, y, recall_at=(1, 2, 4), query_mask=qm, gallery_mask=~qm, precision="fp32")
    assert out["recall@1"] == pytest.approx(1 / 3)
    assert out["recall@2"] == pytest.approx(2 / 3)
    assert out["recall@4"] == pytest.approx(2 / 3)
    assert out["r_precision"] == pytest.approx(1 / 2)
    assert out["map@r"] == pytest.approx(3 / 8)
    m = RetrievalMetrics(recall_at=(1, 2), clustering=False)
    m.update(x[:4], y[:4], query_mask=qm[:4], gallery_mask=~qm[:4])
    m.update(x[4:], y[4:], query_mask=qm[4:], gallery_mask=~qm[4:])
    res = m.compute()
    assert res["recall@2"] == pytest.approx(2 / 3) and res["map@r"] == pytest.approx(3 / 8)


def test_in_shop_against_brute_force(device: torch.device) -> None:
    g = torch.Generator().manual_seed(4)
    x = torch.randn(300, 24, generator=g)
    y = torch.randint(0, 60, (300,), generator=g)
    qm = torch.rand(300, generator=g) < 0.5
    ref = brute_metrics(x, y, (1, 10, 20), "cosine", qm, ~qm)
    x, y, qm = x.to(device), y.to(device), qm.to(device)
    got = F.retrieval_metrics(x, y, recall_at=(1, 10, 20), query_mask=qm, gallery_mask=~qm, query_block=64, gallery_chunk=50)
    for key in ("recall@1", "recall@10", "recall@20", "r_precision", "map@r"):
        assert got[key] == pytest.approx(ref[key], abs=1e-12), key


def test_against_pytorch_metric_learning() -> None:
    pml = pytest.importorskip("pytorch_metric_learning.utils.accuracy_calculator")
    g = torch.Generator().manual_seed(5)
    y = torch.arange(60).repeat_interleave(torch.randint(2, 9, (60,), generator=g))
    centers = torch.randn(60, 64, generator=g)
    x = centers[y] + 1.2 * torch.randn(y.numel(), 64, generator=g)
    calc = pml.AccuracyCalculator(
        include=("precision_at_1", "r_precision", "mean_average_precision_at_r"), device=torch.device("cpu")
    )
    xn = torch.nn.functional.normalize(x, dim=1)
    ref = calc.get_accuracy(xn, y, xn, y, ref_includes_query=True)
    got = F.retrieval_metrics(x, y, recall_at=(1,))
    assert got["precision@1"] == pytest.approx(ref["precision_at_1"], abs=1e-6)
    assert got["r_precision"] == pytest.approx(ref["r_precision"], abs=1e-6)
    assert got["map@r"] == pytest.approx(ref["mean_average_precision_at_r"], abs=1e-6)


def test_nmi_matches_sklearn() -> None:
    sk = pytest.importorskip("sklearn.metrics")
    g = torch.Generator().manual_seed(6)
    for n, a, b in ((500, 7, 9), (300, 40, 25), (50, 50, 3)):
        y = torch.randint(0, a, (n,), generator=g) * 3 + 11  # non-contiguous label values
        c = torch.randint(0, b, (n,), generator=g)
        ref = sk.normalized_mutual_info_score(y.numpy(), c.numpy(), average_method="arithmetic")
        assert F.nmi(y, c) == pytest.approx(ref, abs=1e-12)
    y = torch.randint(0, 5, (100,), generator=g)
    assert F.nmi(y, y * 7) == pytest.approx(1.0)
    assert F.nmi(torch.zeros(10, dtype=torch.long), torch.zeros(10, dtype=torch.long)) == 1.0


def _f1_by_pairs(y: torch.Tensor, c: torch.Tensor) -> float:
    tp = fp = fn = 0
    n = y.numel()
    for i in range(n):
        for j in range(i + 1, n):
            same_c, same_y = bool(c[i] == c[j]), bool(y[i] == y[j])
            tp += same_c and same_y
            fp += same_c and not same_y
            fn += same_y and not same_c
    p = tp / (tp + fp) if tp + fp else 0.0
    r = tp / (tp + fn) if tp + fn else 0.0
    return 2 * p * r / (p + r) if p + r else 0.0


def test_f1_matches_pair_enumeration() -> None:
    g = torch.Generator().manual_seed(7)
    for n, a, b in ((120, 6, 8), (90, 30, 30), (60, 2, 15)):
        y = torch.randint(0, a, (n,), generator=g)
        c = torch.randint(0, b, (n,), generator=g)
        assert F.f1_score(y, c) == pytest.approx(_f1_by_pairs(y, c), abs=1e-12)
    assert F.f1_score(y, y) == pytest.approx(1.0)


def test_clustering_metrics_on_separated_blobs_and_sklearn_on_kmeans_output(device: torch.device) -> None:
    sk = pytest.importorskip("sklearn.metrics")
    g = torch.Generator().manual_seed(8)
    y = torch.arange(12).repeat_interleave(25)
    x = 20 * torch.randn(12, 16, generator=g)[y] + torch.randn(300, 16, generator=g)
    from lightning_dml.metrics.kmeans import faiss_available

    for backend in ("torch", "faiss") if faiss_available() else ("torch",):
        assign = F.kmeans(x.to(device), 12, iters=20, seed=0, backend=backend)
        assert assign.device.type == device.type
        assign = assign.cpu()
        assert F.nmi(y, assign) == pytest.approx(sk.normalized_mutual_info_score(y.numpy(), assign.numpy()), abs=1e-12)
    out = F.clustering_metrics(x.to(device), y.to(device), metric="euclidean", seeds=3, backend="torch")
    assert out["nmi"] > 0.95 and out["f1"] > 0.85


def test_torch_kmeans_is_deterministic_and_handles_empty_clusters() -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(200, 8, generator=g)
    x[:150] = 0.0  # 150 identical points: most initial centroids coincide -> empty clusters
    a1 = F.kmeans(x, 30, iters=10, seed=3, backend="torch")
    a2 = F.kmeans(x, 30, iters=10, seed=3, backend="torch")
    assert torch.equal(a1, a2)
    assert a1.min() >= 0 and a1.max() < 30
    # the 50 distinct points each get their own cluster or share one only if needed
    assert torch.unique(a1).numel() >= 20


def test_metric_class_batches_duplicates_and_order(device: torch.device) -> None:
    """Batched updates, DDP-style repeated (padding) rows and shuffled order give the functional result."""
    x, y = _tricky_set(n=240, seed=10)
    ref = F.retrieval_metrics(x, y, recall_at=(1, 2, 4, 8))
    perm = torch.randperm(240, generator=torch.Generator().manual_seed(0))
    pad = torch.tensor([5, 17, 3])
    order = torch.cat([perm, pad])
    m = RetrievalMetrics(recall_at=(1, 2, 4, 8), clustering=True).to(device)
    x, y, order = x.to(device), y.to(device), order.to(device)
    for chunk in order.split(50):
        m.update(x[chunk], y[chunk], indices=chunk)
    out = m.compute()
    for key, val in ref.items():
        assert out[key] == pytest.approx(val, abs=0), key
    assert set(out) == set(ref) | {"nmi", "f1"}
    assert all(0.0 <= v <= 1.0 for v in out.values())
    m.reset()
    with pytest.raises(ValueError, match="no data"):
        m.compute()


def test_recall_k_larger_than_gallery_and_lone_queries() -> None:
    x = torch.randn(6, 4)
    y = torch.tensor([0, 0, 1, 2, 3, 4])
    with pytest.warns(UserWarning, match=r"recall_at \[100\] exceed\(s\) the 5 gallery items"):
        out = F.retrieval_metrics(x, y, recall_at=(1, 5, 100))
    assert out["recall@100"] == pytest.approx(2 / 6)  # only the two class-0 queries have a positive
    assert out["recall@5"] == pytest.approx(2 / 6)


def test_recall_k_beyond_the_gallery_warns_once() -> None:
    """A K larger than the items a query is ranked against: one warning per place, not one per evaluation."""
    import warnings

    x, y = torch.randn(8, 4), torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    qm = torch.tensor([True, False] * 4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        for _ in range(3):
            m = RetrievalMetrics(recall_at=(1, 4, 8), clustering=False)
            m.update(x, y, query_mask=qm, gallery_mask=~qm)  # 4 gallery items
            m.compute()
    texts = [str(w.message) for w in caught if issubclass(w.category, UserWarning)]
    assert texts == ["recall_at [8] exceed(s) the 4 gallery items a query is ranked against: Recall@K for those K "
                     "equals Recall@4"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        F.retrieval_metrics(x, y, recall_at=(1, 4), query_mask=qm, gallery_mask=~qm)  # K = gallery size: no warning


def test_labels_of_another_type_are_named() -> None:
    """numpy or list labels: the message names the type (it used to print "got shape ndarray")."""
    import numpy as np

    m = RetrievalMetrics(clustering=False)
    with pytest.raises(ValueError, match=r"labels must be a 1-D torch.Tensor .* got a numpy.ndarray \(convert it "):
        m.update(torch.randn(4, 3), np.array([0, 0, 1, 1]))
    with pytest.raises(ValueError, match=r"labels must be a 1-D torch.Tensor .* got a list"):
        m.update(torch.randn(4, 3), [0, 0, 1, 1])
    with pytest.raises(ValueError, match=r"query_mask must be a 1-D torch.Tensor .* got a list"):
        F.retrieval_metrics(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]), query_mask=[True] * 4,
                            gallery_mask=torch.ones(4, dtype=torch.bool))


def test_input_validation() -> None:
    x = torch.randn(10, 4)
    y = torch.randint(0, 3, (10,))
    m = RetrievalMetrics(clustering=False)
    with pytest.raises(ValueError, match="NaN"):
        bad = x.clone()
        bad[3, 1] = float("nan")
        m.update(bad, y)
    with pytest.raises(ValueError, match="Inf"):
        bad = x.clone()
        bad[2, 0] = float("inf")
        m.update(bad, y)
    with pytest.raises(ValueError, match="labels"):
        m.update(x, y[:9])
    with pytest.raises(ValueError, match="2-D"):
        m.update(x[0], y)
    with pytest.raises(ValueError, match="dimension changed"):
        m.update(x, y)
        m.update(torch.randn(3, 5), y[:3])
    with pytest.raises(ValueError, match="query_mask and gallery_mask"):
        F.retrieval_metrics(x, y, query_mask=torch.ones(10, dtype=torch.bool))
    with pytest.raises(ValueError, match="zero norm"):
        z = x.clone()
        z[4] = 0
        F.retrieval_metrics(z, y)
    with pytest.raises(ValueError, match="index 3 appears more than once"):
        F.retrieval_metrics(x, y, indices=torch.tensor([0, 1, 2, 3, 3, 5, 6, 7, 8, 9]))
    with pytest.raises(ValueError, match="index 3 appears more than once with different"):
        conflict = RetrievalMetrics(clustering=False)
        conflict.update(x, y, indices=torch.tensor([0, 1, 2, 3, 3, 5, 6, 7, 8, 9]))
        conflict.compute()
    with pytest.raises(ValueError, match="precision must be one of"):
        RetrievalMetrics(precision="fp16")
    with pytest.raises(ValueError, match="no data"):
        RetrievalMetrics().compute()


def test_error_bound_holds() -> None:
    """The approximate scores stay within the stated bound of the exact ones (fp32, TF32 emulated, bf16)."""
    g = torch.Generator().manual_seed(11)
    x = torch.randn(200, 96, generator=g) * torch.rand(200, 1, generator=g) * 10
    items = torch.arange(200)
    for metric in ("cosine", "euclidean"):
        for prec in ("fp32", "tf32", "bf16"):
            sc = Scorer(x, metric, prec)
            a = sc.approx(items, items).double()
            w = sc.error_bound(items, items)
            qi, gi = torch.meshgrid(items, items, indexing="ij")
            e = sc.exact(qi.reshape(-1), gi.reshape(-1)).reshape(200, 200)
            assert bool(((a - e).abs() <= w.unsqueeze(1)).all()), (metric, prec)


def test_tree_sum_is_batch_independent() -> None:
    t = torch.randn(50, 77, dtype=torch.float64)
    full = tree_sum(t)
    for i in (0, 13, 49):
        assert float(tree_sum(t[i : i + 1])[0]) == float(full[i])
    assert torch.allclose(full, t.sum(dim=1))


def test_count_true_with_more_than_2047_true_entries_in_one_row() -> None:
    """A window with >= 2,048 true entries for one query: each byte lane of the word-wise count must stop at 255.

    N = 3,000 points in 2-D (cosine): rows 0-2047 at (1, u), the rest at (-1, u), u ~ U(-0.1, 0.1), all labels
    distinct but one pair, (1, 0) (row 0) and (-1, 0.3) (row 2048). The best positive of row 0 has exactly 2,047
    items ahead of it (the other rows near (1, 0)): Recall@2047 misses, Recall@2048 hits.
    """
    g = torch.Generator().manual_seed(0)
    n = 3000
    u = torch.rand(n, generator=g) * 0.2 - 0.1
    x = torch.stack([torch.where(torch.arange(n) < 2048, 1.0, -1.0), u], dim=1)
    x[0] = torch.tensor([1.0, 0.0])
    x[2048] = torch.tensor([-1.0, 0.3])
    y = torch.arange(n)
    y[2048] = 0
    # the counting primitive itself, on a window with every entry true and on a random one
    for m in (torch.ones(4, 4096, dtype=torch.bool), torch.rand(8, 4096, generator=g) < 0.9):
        assert torch.equal(_candidates.count_true(m, 1), m.sum(1, dtype=torch.int32))
        assert torch.equal(_candidates.count_true(m.T.contiguous(), 0), m.sum(1, dtype=torch.int32))
    ks = (1, 1000, 2047, 2048, 2500)
    stats = F.retrieval_stats(x, y, rank_ks=ks, k=1, precision="fp32")
    x64 = x.double()  # the pair's exact ranks, from a float64 brute force with the tie rule
    cos = (x64[[0, 2048]] @ x64.T) / (x64[[0, 2048]].norm(dim=1, keepdim=True) * x64.norm(dim=1))
    expect = []
    for row, q, p in ((cos[0], 0, 2048), (cos[1], 2048, 0)):
        ahead = (row > row[p]) | ((row == row[p]) & (torch.arange(n) < p))
        ahead[q] = False
        expect.append(int(ahead.sum()))
    assert expect[0] == 2047
    assert stats.first_positive_rank[[0, 2048]].tolist() == expect
    got = F.retrieval_metrics(x, y, recall_at=ks, map_at_r=False, precision="fp32")
    for k in ks:
        assert got[f"recall@{k}"] == sum(r < k for r in expect) / n, k


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_symmetric_tile_pass_equals_brute_force(precision: str) -> None:
    """All-vs-all with many tiles (the symmetric pass, split over 3 simulated processes too)."""
    x, y = _tricky_set(n=330, seed=12)
    ks = (1, 2, 4, 8, 16)
    ref = brute_metrics(x, y, ks)
    ps = F.prepare(x, y)
    task, scorer, grid = F.build_search(ps, precision=precision, query_block=40)
    assert grid.symmetric(task)
    k = int(task.num_relevant.max())
    stats = F.retrieval_stats(x, y, rank_ks=ks, precision=precision, query_block=40, k=k)
    got = F.stats_to_metrics(stats, ks)
    for key in KEYS:
        assert got[key] == pytest.approx(ref[key], abs=1e-12), key
    # three "processes", each with its share of tiles, merged as under DDP
    world = 3
    partial = []
    request = SearchRequest(k, ks)
    for rank in range(world):
        st = initial_state(task, scorer, torch.arange(330), request)
        scan_symmetric(task, scorer, grid, st, (rank, world))
        partial.append(st)
    merged = merge_states(partial)
    blocks = range(grid.num_blocks(task))
    res = concat_results([finish(task, scorer, grid, merged.select(grid.block_rows(task, b)), request) for b in blocks], k)
    single, _ = run_search(task, scorer, grid, request)
    assert torch.equal(res.first_positive_rank >= 0, single.first_positive_rank >= 0)
    for kk in ks:
        assert torch.equal((res.first_positive_rank >= 0) & (res.first_positive_rank < kk),
                           (single.first_positive_rank >= 0) & (single.first_positive_rank < kk))
    assert torch.equal(res.neighbors >= 0, stats.neighbors >= 0)
    labels = y[task.g_items[res.neighbors.clamp(min=0)]]
    assert torch.equal((res.neighbors >= 0) & (labels == y.unsqueeze(1)), stats.relevance)


def test_progress_bars_are_opt_in_and_do_not_change_results(capsys):
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(400, 8, generator=g), torch.randint(0, 20, (400,), generator=g)
    quiet = RetrievalMetrics(recall_at=(1, 4), kmeans_seeds=2, query_block=64, gallery_chunk=64)
    loud = RetrievalMetrics(recall_at=(1, 4), kmeans_seeds=2, query_block=64, gallery_chunk=64, progress=True)
    quiet.update(x, y)
    loud.update(x, y)
    assert quiet.compute() == loud.compute()
    err = capsys.readouterr().err
    assert "retrieval" in err and "k-means" in err
    quiet.compute()
    assert capsys.readouterr().err == ""


def test_update_from_batch_equals_update() -> None:
    """An evaluation batch (images, labels, indices[, is_query, is_gallery]) is unpacked by the metric itself."""
    g = torch.Generator().manual_seed(13)
    x, y = torch.randn(60, 8, generator=g), torch.randint(0, 6, (60,), generator=g)
    idx = torch.arange(60)
    qm = torch.rand(60, generator=g) < 0.5
    images = torch.zeros(60, 1, 2, 2)
    for batch, kwargs in (
        ((images, y, idx), {"indices": idx}),
        ((images, y, idx, qm, ~qm), {"indices": idx, "query_mask": qm, "gallery_mask": ~qm}),
    ):
        a, b = RetrievalMetrics(clustering=False), RetrievalMetrics(clustering=False)
        a.update_from_batch(x, batch)
        b.update(x, y, **kwargs)
        assert a.compute() == b.compute()
    with pytest.raises(ValueError, match="evaluation batch must be"):
        RetrievalMetrics().update_from_batch(x, (images,))


def test_tile_sizes_from_budget_and_compute_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """Explicit tile sizes and memory budgets change the tiling, never a figure; compute_device='cpu' works."""
    from lightning_dml.metrics._device import TILE_ENTRY_BYTES, tile_sizes

    cpu = torch.device("cpu")
    assert tile_sizes(cpu, 60502, 60502) == (2048, 8192)
    qb, gc = tile_sizes(cpu, 10**6, 10**6, tile_memory=TILE_ENTRY_BYTES * 100 * 100)
    assert qb * gc <= 100 * 100 and qb == 100
    assert tile_sizes(cpu, 50, 70, query_block=1000, gallery_chunk=7) == (50, 7)
    # CUDA: a quarter of the free memory, at most 4 GB (the logic, with the free memory of an 80 GB GPU faked)
    from lightning_dml.metrics import _device

    free = {"now": 80 * 2**30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["now"], 80 * 2**30))
    gpu = torch.device("cuda")
    assert tile_sizes(gpu, 10**6, 10**6) == (16384, 16384)
    assert _device.GPU_TILE_MEMORY_CAP == TILE_ENTRY_BYTES * 16384 * 16384
    free["now"] = 4 * TILE_ENTRY_BYTES * 4096 * 4096  # a busy GPU: smaller tiles
    assert tile_sizes(gpu, 10**6, 10**6) == (4096, 4096)
    assert tile_sizes(gpu, 5000, 10**6) == (4096, 4096)
    assert tile_sizes(gpu, 1000, 3000) == (1000, 3000)
    x, y = _tricky_set(n=200, seed=14)
    ref = brute_metrics(x, y, (1, 4))
    for kwargs in ({"tile_memory": TILE_ENTRY_BYTES * 30 * 30}, {"query_block": 33, "gallery_chunk": 17}):
        got = F.retrieval_metrics(x, y, recall_at=(1, 4), **kwargs)
        for key in ("recall@1", "recall@4", "map@r"):
            assert got[key] == pytest.approx(ref[key], abs=1e-12), (kwargs, key)
    m = RetrievalMetrics(recall_at=(1, 4), clustering=False, compute_device="cpu", tile_memory=TILE_ENTRY_BYTES * 900)
    m.update(x, y)
    assert m.compute()["recall@4"] == pytest.approx(ref["recall@4"], abs=1e-12)
