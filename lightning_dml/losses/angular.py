"""Angular loss (Wang et al., "Deep Metric Learning with Angular Loss", ICCV 2017)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_dml.losses.base import PairLoss, batch_normaliser, similarity_matrix
from lightning_dml.losses.registry import register_loss
from lightning_dml.miners import label_masks

__all__ = ["AngularLoss"]

#: largest alpha accepted: beyond it the factorised sum can underflow in fp32 (see the class docstring)
MAX_ALPHA = math.pi / 3


@register_loss("angular")
class AngularLoss(PairLoss):
    r"""Angular loss in its N-pair form (Angular paper Eq. 8, with ``f_{a,p,n}`` of Eq. 7).

    Embeddings are L2-normalised. For every positive pair ``(a, p)`` of the batch (the paper's N-pair batch has one
    per anchor; here every ordered same-label pair, as in pytorch-metric-learning):

    .. math::
        l(a, p) = \log\Big[1 + \sum_{n: y_n \ne y_a} \exp\big(4 \tan^2\alpha\, (x_a + x_p)^\top x_n
                  - 2 (1 + \tan^2\alpha)\, x_a^\top x_p\big)\Big]

    averaged over the positive pairs. The sum over ``n`` factorises, ``e^{4 t^2 (s_an + s_pn)} =
    e^{4 t^2 s_an} e^{4 t^2 s_pn}``, so it is one ``B x N`` by ``N x N`` matrix product (no ``pairs x N``
    tensor); each factor is shifted by its row maximum, which is exact while ``4 t^2`` times the similarity range
    stays within fp32's exponent range, i.e. for ``alpha <= 60`` degrees (larger values are refused).

    Args:
        alpha: the angle bound, in **radians** (default ``pi / 4`` = 45 degrees, the value this project takes
            from the paper's experiments). pytorch-metric-learning's ``AngularLoss(alpha=40)`` takes **degrees**
            (default 40 degrees).

    The paper also combines the angular loss with N-pair (Eq. 9, ``lambda = 2``); that combination is not part of
    this class. References are supported (they are extra positives and negatives of each anchor).

    Degenerate batches: no positive pair -> 0 with zero gradient; a positive pair whose anchor has no negative
    contributes ``log 1 = 0`` and counts in the mean (as in pml).
    """

    #: a mean of per-anchor (per-pair) terms over the global gallery: exact under DDP with all-reduced counts
    gather_mode = "references"

    def __init__(self, alpha: float = math.pi / 4) -> None:
        super().__init__()
        if not 0 < alpha <= MAX_ALPHA:
            raise ValueError(
                f"alpha must be an angle in radians in (0, pi/3], got {alpha} (pml's alpha is in degrees: "
                f"use math.radians)"
            )
        self.alpha = float(alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        pos, neg = label_masks(labels, gallery_labels)
        g = anchors if gallery is None else gallery
        sim = similarity_matrix(anchors, g)  # B x N
        sim_gg = sim if gallery is None else similarity_matrix(g, g)  # N x N
        return self.angular_loss(sim, sim_gg, pos, neg)

    def angular_loss(self, sim: Tensor, sim_gg: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        """Loss from anchor-gallery ``sim`` [B, N], gallery-gallery ``sim_gg`` [N, N] (its first B rows are the
        anchors when the gallery starts with the batch) and the label masks."""
        tan2 = math.tan(self.alpha) ** 2
        c = 4.0 * tan2
        x_an = c * sim
        shift_a = x_an.masked_fill(~neg, -torch.inf).amax(dim=1).detach()
        shift_a = torch.where(torch.isfinite(shift_a), shift_a, 0.0)
        e_an = torch.exp(x_an - shift_a[:, None]) * neg
        x_pn = c * sim_gg
        shift_p = x_pn.amax(dim=1).detach()
        e_pn = torch.exp(x_pn - shift_p[:, None])
        total = e_an @ e_pn.T  # [a, p]: sum over the negatives n of a of e^{c s_an} e^{c s_pn}, shifted
        has = total > 0
        log_total = torch.log(torch.where(has, total, 1.0))
        inner = log_total + shift_a[:, None] + shift_p[None, :] - 2.0 * (1.0 + tan2) * sim
        terms = F.softplus(torch.where(has, inner, -torch.inf))
        total = torch.where(pos, terms, 0.0).sum()
        return total / batch_normaliser(pos.sum(), total)
