"""The metrics engine (lightning_dml/metrics/): cases the mutation check (issue 26, docs/testing.md) found untested,
each against the float64 brute force of tests/metrics_reference.py."""

from __future__ import annotations

import pytest
import torch

from lightning_dml.metrics import functional as F
from tests.metrics_reference import brute_task_metrics

METRICS = ["precision@3", "ndcg@4", "mrr", "map", "fnmr@fmr=0.1", "fnmr@fmr=1"]


def _data(n: int = 40, classes: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    return torch.randn(classes, 6, generator=g)[y] + 0.8 * torch.randn(n, 6, generator=g), y


def _compare(got: dict, want: dict) -> None:
    for key, value in want.items():
        if key.startswith("_") or key.startswith("threshold"):
            continue
        assert got[key] == pytest.approx(value, abs=1e-12), key


def test_label_sets_of_one_column_are_the_plain_labels() -> None:
    """``[N, 1]`` label sets (L = 1 is allowed, only L = 0 is refused) give the plain labels' figures."""
    x, y = _data()
    plain = F.retrieval_metrics(x, y, metrics=METRICS)
    sets = F.retrieval_metrics(x, y.unsqueeze(1), metrics=METRICS)
    assert sets == plain
    _compare(plain, brute_task_metrics(x, y, precision_at=(3,), ndcg_at=(4,), fmrs=("0.1", "1")))
    with pytest.raises(ValueError, match="L >= 1"):
        F.retrieval_metrics(x, torch.zeros(40, 0, dtype=torch.long))


def test_fnmr_at_fmr_one_and_without_negative_pairs() -> None:
    """F = 1 accepts every pair: threshold -inf, FNMR 0.0; a set of one class has no negative pair: the same."""
    x, y = _data(seed=1)
    got = F.retrieval_metrics(x, y, metrics=["fnmr@fmr=1", "fnmr@fmr=0.5"])
    want = brute_task_metrics(x, y, fmrs=("1", "0.5"))
    assert got["fnmr@fmr=1"] == 0.0 and got["threshold@fmr=1"] == float("-inf")
    assert got["fnmr@fmr=0.5"] == pytest.approx(want["fnmr@fmr=0.5"], abs=1e-15)
    one = F.retrieval_metrics(x, torch.zeros_like(y), metrics=["fnmr@fmr=0.5"])
    assert one["fnmr@fmr=0.5"] == 0.0 and one["threshold@fmr=0.5"] == float("-inf")
    # the false match rate reached: 0.0 without a negative pair, 1.0 when F = 1 accepts every negative
    assert F.retrieval_stats(x, torch.zeros_like(y), metrics=["fnmr@fmr=0.5"]).pairs.fmr == [0.0]
    assert F.retrieval_stats(x, y, metrics=["fnmr@fmr=1"]).pairs.fmr == [1.0]


def test_neighbour_lists_past_the_gallery_are_padded() -> None:
    """k larger than the gallery: the real neighbours in the brute-force order, then -1 (scores -inf)."""
    x, y = _data(n=12, classes=3, seed=2)
    qm = torch.arange(12) < 2
    gm = (torch.arange(12) >= 2) & (torch.arange(12) < 5)
    stats = F.retrieval_stats(x, y, query_mask=qm, gallery_mask=gm, k=5)
    xn = torch.nn.functional.normalize(x.double(), dim=1)
    for row, q in enumerate((0, 1)):
        s = xn[2:5] @ xn[q]
        want = sorted(range(2, 5), key=lambda g: (-float(s[g - 2]), g))
        assert stats.neighbors[row].tolist() == want + [-1, -1]
    scores, ids = F.knn(x[:2], x[2:5], k=5)
    assert (ids[:, 3:] == -1).all() and torch.isinf(scores[:, 3:]).all() and (ids[:, :3] >= 0).all()


def test_a_rate_written_with_more_digits_than_a_float_keeps_its_digits() -> None:
    """``fnmr@fmr=F`` is keyed by F's exact decimal digits, also past float precision (a finite decimal)."""
    name = "fnmr@fmr=0.12345678901234567890123"
    x, y = _data(n=12, classes=3, seed=3)
    got = F.retrieval_metrics(x, y, recall_at=(1,), metrics=[name])
    assert name in got and "threshold@fmr=0.12345678901234567890123" in got


def test_stats_to_metrics_defaults_are_retrieval_metrics_defaults() -> None:
    """Recall@1, 2, 4, 8 with R-Precision and MAP@R by default, as retrieval_metrics (same figures)."""
    x, y = _data(seed=4)
    got = F.stats_to_metrics(F.retrieval_stats(x, y, rank_ks=(1, 2, 4, 8), metrics=["map@r"]))
    assert got == F.retrieval_metrics(x, y)
    assert sorted(got) == sorted(["recall@1", "recall@2", "recall@4", "recall@8", "precision@1", "r_precision",
                                  "map@r"])


@pytest.mark.parametrize("clusters", [[0, 1, 2, 3], [0, 1, 0, 1]])
def test_clustering_f1_without_a_correct_pair_is_zero(clusters: list[int]) -> None:
    """No pair both in one cluster and in one class: precision and recall are 0 and F1 is 0 (the documented value),
    whether the clusters are singletons (no same-cluster pair at all) or mix the classes."""
    labels = torch.tensor([0, 0, 1, 1])
    assert F.f1_score(labels, torch.tensor(clusters)) == 0.0


def test_faiss_kmeans_refuses_more_clusters_than_points_whatever_the_width() -> None:
    """The bound is the number of points (x.shape[0]), not the width: 5 clusters of 3 points in 8 dimensions."""
    from lightning_dml.metrics.kmeans import faiss_available, kmeans

    if not faiss_available():
        pytest.skip("faiss is not installed (the faiss extra)")
    with pytest.raises(ValueError, match="1 <= k <= number of points"):
        kmeans(torch.randn(3, 8), 5, backend="faiss")


def test_an_evaluation_batch_of_images_and_labels_alone_is_accepted() -> None:
    """``(images, labels)``: no indices, masks, sequences or categories."""
    from lightning_dml.metrics.retrieval import eval_batch_targets

    labels = torch.tensor([1, 2])
    got = eval_batch_targets((torch.zeros(2, 3), labels))
    assert got["labels"] is labels and got["indices"] is None and got["query_mask"] is None


# ------------------------------------------------------------------ survivors of the fresh metrics sample (seed 28)
def test_masks_selecting_no_query_or_no_gallery_item_are_refused_by_name():
    """``_items``' two guards: an empty query or gallery side is one clear error, not an empty search."""
    from lightning_dml.metrics.functional import retrieval_metrics

    x, y = torch.randn(10, 4, dtype=torch.float64), torch.arange(10) % 3
    some, none = torch.ones(10, dtype=torch.bool), torch.zeros(10, dtype=torch.bool)
    with pytest.raises(ValueError, match="gallery_mask selects no gallery item"):
        retrieval_metrics(x, y, query_mask=some, gallery_mask=none)
    with pytest.raises(ValueError, match="query_mask selects no query"):
        retrieval_metrics(x, y, query_mask=none, gallery_mask=some)


def test_category_zero_alone_is_a_category():
    """Category ids start at 0: a set whose items all have category 0 gets its per-category metrics (equal to the
    overall ones), through the stateful class as through the functional core."""
    from lightning_dml.metrics import RetrievalMetrics
    from lightning_dml.metrics.functional import retrieval_metrics

    torch.manual_seed(3)
    x, y = torch.randn(12, 4, dtype=torch.float64), torch.arange(12) % 3
    cat = torch.zeros(12, dtype=torch.long)
    m = RetrievalMetrics(recall_at=(1,))
    m.update(x, y, category=cat)
    out = m.compute()
    expected = retrieval_metrics(x, y, recall_at=(1,), category=cat)
    per_category = {k: v for k, v in out.items() if k.startswith("category/0/")}
    assert per_category and per_category == {k: v for k, v in expected.items() if k.startswith("category/0/")}
    for key, value in per_category.items():
        assert value == out[key.removeprefix("category/0/")]


def test_more_than_8192_queries_in_one_set_up_block():
    """The best-positive set-up works on blocks of 8192 query rows: a query block one row longer than that gives
    the brute force's figures (integer coordinates: ties are exact, so the tie rule is checked too)."""
    from lightning_dml.metrics.functional import retrieval_metrics

    g = torch.Generator().manual_seed(5)
    nq, ng = 8193, 12
    x = torch.randint(-3, 4, (nq + ng, 3), generator=g).double()
    y = torch.randint(0, 4, (nq + ng,), generator=g)
    qm = torch.arange(nq + ng) < nq
    got = retrieval_metrics(x, y, recall_at=(1, 2), metric="euclidean", query_mask=qm, gallery_mask=~qm,
                            query_block=nq)
    want = brute_task_metrics(x, y, recall_at=(1, 2), metric="euclidean", query_mask=qm, gallery_mask=~qm)
    for key in ("recall@1", "recall@2", "map@r"):
        assert got[key] == pytest.approx(want[key], rel=1e-12, abs=1e-15), key
