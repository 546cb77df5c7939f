"""Multi-Similarity mining (Wang et al., "Multi-Similarity Loss with General Pair Weighting", CVPR 2019, Eqs. 11-12;
pml's ``MultiSimilarityMiner`` with its default cosine similarity)."""

from __future__ import annotations

from torch import Tensor

from lightning_dml.miners.base import Miner, MiningBatch, pairs_from_masks
from lightning_dml.miners.mining import multi_similarity_mining

__all__ = ["MultiSimilarityMiner"]


class MultiSimilarityMiner(Miner):
    """Pairs ``(a1, p, a2, n)`` kept by MS Eqs. 11-12 on cosine similarities: a negative with
    ``S_an > min_p S_ap - epsilon`` and a positive with ``S_ap < max_n S_an + epsilon``
    (:func:`~lightning_dml.miners.mining.multi_similarity_mining`). An anchor without positives keeps no negative and
    one without negatives no positive."""

    output = "pairs"

    def __init__(self, epsilon: float = 0.1) -> None:
        super().__init__()
        self.epsilon = float(epsilon)

    def extra_repr(self) -> str:
        return f"epsilon={self.epsilon}"

    def mine(self, b: MiningBatch) -> tuple[Tensor, ...]:
        return pairs_from_masks(*multi_similarity_mining(b.sim, b.pos, b.neg, self.epsilon))
