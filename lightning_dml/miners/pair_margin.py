"""Pair margin mining (pml's ``PairMarginMiner``; the contrastive loss's active pairs, Hadsell et al., CVPR 2006):
positive pairs farther than ``pos_margin`` and negative pairs closer than ``neg_margin``."""

from __future__ import annotations

from torch import Tensor

from lightning_dml.miners.base import Miner, MiningBatch, pairs_from_masks

__all__ = ["PairMarginMiner"]


class PairMarginMiner(Miner):
    """Pairs ``(a1, p, a2, n)``: positives with ``D > pos_margin``, negatives with ``D < neg_margin`` (Euclidean
    distances of unit vectors, pml's default). Only needs "is positive": label sets are accepted."""

    output = "pairs"

    def __init__(self, pos_margin: float = 0.2, neg_margin: float = 0.8) -> None:
        super().__init__()
        self.pos_margin, self.neg_margin = float(pos_margin), float(neg_margin)

    def extra_repr(self) -> str:
        return f"pos_margin={self.pos_margin}, neg_margin={self.neg_margin}"

    def mine(self, b: MiningBatch) -> tuple[Tensor, ...]:
        return pairs_from_masks(b.pos & (b.dist > self.pos_margin), b.neg & (b.dist < self.neg_margin))
