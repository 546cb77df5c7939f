"""Triplet margin mining (pml's ``TripletMarginMiner``; the triplet selection of FaceNet, Schroff et al., CVPR 2015,
Sec. 3.2, and GPW Eq. 19): the triplets ``(a, p, n)`` whose margin ``D_an - D_ap`` is at most ``margin``."""

from __future__ import annotations

from torch import Tensor

from lightning_dml.miners.base import Miner, MiningBatch, triplets_from_keep
from lightning_dml.miners.pairs import positive_index

__all__ = ["TripletMarginMiner", "TRIPLET_TYPES"]

TRIPLET_TYPES = ("all", "hard", "semihard", "easy")


class TripletMarginMiner(Miner):
    """Triplets by their margin ``t = D_an - D_ap`` (Euclidean distances of unit vectors, pml's default):

    * ``"all"``: ``t <= margin`` (the triplets with a non-zero hinge ``[D_ap - D_an + margin]_+``, boundary included);
    * ``"hard"``: ``t <= 0`` as well (the negative no farther than the positive);
    * ``"semihard"``: ``0 < t <= margin``;
    * ``"easy"``: ``t > margin`` (the complement of ``"all"``).

    Built on ``[B, K, N]`` tensors (each anchor's ``K`` positives, no ``B x N x N`` tensor). Returns ``(a, p, n)``.
    """

    output = "triplets"

    def __init__(self, margin: float = 0.2, type_of_triplets: str = "all") -> None:
        super().__init__()
        if type_of_triplets not in TRIPLET_TYPES:
            raise ValueError(f"type_of_triplets must be one of {TRIPLET_TYPES}, got {type_of_triplets!r}")
        self.margin, self.type_of_triplets = float(margin), type_of_triplets

    def extra_repr(self) -> str:
        return f"margin={self.margin}, type_of_triplets={self.type_of_triplets!r}"

    def mine(self, b: MiningBatch) -> tuple[Tensor, ...]:
        index, valid = positive_index(b.pos)
        d_ap = b.dist.gather(1, index)
        t = b.dist[:, None, :] - d_ap[:, :, None]  # [B, K, N]
        if self.type_of_triplets == "easy":
            cond = t > self.margin
        else:
            cond = t <= self.margin
            if self.type_of_triplets == "hard":
                cond &= t <= 0
            elif self.type_of_triplets == "semihard":
                cond &= t > 0
        keep = cond & valid[:, :, None] & b.neg[:, None, :]
        return triplets_from_keep(index, keep)
