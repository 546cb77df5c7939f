"""Exact retrieval and clustering metrics for deep metric learning.

``RetrievalMetrics`` (a ``torchmetrics.Metric``) and the functional core ``lightning_dml.metrics.functional``.
Definitions, tie rule, devices and DDP behaviour: ``docs/metrics.md``.
"""

from lightning_dml.metrics import functional
from lightning_dml.metrics._progress import progress_bars
from lightning_dml.metrics.kmeans import kmeans
from lightning_dml.metrics.retrieval import RetrievalMetrics

__all__ = ["RetrievalMetrics", "functional", "kmeans", "progress_bars"]
