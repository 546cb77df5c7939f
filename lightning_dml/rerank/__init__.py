"""Learned pairwise re-ranking (issue 30, part 1): models that re-score a query's top-n candidates, their saved
folder, and their training.

* :mod:`lightning_dml.rerank.models`: :class:`PairwiseReranker`, :class:`ConcatSiamese` (STIR), and
  :class:`FeatureDistanceSiamese` (OML's ``LinearTrivialDistanceSiamese``);
* :mod:`lightning_dml.rerank.io`: :func:`save_reranker` / :func:`load_reranker` (``reranker.json`` + safetensors).
"""

from lightning_dml.rerank.io import load_reranker, read_reranker_record, save_reranker
from lightning_dml.rerank.models import (
    RERANKER_KINDS,
    ConcatSiamese,
    FeatureDistanceSiamese,
    PairwiseReranker,
    RerankerInputError,
)

__all__ = [
    "ConcatSiamese",
    "FeatureDistanceSiamese",
    "PairwiseReranker",
    "RERANKER_KINDS",
    "RerankerInputError",
    "load_reranker",
    "read_reranker_record",
    "save_reranker",
]
