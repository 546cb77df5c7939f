"""Angular loss (Wang et al., "Deep Metric Learning with Angular Loss", ICCV 2017)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_dml.losses.base import PairLoss, batch_normaliser
from lightning_dml.losses.registry import register_loss
from lightning_dml.miners.mining import positive_table

__all__ = ["AngularLoss"]

#: largest alpha accepted: beyond it the factorised sum can underflow in fp32 (see the class docstring)
MAX_ALPHA = math.pi / 3


@register_loss("angular")
class AngularLoss(PairLoss):
    r"""Angular loss in its N-pair form (Angular paper Eq. 8, with ``f_{a,p,n}`` of Eq. 7).

    Embeddings are L2-normalised. For every positive pair ``(a, p)`` of the batch (the paper's N-pair batch has one
    per anchor; here every ordered same-label pair, as in pytorch-metric-learning):

    .. math::
        l(a, p) = \log\Big[1 + \sum_{n: y_n \ne y_a} \exp\big(4 \tan^2\alpha\, (x_a + x_p)^\top x_n
                  - 2 (1 + \tan^2\alpha)\, x_a^\top x_p\big)\Big]

    averaged over the positive pairs. The sum over ``n`` factorises, ``e^{4 t^2 (s_an + s_pn)} =
    e^{4 t^2 s_an} e^{4 t^2 s_pn}``: with ``E = e^{4 t^2 (S - 1)}`` (one ``N x N`` exponential) it is a row-wise
    dot product of ``E_a`` (restricted to the negatives of ``a``) and ``E_p``, ``O(B K N)`` for ``K`` positives per
    anchor (no ``pairs x N`` tensor, no ``N x N x N`` product), with a closed-form backward. ``E`` lies in
    ``[e^{-8 t^2}, 1]``, so neither it nor the products underflow in fp32 for ``alpha <= 60`` degrees (larger values
    are refused).

    Args:
        alpha: the angle bound, in **radians** (default ``pi / 4`` = 45 degrees, the value this project takes
            from the paper's experiments). pytorch-metric-learning's ``AngularLoss(alpha=40)`` takes **degrees**
            (default 40 degrees).

    The paper also combines the angular loss with N-pair (Eq. 9, ``lambda = 2``); that combination is not part of
    this class. References are supported (they are extra positives and negatives of each anchor).

    Degenerate batches: no positive pair -> 0 with zero gradient; a positive pair whose anchor has no negative
    contributes ``log 1 = 0`` and counts in the mean (as in pml).
    """

    #: a mean of per-anchor (per-pair) terms over the global gallery: exact under DDP with all-reduced counts
    gather_mode = "references"
    label_sets_reason = (
        "label sets are not implemented for it yet (its definition only asks which pairs are positive, so it could "
        "take them: see docs/losses/README.md)"
    )

    def __init__(self, alpha: float = math.pi / 4) -> None:
        super().__init__()
        if not 0 < alpha <= MAX_ALPHA:
            raise ValueError(
                f"alpha must be an angle in radians in (0, pi/3], got {alpha} (pml's alpha is in degrees: "
                f"use math.radians)"
            )
        self.alpha = float(alpha)

    def extra_repr(self) -> str:
        return f"alpha={self.alpha}"

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        _, cols, valid = positive_table(labels, gallery_labels)
        # every row's positives first, then the table cut to the largest positive count (the self slot and the
        # padding of smaller classes cost no pass over the gallery)
        order = torch.argsort((~valid).to(torch.uint8), dim=1, stable=True)
        width = max(int(valid.sum(dim=1).amax()), 1)
        cols, valid = cols.gather(1, order)[:, :width], valid.gather(1, order)[:, :width]
        neg = labels[:, None] != gallery_labels[None, :]
        g = anchors if gallery is None else gallery
        tan2 = math.tan(self.alpha) ** 2
        inner = _AngularPairs.apply(g, neg, cols, 4.0 * tan2, 2.0 * (1.0 + tan2))
        terms = F.softplus(torch.where(valid, inner, -torch.inf))
        total = terms.sum()
        return total / batch_normaliser(valid.sum(), total)


class _AngularPairs(torch.autograd.Function):
    r"""``inner[a, k] = log sum_{n: neg[a, n]} e^{c (S_an + S_pn)} - b S_ap`` for the ``k``-th positive ``p`` of
    anchor ``a`` (``-inf`` where ``a`` has no negative), ``S = G G^T`` clamped to ``[-1, 1]`` (zero gradient outside,
    as autograd through the clamp), the anchors being the first ``B`` rows of ``G``; closed-form backward.

    With ``E = e^{c (S - 1)}`` (in ``[e^{-2c}, 1]``: no overflow, and no underflow for ``c <= 12``, i.e.
    ``alpha <= 60`` degrees) the sum is ``e^{2c} sum_n neg_an E_an E_pn``: per positive slot ``k`` one gather of
    the rows ``E_p`` and a row-wise dot product, ``O(B K N)`` instead of the ``B x N x N`` product of all pairs.
    """

    @staticmethod
    def forward(ctx, g, neg, cols, c: float, b: float):  # type: ignore[override]
        n_anchors = neg.shape[0]
        raw = g @ g.T
        raw.diagonal().fill_(0.0)  # the self-pairs are never used (n is a negative of a, p a positive)
        out_of_range = None
        if bool((raw.amax() > 1.0) | (raw.amin() < -1.0)):
            # entries beyond [-1, 1] (duplicates and opposites, by rounding): clamped, with zero gradient
            out_of_range = (raw < -1.0) | (raw > 1.0)
            raw.clamp_(-1.0, 1.0)
        s_ap = raw[:n_anchors].gather(1, cols)
        # in place, one pass: E = e^{c S - c}
        e = torch.add(torch.full((), -c, dtype=raw.dtype, device=raw.device), raw, alpha=c, out=raw).exp_()
        e_neg = e[:n_anchors].masked_fill(~neg, 0.0)
        total = torch.empty(cols.shape, dtype=e.dtype, device=e.device)
        rows = torch.empty_like(e_neg)
        for k in range(cols.shape[1]):
            torch.index_select(e, 0, cols[:, k], out=rows)
            total[:, k] = torch.bmm(e_neg[:, None, :], rows[:, :, None]).view(-1)
        has = total > 0
        inner = torch.where(has, torch.log(torch.where(has, total, 1.0)) + 2.0 * c - b * s_ap, -torch.inf)
        ctx.e, ctx.e_neg, ctx.total, ctx.out_of_range, ctx.c, ctx.b = e, e_neg, total, out_of_range, c, b
        ctx.save_for_backward(g, cols)
        return inner

    @staticmethod
    def backward(ctx, grad_inner):  # type: ignore[override]
        if ctx.e is None:
            raise RuntimeError("the angular loss's backward can run only once (it reuses its buffers)")
        g, cols = ctx.saved_tensors
        e, e_neg, total, c = ctx.e, ctx.e_neg, ctx.total, ctx.c
        ctx.e = ctx.e_neg = None
        n_anchors = e_neg.shape[0]
        # d inner / d total = 1 / total; d total / d S_an = d total / d S_pn = c E_an E_pn (n a negative of a)
        w = torch.where(total > 0, grad_inner / total.clamp(min=torch.finfo(total.dtype).tiny), 0.0) * c
        rows = torch.empty_like(e_neg)
        to_anchor = torch.zeros_like(e_neg)  # sum_k w_ak E_{p_k, n}
        to_positive = torch.zeros_like(e)  # row p: sum over the pairs (a, p) of w_ap E_an [neg]
        for k in range(cols.shape[1]):
            torch.index_select(e, 0, cols[:, k], out=rows)
            to_anchor.addcmul_(rows, w[:, k : k + 1])
            to_positive.index_add_(0, cols[:, k], torch.mul(e_neg, w[:, k : k + 1], out=rows))
        weights = to_positive.mul_(e)  # dL/dS, N x N
        weights[:n_anchors].addcmul_(to_anchor, e_neg)
        # d inner / d S_ap = -b
        weights[:n_anchors].scatter_add_(1, cols, grad_inner * -ctx.b)
        if ctx.out_of_range is not None:
            weights.masked_fill_(ctx.out_of_range, 0.0)
        return torch.addmm(weights @ g, weights.T, g), None, None, None, None
