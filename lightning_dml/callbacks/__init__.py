"""Callbacks, one module per job.

* :mod:`~lightning_dml.callbacks.checkpoint`: :class:`PeriodicCheckpoint`, the ``last.ckpt`` a preempted run
  resumes from;
* :mod:`~lightning_dml.callbacks.diagnostics`: what is logged during training, :class:`PairSimilarityHistogram`
  and :class:`RecallCurve`;
* :mod:`~lightning_dml.callbacks.predictions`: :class:`PredictionWriter`, the file ``lightning-dml predict``
  writes, and :func:`load_predictions`;
* :mod:`~lightning_dml.callbacks.report`: :class:`RetrievalReport`, the retrieval report (``lightning-dml report``)
  at the end of ``test``, with the worst queries logged to W&B and TensorBoard;
* :mod:`~lightning_dml.callbacks.retrieval`: :class:`RetrievalComparison` (the before/after table of
  ``make demo``), :class:`RetrievalGridLogger`, :func:`format_table`, :func:`evaluate_embeddings`;
* :mod:`~lightning_dml.callbacks.summary`: :class:`ValidationSummary`, the last validation metrics at the end
  of ``fit``;
* :mod:`~lightning_dml.callbacks.class_embeddings`: :class:`ClassEmbeddingRefresh` (N-pair hard class mining);
* :mod:`~lightning_dml.callbacks.embedding`: :func:`embed_loader`, the eval-mode embedding pass they share.
"""

from lightning_dml.callbacks.checkpoint import PeriodicCheckpoint
from lightning_dml.callbacks.class_embeddings import ClassEmbeddingRefresh
from lightning_dml.callbacks.diagnostics import PairSimilarityHistogram, RecallCurve
from lightning_dml.callbacks.embedding import embed_loader
from lightning_dml.callbacks.predictions import PredictionWriter, load_predictions
from lightning_dml.callbacks.report import RetrievalReport
from lightning_dml.callbacks.retrieval import (
    RetrievalComparison,
    RetrievalGridLogger,
    evaluate_embeddings,
    format_table,
)
from lightning_dml.callbacks.summary import ValidationSummary

__all__ = [
    "ClassEmbeddingRefresh",
    "PairSimilarityHistogram",
    "PeriodicCheckpoint",
    "PredictionWriter",
    "RecallCurve",
    "RetrievalComparison",
    "RetrievalGridLogger",
    "RetrievalReport",
    "ValidationSummary",
    "embed_loader",
    "evaluate_embeddings",
    "format_table",
    "load_predictions",
]
