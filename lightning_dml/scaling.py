"""Scale-safe arithmetic on embeddings of any magnitude: exact power-of-two rescaling and L2 normalisation.

``torch.nn.functional.normalize`` squares the entries: in fp32 an embedding whose entries reach about 1e19
overflows the squared norm to Inf and normalises to the zero vector (and entries below about 1e-19 underflow it
to 0). Dividing first by a power of two near the largest entry is exact in floating point (only the exponent
changes) and brings every entry into ``[-1, 1]``, so the result is that of the same embeddings scaled down by one
common factor, and the gradient is unchanged: ``normalize(x / s)`` has the same value and the same derivative
with respect to ``x`` as ``normalize(x)`` in exact arithmetic.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["power_of_two_scale", "common_power_of_two_scale", "l2_normalize"]


def _exponent_range(dtype: torch.dtype) -> tuple[int, int]:
    """Exponents ``e`` for which ``2**e`` and ``2**-e`` are both normal numbers of ``dtype``."""
    info = torch.finfo(dtype)
    low = math.frexp(info.tiny)[1]  # 2**(low - 1) is the smallest normal number
    high = math.frexp(info.max)[1]  # 2**(high - 1) is the largest power of two
    bound = min(1 - low, high - 1)
    return -bound, bound


def power_of_two_scale(x: Tensor, dim: int | None = None) -> Tensor:
    """``2**e`` with ``max|x| = m 2**e``, ``m`` in ``[0.5, 1)``, along ``dim`` (kept) or over all of ``x``.

    An all-zero row (or tensor) gives 1. ``e`` is clamped so that ``2**e`` and ``2**-e`` are normal numbers of
    ``x``'s dtype. The result is detached (a constant for autograd) and stays on ``x``'s device (no host sync).
    """
    a = x.detach()
    if dim is None:
        a = a.reshape(-1)
    d, keep = (0 if dim is None else dim), dim is not None
    if a.numel() > 0:  # max |x| as two reductions: vector_norm(ord=inf) is ~10x slower on the CPU
        amax = torch.maximum(a.amax(dim=d, keepdim=keep), a.amin(dim=d, keepdim=keep).neg())
    else:
        amax = torch.linalg.vector_norm(a, ord=float("inf"), dim=d, keepdim=keep)
    exponent = torch.frexp(amax)[1].clamp(*_exponent_range(x.dtype))
    return torch.exp2(exponent.to(x.dtype))


def common_power_of_two_scale(*tensors: Tensor) -> Tensor:
    """One 0-d :func:`power_of_two_scale` over all ``tensors`` (empty ones are ignored; none gives 1)."""
    scales = [power_of_two_scale(t) for t in tensors if t.numel() > 0]
    if not scales:
        return torch.ones((), dtype=tensors[0].dtype, device=tensors[0].device)
    return torch.stack(scales).amax()


class _ScaledNormalize(torch.autograd.Function):
    """``F.normalize(x / s)`` with ``s`` = :func:`power_of_two_scale` along ``dim``, and its analytic backward.

    Backward: ``(g - u (g . u)) / (s ||x / s||)`` with ``u`` the output, the derivative of ``x / ||x||`` (for an
    all-zero row ``u = 0`` and the result is ``g / eps``, as for ``F.normalize``). One autograd node with a fused
    backward instead of autograd through a division and ``F.normalize``: the scale-safety costs one extra pass.
    """

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, eps: float) -> Tensor:  # type: ignore[override]
        scale = power_of_two_scale(x, dim=dim)
        y = x / scale
        norm = torch.linalg.vector_norm(y, dim=dim, keepdim=True).clamp_(min=eps)
        out = y.div_(norm)
        ctx.dim = dim
        ctx.save_for_backward(out, norm.mul_(scale))
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        out, norm_x = ctx.saved_tensors
        along = (grad * out).sum(dim=ctx.dim, keepdim=True)
        return (grad - out * along).div_(norm_x), None, None


def l2_normalize(x: Tensor, dim: int = 1, eps: float = 1e-12) -> Tensor:
    """``x / ||x||`` along ``dim`` for entries of any magnitude (a zero vector stays zero).

    Each row is first divided by its :func:`power_of_two_scale` (exact), so the squared norm cannot overflow or
    underflow; otherwise the value and the gradient of ``F.normalize(x, p=2, dim=dim, eps=eps)``.
    """
    return _ScaledNormalize.apply(x, dim, eps)
