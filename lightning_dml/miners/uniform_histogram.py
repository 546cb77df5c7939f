"""Uniform-histogram mining (pml's ``UniformHistogramMiner``): pairs drawn so that their distances are spread
evenly over the batch's range - ``pos_per_bin`` positive and ``neg_per_bin`` negative pairs from each non-empty bin
of a ``num_bins``-bin histogram between the smallest and the largest distance."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.miners.base import Miner, MiningBatch

__all__ = ["UniformHistogramMiner", "uniform_histogram_draw"]


def uniform_histogram_draw(
    values: Tensor, num_bins: int, per_bin: int, generator: torch.Generator | None = None
) -> Tensor:
    """Indices into ``values [T]``: ``per_bin`` draws, uniform with replacement, from each non-empty bin of
    ``num_bins`` equal bins from ``min(values)`` to ``max(values)`` (bin ``i`` holds ``e_i <= v < e_{i+1}``, the last
    one ``v <= max``: the edges of ``torch.linspace`` as pml's; ``bucketize`` on the inner edges). One sort and one
    draw for all bins, no loop."""
    if values.numel() == 0:
        return torch.zeros(0, dtype=torch.long, device=values.device)
    edges = torch.linspace(values.min(), values.max(), num_bins + 1, device=values.device, dtype=values.dtype)
    bins = torch.bucketize(values, edges[1:-1], right=True)
    order = torch.argsort(bins, stable=True)
    counts = torch.bincount(bins, minlength=num_bins)
    starts = torch.cumsum(counts, 0) - counts
    filled = (counts > 0).nonzero(as_tuple=True)[0]
    u = torch.rand(filled.numel(), per_bin, device=values.device, dtype=torch.float64, generator=generator)
    slot = starts[filled, None] + (u * counts[filled, None]).long().clamp(max=counts[filled, None] - 1)
    return order[slot.reshape(-1)]


class UniformHistogramMiner(Miner):
    """Pairs ``(a1, p, a2, n)``: from every non-empty bin of the positive pairs' distance histogram
    ``pos_per_bin`` pairs, and ``neg_per_bin`` from the negatives' (:func:`uniform_histogram_draw`; uniform within a
    bin, with replacement, as pml's ``torch.multinomial`` of ones). ``seed`` makes the draws repeatable (a
    generator on the embeddings' device). Batch-wide histogram: under ``gather_distributed`` the whole gathered
    batch is mined on every process, the same draws there only with ``seed`` set."""

    output = "pairs"
    per_anchor = False
    random = True

    def __init__(
        self, num_bins: int = 100, pos_per_bin: int = 10, neg_per_bin: int = 10, seed: int | None = None
    ) -> None:
        super().__init__()
        for name, value in (("num_bins", num_bins), ("pos_per_bin", pos_per_bin), ("neg_per_bin", neg_per_bin)):
            if int(value) != value or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        self.num_bins, self.pos_per_bin, self.neg_per_bin = int(num_bins), int(pos_per_bin), int(neg_per_bin)
        self.seed = seed

    def extra_repr(self) -> str:
        return f"num_bins={self.num_bins}, pos_per_bin={self.pos_per_bin}, neg_per_bin={self.neg_per_bin}"

    def mine(self, b: MiningBatch) -> tuple[Tensor, ...]:
        g = self.generator(b.dist.device)
        a1, p = b.pos.nonzero(as_tuple=True)
        a2, n = b.neg.nonzero(as_tuple=True)
        ip = uniform_histogram_draw(b.dist[a1, p], self.num_bins, self.pos_per_bin, g)
        ineg = uniform_histogram_draw(b.dist[a2, n], self.num_bins, self.neg_per_bin, g)
        return a1[ip], p[ip], a2[ineg], n[ineg]
