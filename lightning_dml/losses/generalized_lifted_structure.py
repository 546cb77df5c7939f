"""Generalized lifted structure loss (Hermans, Beyer & Leibe, "In Defense of the Triplet Loss for Person
Re-Identification", 2017, Sec. 2, p. 4), with pytorch-metric-learning's two margins."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss, batch_normaliser, distance_and_derivative, distance_from_similarity
from lightning_dml.losses.base import masked_lse
from lightning_dml.losses.registry import register_loss

__all__ = ["GeneralizedLiftedStructureLoss"]


@register_loss("generalized_lifted_structure")
class GeneralizedLiftedStructureLoss(PairLoss):
    r"""Generalized lifted structure loss (Hermans et al. 2017, the equation on p. 4; MS paper Eq. 6 in distances).

    With Euclidean distances ``D`` of L2-normalised embeddings, per anchor ``i``

    .. math::
        \ell_i = \Big[\log \sum_{p \in P(i)} e^{D_{ip} - m_+} + \log \sum_{n \in N(i)} e^{m_- - D_{in}}\Big]_+

    and ``L = (1/B) sum_i l_i``. ``m_+ = 0`` is the paper's loss (equal to
    ``LiftedStructureLoss(variant="generalized", margin=m_-)``); ``pos_margin`` is pml's
    ``GeneralizedLiftedStructureLoss(pos_margin, neg_margin)``, of which this is the same loss (values and
    gradients) on batches where every anchor has a positive and a negative.

    Args:
        neg_margin: ``m_-`` (pml and the paper: 1).
        pos_margin: ``m_+`` (pml: 0).

    Degenerate batches: an anchor without a positive or without a negative contributes 0 (the paper's term is
    undefined; pml keeps the other log-sum alone) and still counts in the ``1/B``; one class or singletons give 0
    with zero gradient. Label sets (``[B, L]``): a pair is positive when the sets intersect. Per-anchor terms:
    under ``gather_distributed`` each process scores its anchors against the gathered batch (``"references"``).
    """

    gather_mode = "references"
    supports_label_sets = True

    def __init__(self, neg_margin: float = 1.0, pos_margin: float = 0.0) -> None:
        super().__init__()
        self.neg_margin, self.pos_margin = float(neg_margin), float(pos_margin)

    def extra_repr(self) -> str:
        return f"neg_margin={self.neg_margin}, pos_margin={self.pos_margin}"

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        dist = distance_from_similarity(sim)
        rows = (pos.any(1) & neg.any(1)).nonzero().flatten()  # anchors with both sets: no empty log-sum-exp
        dist, pos, neg = dist[rows], pos[rows], neg[rows]
        terms = masked_lse(dist - self.pos_margin, pos) + masked_lse(self.neg_margin - dist, neg)
        return torch.relu(terms).sum() / batch_normaliser(sim.shape[0], sim)

    def pair_loss_and_grad(self, sim: Tensor, pos: Tensor, neg: Tensor) -> tuple[Tensor, Tensor]:
        """The same loss and ``dL/dS`` in closed form: an anchor whose term is above the hinge gives its positives
        the softmax weights of ``D - m+`` and its negatives minus those of ``m- - D`` (``dL/dD``), times
        ``dD/dS``."""
        dist, d_dist = distance_and_derivative(sim)
        lse_p, w_p = _lse_and_softmax(dist - self.pos_margin, pos)
        lse_n, w_n = _lse_and_softmax(self.neg_margin - dist, neg)
        ok = pos.any(1) & neg.any(1)
        terms = torch.where(ok, lse_p + lse_n, 0.0)
        norm = batch_normaliser(sim.shape[0], sim)
        active = ((terms > 0).to(sim.dtype) / norm)[:, None]
        return torch.relu(terms).sum() / norm, w_p.sub_(w_n).mul_(active).mul_(d_dist)


def _lse_and_softmax(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """``log sum_mask exp(x)`` per row (``-inf`` for an empty row) and the softmax weights over the mask (0 off it
    and on empty rows), without autograd."""
    x = x.masked_fill(~mask, float("-inf"))
    shift = x.amax(dim=1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, 0.0)
    e = x.sub_(shift).exp_()
    total = e.sum(dim=1, keepdim=True)
    return (shift + total.log()).squeeze(1), e.div_(total.clamp(min=torch.finfo(e.dtype).tiny))
