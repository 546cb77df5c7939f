"""Pair and triplet mining as boolean masks (General Pair Weighting paper, Section III-A).

Every function takes a ``B x N`` similarity matrix ``S`` (cosine) or distance matrix ``D`` (Euclidean on the unit
sphere) whose rows are the ``B`` anchors of the batch and whose columns are the ``N`` gallery items (the batch
itself, optionally followed by extra reference items), plus the label masks of :func:`label_masks`. They return
boolean masks, which carry no gradient (SPEC 0.3 rule 4). The losses of :mod:`lightning_dml.losses` are built on
these same functions.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "self_pair_mask",
    "label_masks",
    "positive_pairs",
    "threshold_mining",
    "multi_similarity_mining",
    "triplet_margin_pair_mining",
    "batch_hard_mining",
    "positive_index",
    "triplet_margin_mining",
]


def self_pair_mask(num_anchors: int, num_gallery: int, device: torch.device | None = None) -> Tensor:
    """``B x N`` mask that is True at the self-pairs ``(i, i)``, by index (SPEC 0.3 rule 3).

    The gallery is the batch followed by reference items, so anchor ``i`` is gallery column ``i``.
    """
    rows = torch.arange(num_anchors, device=device)[:, None]
    cols = torch.arange(num_gallery, device=device)[None, :]
    return rows == cols


def label_masks(labels: Tensor, gallery_labels: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Positive and negative pair masks ``Mpos``, ``Mneg`` (SPEC 0.2).

    Args:
        labels: ``[B]`` labels of the anchors.
        gallery_labels: ``[N]`` labels of the gallery whose first ``B`` entries are the anchors themselves.
            Defaults to ``labels`` (gallery = batch).

    Returns:
        ``(pos, neg)``, both ``B x N`` boolean: ``pos`` = same label without the self-pair (removed by index),
        ``neg`` = different label.
    """
    if gallery_labels is None:
        gallery_labels = labels
    same = labels[:, None] == gallery_labels[None, :]
    pos = same & ~self_pair_mask(labels.shape[0], gallery_labels.shape[0], labels.device)
    return pos, ~same


