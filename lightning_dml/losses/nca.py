"""Neighbourhood Components Analysis loss (Goldberger et al., "Neighbourhood Components Analysis", NIPS 2004)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss, batch_normaliser, masked_lse
from lightning_dml.losses.registry import register_loss
from lightning_dml.losses.reducers import Reducer, build_reducer
from lightning_dml.losses.softmax_pairs import anchor_mean, neighbour_log_probability, neighbour_softmax_terms

__all__ = ["NCALoss"]

_OBJECTIVES = ("log", "expected")


@register_loss("nca")
class NCALoss(PairLoss):
    r"""NCA loss: the stochastic nearest-neighbour classification of NCA (Eqs. 1-2), as a loss.

    Distance: squared Euclidean ``d_ij = ||f_i - f_j||^2`` of L2-normalised embeddings (NCA learns a linear map
    ``A`` with ``d_ij = ||A x_i - A x_j||^2``; here the network is the map). Anchor ``i`` picks ``j != i`` with
    probability ``p_ij = e^{-s d_ij} / sum_{k != i} e^{-s d_ik}`` (Eq. 1, ``s = scale``) and is classified
    correctly with probability ``p_i = sum_{j in C_i} p_ij`` (Eq. 2, ``C_i`` = same label). The loss is

    * ``objective="log"`` (default): ``-(1/|I|) sum_i log p_i``, the log-likelihood objective of NCA Sec. 5
      (Eq. 7 there; pytorch-metric-learning's ``NCALoss``),
    * ``objective="expected"``: ``-(1/|I|) sum_i p_i``, the expected number of correct classifications (Eq. 3),

    over the anchors ``I`` with at least one positive. References add candidates ``j`` (``p_ij`` over the batch
    and the references). Computed from the two log-sum-exps with a closed-form backward
    (:mod:`lightning_dml.losses.softmax_pairs`).

    Args:
        scale: ``s`` (the NCA paper has none: ``A`` absorbs it; 1 as pml's ``softmax_scale``).
        objective: ``"log"`` or ``"expected"``.
        anchor_chunk_size: score the anchors this many at a time, each block's ``B x N`` matrices recomputed in
            the backward (memory ``O(chunk x N)``, same value and gradients; :mod:`lightning_dml.losses.chunking`).
        reducer: a pml reducer (:mod:`lightning_dml.losses.reducers`, or its name) of the per-anchor terms of the
            anchors with a positive, in place of their mean (NCA's objective is a sum over the points: the
            reduction is open); pml's ``NCALoss`` passes the same terms to its reducer. ``ClassWeightedReducer``
            needs ``closed_form=True`` (the default: the labels reach the reduction there; not with an
            ``indices_tuple``) and one label per item.

    Degenerate batches: an anchor without a positive has no term and does not count; a batch without positive
    pairs gives 0 with zero gradient. A single-class batch gives ``p_i = 1`` for all anchors (loss 0, resp. -1).
    pml differs in one point: its mean skips anchors whose ``p_i`` underflows to 0 (ours keeps them, with the
    true large ``-log p_i``).
    """

    #: a mean of per-anchor (per-pair) terms over the global gallery: exact under DDP with all-reduced counts
    gather_mode = "references"
    #: anchor_chunk_size: a sum of per-anchor terms over batch-wide counts (losses.chunking)
    supports_anchor_chunks = True
    #: label sets ([B, L], positive = the sets intersect): the loss only asks which pairs are positive
    supports_label_sets = True

    def __init__(
        self,
        scale: float = 1.0,
        objective: str = "log",
        anchor_chunk_size: int | None = None,
        reducer: Reducer | str | None = None,
    ) -> None:
        super().__init__()
        self.reducer = build_reducer(reducer) if isinstance(reducer, str) else reducer
        if not scale > 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        if objective not in _OBJECTIVES:
            raise ValueError(f"objective must be one of {_OBJECTIVES}, got {objective!r}")
        self.scale, self.objective = float(scale), objective
        self.set_anchor_chunk_size(anchor_chunk_size)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, objective={self.objective!r}"

    def _has_closed_form(self) -> bool:
        return True

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        """Closed-form path (:func:`neighbour_softmax_terms`: the log-sum-exp over the candidates and the
        positives' logits, with a closed-form backward); ``closed_form=False``: :meth:`pair_loss` through autograd.

        ``-scale d_ij = 2 scale (S_ij - 1)``: the constant ``-2 scale`` cancels in ``p_ij``, so the logits are
        ``2 scale S_ij``."""
        if not self.closed_form:
            return super().compute(anchors, labels, gallery, gallery_labels)
        lse, positives, pos = neighbour_softmax_terms(anchors, labels, gallery, gallery_labels, 2.0 * self.scale)
        log_p = neighbour_log_probability(lse, positives, pos, gallery_labels.numel())
        return self._reduce(log_p, pos.any(dim=1), labels)

    def _reduce(self, log_p: Tensor, valid: Tensor, labels: Tensor | None = None) -> Tensor:
        """The objective's mean over the anchors with a positive, from their ``log p_i`` (or ``reducer`` of
        those anchors' terms)."""
        per_anchor = -log_p if self.objective == "log" else -torch.exp(log_p)
        if self.reducer is None:
            return anchor_mean(per_anchor, valid, batch_normaliser(valid.sum(), per_anchor))
        rows = torch.arange(per_anchor.shape[0], device=per_anchor.device)[valid]
        return self.reducer(per_anchor[valid], "element", rows, labels, per_anchor.shape[0])

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        # -scale ||f_i - f_j||^2 = -scale (2 - 2 S_ij) on the unit sphere (S <= 1, so no clamp is needed)
        logits = (2.0 * self.scale) * (sim - 1.0)
        valid = pos.any(dim=1)
        fill = ~valid[:, None]
        return self._reduce(masked_lse(logits, pos | fill) - masked_lse(logits, pos | neg | fill), valid)
