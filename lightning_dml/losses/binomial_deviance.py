"""Binomial deviance loss as reviewed in the Multi-Similarity paper (MS Eq. 9)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from lightning_dml.losses.base import PairLoss, batch_normaliser, masked_mean
from lightning_dml.losses.registry import register_loss

__all__ = ["BinomialDevianceLoss"]


@register_loss("binomial_deviance")
class BinomialDevianceLoss(PairLoss):
    r"""Binomial deviance loss (MS paper Eq. 9; Yi et al.).

    Similarity: cosine ``S`` of L2-normalised embeddings.

    .. math::
        L = \frac{1}{B}\sum_i \Big\{\frac{1}{|Pos(i)|}\sum_{j\in Pos(i)} \log[1 + e^{\alpha(\lambda - S_{ij})}]
            + \frac{1}{|Neg(i)|}\sum_{j\in Neg(i)} \log[1 + e^{\beta(S_{ij} - \lambda)}]\Big\}

    Eq. 9 sums over anchors; the 1/B average (as in MS Eq. 15) keeps the scale independent of the batch size.
    Its pair weights are MS Eq. 10: ``w+ = alpha sigma(alpha(lam - S)) / |Pos(i)|``, ``w- = beta sigma(beta(S - lam))
    / |Neg(i)|`` (divided by B).

    Args:
        alpha: positive scale (2.0), beta: negative scale (50.0), lam: similarity margin (0.5).

    Degenerate batches: an anchor without positives (negatives) has a zero positive (negative) term.
    """

    #: under DDP: anchors scored against the gathered batch, batch-wide reductions (losses.base)
    gather_mode = "references"
    #: label sets ([B, L], positive = the sets intersect): the loss only asks which pairs are positive
    supports_label_sets = True

    def __init__(self, alpha: float = 2.0, beta: float = 50.0, lam: float = 0.5) -> None:
        super().__init__()
        if not alpha > 0 or not beta > 0:
            raise ValueError(f"alpha and beta must be > 0, got alpha={alpha}, beta={beta}")
        self.alpha, self.beta, self.lam = float(alpha), float(beta), float(lam)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}, beta={self.beta}, lam={self.lam}"

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        lp = masked_mean(F.softplus(self.alpha * (self.lam - sim)), pos)
        ln = masked_mean(F.softplus(self.beta * (sim - self.lam)), neg)
        return (lp + ln).sum() / batch_normaliser(sim.shape[0], sim)
