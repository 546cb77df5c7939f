"""Multi-class N-pair loss, its one-vs-one and multi-positive variants (Sohn, NeurIPS 2016, Eqs. 7-9)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_dml.losses.base import PairLoss
from lightning_dml.losses.registry import register_loss
from lightning_dml.losses.softmax_pairs import anchor_mean, neighbour_log_probability, neighbour_softmax_terms
from lightning_dml.scaling import common_power_of_two_scale

__all__ = ["NPairLoss", "npair_indices"]

_VARIANTS = ("mc", "ovo", "multi_positive")
#: largest embedding entry for which the fp32 computation cannot overflow (logits up to 2**64 D)
_FP32_SAFE_ENTRY = 2.0**32


def npair_indices(labels: Tensor) -> tuple[Tensor, Tensor]:
    """The N-pair structure of a batch: for every class with at least two samples, its first two occurrences.

    Returns ``(anchor_index, positive_index)``, each ``[N]``, ordered by label. Extra samples of a class beyond
    the second and classes with a single sample are not used.
    """
    sorted_labels, order = torch.sort(labels, stable=True)
    start = torch.ones_like(sorted_labels, dtype=torch.bool)
    start[1:] = sorted_labels[1:] != sorted_labels[:-1]
    first = start.nonzero().flatten()
    second = first + 1
    has_pair = second < labels.shape[0]
    first, second = first[has_pair], second[has_pair]
    has_pair = sorted_labels[second] == sorted_labels[first]
    return order[first[has_pair]], order[second[has_pair]]


class _OneWayScale(torch.autograd.Function):
    """``x`` times ``value_factor`` in the forward, the gradient times ``grad_factor`` in the backward (powers of
    two: both exact)."""

    @staticmethod
    def forward(ctx, x, value_factor: float, grad_factor: float):  # type: ignore[override]
        ctx.grad_factor = grad_factor
        return x * value_factor if value_factor != 1.0 else x.view_as(x)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad * ctx.grad_factor, None, None


def scaled_for_inner_products(x: Tensor) -> tuple[Tensor, Tensor, float]:
    """``(x / s, s, float(s))``: ``x`` divided by a power of two ``s >= 1`` near its largest entry (exact), so that raw
    inner products ``(x/s)(x/s)^T`` cannot overflow; the caller multiplies differences of logits back by ``s``
    twice, and passes its loss through :func:`true_gradient_scale` with ``s``. ``x`` itself where ``s = 1``.

    The gradient w.r.t. ``x/s`` is ``s`` times the one w.r.t. ``x``, which overflows where the true one does not
    (fp64 entries beyond ``2**512``); so the division passes the gradient through unchanged and
    :func:`true_gradient_scale` divides the loss's incoming gradient by ``s`` instead: every gradient w.r.t. the
    scaled embeddings is then the true gradient w.r.t. the embeddings. Entries of ``2**32`` and beyond would still
    overflow fp32 intermediates (the logits' gradients are ``s`` times the true ones), so such (degenerate) inputs
    are computed in fp64 and the loss cast back (``inf`` where the true value exceeds fp32). One host read decides.
    """
    scale = common_power_of_two_scale(x).clamp(min=1.0)
    s = float(scale)  # the largest entry is in [s / 2, s) (or below 1 where s = 1)
    if x.dtype != torch.float64 and s > _FP32_SAFE_ENTRY:
        x = x.double()
        scale = common_power_of_two_scale(x).clamp(min=1.0)
        s = float(scale)
    return (x if s == 1.0 else _OneWayScale.apply(x, 1.0 / s, 1.0)), scale, s


def true_gradient_scale(loss: Tensor, s: float) -> Tensor:
    """``loss`` itself, its incoming gradient divided by ``s`` (see :func:`scaled_for_inner_products`)."""
    return loss if s == 1.0 else _OneWayScale.apply(loss, 1.0, 1.0 / s)


@register_loss("npair")
class NPairLoss(PairLoss):
    r"""Multi-class N-pair loss (N-pair paper Eq. 7) or N-pair-ovo (Eq. 8), with L2 regularisation (Sec. 3.2.2).

    Similarity: the raw inner product ``f_i^T f_j`` (the embeddings are NOT normalised, as in the paper).
    The batch gives ``N`` pairs ``(x_i, x_i^+)`` of ``N`` distinct classes: the first two samples of every class
    with at least two (see :func:`npair_indices`); with logits ``l_ij = f_i^T f_j^+``,

    * ``"mc"``: ``L = 1/N sum_i log(1 + sum_{j != i} exp(l_ij - l_ii)) = CrossEntropy(l, arange(N))``;
      ``symmetric=True`` averages it with the swapped roles ``CrossEntropy(l^T, arange(N))`` (footnote 2);
    * ``"ovo"``: ``L = 1/N sum_i sum_{j != i} log(1 + exp(l_ij - l_ii))`` (symmetric: averaged likewise);
    * ``"multi_positive"``: the NCA-style loss of Eq. 9 (Sec. 4.4) for batches with several samples per class:
      every sample ``i`` of the batch is an anchor, ``L = mean_i -log( sum_{j != i, y_j = y_i} exp(f_i^T f_j) /
      sum_{j != i} exp(f_i^T f_j) )`` over the anchors with at least one positive (Eq. 9's ``1/2N`` for its
      batches, where every sample has one); ``symmetric`` does not apply (Eq. 9 is symmetric already);

    plus ``l2_reg * mean ||f||^2`` over the ``2N`` embeddings of the pairs (``"multi_positive"``: of the anchors). The paper gives no coefficient;
    0.005 is the common re-implementation value (the TF/Paddle ports use ``0.25 * 0.002 * (mean||a||^2 +
    mean||p||^2)``, i.e. our ``l2_reg = 0.001`` reproduces them).

    The pair structure is fixed by the batch, so reference embeddings are refused (ValueError).

    Degenerate batches: no class with two samples -> 0; a single pair (N = 1) -> only the regulariser
    (``"multi_positive"``: a single-class batch gives 0 plus the regulariser).
    Embeddings of any magnitude give the true value (``inf`` where it, or one anchor's (row's) term of its mean,
    exceeds the float range; never NaN) and, where the value is finite, the true gradient: logits are formed from
    embeddings divided by a power of two (their gradient is not multiplied back: see
    :func:`scaled_for_inner_products`), every mean divides its terms before summing them, and entries beyond
    ``2**32`` are computed in fp64.
    """

    normalize = False
    supports_ref = False
    #: the batch is N pairs of distinct classes (the N-pair sampler): it cannot be scored against other
    #: processes' batches, so ``gather_distributed=True`` is rejected
    required_sampler = "npair"
    gather_mode = None
    label_sets_reason = (
        "its batch is N (anchor, positive) pairs from N distinct classes (N-pair paper Sec. 3.2), a structure built "
        "from one class id per item; with several labels per item \"distinct classes\" is undefined"
    )

    def __init__(self, l2_reg: float = 0.005, symmetric: bool = False, variant: str = "mc") -> None:
        super().__init__()
        if l2_reg < 0:
            raise ValueError(f"l2_reg must be >= 0, got {l2_reg}")
        if variant not in _VARIANTS:
            raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")
        self.l2_reg, self.symmetric, self.variant = float(l2_reg), symmetric, variant
        if variant == "multi_positive":
            # Eq. 9 takes any P x K batch (K >= 2) and is deterministic: under gather_distributed every process
            # computes it on the gathered global batch
            self.required_sampler, self.gather_mode = None, "global_batch"

    def extra_repr(self) -> str:
        return f"l2_reg={self.l2_reg}, symmetric={self.symmetric}, variant={self.variant!r}"

    def _one_direction(self, logits: Tensor, scale: Tensor) -> Tensor:
        """Eq. 7 / Eq. 8 from the logits of scaled-down embeddings (true logits = ``logits * scale**2``).

        The differences ``l_ij - l_ii`` are formed before scaling back (the diagonal is exactly 0, so a logit
        beyond the float range gives an infinite loss, never ``inf - inf``), in two steps of ``scale`` (exact).
        """
        diff = (logits - logits.diagonal()[:, None]) * scale * scale
        n = logits.shape[0]
        # means with each term divided first: a sum beyond the float range whose mean is not stays finite
        if self.variant == "mc":
            # cross-entropy with target i = log sum_j exp(l_ij - l_ii) (the j = i term is exp(0) = 1)
            return (torch.logsumexp(diff, dim=1) / n).sum()
        off = ~torch.eye(n, dtype=torch.bool, device=logits.device)
        return (F.softplus(diff).masked_fill(~off, 0.0) / n).sum()

    def _multi_positive(self, anchors: Tensor, labels: Tensor) -> Tensor:
        """Eq. 9 over every anchor with a positive, overflow-safe as the other variants (see ``compute``)."""
        x, scale, s = scaled_for_inner_products(anchors)
        # the logits x_i^T x_j s^2 scaled back in one exact step, or two where s^2 exceeds the float range
        factors = (s * s,) if math.isfinite(s * s) else (s, s)
        # the neighbour softmax with its closed-form backward (as SupCon and NCA), relative to each row's largest
        # logit (so the differences of huge logits stay exact)
        lse, positives, pos = neighbour_softmax_terms(x, labels, None, labels, factors, clamp=False)
        valid = pos.any(dim=1)
        if not bool(valid.any()):
            return anchors.sum() * 0.0
        log_p = neighbour_log_probability(lse, positives, pos, labels.numel())
        count = valid.sum()
        loss = anchor_mean(-log_p, valid, count)
        if self.l2_reg > 0:  # the coefficient before the scale: s^2 mean ||x||^2 may exceed the range, l2_reg times not
            loss = loss + anchor_mean(x.pow(2).sum(dim=1), valid, count) * self.l2_reg * scale * scale
        return true_gradient_scale(loss, s).to(anchors.dtype)

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        if self.variant == "multi_positive":
            return self._multi_positive(anchors, labels)
        a_idx, p_idx = npair_indices(labels)
        if a_idx.numel() == 0:
            return anchors.sum() * 0.0
        n = a_idx.shape[0]
        both = anchors[torch.cat([a_idx, p_idx])]  # one gather (one scatter in the backward)
        both, scale, s = scaled_for_inner_products(both)
        a, p = both[:n], both[n:]
        logits = a @ p.T
        loss = self._one_direction(logits, scale)
        if self.symmetric:  # halves first (each may be near the float maximum)
            loss = 0.5 * loss + 0.5 * self._one_direction(logits.T, scale)
        if self.l2_reg > 0:
            squared_norms = 0.5 * a.pow(2).sum(1).mean() + 0.5 * p.pow(2).sum(1).mean()
            loss = loss + squared_norms * self.l2_reg * scale * scale
        return true_gradient_scale(loss, s).to(anchors.dtype)
