"""Histogram loss (Ustinova & Lempitsky, "Learning Deep Embeddings with Histogram Loss", NIPS 2016)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss
from lightning_dml.losses.registry import register_loss

__all__ = ["HistogramLoss", "soft_histogram"]


def soft_histogram(values: Tensor, delta: float) -> Tensor:
    """Histogram-loss paper Eq. 2: the linearly interpolated histogram of ``values`` in ``[-1, 1]`` on the nodes
    ``t_r = -1 + r delta`` (``r = 0 .. 2/delta``), normalised by the number of values.

    Each value adds ``(s - t_r)/delta`` to the node ``t_{r+1}`` above it and ``(t_{r+1} - s)/delta`` to the node
    ``t_r`` below it (``r = floor((s + 1)/delta)``, clipped so that ``s = 1`` falls in the last bin); the gradient
    flows through these weights (the bin index is a constant).
    """
    nodes = round(2.0 / delta) + 1
    r = torch.floor((values.detach() + 1.0) / delta).clamp(0, nodes - 2)
    upper = (values + 1.0 - r * delta) / delta
    lower = ((r + 1.0) * delta - 1.0 - values) / delta
    index = r.long()
    hist = torch.zeros(nodes, dtype=values.dtype, device=values.device)
    hist = hist.scatter_add(0, index + 1, upper).scatter_add(0, index, lower)
    return hist / max(values.numel(), 1)


@register_loss("histogram")
class HistogramLoss(PairLoss):
    r"""Histogram loss (Ustinova & Lempitsky, NIPS 2016, Eqs. 2-4).

    The cosine similarities of the positive pairs and of the negative pairs of the batch are turned into two
    histograms ``h+``, ``h-`` on the nodes ``t_r = -1 + r delta`` by linear interpolation (Eq. 2), and the loss is
    the probability that a random negative pair is more similar than a random positive one (Eq. 4):

    .. math::
        L = \sum_r h^-_r \, \Phi^+_r, \qquad \Phi^+_r = \sum_{q \le r} h^+_q.

    Each unordered pair counts once (the paper's pairs ``i < j``; our ordered masks count each twice, which leaves
    normalised histograms unchanged). pml's ``HistogramLoss`` takes its pairs from the triplets of the batch: a
    positive pair only if an end has a negative, a negative pair only if an end has a positive; on batches where
    every item has both, its pairs are all pairs and the two losses are equal (values and gradients). Unlike pml,
    a similarity of exactly 1 (identical embeddings) is counted in the last bin (pml indexes past its histogram).

    Args:
        n_bins: number of bins ``2 / delta`` (paper and pml: 100 nodes' spacing ``delta = 0.02``).
        delta: the bin width; give one of ``n_bins`` / ``delta`` (both: they must agree, ``delta = 2 / n_bins``).

    The histograms are of the whole batch: the loss cannot score against reference items, and under
    ``gather_distributed`` every process computes it on the gathered batch (``"global_batch"``). Label sets
    (``[B, L]``): a pair is positive when the sets intersect. Degenerate batches: no positive pair or no
    negative pair (one class, singletons) gives 0 with zero gradient.
    """

    gather_mode = "global_batch"
    supports_ref = False
    supports_label_sets = True

    def __init__(self, n_bins: int | None = None, delta: float | None = None) -> None:
        super().__init__()
        if n_bins is None and delta is None:
            n_bins = 100
        if n_bins is not None and (isinstance(n_bins, bool) or int(n_bins) != n_bins or n_bins < 1):
            raise ValueError(f"n_bins must be an integer >= 1, got {n_bins!r}")
        if delta is None:
            delta = 2.0 / n_bins
        if not 0 < delta <= 2.0 or abs(2.0 / delta - round(2.0 / delta)) > 1e-6:
            raise ValueError(f"delta must be 2 / n for an integer n >= 1, got {delta}")
        if n_bins is not None and round(2.0 / delta) != n_bins:
            raise ValueError(f"delta and n_bins must satisfy delta = 2 / n_bins, got delta={delta}, n_bins={n_bins}")
        self.delta = float(delta)
        self.n_bins = round(2.0 / self.delta)

    def extra_repr(self) -> str:
        return f"n_bins={self.n_bins}, delta={self.delta}"

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        upper = torch.ones_like(pos).triu(diagonal=1)  # each unordered pair once (the gallery is the batch)
        s_pos, s_neg = sim[pos & upper], sim[neg & upper]
        if s_pos.numel() == 0 or s_neg.numel() == 0:
            return sim.sum() * 0.0
        h_pos = soft_histogram(s_pos, self.delta)
        h_neg = soft_histogram(s_neg, self.delta)
        return (h_neg * torch.cumsum(h_pos, dim=0)).sum()
