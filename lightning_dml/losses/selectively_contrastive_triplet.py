"""Selectively contrastive triplet loss, SCT (Xuan, Stylianou, Liu and Pless, "Hard Negative Examples are Hard, but
Useful", ECCV 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_dml.losses.base import batch_normaliser
from lightning_dml.losses.registry import register_loss
from lightning_dml.losses.temperature import TemperaturePairLoss

__all__ = ["SelectivelyContrastiveTripletLoss"]

POSITIVE_MINING = ("easiest", "hardest")


@register_loss("selectively_contrastive_triplet")
class SelectivelyContrastiveTripletLoss(TemperaturePairLoss):
    r"""Selectively contrastive triplet loss (Xuan et al., ECCV 2020): one triplet per anchor, its positive and its
    hardest negative (cosines ``S_ap``, ``S_an``); a triplet whose negative is closer than its positive only pushes
    the negative away:

    .. math::
        L_{SC}(S_{ap}, S_{an}) = \begin{cases} \lambda\, S_{an} & S_{an} > S_{ap} \\
            -\log \frac{e^{S_{ap}/\tau}}{e^{S_{ap}/\tau} + e^{S_{an}/\tau}} & \text{otherwise} \end{cases}

    (the paper's NCA-form triplet loss with temperature ``tau`` for the easy triplets), averaged over the anchors
    that have a positive and a negative. The positive is the anchor's most similar one (``"easiest"``, the
    easy-positive / hard-negative mining of the authors' code) or its least similar (``"hardest"``, batch-hard).
    Written from the paper; pytorch-metric-learning 3.0's ``SelectivelyContrastiveTripletLoss`` (Python >= 3.12,
    not installable here, and its code was not available to read) may mine and reduce differently: tested against
    a loop reference. On ties the first most similar item is taken (index order); ``S_an = S_ap`` is an easy
    triplet.

    Args:
        temperature: ``tau`` (0.1).
        penalty: ``lambda`` on the hard triplets' ``S_an`` (1).
        positive: ``"easiest"`` (default) or ``"hardest"``.

    Label sets: positives and negatives from intersecting sets. DDP: ``gather_mode = "references"`` (each anchor
    mines the gathered batch; a mean over anchors with all-reduced counts). Degenerate batches: anchors without a
    positive or without a negative are left out (a batch with none gives 0, zero gradient); identical embeddings
    are easy triplets at ``S_an = S_ap``: ``log 2``.
    """

    gather_mode = "references"
    supports_label_sets = True

    def __init__(self, temperature: float = 0.1, penalty: float = 1.0, positive: str = "easiest") -> None:
        super().__init__(temperature)
        if positive not in POSITIVE_MINING:
            raise ValueError(f"SelectivelyContrastiveTripletLoss: positive must be one of {POSITIVE_MINING}, got "
                             f"{positive!r}")
        if penalty < 0:
            raise ValueError(f"SelectivelyContrastiveTripletLoss: penalty must be >= 0, got {penalty}")
        self.penalty, self.positive = float(penalty), positive

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, penalty={self.penalty}, positive={self.positive!r}"

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        valid = pos.any(dim=1) & neg.any(dim=1)
        detached = sim.detach()
        if self.positive == "easiest":
            p = detached.masked_fill(~pos, float("-inf")).argmax(dim=1)
        else:
            p = detached.masked_fill(~pos, float("inf")).argmin(dim=1)
        n = detached.masked_fill(~neg, float("-inf")).argmax(dim=1)
        s_ap = sim.gather(1, p[:, None]).squeeze(1)
        s_an = sim.gather(1, n[:, None]).squeeze(1)
        hard = s_an > s_ap
        terms = torch.where(hard, self.penalty * s_an, F.softplus((s_an - s_ap) / self.temperature))
        return torch.where(valid, terms, 0.0).sum() / batch_normaliser(valid.sum(), sim)
