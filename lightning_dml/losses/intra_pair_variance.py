"""Intra-pair variance loss (Yu & Tao, "Deep Metric Learning with Tuplet Margin Loss", ICCV 2019, Eqs. 15-16)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss
from lightning_dml.losses.registry import register_loss

__all__ = ["IntraPairVarianceLoss"]


@register_loss("intra_pair_variance")
class IntraPairVarianceLoss(PairLoss):
    r"""Intra-pair variance loss, TML paper Eqs. 15-16, as a loss of its own (pml's ``IntraPairVarianceLoss``).

    With cosine similarities ``S`` of L2-normalised embeddings and ``mu_+``, ``mu_-`` the means of ``S`` over all
    (ordered) positive and negative pairs of the batch:

    .. math::
        L = \mathop{\mathrm{mean}}_{(i,j)\,\mathrm{pos}} \big[(1 - \epsilon_+)\mu_+ - S_{ij}\big]_+^2
          + \mathop{\mathrm{mean}}_{(i,j)\,\mathrm{neg}} \big[S_{ij} - (1 + \epsilon_-)\mu_-\big]_+^2

    The gradient flows through the means (as pml; the paper does not stop it). ``TupletMarginLoss`` adds the same
    terms (its ``variance_weight``) to the tuplet loss; this class is the variance term alone, to add to any loss.

    Args:
        pos_eps: ``epsilon_+`` (paper and pml: 0.01).
        neg_eps: ``epsilon_-`` (paper and pml: 0.01).

    The means are over the whole batch: under ``gather_distributed`` every process computes the loss of the
    gathered batch (``"global_batch"``). Reference items are extra gallery columns (their pairs with the anchors
    join the means). Label sets (``[B, L]``): a pair is positive when the sets intersect. Degenerate batches: an
    empty set of pairs (one class: no negative; singletons: no positive) contributes 0; identical embeddings give
    0; both finite with finite gradients.
    """

    gather_mode = "global_batch"
    supports_label_sets = True
    #: indices_tuple (a miner's output, lightning_dml.miners.indices): the tuple's pairs as masks (pml's IntraPairVarianceLoss on tuples without repeated pairs)
    supports_indices_tuple = True

    def __init__(self, pos_eps: float = 0.01, neg_eps: float = 0.01) -> None:
        super().__init__()
        if pos_eps < 0 or neg_eps < 0:
            raise ValueError(f"pos_eps and neg_eps must be >= 0, got pos_eps={pos_eps}, neg_eps={neg_eps}")
        self.pos_eps, self.neg_eps = float(pos_eps), float(neg_eps)

    def extra_repr(self) -> str:
        return f"pos_eps={self.pos_eps}, neg_eps={self.neg_eps}"

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        loss = sim.sum() * 0.0
        s_pos, s_neg = sim[pos], sim[neg]
        if s_pos.numel():
            loss = loss + torch.relu((1.0 - self.pos_eps) * s_pos.mean() - s_pos).pow(2).mean()
        if s_neg.numel():
            loss = loss + torch.relu(s_neg - (1.0 + self.neg_eps) * s_neg.mean()).pow(2).mean()
        return loss

    def pair_loss_and_grad(self, sim: Tensor, pos: Tensor, neg: Tensor) -> tuple[Tensor, Tensor]:
        """The same loss and ``dL/dS`` in closed form on float masks: with ``r = [(1 - eps) mu - S]_+`` over the
        ``P`` positive pairs, ``dL/dS_ij = (2 (1 - eps) sum(r) / P - 2 r_ij) / P`` (the mean's share included), and
        the mirror image for the negatives."""
        loss = sim.new_zeros(())
        grad = torch.zeros_like(sim)
        for mask, factor, sign in ((pos, 1.0 - self.pos_eps, 1.0), (neg, 1.0 + self.neg_eps, -1.0)):
            maskf = mask.to(sim.dtype)
            count = maskf.sum()
            if not bool(count > 0):
                continue
            mean = (sim * maskf).sum() / count
            r = torch.relu(sign * (factor * mean - sim)).mul_(maskf)  # [(1-eps) mu - S]_+ or [S - (1+eps) mu]_+
            loss = loss + r.pow(2).sum() / count
            grad.add_(maskf.mul_(factor * 2.0 * r.sum() / count).sub_(r, alpha=2.0), alpha=sign / count)
        return loss, grad
