"""Instance loss (Zheng et al., "Dual-Path Convolutional Image-Text Embeddings with Instance Loss", ACM TOMM 2020,
Sec. 3.2, Eq. 1), in the batch form of the authors' code and pytorch-metric-learning's ``InstanceLoss``."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss
from lightning_dml.losses.registry import register_loss

__all__ = ["InstanceLoss", "InstanceSoftmaxFunction", "instance_targets"]


def instance_targets(labels: Tensor) -> Tensor:
    """The target column of every item: the rank of its label among the batch's distinct labels (``unique``'s
    inverse index; ``[3, 1, 3, 7] -> [1, 0, 1, 2]``)."""
    return torch.unique(labels, return_inverse=True)[1]


class InstanceSoftmaxFunction(torch.autograd.Function):
    """``mean_i (logsumexp_j(gamma x_i . x_j) - gamma x_i . x_{t_i})`` for unit rows ``x`` with the closed-form
    backward ``(G + G^T) x``, ``G = gamma (softmax - onehot(t)) / B``: one ``B x B`` buffer (the logits, turned into
    ``G`` in place) where autograd keeps the logits, the log-softmax and their gradients. The cosines are not
    clamped (as pml's). Differentiable once."""

    @staticmethod
    def forward(ctx, x: Tensor, targets: Tensor, gamma: float) -> Tensor:  # type: ignore[override]
        batch = x.shape[0]
        rows = torch.arange(batch, device=x.device)
        logits = (x @ x.T).mul_(gamma)
        lse = torch.logsumexp(logits, dim=1)
        loss = (lse - logits[rows, targets]).mean()
        grad = logits.sub_(lse[:, None]).exp_()  # the softmax, in place
        grad[rows, targets] -= 1.0
        grad.mul_(gamma / batch)
        ctx.save_for_backward(x, grad)
        return loss

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        x, grad = ctx.saved_tensors
        # two products: forming G + G^T first is slower on CPU (strided transpose read)
        return grad_out * (grad @ x + grad.T @ x), None, None


@register_loss("instance")
class InstanceLoss(PairLoss):
    r"""Instance loss (Zheng et al., ACM TOMM 2020, Eq. 1): every instance is its own class, learnt by a softmax
    cross-entropy over the instances.

    The paper classifies each embedding into one of the ``N`` training instances with a shared fully connected
    layer. The authors' batch code (layumi, contributed to pytorch-metric-learning as ``InstanceLoss``, whose
    conventions this follows exactly) uses the batch itself as the classifier: the logits of item ``i`` are
    ``gamma`` times its cosines to all ``B`` items of the batch (itself included), and

    .. math::
        L = -\frac{1}{B} \sum_i \log \frac{e^{\gamma \cos(z_i, z_{u_i})}}{\sum_{j=1}^{B} e^{\gamma \cos(z_i, z_j)}}

    with ``u_i`` the rank of ``y_i`` among the batch's distinct labels (:func:`instance_targets`). With one item
    per instance and the labels in batch order (``labels = arange(B)``: pml's default when no labels are given)
    ``u_i = i``: each item must be closer to itself than to every other instance of the batch, the paper's
    instance discrimination. For other labels the target is the batch item at position ``u_i``, whatever its
    label (pml's convention, kept for exactness; not a same-class pull): use it with one distinct label per item
    in ascending order, e.g. the item ids of a batch of distinct instances.

    Args:
        gamma: the logit scale (64, pml's default; the paper's code uses 1 to 64).

    Cost: one ``B x B`` buffer (:class:`InstanceSoftmaxFunction`, closed-form backward). Degenerate batches: every batch is well defined (each row's logits include
    its own ``gamma``); identical embeddings give ``log B``. Label sets are rejected (one instance per item). The
    targets are batch positions, which gathering across processes would renumber: ``gather_distributed`` is
    rejected at fit start (``gather_mode = None``); DDP without it trains each process on its own batch.
    """

    supports_ref = False
    needs_positive_pairs = False
    gather_mode = None
    supports_label_sets = False
    label_sets_reason = "each item is one instance: its target is the rank of its one label among the batch's labels"

    def __init__(self, gamma: float = 64.0) -> None:
        super().__init__()
        if not gamma > 0:
            raise ValueError(f"InstanceLoss: gamma must be > 0, got {gamma}")
        self.gamma = float(gamma)

    def extra_repr(self) -> str:
        return f"gamma={self.gamma}"

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        return InstanceSoftmaxFunction.apply(anchors, instance_targets(labels), self.gamma)
