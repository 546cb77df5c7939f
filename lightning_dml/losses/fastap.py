"""FastAP loss (Cakir et al., "Deep Metric Learning to Rank", CVPR 2019)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss, batch_normaliser, squared_distance_from_similarity
from lightning_dml.losses.registry import register_loss

__all__ = ["FastAPLoss"]


@register_loss("fastap")
class FastAPLoss(PairLoss):
    r"""FastAP: average precision from soft distance histograms (FastAP paper Eqs. 9-11).

    Distance: squared Euclidean ``d = ||f_q - f_j||^2 = 2 - 2 s`` of L2-normalised embeddings, in ``[0, 4]``
    (as the authors' code). It is quantised into ``L`` bins with centres ``z_l = l Delta``, ``l = 0..L``,
    ``Delta = 4 / L``, by the triangular kernel ``delta(d, z) = [1 - |d - z| / Delta]_+`` (Sec. 4.2). For a query
    ``q`` with positive (negative) histograms ``h^+_l = sum_{j in P_q} delta(d_qj, z_l)`` (``h^-``) and their
    cumulative sums ``H^+_l``, ``H_l = H^+_l + H^-_l``:

    .. math::
        \mathrm{FastAP}_q = \frac{1}{N^+_q} \sum_l \frac{h^+_l H^+_l}{H_l}, \qquad L = 1 - \frac{1}{|Q|}\sum_q \mathrm{FastAP}_q

    (terms with ``H_l = 0`` are 0), over the queries ``Q`` with at least one positive (Eq. 11: the batch mean).
    This equals pytorch-metric-learning's ``FastAPLoss(num_bins)``.

    Args:
        num_bins: ``L`` (default 10, the authors' code and pml).
        anchor_chunk_size: score the anchors this many at a time, each block's ``B x N`` matrices recomputed in
            the backward (memory ``O(chunk x N)``, same value and gradients; :mod:`lightning_dml.losses.chunking`).

    Degenerate batches: a query without a positive has no term; a batch without positive pairs gives 0 with zero
    gradient. A single-class batch gives FastAP = 1 (loss 0).
    """

    #: a mean of per-anchor (per-pair) terms over the global gallery: exact under DDP with all-reduced counts
    gather_mode = "references"
    #: anchor_chunk_size: a sum of per-anchor terms over batch-wide counts (losses.chunking)
    supports_anchor_chunks = True
    #: label sets ([B, L], positive = the sets intersect): the loss only asks which pairs are positive
    supports_label_sets = True

    def __init__(self, num_bins: int = 10, anchor_chunk_size: int | None = None) -> None:
        super().__init__()
        if isinstance(num_bins, bool) or int(num_bins) != num_bins or num_bins < 1:
            raise ValueError(f"num_bins must be an integer >= 1, got {num_bins!r}")
        self.num_bins = int(num_bins)
        self.set_anchor_chunk_size(anchor_chunk_size)

    def extra_repr(self) -> str:
        return f"num_bins={self.num_bins}"

    def _histogram(self, lower: Tensor, frac: Tensor, mask: Tensor) -> Tensor:
        """Soft histograms ``[B, L+1]`` of the masked entries (triangular kernel, two neighbouring bins each)."""
        weight_upper = torch.where(mask, frac, 0.0)
        weight_lower = torch.where(mask, 1.0 - frac, 0.0)
        hist = frac.new_zeros(frac.shape[0], self.num_bins + 1)
        return hist.scatter_add(1, lower, weight_lower).scatter_add(1, lower + 1, weight_upper)

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        # A distance between the centres z_l and z_{l+1} has kernel weights 1 - f at bin l and f at bin l + 1
        # (f = d / Delta - l) and 0 elsewhere, so the histograms are two scatter-adds of B x N values instead of
        # an [L+1, B, N] tensor of pulses (same values; the gradient differs only on the kernel's kinks).
        u = squared_distance_from_similarity(sim) * (self.num_bins / 4.0)
        lower = u.detach().floor().clamp_(max=self.num_bins - 1).long()
        frac = u - lower
        h_pos = self._histogram(lower, frac, pos)  # [B, L+1]
        h_neg = self._histogram(lower, frac, neg)
        cum_pos = h_pos.cumsum(dim=1)
        cum_all = (h_pos + h_neg).cumsum(dim=1)
        ratio = torch.where(cum_all > 0, h_pos * cum_pos / torch.where(cum_all > 0, cum_all, 1.0), 0.0)
        n_pos = pos.sum(dim=1)
        valid = n_pos > 0
        fast_ap = ratio.sum(dim=1) / n_pos.clamp(min=1)
        total = torch.where(valid, 1.0 - fast_ap, 0.0).sum()
        return total / batch_normaliser(valid.sum(), total)
