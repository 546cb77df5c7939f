"""Mining functions: boolean pair (and triplet) masks from a similarity or distance matrix and labels; and miners
as objects with pytorch-metric-learning's contract, ``miner(embeddings, labels[, ref_emb, ref_labels])`` -> an
indices tuple (:mod:`lightning_dml.miners.base`, registry :data:`MINERS`, docs/miners.md).

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
from lightning_dml.miners.angular_miner import AngularMiner
from lightning_dml.miners.base import Miner
from lightning_dml.miners.batch_easy_hard import BatchEasyHardMiner, BatchHardMiner
from lightning_dml.miners.distance_weighted_miner import DistanceWeightedMiner
from lightning_dml.miners.hdc import HDCMiner
from lightning_dml.miners.mined_loss import MinedLoss
from lightning_dml.miners.multi_similarity_miner import MultiSimilarityMiner
from lightning_dml.miners.pair_margin import PairMarginMiner
from lightning_dml.miners.registry import MINERS, build_miner
from lightning_dml.miners.triplet_margin import TripletMarginMiner
from lightning_dml.miners.uniform_histogram import UniformHistogramMiner
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
    # miner objects
    "AngularMiner",
    "BatchEasyHardMiner",
    "BatchHardMiner",
    "DistanceWeightedMiner",
    "HDCMiner",
    "MINERS",
    "MinedLoss",
    "Miner",
    "MultiSimilarityMiner",
    "PairMarginMiner",
    "TripletMarginMiner",
    "UniformHistogramMiner",
    "build_miner",
]
