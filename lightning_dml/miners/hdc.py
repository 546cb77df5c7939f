"""Hard-aware mining of HDC (Yuan et al., "Hard-Aware Deeply Cascaded Embedding", ICCV 2017, Sec. 3.2; pml's
``HDCMiner``): the hardest fraction of the batch's positive pairs and of its negative pairs."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_dml.miners.base import Miner, MiningBatch

__all__ = ["HDCMiner", "hardest"]


def hardest(values: Tensor, k: int, largest: bool) -> Tensor:
    """Indices (increasing) of the ``k`` largest (smallest) of ``values [T]``; among values equal to the ``k``-th
    the lowest indices are kept. One ``torch.kthvalue`` selection (linear time; ``torch.topk`` of half the values is
    about 4x slower on the CPU) and no host read."""
    n = values.numel()
    if k <= 0:
        return torch.zeros(0, dtype=torch.long, device=values.device)
    if k >= n:
        return torch.arange(n, device=values.device)
    cut = torch.kthvalue(values, n - k + 1 if largest else k).values
    beyond = values > cut if largest else values < cut
    tied = values == cut
    need = k - beyond.sum()  # >= 1 tied values complete the k, in index order
    return (beyond | (tied & (tied.cumsum(0) <= need))).nonzero(as_tuple=True)[0]


class HDCMiner(Miner):
    """Pairs ``(a1, p, a2, n)``: the ``ceil(filter_percentage x #pos)`` farthest of the batch's positive pairs and
    the ``ceil(filter_percentage x #neg)`` closest of its negative pairs (:func:`hardest`: a selection with
    ``torch.kthvalue``, not a sort; among exactly tied distances at the cut the pairs first in row-major order are
    kept, where pml's ``torch.topk`` leaves it unspecified). Batch-wide: under ``gather_distributed`` the whole
    gathered batch is mined."""

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
        idx = hardest(dist[a, o], math.ceil(self.filter_percentage * a.numel()), largest)
        return a[idx], o[idx]

    def mine(self, b: MiningBatch) -> tuple[Tensor, ...]:
        a1, p = self._top(b.dist, b.pos, True)
        a2, n = self._top(b.dist, b.neg, False)
        return a1, p, a2, n
