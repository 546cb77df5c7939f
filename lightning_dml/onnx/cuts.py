"""``--threshold`` and the calibrated ``match`` flags of ``search --runtime onnx``, on NumPy arrays (no torch).

The torch runtime's definitions, computed with NumPy because their modules import torch at the top:

* :func:`threshold_keep`: :func:`lightning_dml.index.cut.threshold_mask`: a result is kept when it is a real one
  (id >= 0) with ``score >= T``; dropped results become padding (:func:`lightning_dml.index.cut.apply_mask`);
* :func:`calibrated_threshold`: :func:`lightning_dml.index.calibrate.check_calibration`'s threshold (that module
  imports torch only where it computes);
* :func:`match_flags`: :func:`lightning_dml.index.calibrate.match_flags`: a result matches when the exact float64
  score of the query (in the form the index stores vectors: float32, L2-normalised for ``cosine``) and the stored
  vector is strictly greater than the threshold; the cosine is the exact engine's
  (:meth:`lightning_dml.metrics._scores.Scorer.exact`: the float64 dot product over the float64 norms), the
  euclidean score the negated float64 squared distance. Summation orders differ from torch's in the last bits of
  a float64 (about 1e-16 relative), far below the ONNX model's own difference from PyTorch (the export's
  tolerance, 1e-4 relative).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lightning_dml.errors import UserInputError
from lightning_dml.index.calibrate import check_calibration
from lightning_dml.index.manifest import Manifest

__all__ = ["apply_keep", "calibrated_threshold", "match_flags", "parse_threshold", "threshold_keep"]


class OnnxCutError(UserInputError, ValueError):
    """A ``--threshold`` that is not a finite number, or ``--matches_only`` on an uncalibrated index."""


def parse_threshold(text: str | float | None) -> float | None:
    """A ``--threshold`` value (any finite similarity; ``None``: no threshold), as
    :func:`lightning_dml.index.cut.parse_threshold` reads it."""
    if text is None:
        return None
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise OnnxCutError(f"--threshold {text!r} is not a number") from None
    if not math.isfinite(value):
        raise OnnxCutError(f"--threshold {text!r} is not a finite number")
    return value


def threshold_keep(scores: np.ndarray, ids: np.ndarray, threshold: float) -> np.ndarray:
    """``[Q, k]`` bool: a real result (id >= 0) with ``score >= threshold``."""
    return (ids >= 0) & (scores >= threshold)


def apply_keep(scores: np.ndarray, ids: np.ndarray, keep: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Dropped results become padding (``-inf``, ``-1``); kept ones stay in place."""
    return np.where(keep, scores, np.float32(-np.inf)).astype(np.float32), np.where(keep, ids, -1)


def calibrated_threshold(manifest: Manifest, where: str = "") -> float | None:
    """The index's calibrated threshold (``None`` when it was not calibrated), checked by
    :func:`lightning_dml.index.calibrate.check_calibration` (which imports no torch): one line for a malformed
    calibration or one of another checkpoint."""
    cal = check_calibration(manifest, where)
    return None if cal is None else float(cal["threshold"])


def match_flags(queries: np.ndarray, ids: np.ndarray, vectors: np.ndarray, rows_of: Any, metric: str,
                threshold: float) -> np.ndarray:
    """``[Q, k]`` bool: whether result ``ids[q, j]`` (``-1``: padding, never a match) matches the query
    ``queries[q]`` (float32, prepared as the index compares them) under ``threshold`` (module docstring).
    ``vectors``: the stored vectors in table order; ``rows_of(ids)``: their rows."""
    out = np.zeros(ids.shape, dtype=bool)
    q, j = np.nonzero(ids >= 0)
    if q.size == 0:
        return out
    rows = np.asarray(rows_of(ids[q, j]), dtype=np.int64)
    known = rows >= 0
    q, j, rows = q[known], j[known], rows[known]
    a = np.asarray(queries, dtype=np.float32)[q].astype(np.float64)
    used, at = np.unique(rows, return_inverse=True)  # the rows used, read once from the map (sorted)
    b = np.asarray(vectors[used], dtype=np.float32)[at].astype(np.float64)
    if metric == "cosine":
        score = np.einsum("nd,nd->n", a, b) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    else:
        diff = a - b
        score = -np.einsum("nd,nd->n", diff, diff)
    out[q, j] = score > threshold
    return out
