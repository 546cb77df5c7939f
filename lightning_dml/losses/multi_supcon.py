"""Multi-label supervised contrastive loss: SupCon (Khosla et al., NeurIPS 2020, Eq. 2) on label sets, a pair
positive when the Jaccard similarity of its sets exceeds a threshold (pytorch-metric-learning 3.0's
``MultiSupConLoss``)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import batch_normaliser, masked_lse, similarity_matrix
from lightning_dml.losses.registry import register_loss
from lightning_dml.losses.softmax_pairs import anchor_mean
from lightning_dml.losses.supcon import SupConLoss

__all__ = ["MultiSupConLoss", "jaccard_positive_mask"]


def _as_sets(labels: Tensor) -> Tensor:
    """``[B]`` labels or ``[B, L]`` label sets as ``[B, L]`` sets with each label once (repeats become -1)."""
    sets = labels[:, None] if labels.ndim == 1 else labels
    sets = sets.sort(dim=1).values
    repeat = torch.zeros_like(sets, dtype=torch.bool)
    repeat[:, 1:] = (sets[:, 1:] == sets[:, :-1]) & (sets[:, 1:] >= 0)
    return sets.masked_fill(repeat, -1)


def jaccard_positive_mask(labels: Tensor, gallery_labels: Tensor, threshold: float) -> Tensor:
    """``B x N``: ``|A_i & G_j| / |A_i | G_j| > threshold`` for the anchors' and the gallery's label sets (an empty
    set is never positive); ``L x L'`` equality passes (``B x N x L'``), no ``B x N x classes`` one-hot."""
    a, g = _as_sets(labels), _as_sets(gallery_labels)
    inter = torch.zeros(a.shape[0], g.shape[0], dtype=torch.long, device=a.device)
    for col in range(a.shape[1]):
        label = a[:, col, None, None]  # [B, 1, 1] against the gallery's [1, N, L'] columns
        inter += ((label == g[None]) & (label >= 0)).sum(dim=2)
    union = (a >= 0).sum(dim=1)[:, None] + (g >= 0).sum(dim=1)[None, :] - inter
    return inter > threshold * union


@register_loss("multi_supcon")
class MultiSupConLoss(SupConLoss):
    r"""SupCon's L_out (Khosla et al., NeurIPS 2020, Eq. 2) with multi-label positives:

    .. math::
        L_i = \log \sum_{a \in A(i)} e^{s_{ia} / \tau} - \frac{1}{|P(i)|} \sum_{p \in P(i)} s_{ip} / \tau,
        \qquad P(i) = \{ j \ne i : J(Y_i, Y_j) > t \}

    with ``J`` the Jaccard similarity of the two items' label sets (``|Y_i & Y_j| / |Y_i | Y_j|``), ``A(i)`` every
    other item (batch and references) and cosine similarities ``s``; averaged over the anchors with a positive.
    This is pytorch-metric-learning 3.0's ``MultiSupConLoss(num_classes, temperature=0.1)`` (positives from its
    ``jaccard(..., threshold=0.3)``), read from its code (pml 3 needs Python >= 3.12: tested here against a loop
    reference, and against pml 2.9's ``SupConLoss`` for one label per item, where ``J`` is 1 or 0). Differences
    from pml 3, documented: no ``num_classes`` argument (the sets are compared directly); a label repeated in one
    set counts once; pml's ``AvgNonZeroReducer`` also skips an anchor whose loss is exactly 0 (its only other item
    is its one positive), and it returns 0 for a batch without any negative pair, where this mean keeps them.

    Args:
        temperature: ``tau`` (0.1).
        threshold: ``t`` (0.3, pml's); with one label per item any ``t`` in ``[0, 1)`` gives SupCon.

    Labels: ``[B]`` (Jaccard 1 or 0: exactly :class:`~lightning_dml.losses.supcon.SupConLoss`, whose closed-form
    path it then takes) or label sets ``[B, L]`` padded with -1 (an empty set has no positive). DDP: ``gather_mode =
    "references"`` (a mean over anchors with all-reduced counts). Degenerate batches: no positive pair -> 0 with zero
    gradient; one class (no negatives) and identical embeddings are finite.
    """

    gather_mode = "references"
    supports_label_sets = True
    #: the label-set path computes every anchor at once
    supports_anchor_chunks = False

    def __init__(self, temperature: float = 0.1, threshold: float = 0.3) -> None:
        super().__init__(temperature)
        if not 0.0 <= threshold < 1.0:
            raise ValueError(f"MultiSupConLoss: threshold must be in [0, 1), got {threshold}")
        self.threshold = float(threshold)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}, threshold={self.threshold}"

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        if labels.ndim == 1 and gallery_labels.ndim == 1:  # one label per item: SupCon
            return super().compute(anchors, labels, gallery, gallery_labels)
        g = anchors if gallery is None else gallery
        pos = jaccard_positive_mask(labels, gallery_labels, self.threshold)
        others = torch.ones_like(pos)
        others[:, : anchors.shape[0]].fill_diagonal_(False)  # the self-pair is neither positive nor in A(i)
        pos &= others
        logits = similarity_matrix(anchors, g) / self.temperature
        valid = pos.any(dim=1)
        log_denominator = masked_lse(logits, others)
        count = pos.sum(dim=1, keepdim=True).clamp(min=1)
        per_anchor = log_denominator - (torch.where(pos, logits, 0.0) / count).sum(dim=1)
        return anchor_mean(per_anchor, valid, batch_normaliser(valid.sum(), per_anchor))
