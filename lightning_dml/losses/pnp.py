"""PNP loss (Li et al., "Rethinking the Optimization of Average Precision: Only Penalizing Negative Instances before
Positive Ones is Enough", AAAI 2022)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss, batch_normaliser
from lightning_dml.losses.registry import register_loss

__all__ = ["PNPLoss", "PNP_VARIANTS"]

#: the paper's variants: decreasing (D_s: log, D_q: inverse power), increasing (I_u, I_b) and O (the plain count)
PNP_VARIANTS = ("Ds", "Dq", "Iu", "Ib", "O")


@register_loss("pnp")
class PNPLoss(PairLoss):
    r"""Penalising Negatives before Positives, PNP (Li et al., AAAI 2022).

    For anchor ``q`` and each of its positives ``p`` the smoothed number of negatives ranked before ``p`` is

    .. math::
        R_{qp} = \sum_{n \in N_q} \sigma\big((s_{qn} - s_{qp}) / \tau\big)

    and the loss is the mean over anchors with a positive of ``(1 / |P_q'|) sum_{p in P_q'} f(R_qp)`` with
    ``f`` the variant's function: ``O``: ``R``; ``Ds`` (PNP-D_s): ``log(1 + R)``; ``Dq`` (PNP-D_q, the paper's best):
    ``1 - 1 / (1 + R)^alpha``; ``Iu``: ``(1 + R) log(1 + R)``; ``Ib``: ``(b R - log(1 + b R)) / b^2``. As in the
    authors' code (interestingzhuo/PNPloss, through pytorch-metric-learning's ``PNPLoss``, whose conventions this
    follows) ``P_q'`` holds the anchor itself besides its positives (its term ranks the negatives against
    ``s_qq``), and the sigmoid's temperature is ``tau = anneal``.

    Args:
        variant: one of ``PNP_VARIANTS`` (default ``"Dq"``, the paper's PNP-D_q; pml's default is ``"O"``).
        anneal: ``tau`` (0.01).
        alpha: the power of ``Dq`` (1).
        b: the boundary of ``Ib`` (2).

    Cost: one ``M x N`` sigmoid over the ``M`` (anchor, positive) pairs, where pml forms a ``B x B x B`` tensor.
    Label sets: positives and negatives from intersecting sets (the loss only asks which pairs are positive).
    Under DDP each process ranks its anchors' positives against the gathered batch (``gather_mode =
    "references"``; the mean over anchors is batch-wide). Degenerate batches: anchors without a positive are left
    out, a batch without any gives 0; identical embeddings give ``R = |N_q| / 2`` (finite).
    """

    gather_mode = "references"
    supports_label_sets = True

    def __init__(self, variant: str = "Dq", anneal: float = 0.01, alpha: float = 1.0, b: float = 2.0) -> None:
        super().__init__()
        if variant not in PNP_VARIANTS:
            raise ValueError(f"PNPLoss: variant must be one of {PNP_VARIANTS}, got {variant!r}")
        if anneal <= 0 or b <= 0:
            raise ValueError(f"PNPLoss: need anneal > 0 and b > 0, got anneal={anneal}, b={b}")
        self.variant, self.anneal, self.alpha, self.b = variant, float(anneal), float(alpha), float(b)

    def extra_repr(self) -> str:
        return f"variant={self.variant!r}, anneal={self.anneal}, alpha={self.alpha}, b={self.b}"

    def _weight(self, rank: Tensor) -> Tensor:
        if self.variant == "Ds":
            return torch.log1p(rank)
        if self.variant == "Dq":
            return 1.0 - (1.0 + rank).pow(-self.alpha)
        if self.variant == "Iu":
            return (1.0 + rank) * torch.log1p(rank)
        if self.variant == "Ib":
            return (self.b * rank - torch.log1p(self.b * rank)) / self.b**2
        return rank

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        anchors = pos.any(dim=1).nonzero().flatten()
        pr, pc = pos[anchors].nonzero(as_tuple=True)
        rows = torch.cat([anchors[pr], anchors])  # (anchor, positive) pairs, then (anchor, itself)
        cols = torch.cat([pc, anchors])  # the gallery's first B columns are the batch: column q is q itself
        rank = (torch.sigmoid((sim[rows] - sim[rows, cols][:, None]) / self.anneal) * neg[rows]).sum(dim=1)
        count = torch.zeros(sim.shape[0], dtype=sim.dtype, device=sim.device).index_add_(
            0, rows, torch.ones_like(rank)
        )
        per_pair = self._weight(rank) / count[rows]
        return per_pair.sum() / batch_normaliser(anchors.numel(), sim)
