"""Smooth-AP loss (Brown et al., "Smooth-AP: Smoothing the Path Towards Large-Scale Image Retrieval", ECCV 2020)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import batch_normaliser, similarity_matrix
from lightning_dml.losses.registry import register_loss
from lightning_dml.losses.temperature import TemperaturePairLoss
from lightning_dml.miners import positive_table, same_label_mask

__all__ = ["SmoothAPLoss"]


@register_loss("smooth_ap")
class SmoothAPLoss(TemperaturePairLoss):
    r"""Smooth-AP (Smooth-AP paper Eqs. 11-13): AP with the rank indicator replaced by a sigmoid.

    Similarity: cosine ``s_qj`` of L2-normalised embeddings. For a query ``q`` with positive set ``P`` and the
    rest of the gallery ``Omega`` (the batch without ``q`` itself, plus references), with
    ``D_ij = s_qj - s_qi`` and ``G(x) = 1 / (1 + e^{-x / tau})`` (Eq. 12):

    .. math::
        AP_q = \frac{1}{|P|} \sum_{i \in P} \frac{1 + \sum_{j \in P, j \ne i} G(D_{ij})}
                                               {1 + \sum_{j \in \Omega, j \ne i} G(D_{ij})},
        \qquad L = \frac{1}{m} \sum_q (1 - AP_q)

    (Eq. 11 with the smoothed ranks; Eq. 13 the loss over the ``m`` queries that have a positive).

    Only the positives ``i`` of each query need a rank, so the work is ``B x K x N`` with ``K`` the largest class
    count in the gallery (``B^3`` only for a single-class batch), not ``B x N x N``.

    Args:
        temperature: ``tau`` of the sigmoid (paper 0.01).
        anchor_chunk_size: score the anchors this many at a time, each block's ``B x N`` matrices recomputed in
            the backward (memory ``O(chunk x N)``, same value and gradients; :mod:`lightning_dml.losses.chunking`).

    pytorch-metric-learning's ``SmoothAPLoss`` (and the authors' code it follows) keeps the query in its own
    gallery and in its own positive set (one more positive at similarity 1) and needs equal class counts in
    label-sorted blocks; we follow the paper's definition (the query is not retrieved). The tests show both.

    Degenerate batches: a query without a positive has no term; a batch without positive pairs gives 0 with zero
    gradient; a single-class batch gives AP = 1 (loss 0).
    """

    #: a mean of per-anchor (per-pair) terms over the global gallery: exact under DDP with all-reduced counts
    gather_mode = "references"
    #: anchor_chunk_size: a sum of per-anchor terms over batch-wide counts (losses.chunking)
    supports_anchor_chunks = True
    #: label sets ([B, L], positive = the sets intersect): the loss only asks which pairs are positive
    supports_label_sets = True

    def __init__(self, temperature: float = 0.01, anchor_chunk_size: int | None = None) -> None:
        super().__init__(temperature)
        self.set_anchor_chunk_size(anchor_chunk_size)

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        sim = similarity_matrix(anchors, anchors if gallery is None else gallery)
        rows, cols, valid = positive_table(labels, gallery_labels)
        return self.smooth_ap_loss(sim, labels, gallery_labels, cols, valid)

    def smooth_ap_loss(self, sim: Tensor, labels: Tensor, gallery_labels: Tensor, cols: Tensor, valid: Tensor) -> Tensor:
        """Loss from ``sim`` [B, N] and each query's positives as a ``[B, K]`` table ``cols`` / ``valid``."""
        num_queries, num_gallery = sim.shape
        s_i = sim.gather(1, cols)  # [B, K] similarity of each positive i
        g = torch.sigmoid((sim[:, None, :] - s_i[:, :, None]) / self.temperature)  # [B, K, N]: G(D_ij)
        gallery_idx = torch.arange(num_gallery, device=sim.device)
        query_idx = torch.arange(num_queries, device=sim.device)
        others = (gallery_idx[None, None, :] != cols[:, :, None]) & (gallery_idx[None, :] != query_idx[:, None])[:, None, :]
        same = same_label_mask(labels, gallery_labels)[:, None, :]
        g = g * others
        rank_all = 1.0 + g.sum(dim=2)
        rank_pos = 1.0 + (g * same).sum(dim=2)
        n_pos = valid.sum(dim=1)
        has_pos = n_pos > 0
        ap = torch.where(valid, rank_pos / rank_all, 0.0).sum(dim=1) / n_pos.clamp(min=1)
        total = torch.where(has_pos, 1.0 - ap, 0.0).sum()
        return total / batch_normaliser(has_pos.sum(), total)
