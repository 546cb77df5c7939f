"""SphereFace / A-Softmax (Liu et al., "SphereFace: Deep Hypersphere Embedding for Face Recognition", CVPR 2017,
Eqs. 6-7)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_dml.losses.base import upcast
from lightning_dml.losses.proxies import ProxyLoss, normalize_proxies
from lightning_dml.losses.registry import register_loss

__all__ = ["SphereFaceLoss", "angular_margin_psi"]


def angular_margin_psi(cos: Tensor, margin: int) -> Tensor:
    r"""``psi(theta) = (-1)^k cos(m theta) - 2k`` for ``theta in [k pi / m, (k + 1) pi / m]`` (SphereFace Eq. 6,
    L-Softmax Eq. 6), a monotonically decreasing extension of ``cos(m theta)`` over ``[0, pi]``.

    ``cos(m theta)`` is the multiple-angle polynomial ``sum_n (-1)^n C(m, 2n) cos^{m-2n} (1 - cos^2)^n``
    (L-Softmax Eq. 7; finite gradient at ``cos = +-1``, where ``arccos`` has none); ``k`` is a constant of the
    gradient (taken from the detached angle).
    """
    cos_m = torch.zeros_like(cos)
    sin2 = 1.0 - cos * cos
    for n in range(margin // 2 + 1):
        cos_m = cos_m + ((-1) ** n * math.comb(margin, 2 * n)) * cos ** (margin - 2 * n) * sin2**n
    with torch.no_grad():
        k = torch.floor(torch.acos(cos.clamp(-1.0, 1.0)) / (math.pi / margin))
    return torch.where(k.remainder(2) == 0, cos_m, -cos_m) - 2.0 * k


@register_loss("sphereface")
class SphereFaceLoss(ProxyLoss):
    r"""A-Softmax loss (Liu et al., CVPR 2017, Eq. 7): a softmax over the classes of ``||x|| cos(theta_j)`` with
    normalised weights, whose target logit is ``||x|| psi(theta_y)`` (:func:`angular_margin_psi`):

    .. math::
        L = -\frac{1}{B} \sum_i \log \frac{e^{s \|x_i\| \psi(\theta_{y_i, i})}}
            {e^{s \|x_i\| \psi(\theta_{y_i, i})} + \sum_{j \ne y_i} e^{s \|x_i\| \cos\theta_{j, i}}}

    ``||x||`` is the norm of the raw embedding (the one loss here that is not on unit embeddings alone: its
    logits scale with it, Eq. 7); ``s`` is an extra scale (1 in the paper, pml's ``scale``). The paper trains
    with an annealed mix ``(lambda cos + psi) / (1 + lambda)`` of the target logit (its Section 4 / code); like
    pytorch-metric-learning this loss has no annealing (``lambda = 0``, the loss of Eq. 7).

    Args:
        num_classes: number of classes; filled in by ``DMLModule`` when left out.
        embedding_dim: width of the embeddings; filled in by ``DMLModule`` when left out.
        margin: the integer angular margin ``m`` (paper: 4).
        scale: ``s`` (1).

    Weights are initialised standard normal (pml's default). pytorch-metric-learning's
    ``SphereFaceLoss(num_classes, embedding_size, margin=4, scale=1)`` computes the same loss (weights transposed:
    ``W = proxies.T``). Per-sample: exact under DDP without gathering (``gather_distributed`` rejected); label sets
    rejected. Degenerate batches (one class, singletons, identical embeddings) are finite; a zero embedding gives
    uniform logits (``log C``).
    """

    def __init__(
        self,
        num_classes: int | None = None,
        embedding_dim: int | None = None,
        margin: int = 4,
        scale: float = 1.0,
    ) -> None:
        if isinstance(margin, bool) or int(margin) != margin or margin < 1:
            raise ValueError(f"SphereFaceLoss: margin must be an integer >= 1, got {margin!r}")
        if scale <= 0:
            raise ValueError(f"SphereFaceLoss: scale must be > 0, got {scale}")
        self.margin, self.scale = int(margin), float(scale)
        self._norms: Tensor | None = None
        super().__init__(num_classes, embedding_dim)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, margin={self.margin}, scale={self.scale}"

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
    ) -> Tensor:
        # the logits scale with the raw norms, which ProxyLoss.forward normalises away: kept for this call
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            self._norms = torch.linalg.vector_norm(upcast(embeddings), dim=1, keepdim=True)
        try:
            return super().forward(embeddings, labels, ref_embeddings, ref_labels)
        finally:
            self._norms = None

    def proxy_loss(self, x: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        cos = x @ normalize_proxies(proxies).T
        target = cos.gather(1, labels[:, None])
        logits = cos.scatter(1, labels[:, None], angular_margin_psi(target, self.margin))
        return F.cross_entropy(logits * (self.scale * self._norms.to(x.dtype)), labels)


