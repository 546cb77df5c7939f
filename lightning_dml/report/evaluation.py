"""The metrics of a report: every metric ``lightning-dml test`` computes for the model, on the report's items.

``test`` logs what the model's :class:`~lightning_dml.metrics.RetrievalMetrics` compute (``recall_at``,
``clustering``, ``metrics`` of :class:`~lightning_dml.DMLModule`: Recall@K, MAP@R, R-Precision, NMI/F1, and the opt-in
``mrr``, ``ndcg@K``, ``fnmr@fmr=F``..., each also per category). :func:`evaluate_predictions` runs the same class
with the same settings (:func:`evaluation_settings`) on a predictions file's embeddings, labels, query/gallery masks,
sequences and categories, so the report's figures are ``test``'s, key for key.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from lightning_dml.metrics import RetrievalMetrics

__all__ = ["evaluate_predictions", "evaluation_settings"]


def evaluation_settings(model: Any, recall_at: Sequence[int] = ()) -> dict[str, Any]:
    """The evaluation settings of a :class:`~lightning_dml.DMLModule` (its hyper-parameters ``recall_at``,
    ``clustering``, ``metrics``; the module's defaults where absent), with the K of ``recall_at`` added."""
    hparams = dict(getattr(model, "hparams", {}) or {})
    metrics = hparams.get("metrics") or ()
    metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)
    ks = sorted({int(k) for k in (*tuple(hparams.get("recall_at") or (1, 2, 4, 8)), *recall_at)})
    return {"recall_at": tuple(ks), "clustering": bool(hparams.get("clustering", True)), "metrics": metrics}


def evaluate_predictions(
    data: dict[str, Any], *, recall_at: Sequence[int] = (1, 2, 4, 8), clustering: bool = False,
    metrics: Sequence[str] = (), metric: str = "cosine",
) -> dict[str, float]:
    """``{key: value}`` of :class:`~lightning_dml.metrics.RetrievalMetrics` (``recall@1``, ...,
    ``category/<name>/<metric>``) on a predictions dict (:func:`~lightning_dml.callbacks.load_predictions`)."""
    evaluator = RetrievalMetrics(recall_at=tuple(recall_at), clustering=clustering, metrics=tuple(metrics),
                                 metric=metric, category_names=data.get("category_names"))
    evaluator.update(data["embeddings"], data["labels"], indices=data["indices"], query_mask=data.get("query_mask"),
                     gallery_mask=data.get("gallery_mask"), sequence=data.get("sequence"),
                     category=data.get("category"))
    return {key: float(value) for key, value in evaluator.compute().items()}
