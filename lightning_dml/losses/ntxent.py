"""NT-Xent loss (Chen et al., "A Simple Framework for Contrastive Learning of Visual Representations", ICML 2020)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import batch_normaliser, masked_lse
from lightning_dml.losses.registry import register_loss
from lightning_dml.losses.temperature import TemperaturePairLoss

__all__ = ["NTXentLoss"]


@register_loss("ntxent")
class NTXentLoss(TemperaturePairLoss):
    r"""Normalised temperature-scaled cross-entropy loss (SimCLR paper Eq. 1), with labels.

    Similarity: cosine ``sim(z_i, z_j)`` of L2-normalised embeddings. SimCLR's batch holds two views of each
    image, so every anchor has exactly one positive and Eq. 1 reads
    ``l(i, j) = -log( e^{sim(i,j)/tau} / sum_{k != i} e^{sim(i,k)/tau} )``, averaged over all ``2N`` ordered
    positive pairs. With labels (as in pytorch-metric-learning), every same-label pair ``(i, p)`` is a positive
    pair, and its denominator holds that positive and the anchor's negatives (not its other positives):

    .. math::
        l(i, p) = -\log \frac{e^{s_{ip}/\tau}}{e^{s_{ip}/\tau} + \sum_{n: y_n \ne y_i} e^{s_{in}/\tau}}

    averaged over all ordered positive pairs. With one positive per anchor this is exactly Eq. 1.

    Args:
        temperature: ``tau``. Default 0.1: SimCLR's Table 5 finds 0.1 best for its batch sizes and its
            ImageNet runs use 0.1 (its CIFAR-10 runs 0.5); pytorch-metric-learning's default is 0.07.
        anchor_chunk_size: score the anchors this many at a time, each block's ``B x N`` matrices recomputed in
            the backward (memory ``O(chunk x N)``, same value and gradients; :mod:`lightning_dml.losses.chunking`).

    Degenerate batches: no positive pair -> 0 with zero gradient; a positive pair whose anchor has no negative
    contributes ``-log 1 = 0`` and counts in the mean (as in pml); a single-class batch gives 0.
    """

    #: a mean of per-anchor (per-pair) terms over the global gallery: exact under DDP with all-reduced counts
    gather_mode = "references"
    #: anchor_chunk_size: a sum of per-anchor terms over batch-wide counts (losses.chunking)
    supports_anchor_chunks = True
    #: indices_tuple (a miner's output, lightning_dml.miners.indices): the tuple's positive pairs, each against the
    #: anchor's mined negatives (pml's NTXentLoss)
    supports_indices_tuple = True
    label_sets_reason = (
        "label sets are not implemented for it yet (its definition only asks which pairs are positive, so it could "
        "take them: see docs/losses/README.md)"
    )

    def __init__(self, temperature: float = 0.1, anchor_chunk_size: int | None = None) -> None:
        super().__init__(temperature)
        self.set_anchor_chunk_size(anchor_chunk_size)

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        logits = sim / self.temperature
        has_neg = neg.any(dim=1)
        # log sum over the anchor's negatives; rows without negatives use a finite stand-in, masked below
        neg_lse = masked_lse(logits, neg | ~has_neg[:, None])
        neg_lse = torch.where(has_neg, neg_lse, -torch.inf)
        terms = torch.logaddexp(logits, neg_lse[:, None]) - logits
        total = torch.where(pos, terms, 0.0).sum()
        return total / batch_normaliser(pos.sum(), total)
