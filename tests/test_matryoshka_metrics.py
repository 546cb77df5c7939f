"""RetrievalMetrics(widths=...) (issue 31 s.2 acceptance): the per-width metrics of one update pass equal separate
evaluations of the cut embeddings, against the float64 brute force of tests/metrics_reference.py. Under DDP:
tests/distributed/metrics_ddp_script.py (``tasks`` mode evaluates widths too)."""

from __future__ import annotations

import pytest
import torch

from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.widths import WidthError, split_widths
from tests.metrics_reference import brute_metrics

WIDTHS = [3, 8, 16]
KEYS = ("recall@1", "recall@2", "recall@4", "precision@1", "r_precision", "map@r")


def _data():
    """60 items of 6 classes in 16 dimensions, small integer coordinates (many exact ties of the cut cosines) and
    duplicated rows; the leading dimensions carry less of the class than the full vector."""
    g = torch.Generator().manual_seed(3)
    y = torch.arange(6).repeat(10)
    x = (torch.randn(6, 16, generator=g)[y] * 1.5 + torch.randn(60, 16, generator=g) * 1.2).round()
    x[x[:, :3].abs().sum(dim=1) == 0, 0] = 1.0  # no cut of zero norm (no direction)
    x[40:44] = x[5]  # duplicates: ties broken by index
    return x, y


def test_per_width_metrics_equal_separate_brute_force_evaluations():
    x, y = _data()
    metric = RetrievalMetrics(recall_at=(1, 2, 4), widths=WIDTHS, kmeans_backend="torch")
    order = torch.randperm(60, generator=torch.Generator().manual_seed(0))
    for part in order.split(25):  # shuffled, uneven batches with their split indices
        metric.update(x[part], y[part], indices=part)
    got = metric.compute()
    full, by_width = split_widths(got)
    assert list(by_width) == WIDTHS
    for width in WIDTHS:
        want = brute_metrics(x[:, :width], y, recall_at=(1, 2, 4))
        alone = RetrievalMetrics(recall_at=(1, 2, 4), kmeans_backend="torch")
        alone.update(x[:, :width].contiguous(), y)
        separate = alone.compute()
        for key in KEYS:
            assert got[f"w{width}/{key}"] == pytest.approx(want[key], abs=1e-12), (width, key)
        assert by_width[width] == separate  # every metric (nmi, f1 too), to the last digit
    assert {k: full[k] for k in KEYS} == pytest.approx(brute_metrics(x, y, recall_at=(1, 2, 4)), abs=1e-12)
    assert got["w3/map@r"] != got["map@r"]  # the cut matters on this set


def test_width_errors_are_one_line():
    with pytest.raises(WidthError, match="strictly increasing"):
        RetrievalMetrics(widths=[8, 4])
    metric = RetrievalMetrics(widths=[4, 32])
    with pytest.raises(WidthError, match=r"RetrievalMetrics\(widths\): width 32 exceeds the embedding width D = 16"):
        metric.update(torch.randn(4, 16), torch.arange(4))