def positive_pairs(labels: Tensor, gallery_labels: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """All positive pairs ``(i, j)`` (same label, ``j != i`` by index) as index lists, without a ``B x N`` mask.

    Same pairs as ``label_masks(...)[0].nonzero()`` (in another order), in ``O(B K_max + N log N)`` from sorted
    labels, where ``K_max`` is the largest class count in the gallery.
    """
    rows, cols, valid = positive_table(labels, gallery_labels)
    return rows[valid], cols[valid]


def positive_table(labels: Tensor, gallery_labels: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``[B, K]`` tables ``(rows, cols, valid)`` of each anchor's positives from sorted labels (no ``B x N`` mask).

    ``cols[i, r]`` is a positive of anchor ``i`` where ``valid[i, r]``; ``K`` is the largest class count.
    """
    if gallery_labels is None:
        gallery_labels = labels
    sorted_g, order = torch.sort(gallery_labels, stable=True)
    start = torch.searchsorted(sorted_g, labels, right=False)
    count = torch.searchsorted(sorted_g, labels, right=True) - start
    k_max = int(count.max().item()) if labels.numel() > 0 else 0
    offs = torch.arange(k_max, device=labels.device)
    slot = start[:, None] + offs[None, :]
    valid = offs[None, :] < count[:, None]
    cols = order[slot.clamp(max=max(gallery_labels.numel() - 1, 0))]
    rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(cols)
    return rows, cols, valid & (cols != rows)


def threshold_mining(
    dist: Tensor, pos: Tensor, neg: Tensor, pos_threshold: float, neg_threshold: float, strict: bool = False
) -> tuple[Tensor, Tensor]:
    """Pair thresholds on distances (GPW Eqs. 16-17; RLL non-trivial pairs with ``strict=True``).

    Keeps a positive if ``D >= pos_threshold`` (``>`` when strict) and a negative if ``D <= neg_threshold``
    (``<`` when strict).
    """
    if strict:
        return pos & (dist > pos_threshold), neg & (dist < neg_threshold)
    return pos & (dist >= pos_threshold), neg & (dist <= neg_threshold)


def multi_similarity_mining(sim: Tensor, pos: Tensor, neg: Tensor, eps: float) -> tuple[Tensor, Tensor]:
    """Similarity-P mining of the MS paper (Eqs. 11-12) on a similarity matrix.

    Keeps a negative ``j`` of anchor ``i`` if ``S_ij > min_{k in Pos(i)} S_ik - eps`` and a positive ``j`` if
    ``S_ij < max_{k in Neg(i)} S_ik + eps``. An anchor without positives keeps no negative, one without negatives
    keeps no positive (the min/max over an empty set is +inf/-inf).
    For the distance form of GPW Eqs. 22-23 pass ``-D`` as ``sim``.
    """
    sim = sim.detach()
    hardest_pos = sim.masked_fill(~pos, float("inf")).amin(dim=1, keepdim=True)
    hardest_neg = sim.masked_fill(~neg, float("-inf")).amax(dim=1, keepdim=True)
    keep_neg = neg & (sim > hardest_pos - eps)
    keep_pos = pos & (sim < hardest_neg + eps)
    return keep_pos, keep_neg


def triplet_margin_pair_mining(dist: Tensor, pos: Tensor, neg: Tensor, margin: float) -> tuple[Tensor, Tensor]:
    """Pairs that take part in at least one triplet kept by the triplet margin rule (GPW Eq. 19).

    A triplet ``(i, j, k)`` is kept if ``D_ij + margin >= D_ik``. A positive takes part in one if
    ``D_ij >= min_{k in Neg(i)} D_ik - margin``; a negative if ``D_ik <= max_{j in Pos(i)} D_ij + margin``.
    """
    dist = dist.detach()
    hardest_neg = dist.masked_fill(~neg, float("inf")).amin(dim=1, keepdim=True)
    hardest_pos = dist.masked_fill(~pos, float("-inf")).amax(dim=1, keepdim=True)
    return pos & (dist + margin >= hardest_neg), neg & (dist <= hardest_pos + margin)


def batch_hard_mining(dist: Tensor, pos: Tensor, neg: Tensor) -> tuple[Tensor, Tensor]:
    """Batch-hard mining (GPW Eq. 20, Hermans et al.): per anchor the farthest positive and the closest negative.

    Returns one-hot ``B x N`` masks; an anchor without positives (negatives) gets an all-False row. Ties are
    broken by the lowest index.
    """
    dist = dist.detach()
    far_pos = dist.masked_fill(~pos, float("-inf")).argmax(dim=1, keepdim=True)
    near_neg = dist.masked_fill(~neg, float("inf")).argmin(dim=1, keepdim=True)
    hard_pos = torch.zeros_like(pos).scatter_(1, far_pos, True) & pos
    hard_neg = torch.zeros_like(neg).scatter_(1, near_neg, True) & neg
    return hard_pos, hard_neg


def positive_index(pos: Tensor) -> tuple[Tensor, Tensor]:
    """Each anchor's positives gathered into a ``[B, K_max]`` index tensor (SPEC 9.2: never a B^3 tensor).

    Returns:
        ``(index, valid)``: ``index[i, r]`` is the gallery column of the ``r``-th positive of anchor ``i``
        (0 where ``valid`` is False).
    """
    counts = pos.sum(dim=1)
    # at least one (invalid) column so that reductions over the positives never see an empty dimension
    k_max = max(int(counts.max().item()) if pos.numel() > 0 else 0, 1)
    # a stable sort puts the True columns first, in increasing index order
    order = torch.sort(pos.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :k_max]
    valid = torch.arange(k_max, device=pos.device)[None, :] < counts[:, None]
    return order.masked_fill(~valid, 0), valid


def triplet_margin_mining(
    dist: Tensor, pos: Tensor, neg: Tensor, margin: float
) -> tuple[Tensor, Tensor, Tensor]:
    """Triplets kept by the triplet margin rule (GPW Eq. 19) without a B^3 tensor.

    Returns:
        ``(pos_index [B, K], pos_valid [B, K], keep [B, K, N])`` where ``keep[i, r, k]`` is True for the triplet
        (anchor ``i``, positive ``pos_index[i, r]``, negative ``k``) with ``D_ij + margin >= D_ik``.
        Note this also keeps triplets at the hinge boundary, whose hinge is 0.
    """
    dist = dist.detach()
    index, valid = positive_index(pos)
    d_pos = dist.gather(1, index)  # [B, K]
    keep = valid[:, :, None] & neg[:, None, :] & (d_pos[:, :, None] + margin >= dist[:, None, :])
    return index, valid, keep
