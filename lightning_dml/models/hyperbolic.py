"""The Poincare ball of curvature ``-c``: the exponential map at the origin, Hyp-ViT's feature clipping, the
geodesic distance, and the layer that maps Euclidean embeddings into the ball (the hyperbolic "head").

Definitions (Ganea et al., "Hyperbolic Neural Networks", NeurIPS 2018, Sec. 2; Ermolov et al., "Hyperbolic Vision
Transformers", CVPR 2022, Sec. 3.1-3.2, Eqs. 1-4), for the ball ``{x : c ||x||^2 < 1}``:

* exponential map at the origin: ``exp_0(u) = tanh(sqrt(c) ||u||) u / (sqrt(c) ||u||)``, its inverse
  ``log_0(y) = artanh(sqrt(c) ||y||) y / (sqrt(c) ||y||)``;
* Moebius addition ``x (+) y`` (Ganea Eq. 4) and the distance ``d(x, y) = 2 / sqrt(c) artanh(sqrt(c) ||(-x) (+) y||)``
  (Ermolov Eq. 4). With ``delta = ||x - y||^2``, ``a = 1 - c ||x||^2``, ``b = 1 - c ||y||^2`` the same distance is
  ``d = 2 / sqrt(c) artanh(sqrt(q))``, ``q = c delta / (a b + c delta)`` (from ``cosh(sqrt(c) d) = 1 + 2 c delta /
  (a b)``): :func:`poincare_distance_matrix` evaluates it from one Gram matrix, ``O(B N)`` memory instead of the
  ``B x N x D`` Moebius sums of the authors' ``dist_matrix`` (hyptorch ``pmath.py``);
* clipping (Guo et al., "Clipped Hyperbolic Classifiers Are Super-Hyperbolic Classifiers", CVPR 2022, Eq. 6; the
  ``clip_r`` of the Hyp-ViT and HIER code): ``x <- min(1, r / (||x|| + 1e-5)) x`` before the exponential map;
* the Riemannian gradient (Nickel & Kiela, NeurIPS 2017, Eq. 5): the Euclidean gradient at a ball point times
  ``(1 - c ||x||^2)^2 / 4``, as hyptorch's ``RiemannianGradient`` applies it in the backward (HIER's head and
  proxies use it, Hyp-ViT's head does not).

The manifold operations are written here rather than taken from geoopt (on PyPI, 0.5.1): geoopt's ``dist`` is
elementwise (a distance matrix through it is a ``B x N x D`` broadcast) and it has no clipping nor the
Riemannian-gradient layer of the two papers' code; ``tests/test_hyperbolic.py`` checks these functions against
the closed forms (Moebius addition, ``exp_0``/``log_0`` inverse, symmetry, ``d(x, x) = 0``, the boundary).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

__all__ = [
    "BALL_EPS",
    "check_curvature",
    "clip_features",
    "expmap0",
    "logmap0",
    "project",
    "mobius_add",
    "poincare_distance",
    "poincare_distance_matrix",
    "distance_to_origin",
    "RiemannianGradient",
    "to_poincare",
    "ToPoincare",
]

#: relative margin kept from the boundary by :func:`project` (hyptorch ``_project``: radius ``(1 - 1e-3) / sqrt(c)``)
BALL_EPS = 1e-3

#: floor of norms divided by (hyptorch ``clamp_min(norm, 1e-5)``)
_NORM_FLOOR = 1e-5


def check_curvature(c: float, clip_r: float | None = None, where: str = "Poincare ball") -> tuple[float, float | None]:
    """``c > 0`` finite and ``clip_r`` ``None`` or ``> 0`` finite, else one ``ValueError`` naming ``where``."""
    c = float(c)
    if not math.isfinite(c) or c <= 0:
        raise ValueError(f"{where}: the curvature c must be a finite number > 0 (the ball has curvature -c), got {c}")
    if clip_r is not None:
        clip_r = float(clip_r)
        if not math.isfinite(clip_r) or clip_r <= 0:
            raise ValueError(f"{where}: clip_r must be a finite number > 0 or None (no clipping), got {clip_r}")
    return c, clip_r


def clip_features(x: Tensor, clip_r: float | None) -> Tensor:
    """Feature clipping of Guo et al. (CVPR 2022, Eq. 6) as the Hyp-ViT / HIER code does it: rows longer than
    ``clip_r`` are scaled to norm ``clip_r`` (``min(1, clip_r / (||x|| + 1e-5)) x``); ``None``: unchanged."""
    if clip_r is None:
        return x
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True) + _NORM_FLOOR
    return x * torch.clamp(clip_r / norm, max=1.0)


def expmap0(u: Tensor, c: float) -> Tensor:
    """Exponential map at the origin, ``tanh(sqrt(c) ||u||) u / (sqrt(c) ||u||)`` (Ermolov Eq. 1 at ``x = 0``)."""
    sqrt_c = math.sqrt(c)
    norm = torch.linalg.vector_norm(u, dim=-1, keepdim=True).clamp(min=_NORM_FLOOR)
    return torch.tanh(sqrt_c * norm) * u / (sqrt_c * norm)


def logmap0(y: Tensor, c: float) -> Tensor:
    """Logarithmic map at the origin (the inverse of :func:`expmap0` inside the ball):
    ``artanh(sqrt(c) ||y||) y / (sqrt(c) ||y||)``."""
    sqrt_c = math.sqrt(c)
    norm = torch.linalg.vector_norm(y, dim=-1, keepdim=True).clamp(min=_NORM_FLOOR)
    return torch.atanh(sqrt_c * norm) * y / (sqrt_c * norm)


def project(x: Tensor, c: float) -> Tensor:
    """Rows with ``||x|| > (1 - 1e-3) / sqrt(c)`` are scaled onto that radius (hyptorch ``project``; Ganea et al.
    Sec. 4 keep points off the boundary this way); the others are unchanged."""
    max_norm = (1.0 - BALL_EPS) / math.sqrt(c)
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp(min=_NORM_FLOOR)
    return torch.where(norm > max_norm, x / norm * max_norm, x)


def mobius_add(x: Tensor, y: Tensor, c: float) -> Tensor:
    """Moebius addition ``x (+)_c y`` (Ganea et al. Eq. 4), broadcast over the leading dimensions."""
    xy = (x * y).sum(-1, keepdim=True)
    x2 = (x * x).sum(-1, keepdim=True)
    y2 = (y * y).sum(-1, keepdim=True)
    num = (1 + 2 * c * xy + c * y2) * x + (1 - c * x2) * y
    return num / (1 + 2 * c * xy + c * c * x2 * y2)


def poincare_distance(x: Tensor, y: Tensor, c: float) -> Tensor:
    """Geodesic distance of broadcast rows, ``2 / sqrt(c) artanh(sqrt(c) ||(-x) (+)_c y||)`` (Ermolov Eq. 4): the
    definition, for references and small inputs (:func:`poincare_distance_matrix` for matrices)."""
    sqrt_c = math.sqrt(c)
    return 2.0 / sqrt_c * torch.atanh(sqrt_c * torch.linalg.vector_norm(mobius_add(-x, y, c), dim=-1))


def _distance_from_parts(delta: Tensor, a: Tensor, b: Tensor, c: float) -> Tensor:
    """``2 / sqrt(c) artanh(sqrt(q))`` with ``q = c delta / (a b + c delta)``; ``artanh(t) = log1p(t) -
    log(1 - t^2) / 2`` and ``1 - q = a b / (a b + c delta)`` keep it accurate far from the origin. At ``delta = 0``
    the distance is 0 with gradient 0 (the square root is taken only where ``q > 0``)."""
    ab = a * b
    total = ab + c * delta
    q = c * delta / total
    positive = q > 0
    t = torch.where(positive, torch.sqrt(torch.where(positive, q, torch.ones_like(q))), torch.zeros_like(q))
    return (2.0 / math.sqrt(c)) * (torch.log1p(t) + 0.5 * (torch.log(total) - torch.log(ab)))


def poincare_distance_matrix(x: Tensor, y: Tensor, c: float) -> Tensor:
    """``[B, N]`` geodesic distances between the rows of ``x [B, D]`` and ``y [N, D]`` (points of the ball), from
    the Gram matrix ``x y^T`` (module docstring). Equal to :func:`poincare_distance` up to rounding; with ``y is x``
    the matrix is exactly symmetric with an exactly zero diagonal."""
    x2 = (x * x).sum(-1)
    y2 = (y * y).sum(-1)
    gram = x @ y.T
    if y is x:  # exactly symmetric (ties such as d(i, j) = d(j, i) stay ties), exactly 0 on the diagonal
        gram = (gram + gram.T) / 2
    delta = (x2[:, None] + y2[None, :] - 2.0 * gram).clamp(min=0.0)
    if y is x:
        delta = delta.masked_fill(torch.eye(x.shape[0], dtype=torch.bool, device=x.device), 0.0)
    return _distance_from_parts(delta, (1.0 - c * x2)[:, None], (1.0 - c * y2)[None, :], c)


def distance_to_origin(x: Tensor, c: float) -> Tensor:
    """``d(0, x) = 2 / sqrt(c) artanh(sqrt(c) ||x||)`` per row."""
    sqrt_c = math.sqrt(c)
    return 2.0 / sqrt_c * torch.atanh(sqrt_c * torch.linalg.vector_norm(x, dim=-1))


class RiemannianGradient(torch.autograd.Function):
    """Identity in the forward; the backward multiplies the gradient of each ball point ``x`` by
    ``(1 - c ||x||^2)^2 / 4``, the inverse of the Poincare metric tensor (Nickel & Kiela 2017, Eq. 5; hyptorch's
    ``RiemannianGradient``, used by HIER's head and proxies). The curvature is an argument here, not a class
    attribute shared by every layer as in hyptorch."""

    @staticmethod
    def forward(ctx, x: Tensor, c: float) -> Tensor:  # type: ignore[override]
        ctx.save_for_backward(x)
        ctx.c = c
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        (x,) = ctx.saved_tensors
        scale = (1.0 - ctx.c * (x * x).sum(-1, keepdim=True)) ** 2 / 4.0
        return grad_out * scale, None


def to_poincare(x: Tensor, c: float, clip_r: float | None = 2.3, riemannian: bool = False) -> Tensor:
    """Euclidean rows -> points of the ball: clip to ``clip_r`` (:func:`clip_features`), :func:`expmap0`,
    :func:`project`, and with ``riemannian`` the :class:`RiemannianGradient` backward; hyptorch's ``ToPoincare``
    (``train_x=False``, ``train_c=False``), the last layer of the Hyp-ViT and HIER heads."""
    y = project(expmap0(clip_features(x, clip_r), c), c)
    return RiemannianGradient.apply(y, c) if riemannian else y


class ToPoincare(nn.Module):
    """The hyperbolic head's last layer: :func:`to_poincare` with fixed curvature ``c``, clipping radius ``clip_r``
    (2.3 in both papers' code) and the optional Riemannian gradient (HIER: on, Hyp-ViT: off).

    Hyp-ViT's head is ``Linear(384, 128)`` followed by this layer; in this library the linear layer is
    :class:`~lightning_dml.models.LinearEmbedding` (``DMLModule``'s head, whose output stays Euclidean) and the
    hyperbolic losses (:class:`~lightning_dml.losses.HypViTLoss`, :class:`~lightning_dml.losses.HIERLoss`) apply
    this layer first, so that the metrics and the index see the Euclidean embedding (``docs/hyperbolic.md``).
    """

    def __init__(self, c: float = 0.1, clip_r: float | None = 2.3, riemannian: bool = False) -> None:
        super().__init__()
        self.c, self.clip_r = check_curvature(c, clip_r, type(self).__name__)
        self.riemannian = bool(riemannian)

    def forward(self, x: Tensor) -> Tensor:
        return to_poincare(x, self.c, self.clip_r, self.riemannian)

    def extra_repr(self) -> str:
        return f"c={self.c}, clip_r={self.clip_r}, riemannian={self.riemannian}"
