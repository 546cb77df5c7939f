"""Pair losses of the five papers (SPEC sections 2-6), built on :mod:`lightning_dml.miners`.

``LOSSES`` maps a registry name to its class; ``build_loss(name, **hparams)`` builds one. Every loss is called as
``loss(embeddings [B, D], labels [B], ref_embeddings=None, ref_labels=None)`` and returns an fp32 scalar.
"""

# every loss registers itself with @register_loss where it is defined and declares its anatomy (what it needs and
# supports: PairLoss's class attributes)
from lightning_dml.losses.base import PairLoss
from lightning_dml.losses.binomial_deviance import BinomialDevianceLoss
from lightning_dml.losses.contrastive import ContrastiveLoss
from lightning_dml.losses.cross_batch_memory import CrossBatchMemory
from lightning_dml.losses.distributed import gather_from_other_ranks, gathered_loss
from lightning_dml.losses.general_pair_weighting import GeneralPairWeightingLoss
from lightning_dml.losses.lifted_structure import LiftedStructureLoss
from lightning_dml.losses.multi_similarity import MultiSimilarityLoss
from lightning_dml.losses.npair import NPairLoss
from lightning_dml.losses.ranked_list import RankedListLoss
from lightning_dml.losses.registry import LOSSES, build_loss, register_loss
from lightning_dml.losses.triplet import TripletLoss
from lightning_dml.losses.tuplet_margin import TupletMarginLoss

# proxy and classification losses (each registers itself with @register_loss where it is defined)
from lightning_dml.losses.proxies import ProxyLoss
from lightning_dml.losses.proxy_anchor import ProxyAnchorLoss
from lightning_dml.losses.normalized_softmax import NormalizedSoftmaxLoss
from lightning_dml.losses.proxy_nca import ProxyNCALoss
from lightning_dml.losses.cosface import CosFaceLoss
from lightning_dml.losses.arcface import ArcFaceLoss
from lightning_dml.losses.subcenter_arcface import SubCenterArcFaceLoss
from lightning_dml.losses.soft_triple import SoftTripleLoss

# pair and set losses (each registers itself with @register_loss where it is defined)
from lightning_dml.losses.angular import AngularLoss
from lightning_dml.losses.circle import CircleLoss
from lightning_dml.losses.fastap import FastAPLoss
from lightning_dml.losses.margin import MarginLoss
from lightning_dml.losses.nca import NCALoss
from lightning_dml.losses.ntxent import NTXentLoss
from lightning_dml.losses.smooth_ap import SmoothAPLoss
from lightning_dml.losses.supcon import SupConLoss

# pml 2.x losses, part 3a (issue 29; each registers itself with @register_loss where it is defined)
from lightning_dml.losses.dynamic_soft_margin import DynamicSoftMarginLoss
from lightning_dml.losses.generalized_lifted_structure import GeneralizedLiftedStructureLoss
from lightning_dml.losses.histogram import HistogramLoss
from lightning_dml.losses.intra_pair_variance import IntraPairVarianceLoss
from lightning_dml.losses.large_margin_softmax import LargeMarginSoftmaxLoss

# pml 2.x / 3.0 losses, part 3b (issue 29; each registers itself with @register_loss where it is defined)
from lightning_dml.losses.p2sgrad import P2SGradLoss
from lightning_dml.losses.decoupled_contrastive import DecoupledContrastiveLoss
from lightning_dml.losses.multi_supcon import MultiSupConLoss
from lightning_dml.losses.pnp import PNPLoss
from lightning_dml.losses.snr_contrastive import SNRContrastiveLoss
from lightning_dml.losses.selectively_contrastive_triplet import SelectivelyContrastiveTripletLoss
from lightning_dml.losses.sphereface import SphereFaceLoss
from lightning_dml.losses.threshold_consistent_margin import ThresholdConsistentMarginLoss
from lightning_dml.losses.vicreg import VICRegLoss

# pml 2.x / 3.0 losses, part 3c (issue 29; each registers itself with @register_loss where it is defined)
from lightning_dml.losses.instance import InstanceLoss
from lightning_dml.losses.dynamic_arcface import DynamicArcFaceLoss
from lightning_dml.losses.manifold import ManifoldLoss
from lightning_dml.losses.self_supervised import SelfSupervisedLoss

# hyperbolic embeddings (issue 29 section 3; each registers itself with @register_loss where it is defined)
from lightning_dml.losses.hyperbolic import HypViTLoss
from lightning_dml.losses.hier import HIERLoss

# nested widths (issue 31 section 2; registers itself with @register_loss)
from lightning_dml.losses.matryoshka import MatryoshkaLoss

__all__ = [
    "LOSSES",
    "build_loss",
    "register_loss",
    "gather_from_other_ranks",
    "gathered_loss",
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
    "ProxyLoss",
    "ProxyAnchorLoss",
    "NormalizedSoftmaxLoss",
    "ProxyNCALoss",
    "CosFaceLoss",
    "ArcFaceLoss",
    "SubCenterArcFaceLoss",
    "SoftTripleLoss",
    "AngularLoss",
    "CircleLoss",
    "FastAPLoss",
    "MarginLoss",
    "NCALoss",
    "NTXentLoss",
    "SmoothAPLoss",
    "SupConLoss",
    "DynamicSoftMarginLoss",
    "GeneralizedLiftedStructureLoss",
    "HistogramLoss",
    "IntraPairVarianceLoss",
    "LargeMarginSoftmaxLoss",
    "DecoupledContrastiveLoss",
    "MultiSupConLoss",
    "P2SGradLoss",
    "PNPLoss",
    "SNRContrastiveLoss",
    "SelectivelyContrastiveTripletLoss",
    "SphereFaceLoss",
    "ThresholdConsistentMarginLoss",
    "VICRegLoss",
    "DynamicArcFaceLoss",
    "InstanceLoss",
    "ManifoldLoss",
    "SelfSupervisedLoss",
    "HypViTLoss",
    "HIERLoss",
    "MatryoshkaLoss",
]
