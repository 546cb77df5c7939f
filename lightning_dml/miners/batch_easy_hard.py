"""Batch easy/hard mining: per anchor one positive and one negative chosen by a strategy (pml's
``BatchEasyHardMiner``; Xuan et al., "Improved Embeddings with Easy Positive Triplet Mining", WACV 2020) and its
special case batch-hard (Hermans et al., "In Defense of the Triplet Loss", 2017, Sec. 2: the farthest positive and
the closest negative of each anchor; GPW Eq. 20)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.miners.base import Miner, MiningBatch

__all__ = ["BatchEasyHardMiner", "BatchHardMiner", "STRATEGIES"]

#: the strategies of pml's BatchEasyHardMiner
STRATEGIES = ("hard", "semihard", "easy", "all")


def _pick(
    dist: Tensor, mask: Tensor, largest: bool, allowed: tuple[float, float] | None
) -> tuple[Tensor, Tensor, Tensor]:
    """Per row, the largest (smallest) ``dist`` among ``mask`` (and within ``allowed``): ``(value, column, has)``;
    ties go to the lowest column, as ``torch.max`` / ``torch.min`` along a dimension."""
    if allowed is not None:
        mask = mask & (dist >= allowed[0]) & (dist <= allowed[1])
    fill = float("-inf") if largest else float("inf")
    masked = dist.masked_fill(~mask, fill)
    value, column = masked.max(dim=1) if largest else masked.min(dim=1)
    return value, column, mask.any(dim=1)


class BatchEasyHardMiner(Miner):
    """Per anchor, one positive by ``pos_strategy`` and one negative by ``neg_strategy`` (pml 2.9's
    ``BatchEasyHardMiner`` with its default Euclidean distance of unit vectors):

    * positives: ``"easy"`` the closest, ``"hard"`` the farthest, ``"semihard"`` the farthest among those closer than
      the anchor's chosen negative, ``"all"`` every positive pair;
    * negatives: ``"easy"`` the farthest, ``"hard"`` the closest, ``"semihard"`` the closest among those farther than
      the anchor's chosen positive, ``"all"`` every negative pair.

    ``allowed_pos_range`` / ``allowed_neg_range``: ``(low, high)`` distances a chosen pair must lie within.
    Returns pairs ``(a, p, a, n)`` of the anchors that have both (with ``"all"`` on one side: that side's every
    pair, and the other side's chosen pairs). Ties: the lowest gallery index.
    """

    output = "pairs"

    def __init__(
        self,
        pos_strategy: str = "easy",
        neg_strategy: str = "semihard",
        allowed_pos_range: tuple[float, float] | None = None,
        allowed_neg_range: tuple[float, float] | None = None,
    ) -> None:
        super().__init__()
        for name, value in (("pos_strategy", pos_strategy), ("neg_strategy", neg_strategy)):
            if value not in STRATEGIES:
                raise ValueError(f"{name} must be one of {STRATEGIES}, got {value!r}")
        if pos_strategy == neg_strategy == "semihard":
            raise ValueError('pos_strategy and neg_strategy cannot both be "semihard"')
        if {pos_strategy, neg_strategy} == {"semihard", "all"}:
            raise ValueError('"semihard" cannot be combined with "all"')
        for name, rng in (("allowed_pos_range", allowed_pos_range), ("allowed_neg_range", allowed_neg_range)):
            if rng is not None and (len(rng) != 2 or not float(rng[0]) <= float(rng[1])):
                raise ValueError(f"{name} must be (low, high) with low <= high, got {rng!r}")
        self.pos_strategy, self.neg_strategy = pos_strategy, neg_strategy
        self.allowed_pos_range = None if allowed_pos_range is None else tuple(float(v) for v in allowed_pos_range)
        self.allowed_neg_range = None if allowed_neg_range is None else tuple(float(v) for v in allowed_neg_range)

    def extra_repr(self) -> str:
        return f"pos_strategy={self.pos_strategy!r}, neg_strategy={self.neg_strategy!r}"

    def _positives(self, b: MiningBatch, neg_dist: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        mask = b.pos
        if neg_dist is not None:  # semihard: closer than the chosen negative
            mask = mask & (b.dist < neg_dist[:, None])
        return _pick(b.dist, mask, self.pos_strategy != "easy", self.allowed_pos_range)

    def _negatives(self, b: MiningBatch, pos_dist: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        mask = b.neg
        if pos_dist is not None:  # semihard: farther than the chosen positive
            mask = mask & (b.dist > pos_dist[:, None])
        return _pick(b.dist, mask, self.neg_strategy == "easy", self.allowed_neg_range)

    def mine(self, b: MiningBatch) -> tuple[Tensor, ...]:
        pos_s, neg_s = self.pos_strategy, self.neg_strategy
        rows = torch.arange(b.dist.shape[0], device=b.dist.device)
        if pos_s == "semihard" and neg_s != "all":
            nd, n, has_n = self._negatives(b, None)
            _, p, has_p = self._positives(b, nd)
        elif neg_s == "semihard" and pos_s != "all":
            pd, p, has_p = self._positives(b, None)
            _, n, has_n = self._negatives(b, pd)
        else:
            if pos_s != "all":
                _, p, has_p = self._positives(b, None)
            if neg_s != "all":
                _, n, has_n = self._negatives(b, None)
        if pos_s == "all" and neg_s == "all":
            a1, p1 = b.pos.nonzero(as_tuple=True)
            a2, n2 = b.neg.nonzero(as_tuple=True)
            return a1, p1, a2, n2
        if pos_s == "all":
            a1, p1 = b.pos.nonzero(as_tuple=True)
            return a1, p1, rows[has_n], n[has_n]
        if neg_s == "all":
            a2, n2 = b.neg.nonzero(as_tuple=True)
            return rows[has_p], p[has_p], a2, n2
        keep = has_p & has_n
        return rows[keep], p[keep], rows[keep], n[keep]


class BatchHardMiner(BatchEasyHardMiner):
    """Batch-hard mining (Hermans et al. 2017, Sec. 2; GPW Eq. 20): per anchor the farthest positive and the closest
    negative, as triplets ``(a, p, n)`` (pml 2.9's ``BatchHardMiner``). Ties: the lowest gallery index."""

    output = "triplets"

    def __init__(
        self,
        allowed_pos_range: tuple[float, float] | None = None,
        allowed_neg_range: tuple[float, float] | None = None,
    ) -> None:
        super().__init__("hard", "hard", allowed_pos_range, allowed_neg_range)

    def mine(self, b: MiningBatch) -> tuple[Tensor, ...]:
        a, p, _, n = super().mine(b)
        return a, p, n
