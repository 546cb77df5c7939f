"""Mining functions: boolean pair (and triplet) masks from a similarity or distance matrix and labels."""

from lightning_dml.miners.distance_weighted import distance_weighted_log_weights, distance_weighted_sampling
from lightning_dml.miners.mining import (
    batch_hard_mining,
    label_masks,
    multi_similarity_mining,
    positive_index,
    positive_pairs,
    self_pair_mask,
    threshold_mining,
    triplet_margin_mining,
    triplet_margin_pair_mining,
)

__all__ = [
    "batch_hard_mining",
    "distance_weighted_log_weights",
    "distance_weighted_sampling",
    "label_masks",
    "multi_similarity_mining",
    "positive_index",
    "positive_pairs",
    "self_pair_mask",
    "threshold_mining",
    "triplet_margin_mining",
    "triplet_margin_pair_mining",
]
