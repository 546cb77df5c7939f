"""Contrastive loss in the distance forms of the General Pair Weighting paper (GPW Eqs. 11, 35, 36)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import ClosedFormPairFunction, PairLoss, batch_normaliser, distance_and_derivative
from lightning_dml.losses.base import distance_from_similarity, similarity_matrix
from lightning_dml.losses.base import squared_distance_from_similarity
from lightning_dml.losses.reducers import Reducer, build_reducer
from lightning_dml.losses.registry import register_loss
from lightning_dml.miners import label_masks, negative_mask, positive_pairs

__all__ = ["ContrastiveLoss", "PAIR_REDUCTIONS", "check_reduction_or_reducer", "reduce_pair_terms",
           "reducer_on_pairs"]

PAIR_REDUCTIONS = ("mean_nonzero", "mean", "sum")


def reduce_pair_terms(hinge: Tensor, mask: Tensor, reduction: str) -> Tensor:
    """Reduce the hinge terms of one pair set (positive or negative) over the whole ``B x N`` matrix.

    ``mean_nonzero``: mean over the pairs with a non-zero term (pytorch-metric-learning's AvgNonZeroReducer; the
    "average operation" of GPW footnote 8); ``mean``: mean over all pairs of the set; ``sum``: the plain sum of
    the paper's equation. An empty set gives 0. The count is batch-wide under DDP (:func:`batch_normaliser`).
    """
    total = (hinge * mask).sum()
    if reduction == "sum":
        return total / batch_normaliser(None, total)
    count = (mask & (hinge > 0)).sum() if reduction == "mean_nonzero" else mask.sum()
    return total / batch_normaliser(count, total)


def reducer_on_pairs(reducer: Reducer, terms: Tensor, mask: Tensor, kind: str, labels: Tensor | None) -> Tensor:
    """``reducer`` (:mod:`lightning_dml.losses.reducers`) of the ``B x N`` terms at the pairs of ``mask``, as pml
    hands its reducer a loss's ``pos_pair`` / ``neg_pair`` terms with their indices ``(anchors, others)``; the
    per-anchor reducer counts the ``B`` rows of the matrix as the batch."""
    rows, cols = mask.nonzero(as_tuple=True)
    return reducer(terms[rows, cols], kind, (rows, cols), labels, mask.shape[0])


def check_reduction_or_reducer(
    name: str, reduction: str | None, reducer: Reducer | str | None, reductions: tuple[str, ...]
) -> tuple[str, Reducer | None]:
    """The loss's ``reduction`` string (default ``reductions[0]``) and its reducer (built from a name); ``ValueError``
    in one line when both are given (the reducer replaces the reduction) or the reduction is unknown."""
    if reduction is not None and reducer is not None:
        raise ValueError(
            f"{name} takes reduction={reduction!r} or reducer={reducer!r}, not both: the reducer replaces the "
            f"reduction (pml's AvgNonZeroReducer, MeanReducer and SumReducer are {', '.join(map(repr, reductions))})"
        )
    if reduction is not None and reduction not in reductions:
        raise ValueError(f"reduction must be one of {reductions}, got {reduction!r}")
    return reduction or reductions[0], build_reducer(reducer) if isinstance(reducer, str) else reducer


@register_loss("contrastive")
class ContrastiveLoss(PairLoss):
    r"""Contrastive loss (GPW Eq. 11; squared forms Eqs. 35 and 36).

    Distance: Euclidean ``D_ij = ||f_i - f_j||`` of L2-normalised embeddings (GPW Eq. 1), or ``D^2`` with
    ``squared=True``.

    .. math::
        L = \sum_{y_{ij}=1} h([D_{ij} - m_1]_+) + \sum_{y_{ij}=0} h([m_2 - D_{ij}]_+)

    with ``h(x) = x`` (Eq. 11; Eq. 36 when ``squared``) or ``h(x) = x^2`` with ``squared_hinge`` (Eq. 35, Hadsell
    et al.'s original). Every positive beyond ``m1`` and every negative inside ``m2`` is mined with weight 1
    (GPW Section II-B).

    Args:
        pos_margin: ``m1`` (GPW baseline 0: every positive is pulled).
        neg_margin: ``m2`` (GPW CUB/Cars value 0.8).
        squared: use squared distances (Eq. 36).
        squared_hinge: square the hinges (Eq. 35).
        reduction: ``"mean_nonzero"`` (default; positive and negative terms each averaged over their non-zero
            pairs and added, as pytorch-metric-learning does), ``"mean"`` (each averaged over all its pairs) or
            ``"sum"`` (the equation literally).
        reducer: a pml reducer (:mod:`lightning_dml.losses.reducers`, or its name) in place of ``reduction`` (GPW
            and Hadsell et al. leave the reduction open): it reduces the positive pairs' terms and the negative
            pairs' terms separately (every pair of the set, zero terms included) and the two are added, as pml's
            ``ContrastiveLoss(reducer=...)``; ``"avg_non_zero"``, ``"mean"`` and ``"sum"`` equal the three
            reductions. Giving both ``reduction`` and ``reducer`` is refused. Computed through autograd (no
            closed form); ``ClassWeightedReducer`` (weights by the anchor's class) needs one label per item and no
            ``indices_tuple`` (the mined path reduces without the labels).
        anchor_chunk_size: score the anchors this many at a time, each block's ``B x N`` matrices recomputed in
            the backward (memory ``O(chunk x N)``, same value and gradients; :mod:`lightning_dml.losses.chunking`).

    Degenerate batches: no positive (negative) pair or none with a non-zero term -> that term is 0; a batch
    without any active pair gives 0 with zero gradient.
    """

    #: under DDP: anchors scored against the gathered batch, batch-wide reductions (losses.base)
    gather_mode = "references"
    #: anchor_chunk_size: a sum of per-anchor terms over batch-wide counts (losses.chunking)
    supports_anchor_chunks = True
    #: label sets ([B, L], positive = the sets intersect): the loss only asks which pairs are positive
    supports_label_sets = True
    #: indices_tuple (a miner's output, lightning_dml.miners.indices): the pairs listed (a triplet tuple: its (a, p) and (a, n) pairs), as pml's ContrastiveLoss
    supports_indices_tuple = True

    def __init__(
        self,
        pos_margin: float = 0.0,
        neg_margin: float = 0.8,
        squared: bool = False,
        squared_hinge: bool = False,
        reduction: str | None = None,
        anchor_chunk_size: int | None = None,
        reducer: Reducer | str | None = None,
    ) -> None:
        super().__init__()
        if pos_margin < 0 or neg_margin < 0:
            raise ValueError(f"margins must be >= 0, got pos_margin={pos_margin}, neg_margin={neg_margin}")
        reduction, self.reducer = check_reduction_or_reducer("ContrastiveLoss", reduction, reducer, PAIR_REDUCTIONS)
        self.pos_margin, self.neg_margin = float(pos_margin), float(neg_margin)
        self.squared, self.squared_hinge, self.reduction = squared, squared_hinge, reduction
        self.set_anchor_chunk_size(anchor_chunk_size)

    def extra_repr(self) -> str:
        return (
            f"pos_margin={self.pos_margin}, neg_margin={self.neg_margin}, squared={self.squared}, "
            f"squared_hinge={self.squared_hinge}, "
            + (f"reducer={self.reducer!r}" if self.reducer is not None else f"reduction={self.reduction!r}")
        )

    def _has_closed_form(self) -> bool:
        return self.reducer is None  # a reducer runs through autograd (pair_loss)

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor, labels: Tensor | None = None) -> Tensor:
        dist = squared_distance_from_similarity(sim) if self.squared else distance_from_similarity(sim)
        hp = torch.relu(dist - self.pos_margin)
        hn = torch.relu(self.neg_margin - dist)
        lp, ln = (hp * hp, hn * hn) if self.squared_hinge else (hp, hn)
        if self.reducer is not None:
            return reducer_on_pairs(self.reducer, lp, pos, "pos_pair", labels) + reducer_on_pairs(
                self.reducer, ln, neg, "neg_pair", labels
            )
        return reduce_pair_terms(lp, pos, self.reduction) + reduce_pair_terms(ln, neg, self.reduction)

    def pair_loss_and_grad(self, sim: Tensor, pos: Tensor, neg: Tensor) -> tuple[Tensor, Tensor]:
        dist, d_dist = distance_and_derivative(sim, self.squared)
        hp = torch.where(pos, dist - self.pos_margin, 0.0).clamp_(min=0.0)
        hn = torch.where(neg, self.neg_margin - dist, 0.0).clamp_(min=0.0)
        active_p, active_n = hp > 0, hn > 0
        if self.reduction == "sum":
            cp = cn = batch_normaliser(None, dist)
        elif self.reduction == "mean":
            cp, cn = batch_normaliser(torch.stack([pos.sum(), neg.sum()]), dist)
        else:
            cp, cn = batch_normaliser(torch.stack([active_p.sum(), active_n.sum()]), dist)
        if self.squared_hinge:
            loss = (hp * hp).sum() / cp + (hn * hn).sum() / cn
            grad_dist = (2.0 / cp) * hp - (2.0 / cn) * hn
        else:
            loss = hp.sum() / cp + hn.sum() / cn
            grad_dist = active_p.to(dist.dtype) / cp - active_n.to(dist.dtype) / cn
        return loss, grad_dist.mul_(d_dist)

    # ----------------------------------------------------------------------------------- sparse closed form
    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        """Closed-form path with a sparse ``W``: only positive pairs and active negatives carry a weight.

        Positives come from :func:`positive_pairs` (the sorted labels, or the label sets' mask); negatives are examined only in rows whose
        largest non-self similarity can reach the negative margin (``D < m2`` <=> ``S > 1 - m2^2 / 2``). Every
        value is computed with the same element-wise formulas as :meth:`pair_loss`.
        """
        if self.reducer is not None:  # autograd, with the labels for the reducer (ClassWeightedReducer)
            pos, neg = label_masks(labels, gallery_labels)
            g = anchors if gallery is None else gallery
            return self.pair_loss(similarity_matrix(anchors, g), pos, neg, labels if labels.ndim == 1 else None)
        if not self.closed_form:
            return super().compute(anchors, labels, gallery, gallery_labels)
        B = anchors.shape[0]
        N = gallery_labels.shape[0]

        def fn(raw: Tensor):
            pr, pc = positive_pairs(labels, gallery_labels)
            xp, dxp = self._dist(raw[pr, pc])
            hp = (xp - self.pos_margin).clamp(min=0.0)
            # negatives: candidate rows only
            gap_thr = self.neg_margin if self.squared else self.neg_margin**2
            sim_thr = 1.0 - gap_thr / 2.0 - 1e-6
            raw[:, :B].diagonal().fill_(-2.0)  # self-pairs are never negatives (nothing reads the diagonal later)
            rows = (raw.amax(dim=1) > sim_thr).nonzero().flatten()
            if rows.numel() > 0 and self.neg_margin > 0:
                block = raw[rows]
                xn, dxn = self._dist(block)
                neg = negative_mask(labels[rows], gallery_labels, rows)
                hn_block = (self.neg_margin - xn).clamp(min=0.0) * neg
                rr, nc = hn_block.nonzero(as_tuple=True)
                hn, dxn, nr = hn_block[rr, nc], dxn[rr, nc], rows[rr]
            else:
                hn = dxn = raw.new_zeros(0)
                nr = nc = torch.zeros(0, dtype=torch.long, device=raw.device)
            if self.reduction == "sum":
                cp = cn = batch_normaliser(None, raw)
            elif self.reduction == "mean":
                n_pos = pr.numel()
                cp, cn = batch_normaliser(raw.new_tensor([float(n_pos), float(B * N - n_pos - B)]), raw)
            else:
                cp, cn = batch_normaliser(torch.stack([(hp > 0).sum(), (hn > 0).sum()]), raw)
            if self.squared_hinge:
                loss = (hp * hp).sum() / cp + (hn * hn).sum() / cn
                gp, gn = 2.0 * hp / cp, -2.0 * hn / cn
            else:
                loss = hp.sum() / cp + hn.sum() / cn
                gp, gn = (hp > 0).to(raw.dtype) / cp, -(hn > 0).to(raw.dtype) / cn
            return loss, (torch.cat([pr, nr]), torch.cat([pc, nc]), torch.cat([gp * dxp, gn * dxn]))

        return ClosedFormPairFunction.apply(anchors, gallery, fn)

    def _dist(self, raw: Tensor) -> tuple[Tensor, Tensor]:
        return distance_and_derivative(raw.clamp(-1.0, 1.0), self.squared)
