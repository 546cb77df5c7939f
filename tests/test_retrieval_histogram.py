"""pair_score_histogram (issue 22, the report's histograms): every positive and every negative (query, gallery)
pair counted once, in the bin of its exact score, whatever the tiles; and RetrievalResults' R-Precision."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.retrieval import RetrievalResults, pair_score_histogram
from tests.test_metrics_tasks import _task_data


def _on_edges(n: int = 90, seed: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Unit vectors of entries +-0.5 (4-d) beside random ones: their cosines are exact multiples of 1/4, many of
    them on a bin edge of 8 bins over [-1, 1] (edges -1 + j/4), where any rounding error changes the bin."""
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n, 4), generator=g).double() * 2 - 1
    x = 0.5 * signs
    x[n // 2 :] = torch.randn(n - n // 2, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 6, (n,), generator=g)
    seq = torch.randint(-1, 10, (n,), generator=g)
    return x.float(), y, seq


def _brute(x: torch.Tensor, labels: torch.Tensor, metric: str, bins: int, low: float, high: float,
           qm: torch.Tensor | None = None, gm: torch.Tensor | None = None, seq: torch.Tensor | None = None,
           ) -> tuple[list[int], list[int]]:
    """float64 brute force: every (q, g) pair with q != g, g in the gallery, not in q's sequence."""
    x64 = x.double()
    if metric == "cosine":
        x64 = torch.nn.functional.normalize(x64, dim=1)
        s = x64 @ x64.T
    else:
        s = -((x64[:, None, :] - x64[None, :, :]) ** 2).sum(-1)
    n = x.shape[0]
    qm = torch.ones(n, dtype=torch.bool) if qm is None else qm
    gm = torch.ones(n, dtype=torch.bool) if gm is None else gm
    lab = labels if labels.ndim == 2 else labels[:, None]
    pos, neg = [0] * bins, [0] * bins
    width = (high - low) / bins
    for q in range(n):
        if not qm[q]:
            continue
        for g in range(n):
            if g == q or not gm[g] or (seq is not None and seq[q] >= 0 and seq[q] == seq[g]):
                continue
            b = min(bins - 1, max(0, math.floor((float(s[q, g]) - low) / width)))
            a, c = set(lab[q].tolist()) - {-1}, set(lab[g].tolist()) - {-1}
            (pos if a & c else neg)[b] += 1
    return pos, neg


@pytest.mark.parametrize("tiles", [{}, {"query_block": 16, "gallery_chunk": 29}], ids=["one-tile", "small-tiles"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_counts_equal_a_float64_brute_force_on_bin_edges(tiles: dict, precision: str) -> None:
    x, y, seq = _on_edges()
    h = pair_score_histogram(x, y, sequence=seq, bins=8, precision=precision, **tiles)
    assert h["edges"] == [-1 + j / 4 for j in range(9)]
    assert (h["positive"], h["negative"]) == _brute(x, y, "cosine", 8, -1.0, 1.0, seq=seq)


def test_query_gallery_label_sets_and_euclidean() -> None:
    x, labels, seq, _ = _task_data(n=80, seed=4, sets=True, seq=True)
    g = torch.Generator().manual_seed(1)
    qm, gm = torch.rand(80, generator=g) < 0.5, torch.rand(80, generator=g) < 0.7
    h = pair_score_histogram(x, labels, query_mask=qm, gallery_mask=gm, sequence=seq, bins=16, query_block=9,
                             gallery_chunk=11)
    assert (h["positive"], h["negative"]) == _brute(x, labels, "cosine", 16, -1.0, 1.0, qm, gm, seq)
    e = pair_score_histogram(x, labels, metric="euclidean", bins=10)
    edges = e["edges"]
    assert edges[-1] == 0.0 and edges[0] < 0 and len(edges) == 11
    d2 = torch.cdist(x.double(), x.double()) ** 2
    assert -float(d2.max()) >= edges[0]  # every pair within the range
    total = x.shape[0] * (x.shape[0] - 1)
    assert sum(e["positive"]) + sum(e["negative"]) == total
    # the range is the one the function documents: recompute the bins from it
    low, high = edges[0], edges[-1]
    pos, neg = _brute(x, labels, "euclidean", 10, low, high)
    assert (pos, neg) == (e["positive"], e["negative"])


def test_results_keep_the_histogram_and_r_precision_through_save(tmp_path) -> None:
    x, y, seq = _on_edges()
    res = RetrievalResults.compute(x, y, sequence=seq, top_k=3, pair_histogram_bins=8)
    assert res.pair_histogram == pair_score_histogram(x, y, sequence=seq, bins=8)
    m = RetrievalMetrics(clustering=False, recall_at=(1,))
    m.update(x, y, sequence=seq)
    assert res.r_precision_mean() == m.compute()["r_precision"]
    back = RetrievalResults.load(res.save(tmp_path / "r.npz"))
    assert back.pair_histogram == res.pair_histogram
    np.testing.assert_array_equal(back.r_precision, res.r_precision)
    assert RetrievalResults.compute(x, y, top_k=3).pair_histogram is None


def test_bad_bins() -> None:
    x, y, _ = _on_edges(10)
    with pytest.raises(ValueError, match="bins must be >= 1"):
        pair_score_histogram(x, y, bins=0)
