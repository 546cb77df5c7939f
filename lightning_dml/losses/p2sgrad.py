"""P2SGrad (Zhang et al., "P2SGrad: Refined Gradients for Optimizing Deep Face Models", CVPR 2019, Eq. 11)."""

from __future__ import annotations

from torch import Tensor, nn

from lightning_dml.losses.proxies import ProxyLoss, normalize_proxies
from lightning_dml.losses.registry import register_loss

__all__ = ["P2SGradLoss"]


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
        cos = (x @ normalize_proxies(proxies).T).clamp(-1.0, 1.0)
        target = cos.gather(1, labels[:, None])
        # sum_j (cos_ij - delta_j)^2 = sum_j cos_ij^2 - cos_iy^2 + (cos_iy - 1)^2: no B x C one-hot buffer
        total = cos.square().sum() + ((target - 1.0).square() - target.square()).sum()
        return total / cos.numel()
