"""Embeddings of extreme scale (issue 10): every figure equals that of the same set scaled down by one factor.

Cosine ranking and Euclidean ranking are scale-invariant, so are NMI/F1 of a k-means on the (normalised or raw)
embeddings. Before the fix, at about 1e19 and beyond, float32 squares overflowed: Euclidean Recall@1 came out 1.0
instead of 0.9, cosine NMI/F1 0.0, and the k-means++ seeding crashed on an Inf probability.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.metrics import functional as F
from tests.metrics_reference import brute_metrics


def _clustered(
    n: int = 120, d: int = 16, classes: int = 10, seed: int = 0, spread: float = 3.0
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(classes).repeat_interleave(n // classes)
    x = spread * torch.randn(classes, d, generator=g)[y] + torch.randn(n, d, generator=g)
    return x, y


@pytest.mark.parametrize("scale", [2.0**100, 2.0**-100, 1e30, 1e19, 1e-30])
@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_retrieval_metrics_scale_invariant(metric: str, scale: float) -> None:
    x, y = _clustered(spread=0.6)
    big = x * scale
    assert bool(torch.isfinite(big).all())
    ks = (1, 2, 4, 8)
    ref = brute_metrics(big.double() / scale, y, ks, metric)  # the same embeddings scaled down by one factor
    got = F.retrieval_metrics(big, y, recall_at=ks, metric=metric, precision="fp32")
    small = F.retrieval_metrics(x, y, recall_at=ks, metric=metric, precision="fp32")
    for key in ref:
        assert got[key] == pytest.approx(ref[key], abs=1e-12), key
    if scale in (2.0**100, 2.0**-100):  # exact scaling: identical to the unscaled set
        assert got == small
    assert 0.2 < got["recall@1"] < 1.0  # a set where the figure is informative


@pytest.mark.parametrize("scale", [2.0**100, 1e30, 1e-30])
@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_clustering_metrics_scale_invariant(metric: str, scale: float) -> None:
    x, y = _clustered(seed=1)
    ref = F.clustering_metrics(x, y, metric=metric, seeds=2, backend="torch")
    got = F.clustering_metrics(x * scale, y, metric=metric, seeds=2, backend="torch")
    assert ref["nmi"] > 0.5 and ref["f1"] > 0.3
    if scale == 2.0**100:
        assert got == ref
    else:  # 1e30 is not a power of two: the rows round differently, the clusters here do not change
        assert got == pytest.approx(ref, abs=1e-12)


def test_kmeans_seeding_at_huge_scale_does_not_crash() -> None:
    """k-means++ drew with probabilities |x - c|^2 that overflowed float32 (the crash of issue 10)."""
    x, y = _clustered(seed=2)
    for backend in ("torch", "faiss") if F.kmeans.__module__ and _faiss() else ("torch",):
        small = F.kmeans(x, 10, iters=5, seed=0, backend=backend)
        big = F.kmeans(x * 2.0**120, 10, iters=5, seed=0, backend=backend)
        assert torch.equal(small, big), backend


def _faiss() -> bool:
    from lightning_dml.metrics.kmeans import faiss_available

    return faiss_available()


def test_metric_class_at_huge_scale_equals_scaled_down() -> None:
    x, y = _clustered(seed=3)
    out = {}
    for s in (1.0, 2.0**110):
        m = RetrievalMetrics(recall_at=(1, 4), metric="euclidean", kmeans_seeds=1, kmeans_backend="torch")
        m.update(x * s, y)
        out[s] = m.compute()
    assert out[1.0] == out[2.0**110]


def test_knn_scores_are_in_raw_units_at_huge_scale() -> None:
    x, _ = _clustered(n=40, seed=4)
    s, i = F.knn(x, k=3, metric="euclidean")
    s_big, i_big = F.knn(x * 2.0**100, k=3, metric="euclidean")
    assert torch.equal(i, i_big)
    assert torch.equal(s_big, s * 2.0**200)


def test_float64_input_beyond_float32_range_is_a_clear_error() -> None:
    x, y = _clustered(n=20)
    with pytest.raises(ValueError, match="overflow float32"):
        F.retrieval_metrics(x.double() * 1e300, y)
