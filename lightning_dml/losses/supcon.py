"""Supervised contrastive loss (Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import batch_normaliser, masked_lse
from lightning_dml.losses.registry import register_loss
from lightning_dml.losses.temperature import TemperaturePairLoss

__all__ = ["SupConLoss"]


@register_loss("supcon")
class SupConLoss(TemperaturePairLoss):
    r"""Supervised contrastive loss, the "L_out" form (SupCon paper Eq. 2).

    Similarity: cosine ``z_i . z_j`` of L2-normalised embeddings. For an anchor ``i`` with positives ``P(i)``
    (same label, ``i`` itself excluded) and all other items ``A(i)`` (the batch without ``i``, plus references):

    .. math::
        L_i = \frac{-1}{|P(i)|} \sum_{p \in P(i)} \log \frac{e^{z_i \cdot z_p / \tau}}{\sum_{a \in A(i)} e^{z_i \cdot z_a / \tau}}

    averaged over the anchors with ``|P(i)| >= 1`` (Eq. 2 sums over anchors; the mean only rescales, and is what
    the authors' code and pytorch-metric-learning do).

    Args:
        temperature: ``tau``. Default 0.1, the value the paper's text reports for its experiments (and
            pytorch-metric-learning's default); the authors' released code defaults to 0.07 and also rescales the
            loss by ``tau / 0.07``, which we do not (it only multiplies the loss by a constant).

    Degenerate batches: an anchor without a positive has no term and does not count in the mean; a batch without
    any positive pair gives 0 with zero gradient. A batch of one class (no negatives) is still defined (each
    anchor's denominator holds its positives only).
    pytorch-metric-learning differs there: it returns 0 when the batch has no negative pair at all, and its
    mean skips anchors whose loss is exactly 0.
    """

    #: a mean of per-anchor (per-pair) terms over the global gallery: exact under DDP with all-reduced counts
    gather_mode = "references"

    def __init__(self, temperature: float = 0.1) -> None:
        super().__init__(temperature)

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        logits = sim / self.temperature
        valid = pos.any(dim=1)
        # rows without positives get a full (finite) denominator; their term is masked out
        log_denominator = masked_lse(logits, pos | neg | ~valid[:, None])
        # -1/|P| sum_P log(e^{l_ip} / sum_A e^{l_ia}) = log sum_A e^{l_ia} - mean_P l_ip
        per_anchor = log_denominator - torch.where(pos, logits, 0.0).sum(dim=1) / pos.sum(dim=1).clamp(min=1)
        total = torch.where(valid, per_anchor, 0.0).sum()
        return total / batch_normaliser(valid.sum(), total)
