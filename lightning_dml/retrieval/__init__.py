"""What the model retrieves: :class:`RetrievalResults` (per-query top-k, scores, relevance, ranks, AP), kept in one
file and queried for the worst queries, per-class figures and the most confused class pairs."""

from lightning_dml.retrieval.results import RetrievalResults

__all__ = ["RetrievalResults"]
