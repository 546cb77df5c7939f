"""Pair and triplet mining as boolean masks (General Pair Weighting paper, Section III-A).

Every function takes a ``B x N`` similarity matrix ``S`` (cosine) or distance matrix ``D`` (Euclidean on the unit
sphere) whose rows are the ``B`` anchors of the batch and whose columns are the ``N`` gallery items (the batch
itself, optionally followed by extra reference items), plus the label masks of :func:`label_masks` (labels or label
sets: :mod:`lightning_dml.miners.pairs`, re-exported here). They return
boolean masks, which carry no gradient (SPEC 0.3 rule 4). The losses of :mod:`lightning_dml.losses` are built on
these same functions.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.miners.pairs import label_masks, positive_index, positive_pairs, positive_table, self_pair_mask

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
