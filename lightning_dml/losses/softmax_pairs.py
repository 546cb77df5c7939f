"""Closed-form backward of the neighbour softmax shared by SupCon, NCA and the multi-positive N-pair loss.

These losses score anchor ``i`` by a softmax of ``l_ij = a S_ij`` over every other gallery item ``j != i`` (SupCon
Eq. 2's ``A(i)``, NCA Eq. 1, N-pair Eq. 9), with ``S = A G^T``. All they need of the ``B x N`` matrix is, per
anchor, the log-sum-exp over the others and the logits of its positives (``K`` per anchor, from the sorted labels);
the rest of each loss is a few ``[B]`` / ``[B, K]`` operations left to autograd.
:func:`neighbour_softmax_terms` computes those two in one pass over ``S`` (no ``B x N`` label masks, no autograd
intermediates) and its backward in closed form: ``dL/dl_ij = g_i p_ij`` (``p`` the softmax over the others) plus the
positives' gradients scattered into their ``K`` entries. When the gallery is the batch itself and the rows' largest
logits lie within ``60`` of each other (always for SupCon / NCA at their defaults), one shift for all rows keeps
``e^{l_ij - M}`` symmetric, so ``W + W^T`` is formed from ``e`` with two element-wise passes (no transposed read)
and the backward is a single ``B x B x D`` product.

At any scale: the exponents are formed as ``a (S_ij - shift)`` (never ``a S_ij``, which overflows), ``W`` is formed
without ``a`` and the scale applied to the ``[B, D]`` products factor by factor (``a`` may be given as factors whose
product is beyond the float range), and :func:`anchor_mean` divides the anchors' terms before summing them.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_dml.losses.base import masked_lse
from lightning_dml.miners.mining import positive_table

__all__ = ["anchor_mean", "neighbour_softmax_terms", "neighbour_log_probability"]

#: largest spread of the rows' largest logits for which one common shift keeps every row's sum a normal number
_COMMON_SHIFT_SPREAD = 60.0


def _scaled(x, factors: tuple[float, ...]):
    """``x`` times each factor in turn (in place for a tensor; a factor 1 is skipped: no pass over ``x``)."""
    for f in factors:
        if f != 1.0:
            x = x.mul_(f) if isinstance(x, Tensor) else x * f
    return x


class _NeighbourSoftmax(torch.autograd.Function):
    """``(lse_i, lp_ik)``: ``log sum_{j != i} e^{l_ij} - r_i`` and ``l_{i, cols_ik} - r_i`` (``r_i`` the row's
    largest logit among the others, a constant), with ``l = a S``, ``S = A G^T`` (clamped to ``[-1, 1]`` if
    ``clamp``: its gradient is 0 outside, as autograd through the clamp gives)."""

    @staticmethod
    def forward(ctx, anchors, gallery, rows, cols, valid, a: tuple[float, ...], clamp: bool):  # type: ignore[override]
        b = anchors.shape[0]
        g = anchors if gallery is None else gallery
        raw = anchors @ g.T
        self_pairs = raw[:, :b].diagonal()
        self_pairs.fill_(-math.inf)
        row_max = raw.amax(dim=1)  # -inf for a row without others
        has_others = torch.isfinite(row_max)
        checks = [
            torch.where(has_others, row_max, -math.inf).amax(),
            torch.where(has_others, row_max, math.inf).amin(),
        ]
        if clamp:
            self_pairs.fill_(math.inf)
            checks.append(raw.amin())
            self_pairs.fill_(-math.inf)
        stats = torch.stack(checks).tolist()  # the one host read of the forward
        spread = _scaled(stats[0] - stats[1], a) if stats[1] <= stats[0] else 0.0
        out_of_range = None
        if clamp and (stats[0] > 1.0 or stats[-1] < -1.0):
            # entries beyond [-1, 1] (duplicates and opposites, by rounding): clamped, with zero gradient
            out_of_range = (raw < -1.0) | (raw > 1.0)
            raw.clamp_(-1.0, 1.0)
            self_pairs.fill_(-math.inf)
            row_max = row_max.clamp(-1.0, 1.0)
        ref = torch.where(has_others, row_max, 0.0)
        positives = _scaled(raw.gather(1, cols) - ref[:, None], a)
        common = gallery is None and out_of_range is None and spread <= _COMMON_SHIFT_SPREAD
        shift = ref.amax() if common else ref[:, None]
        # e_ij = exp(a (S_ij - shift)), in place; the self-pairs are exp(-inf) = 0. The difference is formed before
        # the scale (not a S - a shift, one fused pass): the largest entry of a row is then exactly e^0 = 1 and no
        # term can overflow, at any scale (a S alone overflows fp64 at a = 2**1022, and at a = 2e30 in fp32 the
        # rounding of a * shift alone is ~1e23, far beyond exp's range)
        e = _scaled(raw.sub_(shift), a).exp_()
        sums = e.sum(dim=1)
        lse = torch.log(sums)
        if common:
            lse = lse + _scaled(shift - ref, a)
        ctx.e, ctx.sums, ctx.out_of_range = e, sums, out_of_range
        ctx.a, ctx.common = a, common
        ctx.save_for_backward(anchors, gallery, rows, cols, valid)
        return lse, positives

    @staticmethod
    def backward(ctx, grad_lse, grad_pos):  # type: ignore[override]
        if ctx.e is None:
            raise RuntimeError("the neighbour softmax's backward can run only once (it reuses its buffers)")
        anchors, gallery, rows, cols, valid = ctx.saved_tensors
        e, sums, out_of_range, a = ctx.e, ctx.sums, ctx.out_of_range, ctx.a
        ctx.e = None
        # dL/dS_ij = a W_ij with W_ij = dL/dl_ij = g_i e_ij / sum_i + the positives' gradients. The scale is applied
        # to the [B, D] products, factor by factor, after W is formed: W's entries are bounded by the incoming
        # gradients, whereas a * g_i / sum_i overflows where a does (a = s * s beyond the float range), and its
        # inf times a vanishing e_ij, or against a positive's -inf, is NaN where the true gradient is 0
        u = torch.where(sums > 0, grad_lse / sums.clamp(min=torch.finfo(sums.dtype).tiny), 0.0)
        vals = torch.where(valid, grad_pos, 0.0)
        if ctx.common:
            # W + W^T with e symmetric: e_ij (u_i + u_j), plus the positives' entries and their transposes
            w = e.mul_(u[:, None] + u[None, :])
            w.index_put_((rows, cols), vals, accumulate=True)
            w.index_put_((cols, rows), vals, accumulate=True)
            return _scaled(w @ anchors, a), None, None, None, None, None, None
        w = e.mul_(u[:, None])
        w.index_put_((rows, cols), vals, accumulate=True)
        if out_of_range is not None:
            w.masked_fill_(out_of_range, 0.0)
        if gallery is None:
            return _scaled(torch.addmm(w @ anchors, w.T, anchors), a), None, None, None, None, None, None
        grad_a = _scaled(w @ gallery, a) if ctx.needs_input_grad[0] else None
        grad_g = _scaled(w.T @ anchors, a) if ctx.needs_input_grad[1] else None
        return grad_a, grad_g, None, None, None, None, None


def neighbour_softmax_terms(
    anchors: Tensor,
    labels: Tensor,
    gallery: Tensor | None,
    gallery_labels: Tensor,
    a: float | tuple[float, ...],
    clamp: bool = True,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per anchor, the softmax terms of logits ``l_ij = a S_ij`` over every other gallery item, ``S = A G^T``.

    Args:
        anchors: ``[B, D]``; the gallery's first ``B`` rows when ``gallery`` is given.
        labels, gallery_labels: ``[B]`` and ``[N]``.
        gallery: ``[N, D]`` or ``None`` (the batch itself).
        a: the logit scale (``> 0``), or factors whose product it is (applied one after the other: a scale
            beyond the float range as two finite factors).
        clamp: clamp ``S`` to ``[-1, 1]`` first (unit vectors: SPEC 0.3 rule 1).

    Returns:
        ``(lse, positives, valid)``: ``lse[i] = log sum_{j != i} e^{l_ij} - r_i`` (``-inf`` for an anchor without
        any other item), ``positives[i, k] = l_{i, p_k(i)} - r_i`` for the ``k``-th positive ``p_k(i)`` where
        ``valid[i, k]``, with a per-anchor constant ``r_i`` (the row's largest logit) that cancels in every softmax
        ratio and keeps both finite at any scale. Differentiable w.r.t. ``anchors`` and ``gallery``; an entry of
        ``positives`` outside ``valid`` is arbitrary and must be masked out with ``torch.where``.
    """
    rows, cols, valid = positive_table(labels, gallery_labels)
    factors = tuple(float(f) for f in a) if isinstance(a, tuple) else (float(a),)
    lse, positives = _NeighbourSoftmax.apply(anchors, gallery, rows, cols, valid, factors, clamp)
    return lse, positives, valid


