"""P2SGrad (Zhang et al., "P2SGrad: Refined Gradients for Optimizing Deep Face Models", CVPR 2019, Eq. 11)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from lightning_dml.losses.proxies import ProxyLoss, unit_rows, unit_rows_backward_
from lightning_dml.losses.registry import register_loss

__all__ = ["P2SGradLoss", "P2SGradFunction"]


class P2SGradFunction(torch.autograd.Function):
    """``mean_{i,j} (clamp(cos_ij, -1, 1) - delta(j = y_i))^2`` from the normalised embeddings ``x`` and the raw
    weights, with the closed-form backward ``dL/dcos = 2 (cos - onehot) / (B C)`` (0 where the clamp is active):
    one ``B x C`` buffer (the cosines, turned into ``dL/dcos`` in place) instead of autograd's chain of ``B x C``
    intermediates; the weights' gradient is projected through their normalisation, ``(g - u (g . u)) / n``.
    Differentiable once."""

    @staticmethod
    def forward(ctx, x: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:  # type: ignore[override]
        unit, norms = unit_rows(proxies)
        cos = x @ unit.T
        rows = torch.arange(x.shape[0], device=labels.device)
        inside = cos.abs() < 1.0  # no gradient at the clamp's bounds (torch >= 2.14's clamp, pml's P2SGradLoss)
        cos.clamp_(-1.0, 1.0)
        target = cos[rows, labels]
        loss = (cos.square().sum() + ((target - 1.0).square() - target.square()).sum()) / cos.numel()
        grad = cos  # the cosines become dL/dcos in place
        grad.index_put_((rows, labels), target - 1.0)
        grad.mul_(2.0 / cos.numel()).mul_(inside)
        ctx.save_for_backward(x, unit, norms, grad)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        x, unit, norms, grad = ctx.saved_tensors
        grad = grad * grad_out
        grad_x = grad @ unit if ctx.needs_input_grad[0] else None
        grad_p = None
        if ctx.needs_input_grad[1]:
            grad_p = unit_rows_backward_(grad.T @ x, unit, norms)
        return grad_x, grad_p, None


@register_loss("p2sgrad")
class P2SGradLoss(ProxyLoss):
    r"""P2SGrad: the cosine to every class weight regressed onto the one-hot target (Zhang et al., CVPR 2019).

    The paper defines the update, not a loss: Eq. 11's gradient ``sum_j (cos(theta_ij) - 1[j = y_i]) grad
    cos(theta_ij)`` is the gradient of a squared error between the cosines and the one-hot vector. As the authors'
    code (nii-yamagishilab ``p2sgrad.py``, which pytorch-metric-learning's ``P2SGradLoss`` adapts) the loss is the
    mean of that squared error over the ``B x C`` entries:

    .. math::
        L = \frac{1}{B C} \sum_i \sum_{j=1}^{C} (\cos\theta_{ij} - \delta(j = y_i))^2

    (Eq. 11's gradient times ``2 / (B C)``), with ``cos(theta_ij)`` between the L2-normalised embedding and the
    L2-normalised weight of class ``j``, clamped to ``[-1, 1]`` as in that code. No scale, no margin: the
    hyper-parameter-free loss of the paper.

    Args:
        num_classes: number of classes; filled in by ``DMLModule`` when left out.
        embedding_dim: width of the embeddings; filled in by ``DMLModule`` when left out.

    Weights are initialised uniform in ``[-1, 1]`` (the authors' code; it renormalises the columns, which the
    forward's normalisation does). pytorch-metric-learning's ``P2SGradLoss(descriptors_dim, num_classes)`` computes
    the same value and embedding gradient; it stores the weights transposed (``weight = proxies.T``) and renormalises
    them in place instead of differentiating through the normalisation, so its weight gradient lacks the projection
    onto the unit sphere's tangent space that ours has.

    Degenerate batches: one class, singletons and identical embeddings are all well defined (a per-sample loss
    against the weights); the value lies in ``[0, 4 / C]``. Per-sample, so exact under DDP without gathering
    (``gather_distributed=True`` is rejected, as for every per-sample proxy loss).
    """

    def __init__(self, num_classes: int | None = None, embedding_dim: int | None = None) -> None:
        super().__init__(num_classes, embedding_dim)

    def reset_parameters(self) -> None:
        if self.proxies is not None:
            nn.init.uniform_(self.proxies, -1.0, 1.0)

    def proxy_loss(self, x: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        # sum_j (cos_ij - delta_j)^2 = sum_j cos_ij^2 - cos_iy^2 + (cos_iy - 1)^2: no B x C one-hot buffer
        return P2SGradFunction.apply(x, proxies, labels)
