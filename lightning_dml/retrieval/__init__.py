"""What the model retrieves: :class:`RetrievalResults` (per-query top-k, scores, relevance, ranks, AP), kept in one
file and queried for the worst queries, per-class figures and the most confused class pairs;
:func:`pair_score_histogram`, the exact score histograms of every positive and every negative pair."""

from lightning_dml.retrieval.histogram import pair_score_histogram
from lightning_dml.retrieval.results import RetrievalResults

__all__ = ["RetrievalResults", "pair_score_histogram"]
