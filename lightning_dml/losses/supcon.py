"""Supervised contrastive loss (Khosla et al., "Supervised Contrastive Learning", NeurIPS 2020)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import batch_normaliser, masked_lse
from lightning_dml.losses.reducers import Reducer, build_reducer
from lightning_dml.losses.registry import register_loss
from lightning_dml.losses.softmax_pairs import anchor_mean, neighbour_softmax_terms
from lightning_dml.losses.temperature import TemperaturePairLoss

__all__ = ["SupConLoss"]


@register_loss("supcon")
class SupConLoss(TemperaturePairLoss):
    r"""Supervised contrastive loss, the "L_out" form (SupCon paper Eq. 2).

    Similarity: cosine ``z_i . z_j`` of L2-normalised embeddings. For an anchor ``i`` with positives ``P(i)``
    (same label, ``i`` itself excluded) and all other items ``A(i)`` (the batch without ``i``, plus references):

    .. math::
        L_i = \frac{-1}{|P(i)|} \sum_{p \in P(i)} \log \frac{e^{z_i \cdot z_p / \tau}}{\sum_{a \in A(i)} e^{z_i \cdot z_a / \tau}}

    averaged over the anchors with ``|P(i)| >= 1`` (Eq. 2 sums over anchors; the mean only rescales, and is what
    the authors' code and pytorch-metric-learning do). Computed from the denominators' log-sum-exp and the
    positives' logits with a closed-form backward (:mod:`lightning_dml.losses.softmax_pairs`).

    Args:
        temperature: ``tau``. Default 0.1, the value the paper's text reports for its experiments (and
            pytorch-metric-learning's default); the authors' released code defaults to 0.07 and also rescales the
            loss by ``tau / 0.07``, which we do not (it only multiplies the loss by a constant).
        anchor_chunk_size: score the anchors this many at a time, each block's ``B x N`` matrices recomputed in
            the backward (memory ``O(chunk x N)``, same value and gradients; :mod:`lightning_dml.losses.chunking`).
        reducer: a pml reducer (:mod:`lightning_dml.losses.reducers`, or its name) of the ``B`` per-anchor terms
            ``L_i`` in place of the mean over the anchors with positives (the paper's Eq. 2 leaves the reduction
            open: a sum); an anchor without a positive has the term 0, as in pml, so ``reducer="avg_non_zero"``
            (pml's default) gives pml's value. ``ClassWeightedReducer`` needs ``closed_form=True`` (the default:
            the labels reach the reduction there; not with an ``indices_tuple``) and one label per item.

    Degenerate batches: an anchor without a positive has no term and does not count in the mean; a batch without
    any positive pair gives 0 with zero gradient. A batch of one class (no negatives) is still defined (each
    anchor's denominator holds its positives only).
    pytorch-metric-learning differs there: it returns 0 when the batch has no negative pair at all, and its
    mean skips anchors whose loss is exactly 0.
    """

    #: a mean of per-anchor (per-pair) terms over the global gallery: exact under DDP with all-reduced counts
    gather_mode = "references"
    #: anchor_chunk_size: a sum of per-anchor terms over batch-wide counts (losses.chunking)
    supports_anchor_chunks = True
    #: label sets ([B, L], positive = the sets intersect): the loss only asks which pairs are positive
    supports_label_sets = True
    #: indices_tuple (a miner's output, lightning_dml.miners.indices): P(i) and A(i) restricted to the tuple's pairs
    #: (pml's SupConLoss); computed by :meth:`pair_loss` through autograd
    supports_indices_tuple = True

    def __init__(
        self, temperature: float = 0.1, anchor_chunk_size: int | None = None, reducer: Reducer | str | None = None
    ) -> None:
        super().__init__(temperature)
        self.set_anchor_chunk_size(anchor_chunk_size)
        self.reducer = build_reducer(reducer) if isinstance(reducer, str) else reducer

    def _reduce(self, per_anchor: Tensor, valid: Tensor, labels: Tensor | None) -> Tensor:
        """The mean over the anchors with positives, or ``reducer`` over all anchors (0 for those without)."""
        if self.reducer is None:
            return anchor_mean(per_anchor, valid, batch_normaliser(valid.sum(), per_anchor))
        terms = torch.where(valid, per_anchor, 0.0)
        rows = torch.arange(terms.shape[0], device=terms.device)
        return self.reducer(terms, "element", rows, labels, terms.shape[0])

    def _has_closed_form(self) -> bool:
        return True

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        """Closed-form path (:func:`neighbour_softmax_terms`: the denominator's log-sum-exp and the positives'
        logits, with a closed-form backward); ``closed_form=False``: :meth:`pair_loss` through autograd."""
        if not self.closed_form:
            return super().compute(anchors, labels, gallery, gallery_labels)
        lse, positives, pos = neighbour_softmax_terms(anchors, labels, gallery, gallery_labels, 1.0 / self.temperature)
        count = pos.sum(dim=1)
        valid = count > 0
        # the mean over the positives with each term divided first (as anchor_mean: no overflow of the sum)
        per_anchor = lse - (torch.where(pos, positives, 0.0) / count.clamp(min=1)[:, None]).sum(dim=1)
        return self._reduce(per_anchor, valid, labels)

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        logits = sim / self.temperature
        valid = pos.any(dim=1)
        # rows without positives get a full (finite) denominator; their term is masked out
        log_denominator = masked_lse(logits, pos | neg | ~valid[:, None])
        # -1/|P| sum_P log(e^{l_ip} / sum_A e^{l_ia}) = log sum_A e^{l_ia} - mean_P l_ip
        count = pos.sum(dim=1, keepdim=True).clamp(min=1)
        per_anchor = log_denominator - (torch.where(pos, logits, 0.0) / count).sum(dim=1)
        return self._reduce(per_anchor, valid, None)
