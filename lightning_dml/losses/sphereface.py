"""SphereFace / A-Softmax (Liu et al., "SphereFace: Deep Hypersphere Embedding for Face Recognition", CVPR 2017,
Eqs. 6-7)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor

from lightning_dml.losses.large_margin_softmax import LargeMarginSoftmaxLoss, large_margin_cosine
from lightning_dml.losses.proxies import normalize_proxies
from lightning_dml.losses.registry import register_loss

__all__ = ["SphereFaceLoss", "angular_margin_psi"]


#: SphereFace Eq. 6 is L-Softmax's psi (Eqs. 6-7): one implementation
angular_margin_psi = large_margin_cosine


@register_loss("sphereface")
class SphereFaceLoss(LargeMarginSoftmaxLoss):
    r"""A-Softmax loss (Liu et al., CVPR 2017, Eq. 7): a softmax over the classes of ``||x|| cos(theta_j)`` with
    normalised weights, whose target logit is ``||x|| psi(theta_y)`` (:func:`angular_margin_psi`):

    .. math::
        L = -\frac{1}{B} \sum_i \log \frac{e^{s \|x_i\| \psi(\theta_{y_i, i})}}
            {e^{s \|x_i\| \psi(\theta_{y_i, i})} + \sum_{j \ne y_i} e^{s \|x_i\| \cos\theta_{j, i}}}

    ``||x||`` is the norm of the raw embedding (as in L-Softmax, whose forward this loss shares, not on unit embeddings: its
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

    def proxy_loss(self, x: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        cos = x @ normalize_proxies(proxies).T
        target = cos.gather(1, labels[:, None])
        logits = cos.scatter(1, labels[:, None], angular_margin_psi(target, self.margin))
        return F.cross_entropy(logits * (self.scale * self._raw_norms.to(x.dtype)[:, None]), labels)


