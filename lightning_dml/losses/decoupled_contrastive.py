"""Decoupled contrastive loss, DCL (Yeh et al., "Decoupled Contrastive Learning", ECCV 2022)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import batch_normaliser, masked_lse
from lightning_dml.losses.registry import register_loss
from lightning_dml.losses.temperature import TemperaturePairLoss

__all__ = ["DecoupledContrastiveLoss"]


@register_loss("decoupled_contrastive")
class DecoupledContrastiveLoss(TemperaturePairLoss):
    r"""Decoupled contrastive loss (Yeh et al., ECCV 2022): the NT-Xent loss with the positive removed from its
    denominator, which decouples the positive and negative gradients (the paper's "negative-positive coupling"
    factor of NT-Xent's gradient disappears).

    .. math::
        l(i, p) = -\frac{s_{ip}}{\tau} + \log \sum_{n: y_n \ne y_i} e^{s_{in}/\tau}

    with cosine similarities ``s``, over every ordered positive pair ``(i, p)`` (with labels, as
    :class:`~lightning_dml.losses.ntxent.NTXentLoss`; SimCLR's two views of an image are one label with two items,
    the paper's setting), averaged over those pairs. Written from the paper (pytorch-metric-learning 3.0's
    ``DecoupledContrastiveLoss`` needs Python >= 3.12 and is not installable here; tested against a loop reference).
    The weighted variant DCLW (the paper's von Mises-Fisher weight on the positive term) is not implemented.

    Args:
        temperature: ``tau`` (0.1, as this library's NT-Xent).

    Label sets: positives and negatives from intersecting sets. DDP: ``gather_mode = "references"`` (a mean over
    pairs with all-reduced counts). Degenerate batches: a positive pair whose anchor has no negative has no
    denominator (``log 0``): it is left out of the sum and of the count, so a one-class batch (and a batch without
    positive pairs) gives 0 with zero gradient; identical embeddings give ``log |N_i|``.
    """

    gather_mode = "references"
    supports_label_sets = True

    def __init__(self, temperature: float = 0.1) -> None:
        super().__init__(temperature)

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        logits = sim / self.temperature
        has_neg = neg.any(dim=1)
        # rows without negatives get a finite stand-in denominator; their pairs are masked out below
        log_denominator = masked_lse(logits, neg | ~has_neg[:, None])
        pairs = pos & has_neg[:, None]
        total = torch.where(pairs, log_denominator[:, None] - logits, 0.0).sum()
        return total / batch_normaliser(pairs.sum(), total)
