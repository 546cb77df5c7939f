"""Large-Margin Softmax loss (Liu, Wen, Yu & Yang, "Large-Margin Softmax Loss for Convolutional Neural Networks",
ICML 2016)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_dml.losses.base import refuse_indices_tuple, upcast
from lightning_dml.losses.proxies import ProxyLoss, normalize_proxies
from lightning_dml.losses.registry import register_loss

__all__ = ["LargeMarginSoftmaxLoss", "large_margin_cosine"]


def large_margin_cosine(cos: Tensor, margin: int) -> Tensor:
    r"""L-Softmax paper Eqs. 6-7: ``psi(theta) = (-1)^k cos(m theta) - 2k`` for ``theta`` in
    ``[k pi/m, (k+1) pi/m]``, with ``cos(m theta)`` from the multiple-angle formula in ``cos theta``

    .. math::
        \cos(m\theta) = \sum_{n=0}^{\lfloor m/2 \rfloor} (-1)^n \binom{m}{2n} \cos^{m-2n}\theta\,(1-\cos^2\theta)^n

    (differentiable in ``cos``; ``k`` is a constant, read from ``theta = arccos(clamp(cos, -1, 1))``).
    """
    cos_m = torch.zeros_like(cos)
    sin_sq = 1.0 - cos * cos
    for n in range(margin // 2 + 1):
        cos_m = cos_m + (-1) ** n * math.comb(margin, 2 * n) * cos.pow(margin - 2 * n) * sin_sq.pow(n)
    with torch.no_grad():
        k = torch.floor(torch.acos(cos.clamp(-1.0, 1.0)) / (math.pi / margin))
        sign = 1.0 - 2.0 * torch.remainder(k, 2.0)  # (-1)^k
    return sign * cos_m - 2.0 * k


@register_loss("large_margin_softmax")
class LargeMarginSoftmaxLoss(ProxyLoss):
    r"""Large-Margin Softmax loss (L-Softmax paper Eqs. 4-7): softmax cross-entropy over the logits
    ``s ||W_j|| ||x|| cos(theta_j)`` with the target class's ``cos(theta_y)`` replaced by ``psi(theta_y)``
    (:func:`large_margin_cosine`), averaged over the batch.

    ``W`` (the class weights, the loss's proxies, ``[num_classes, embedding_dim]``) and ``x`` are **not**
    normalised: the paper's logits keep both norms (``||x||`` is read from the raw embeddings, in fp32).
    ``scale`` ``s`` multiplies the logits (1 in the paper; pml's ``scale``). The proxies start standard normal
    (pml's default ``weight_init_func``). pml's ``LargeMarginSoftmaxLoss(num_classes, embedding_size, margin,
    scale)`` computes the same loss (values and gradients; it stores ``W`` transposed, ``[embedding_size,
    num_classes]``). The paper's annealing of ``psi`` with the plain cosine (``lambda``, Sec. 5) is not applied
    (pml does not either).

    Args:
        num_classes, embedding_dim: as every proxy loss (``DMLModule`` fills them in when left out).
        margin: the integer ``m >= 1`` (paper 2 to 4; pml 4); ``m = 1`` is the softmax loss.
        scale: ``s`` (pml 1).

    A per-sample loss against the proxies: under DDP it needs no gathering (``gather_distributed=True`` is
    rejected); label sets are rejected (one class per item). A zero embedding has ``||x|| = 0``: all logits 0, the
    loss ``log C`` with zero gradient.
    """

    def __init__(
        self, num_classes: int | None = None, embedding_dim: int | None = None, margin: int = 4, scale: float = 1.0
    ) -> None:
        if isinstance(margin, bool) or int(margin) != margin or margin < 1:
            raise ValueError(f"{type(self).__name__}: margin must be an integer >= 1, got {margin!r}")
        if not scale > 0:
            raise ValueError(f"{type(self).__name__}: scale must be > 0, got {scale}")
        self.margin, self.scale = int(margin), float(scale)
        self._raw_norms: Tensor | None = None
        super().__init__(num_classes, embedding_dim)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, margin={self.margin}, scale={self.scale}"

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
        indices_tuple: tuple[Tensor, ...] | None = None,
    ) -> Tensor:
        refuse_indices_tuple(self, indices_tuple, ref_embeddings)  # a miner's tuple: the one-line refusal
        # the base class validates and hands proxy_loss the normalised embeddings: their norms are kept for it
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            self._raw_norms = upcast(embeddings).norm(dim=1) if isinstance(embeddings, Tensor) else None
        try:
            return super().forward(embeddings, labels, ref_embeddings, ref_labels)
        finally:
            self._raw_norms = None

    def proxy_loss(self, x: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        cos = x @ normalize_proxies(proxies).T
        target = cos.gather(1, labels[:, None])
        cos = cos.scatter(1, labels[:, None], large_margin_cosine(target, self.margin))
        logits = cos * (self._raw_norms.to(x.dtype)[:, None] * proxies.norm(dim=1)[None, :] * self.scale)
        return F.cross_entropy(logits, labels)
