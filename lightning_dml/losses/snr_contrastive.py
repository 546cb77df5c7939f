"""Contrastive loss on the signal-to-noise ratio distance (Yuan et al., "Signal-to-Noise Ratio: A Robust Distance
Metric for Deep Metric Learning", CVPR 2019, Eqs. 5-6 and 8)."""

from __future__ import annotations

from torch import Tensor

from lightning_dml.losses.base import DIST_EPS, PairLoss
from lightning_dml.losses.contrastive import PAIR_REDUCTIONS, reduce_pair_terms
from lightning_dml.losses.registry import register_loss
from lightning_dml.miners import label_masks

__all__ = ["SNRContrastiveLoss", "snr_distance"]


def snr_distance(anchors: Tensor, gallery: Tensor) -> Tensor:
    r"""The ``B x N`` SNR distance ``d(a, g) = var(g - a) / var(a)`` (Yuan et al., Eq. 6: noise ``g - a`` over
    signal ``a``; unbiased variances over the ``D`` components, whose ``1 / (D - 1)`` cancels).

    From inner products and component sums instead of the ``B x N x D`` differences:
    ``(D - 1) var(g - a) = |a|^2 + |g|^2 - 2 a.g - (sum(g) - sum(a))^2 / D``, clamped at 0 (it is >= 0 by
    Cauchy-Schwarz; rounding can push it below). A zero-variance anchor (all components equal) has its signal
    floored at ``1e-12``: a finite, very large distance.
    """
    dim = anchors.shape[1]
    sa, sg = anchors.sum(dim=1), gallery.sum(dim=1)
    na, ng = anchors.square().sum(dim=1), gallery.square().sum(dim=1)
    noise = na[:, None] + ng[None, :] - 2.0 * (anchors @ gallery.T) - (sg[None, :] - sa[:, None]).square() / dim
    signal = (na - sa.square() / dim).clamp(min=DIST_EPS)
    return noise.clamp(min=0.0) / signal[:, None]


@register_loss("snr_contrastive")
class SNRContrastiveLoss(PairLoss):
    r"""Contrastive loss with the SNR distance (Yuan et al., CVPR 2019, Eq. 8):

    .. math::
        L = \operatorname{red}_{y_{ij}=1} [d_{ij} - m_1]_+ + \operatorname{red}_{y_{ij}=0} [m_2 - d_{ij}]_+

    over ordered pairs (the SNR distance :func:`snr_distance` is not symmetric) of L2-normalised embeddings, ``red``
    the reduction of :class:`~lightning_dml.losses.contrastive.ContrastiveLoss` (default ``"mean_nonzero"``: each
    sum divided by its number of non-zero terms, pytorch-metric-learning's ``AvgNonZeroReducer``). Matches pml's
    ``SignalToNoiseRatioContrastiveLoss(pos_margin, neg_margin)`` (its ``SNRDistance`` normalises the embeddings).
    The paper's zero-mean regulariser on the embeddings (its Eq. 9) is not part of this loss (nor of pml's): add
    it as a separate term.

    Args:
        pos_margin: ``m1`` (0).
        neg_margin: ``m2`` (1, pml's default).
        reduction: ``"mean_nonzero"``, ``"mean"`` or ``"sum"``.

    Label sets: positive when the sets intersect. Under DDP: references with batch-wide counts. Degenerate
    batches: no positive / negative pair -> that term is 0; identical embeddings have distance 0.
    """

    gather_mode = "references"
    supports_label_sets = True

    def __init__(self, pos_margin: float = 0.0, neg_margin: float = 1.0, reduction: str = "mean_nonzero") -> None:
        super().__init__()
        if pos_margin < 0 or neg_margin < 0:
            raise ValueError(f"margins must be >= 0, got pos_margin={pos_margin}, neg_margin={neg_margin}")
        if reduction not in PAIR_REDUCTIONS:
            raise ValueError(f"reduction must be one of {PAIR_REDUCTIONS}, got {reduction!r}")
        self.pos_margin, self.neg_margin, self.reduction = float(pos_margin), float(neg_margin), reduction

    def extra_repr(self) -> str:
        return f"pos_margin={self.pos_margin}, neg_margin={self.neg_margin}, reduction={self.reduction!r}"

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        pos, neg = label_masks(labels, gallery_labels)
        dist = snr_distance(anchors, anchors if gallery is None else gallery)
        hp = (dist - self.pos_margin).clamp(min=0.0)
        hn = (self.neg_margin - dist).clamp(min=0.0)
        return reduce_pair_terms(hp, pos, self.reduction) + reduce_pair_terms(hn, neg, self.reduction)
