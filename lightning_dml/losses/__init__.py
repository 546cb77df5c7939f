"""Pair losses of the five papers (SPEC sections 2-6), built on :mod:`lightning_dml.miners`.

``LOSSES`` maps a registry name to its class; ``build_loss(name, **hparams)`` builds one. Every loss is called as
``loss(embeddings [B, D], labels [B], ref_embeddings=None, ref_labels=None)`` and returns an fp32 scalar.
"""

from lightning_dml.losses.base import PairLoss
from lightning_dml.losses.binomial_deviance import BinomialDevianceLoss
from lightning_dml.losses.contrastive import ContrastiveLoss
from lightning_dml.losses.cross_batch_memory import CrossBatchMemory
from lightning_dml.losses.distributed import gather_from_other_ranks
from lightning_dml.losses.general_pair_weighting import GeneralPairWeightingLoss
from lightning_dml.losses.lifted_structure import LiftedStructureLoss
from lightning_dml.losses.multi_similarity import MultiSimilarityLoss
from lightning_dml.losses.npair import NPairLoss
from lightning_dml.losses.ranked_list import RankedListLoss
from lightning_dml.losses.registry import LOSSES, build_loss, register_loss
from lightning_dml.losses.triplet import TripletLoss
from lightning_dml.losses.tuplet_margin import TupletMarginLoss

for _name, _cls in (
    ("contrastive", ContrastiveLoss),
    ("triplet", TripletLoss),
    ("lifted_structure", LiftedStructureLoss),
    ("binomial_deviance", BinomialDevianceLoss),
    ("npair", NPairLoss),
    ("multi_similarity", MultiSimilarityLoss),
    ("ranked_list", RankedListLoss),
    ("tuplet_margin", TupletMarginLoss),
    ("general_pair_weighting", GeneralPairWeightingLoss),
    ("cross_batch_memory", CrossBatchMemory),
):
    register_loss(_name)(_cls)

__all__ = [
    "LOSSES",
    "build_loss",
    "register_loss",
    "gather_from_other_ranks",
    "PairLoss",
    "BinomialDevianceLoss",
    "ContrastiveLoss",
    "CrossBatchMemory",
    "GeneralPairWeightingLoss",
    "LiftedStructureLoss",
    "MultiSimilarityLoss",
    "NPairLoss",
    "RankedListLoss",
    "TripletLoss",
    "TupletMarginLoss",
]