def neighbour_log_probability(lse: Tensor, positives: Tensor, pos: Tensor, num_gallery: int) -> Tensor:
    """``log p_i = log sum_{j in P(i)} e^{l_ij} - log sum_{j != i} e^{l_ij}`` (NCA Eq. 2, N-pair Eq. 9) from the
    terms of :func:`neighbour_softmax_terms` with ``num_gallery`` items; ``-inf`` for an anchor without positives
    (to be masked out) and exactly 0, with zero gradient, for one whose others are all positives (no negatives).
    """
    count = pos.sum(dim=1)
    has_pos = count > 0
    # an anchor without positives sums zeros instead (finite; its term is masked out by the caller)
    log_pos = masked_lse(torch.where(pos, positives, 0.0), pos | ~has_pos[:, None])
    return torch.where(count == num_gallery - 1, 0.0, torch.where(has_pos, log_pos - lse, -math.inf))


def anchor_mean(terms: Tensor, valid: Tensor, count: Tensor) -> Tensor:
    """``sum_{i: valid_i} terms_i / count``, each term divided before the sum, so that terms whose sum exceeds the
    float range but whose mean does not (logits near the float maximum: N-pair Eq. 9 on huge embeddings, NCA /
    SupCon at extreme scales) give the finite mean; the terms outside ``valid`` (and their gradient) are dropped."""
    return (torch.where(valid, terms, 0.0) / count).sum()
