"""Hard-aware mining of HDC (Yuan et al., "Hard-Aware Deeply Cascaded Embedding", ICCV 2017, Sec. 3.2; pml's
``HDCMiner``): the hardest fraction of the batch's positive pairs and of its negative pairs."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_dml.miners.base import Miner, MiningBatch

__all__ = ["HDCMiner"]


class HDCMiner(Miner):
    """Pairs ``(a1, p, a2, n)``: the ``ceil(filter_percentage x #pairs)`` farthest positive pairs and the as many
    closest negative pairs of the whole batch (``torch.topk``; among exactly tied distances at the cut the pair
    kept is the one ``topk`` returns, which pml shares but does not specify). Batch-wide: under
    ``gather_distributed`` the whole gathered batch is mined."""

    output = "pairs"
    per_anchor = False

    def __init__(self, filter_percentage: float = 0.5) -> None:
        super().__init__()
        if not 0.0 <= float(filter_percentage) <= 1.0:
            raise ValueError(f"filter_percentage must be in [0, 1], got {filter_percentage}")
        self.filter_percentage = float(filter_percentage)

    def extra_repr(self) -> str:
        return f"filter_percentage={self.filter_percentage}"

    def _top(self, dist: Tensor, mask: Tensor, largest: bool) -> tuple[Tensor, Tensor]:
        a, o = mask.nonzero(as_tuple=True)
        k = math.ceil(self.filter_percentage * a.numel())
        idx = torch.topk(dist[a, o], k=k, largest=largest).indices
        return a[idx], o[idx]

    def mine(self, b: MiningBatch) -> tuple[Tensor, ...]:
        a1, p = self._top(b.dist, b.pos, True)
        a2, n = self._top(b.dist, b.neg, False)
        return a1, p, a2, n
