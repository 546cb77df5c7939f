"""Ranked List Loss (Wang et al., CVPR 2019), RLL Eqs. 8-14."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss, batch_normaliser, distance_from_similarity, masked_mean
from lightning_dml.losses.base import masked_softmax
from lightning_dml.losses.registry import register_loss
from lightning_dml.miners import threshold_mining

__all__ = ["RankedListLoss"]


@register_loss("ranked_list")
class RankedListLoss(PairLoss):
    r"""Ranked List Loss (RLL Eqs. 8-14).

    Distance: Euclidean ``d_ij = ||f_i - f_j||`` of L2-normalised embeddings (non-squared).
    Non-trivial pairs (Eq. 8): positives with ``d_ij > alpha - margin``, negatives with ``d_ij < alpha``
    (:func:`lightning_dml.miners.threshold_mining` with ``strict=True``).

    .. math::
        L_P(i) = \frac{1}{|P^*_i|}\sum_{j\in P^*_i} (d_{ij} - (\alpha - m))\quad\text{(Eq. 11)}\qquad
        L_N(i) = \sum_{j\in N^*_i} \frac{w_{ij}}{\sum_{k\in N^*_i} w_{ik}} (\alpha - d_{ij})\quad\text{(Eq. 12)}

    with ``w_ij = exp(T (alpha - d_ij))`` computed from ``sg(d)`` (Eq. 9), ``L(i) = L_P + lam L_N`` (Eq. 13) and
    ``L = 1/B sum_i L(i)`` over every anchor of the batch (Eq. 14).

    Args:
        alpha: negative boundary (1.2), margin: ``m`` between the boundaries (0.4; positives are pulled inside
        ``alpha - m``), temperature: ``T`` (10; 0 = uniform weights), lam: ``lambda`` (1.0),
        detach_gallery: within anchor ``i``'s list the other items are constants, ``d_ij = ||f_i - sg(f_j)||``
        (RLL's gradient path; False doubles the pairwise gradient paths).

    Degenerate batches: an anchor with an empty ``P*`` (``N*``) has ``L_P = 0`` (``L_N = 0``) and still counts in
    the 1/B divisor.
    """

    #: under DDP: anchors scored against the gathered batch, batch-wide reductions (losses.base)
    gather_mode = "references"
    label_sets_reason = (
        "label sets are not implemented for it yet (its definition only asks which pairs are positive, so it could "
        "take them: see docs/losses/README.md)"
    )

    def __init__(
        self,
        alpha: float = 1.2,
        margin: float = 0.4,
        temperature: float = 10.0,
        lam: float = 1.0,
        detach_gallery: bool = True,
    ) -> None:
        super().__init__()
        if alpha <= 0 or margin < 0 or margin > alpha:
            raise ValueError(f"need alpha > 0 and 0 <= margin <= alpha, got alpha={alpha}, margin={margin}")
        if temperature < 0 or lam < 0:
            raise ValueError(f"temperature and lam must be >= 0, got temperature={temperature}, lam={lam}")
        self.alpha, self.margin, self.temperature, self.lam = float(alpha), float(margin), float(temperature), float(lam)
        self.detach_gallery = detach_gallery

    def extra_repr(self) -> str:
        return (
            f"alpha={self.alpha}, margin={self.margin}, temperature={self.temperature}, lam={self.lam}, "
            f"detach_gallery={self.detach_gallery}"
        )

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        dist = distance_from_similarity(sim)
        kp, kn = threshold_mining(dist.detach(), pos, neg, self.alpha - self.margin, self.alpha, strict=True)
        loss_p = masked_mean(dist - (self.alpha - self.margin), kp)
        weights = masked_softmax(self.temperature * (self.alpha - dist.detach()), kn)
        loss_n = (weights * (self.alpha - dist)).sum(1)
        return (loss_p + self.lam * loss_n).sum() / batch_normaliser(sim.shape[0], sim)
