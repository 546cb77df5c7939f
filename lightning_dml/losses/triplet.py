"""Triplet margin loss over all valid triplets or batch-hard (GPW Eqs. 12, 20, 37)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import ClosedFormPairFunction, PairLoss, batch_normaliser, distance_and_derivative
from lightning_dml.losses.base import distance_from_similarity, similarity_matrix, squared_distance_from_similarity
from lightning_dml.losses.contrastive import check_reduction_or_reducer
from lightning_dml.losses.reducers import PerAnchorReducer, Reducer
from lightning_dml.losses.registry import register_loss
from lightning_dml.miners import batch_hard_mining, label_masks, positive_index
from lightning_dml.miners.mining import positive_table

__all__ = ["TripletLoss"]

_MINING = ("all", "batch_hard")
_REDUCTIONS = ("mean_nonzero", "mean", "sum")


@register_loss("triplet")
class TripletLoss(PairLoss):
    r"""Triplet margin loss (GPW Eq. 12; squared distances Eq. 37; batch-hard mining Eq. 20).

    Distance: Euclidean ``D`` of L2-normalised embeddings (``D^2`` with ``squared=True``, the original form).

    .. math:: L = \mathrm{reduce}_{(i,j,k)} [D_{ij} - D_{ik} + m]_+

    over triplets with ``j`` a positive and ``k`` a negative of anchor ``i``: all of them (``mining="all"``) or,
    per anchor, the farthest positive with the closest negative (``"batch_hard"``, Hermans et al.). The violating
    triplets are the ones GPW's triplet-margin mining (Eq. 19) keeps; each has weight 1 (Eq. 25).
    No ``B x B x B`` tensor is built: positives are gathered per anchor, ``[B, K_max, N]`` (SPEC 9.2).

    Args:
        margin: ``m`` (GPW CUB/Cars value 0.1).
        mining: ``"all"`` or ``"batch_hard"``.
        squared: squared distances (Eq. 37).
        reduction: ``"mean_nonzero"`` (default: mean over triplets with a non-zero hinge, as pytorch-metric-
            learning's AvgNonZeroReducer), ``"mean"`` (over all considered triplets) or ``"sum"``.
        reducer: a pml reducer (:mod:`lightning_dml.losses.reducers`, or its name) of the considered triplets'
            terms in place of ``reduction`` (the paper leaves the reduction open), as pml's
            ``TripletMarginLoss(reducer=...)`` (its triplets' ``"triplet"`` terms, zero terms included);
            ``"avg_non_zero"``, ``"mean"`` and ``"sum"`` equal the three reductions. Giving both ``reduction`` and
            ``reducer`` is refused, and so is ``PerAnchorReducer`` (pml's does not reduce triplets). Computed
            through autograd (no closed form); ``ClassWeightedReducer`` (weights by the anchor's class) needs one
            label per item and no ``indices_tuple`` (the mined path reduces without the labels).
        anchor_chunk_size: score the anchors this many at a time, each block's ``B x N`` matrices recomputed in
            the backward (memory ``O(chunk x N)``, same value and gradients; :mod:`lightning_dml.losses.chunking`).

    Degenerate batches: no valid triplet (one class, no anchor with both a positive and a negative) or no violating
    triplet -> 0 with zero gradient.
    """

    #: under DDP: anchors scored against the gathered batch, batch-wide reductions (losses.base)
    gather_mode = "references"
    #: anchor_chunk_size: a sum of per-anchor terms over batch-wide counts (losses.chunking)
    supports_anchor_chunks = True
    #: label sets ([B, L], positive = the sets intersect): the loss only asks which pairs are positive
    supports_label_sets = True
    #: indices_tuple (a miner's output, lightning_dml.miners.indices): a triplet tuple: exactly its triplets; a pair tuple: every mined positive with every mined negative of the anchor (pml's TripletMarginLoss)
    supports_indices_tuple = True

    def __init__(
        self,
        margin: float = 0.1,
        mining: str = "all",
        squared: bool = False,
        reduction: str | None = None,
        anchor_chunk_size: int | None = None,
        reducer: Reducer | str | None = None,
    ) -> None:
        super().__init__()
        if margin < 0:
            raise ValueError(f"margin must be >= 0, got {margin}")
        if mining not in _MINING:
            raise ValueError(f"mining must be one of {_MINING}, got {mining!r}")
        reduction, self.reducer = check_reduction_or_reducer("TripletLoss", reduction, reducer, _REDUCTIONS)
        if isinstance(self.reducer, PerAnchorReducer):
            raise ValueError("TripletLoss cannot take PerAnchorReducer: it reduces pairs, not triplets (as pml's)")
        self.margin, self.mining, self.squared, self.reduction = float(margin), mining, squared, reduction
        self.set_anchor_chunk_size(anchor_chunk_size)

    def extra_repr(self) -> str:
        reduce = f"reducer={self.reducer!r}" if self.reducer is not None else f"reduction={self.reduction!r}"
        return f"margin={self.margin}, mining={self.mining!r}, squared={self.squared}, {reduce}"

    def _reduce(self, hinge: Tensor, considered: Tensor) -> Tensor:
        total = (hinge * considered).sum()
        return total / self._count(considered & (hinge > 0), considered.sum(), total)

    def _has_closed_form(self) -> bool:
        return self.reducer is None  # a reducer runs through autograd (pair_loss)

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor, labels: Tensor | None = None) -> Tensor:
        dist = squared_distance_from_similarity(sim) if self.squared else distance_from_similarity(sim)
        if self.mining == "batch_hard":
            hard_pos, hard_neg = batch_hard_mining(dist, pos, neg)
            has = hard_pos.any(1) & hard_neg.any(1)
            hinge = torch.relu((dist * hard_pos).sum(1) - (dist * hard_neg).sum(1) + self.margin)
            if self.reducer is not None:  # each anchor's one triplet (a, its farthest p, its closest n)
                (a,) = has.nonzero(as_tuple=True)
                triplets = (a, hard_pos.to(torch.uint8).argmax(1)[a], hard_neg.to(torch.uint8).argmax(1)[a])
                return self.reducer(hinge[a], "triplet", triplets, labels, sim.shape[0])
            return self._reduce(hinge, has)
        index, valid = positive_index(pos)
        d_pos = dist.gather(1, index)
        considered = valid[:, :, None] & neg[:, None, :]
        hinge = torch.relu(d_pos[:, :, None] - dist[:, None, :] + self.margin)
        if self.reducer is not None:  # the considered triplets (a, index[a, k], n), as pml lists all triplets
            a, k, n = considered.nonzero(as_tuple=True)
            return self.reducer(hinge[a, k, n], "triplet", (a, index[a, k], n), labels, sim.shape[0])
        return self._reduce(hinge, considered)

    def triplet_tuple_loss(
        self, sim_ap: Tensor, sim_an: Tensor, triplets: tuple[Tensor, Tensor, Tensor] | None = None
    ) -> Tensor:
        """Eq. 12 over given triplets (a miner's ``(a, p, n)`` as ``indices_tuple``; ``[T]`` similarities of their
        anchor-positive and anchor-negative pairs), reduced by ``reduction`` (or ``reducer``, which needs the
        ``triplets`` themselves) over the ``T`` triplets."""
        if self.mining != "all":
            raise ValueError(
                f"TripletLoss(mining={self.mining!r}) mines its own triplets; a triplet indices_tuple needs mining='all'"
            )
        if self.squared:
            d_ap, d_an = squared_distance_from_similarity(sim_ap), squared_distance_from_similarity(sim_an)
        else:
            d_ap, d_an = distance_from_similarity(sim_ap), distance_from_similarity(sim_an)
        hinge = torch.relu(d_ap - d_an + self.margin)
        if self.reducer is not None:
            if triplets is None:
                raise ValueError("TripletLoss with a reducer needs the triplets (a, p, n) of the terms it reduces")
            return self.reducer(hinge, "triplet", triplets, None, None)
        return self._reduce(hinge, torch.ones_like(hinge, dtype=torch.bool))

    def _count(self, active: Tensor, considered_count: Tensor, like: Tensor) -> Tensor:
        """The reduction's divisor (batch-wide under DDP: :func:`~lightning_dml.losses.base.batch_normaliser`)."""
        if self.reduction == "sum":
            return batch_normaliser(None, like)
        if self.reduction == "mean":
            return batch_normaliser(considered_count, like)
        return batch_normaliser(active.sum(), like)

    def pair_loss_and_grad(self, sim: Tensor, pos: Tensor, neg: Tensor) -> tuple[Tensor, Tensor]:
        dist, d_dist = distance_and_derivative(sim, self.squared)
        if self.mining == "batch_hard":
            hard_pos, hard_neg = batch_hard_mining(dist, pos, neg)
            has = hard_pos.any(1) & hard_neg.any(1)
            hinge = ((dist * hard_pos).sum(1) - (dist * hard_neg).sum(1) + self.margin).clamp_(min=0.0) * has
            active = hinge > 0
            count = self._count(active, has.sum(), dist)
            grad_dist = (hard_pos.to(dist.dtype) - hard_neg.to(dist.dtype)) * (active[:, None].to(dist.dtype) / count)
            return hinge.sum() / count, grad_dist.mul_(d_dist)
        index, valid = positive_index(pos)
        d_pos = dist.gather(1, index)
        hinge = d_pos[:, :, None] - dist[:, None, :] + self.margin  # [B, K, N]
        hinge.masked_fill_(~(valid[:, :, None] & neg[:, None, :]), 0.0).clamp_(min=0.0)
        active = hinge > 0
        considered_count = (valid.sum(1) * neg.sum(1)).sum()
        count = self._count(active, considered_count, dist)
        loss = hinge.sum() / count
        active_f = active.to(dist.dtype)
        grad_dist = -active_f.sum(1)
        grad_dist.scatter_add_(1, index, active_f.sum(2))
        return loss, grad_dist.div_(count).mul_(d_dist)

    # --------------------------------------------------------------------------- fast closed form ("all")
    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        """Closed form for ``mining="all"`` on float ``[B, K, N]`` tensors, positives from the sorted labels."""
        if self.reducer is not None:  # autograd, with the labels for the reducer (ClassWeightedReducer)
            pos, neg = label_masks(labels, gallery_labels)
            g = anchors if gallery is None else gallery
            return self.pair_loss(similarity_matrix(anchors, g), pos, neg, labels if labels.ndim == 1 else None)
        if not self.closed_form or self.mining != "all":
            return super().compute(anchors, labels, gallery, gallery_labels)

        def fn(raw: Tensor):
            dist, d_dist = distance_and_derivative(raw.clamp(-1.0, 1.0), self.squared)
            _, index, valid = positive_table(labels, gallery_labels)
            if index.shape[1] == 0:
                index, valid = index.new_zeros(index.shape[0], 1), valid.new_zeros(valid.shape[0], 1)
            index = index.masked_fill(~valid, 0)
            _, neg = label_masks(labels, gallery_labels)
            negf, validf = neg.to(dist.dtype), valid.to(dist.dtype)
            hinge = dist.gather(1, index)[:, :, None] - dist[:, None, :]  # [B, K, N]
            hinge.add_(self.margin).mul_(validf[:, :, None]).mul_(negf[:, None, :]).clamp_(min=0.0)
            active = torch.sign(hinge)
            count = self._count(active, (validf.sum(1) * negf.sum(1)).sum(), dist)
            loss = hinge.sum() / count
            grad_dist = -active.sum(1)
            grad_dist.scatter_add_(1, index, active.sum(2))
            return loss, grad_dist.div_(count).mul_(d_dist)

        return ClosedFormPairFunction.apply(anchors, gallery, fn)
