"""Distance-weighted sampling as a miner (Wu et al., "Sampling Matters in Deep Embedding Learning", ICCV 2017,
Sec. 4, Eqs. 3-4; pml's ``DistanceWeightedMiner``)."""

from __future__ import annotations

from torch import Tensor

from lightning_dml.miners.base import Miner, MiningBatch
from lightning_dml.miners.distance_weighted import distance_weighted_sampling

__all__ = ["DistanceWeightedMiner"]


class DistanceWeightedMiner(Miner):
    """Triplets ``(a, p, n)``: every positive pair ``(a, p)`` with one negative drawn with probability
    ``∝ q(D_an)^{-1}`` among the anchor's negatives closer than ``nonzero_loss_cutoff``, distances clipped below at
    ``cutoff`` (:func:`~lightning_dml.miners.distance_weighted.distance_weighted_sampling`, as the authors' code).

    pml 2.9 draws the same negative distribution per anchor, but pairs it with ``n_p`` positives drawn at random
    with replacement per anchor (``get_random_triplet_indices``) where this miner takes each positive pair once, and
    drops an anchor none of whose negatives lies within ``nonzero_loss_cutoff`` where this one draws uniformly from
    its negatives. ``seed`` makes the draws repeatable.
    """

    output = "triplets"
    random = True

    def __init__(self, cutoff: float = 0.5, nonzero_loss_cutoff: float = 1.4, seed: int | None = None) -> None:
        super().__init__()
        if not 0.0 <= float(cutoff) < float(nonzero_loss_cutoff):
            raise ValueError(f"need 0 <= cutoff < nonzero_loss_cutoff, got {cutoff} and {nonzero_loss_cutoff}")
        self.cutoff, self.nonzero_loss_cutoff, self.seed = float(cutoff), float(nonzero_loss_cutoff), seed

    def extra_repr(self) -> str:
        return f"cutoff={self.cutoff}, nonzero_loss_cutoff={self.nonzero_loss_cutoff}"

    def mine(self, b: MiningBatch) -> tuple[Tensor, ...]:
        g = self.generator(b.dist.device)
        return distance_weighted_sampling(
            b.dist, b.labels, b.gallery_labels, dim=b.anchors.shape[1], cutoff=self.cutoff,
            nonzero_loss_cutoff=self.nonzero_loss_cutoff, generator=g,
        )
