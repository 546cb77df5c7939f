"""Mining functions: boolean pair (and triplet) masks from a similarity or distance matrix and labels.

Labels are ``[N]`` class ids or ``[N, L]`` label sets padded with -1 (a pair is positive when the sets intersect):
:mod:`lightning_dml.miners.pairs` is the one place that turns either into pair masks.
"""

from lightning_dml.miners.distance_weighted import distance_weighted_log_weights, distance_weighted_sampling
from lightning_dml.miners.mining import (
    batch_hard_mining,
    multi_similarity_mining,
    threshold_mining,
    triplet_margin_mining,
    triplet_margin_pair_mining,
)
from lightning_dml.miners.pairs import (
    cat_labels,
    is_label_sets,
    label_masks,
    negative_mask,
    positive_index,
    positive_pairs,
    positive_table,
    same_label_mask,
    self_pair_mask,
)

__all__ = [
    "batch_hard_mining",
    "cat_labels",
    "distance_weighted_log_weights",
    "distance_weighted_sampling",
    "is_label_sets",
    "label_masks",
    "multi_similarity_mining",
    "negative_mask",
    "positive_index",
    "positive_pairs",
    "positive_table",
    "same_label_mask",
    "self_pair_mask",
    "threshold_mining",
    "triplet_margin_mining",
    "triplet_margin_pair_mining",
]
