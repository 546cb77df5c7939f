"""CosFace / large margin cosine loss (Wang et al., "CosFace", CVPR 2018, Eq. 4)."""

from __future__ import annotations

from torch import Tensor, nn

from lightning_dml.losses.proxies import ProxyLoss
from lightning_dml.losses.registry import register_loss

__all__ = ["CosFaceLoss"]


@register_loss("cosface")
class CosFaceLoss(ProxyLoss):
    r"""Large margin cosine loss, LMCL (Wang et al., CVPR 2018, Eq. 4).

    .. math::
        L = -\frac{1}{B} \sum_i \log \frac{e^{s (\cos\theta_{y_i, i} - m)}}
            {e^{s (\cos\theta_{y_i, i} - m)} + \sum_{j \ne y_i} e^{s \cos\theta_{j, i}}}

    with ``cos(theta_j,i)`` the cosine between the embedding and the (normalised) weight of class ``j``.

    Args:
        num_classes: number of classes; filled in by ``DMLModule`` when left out.
        embedding_dim: width of the embeddings; filled in by ``DMLModule`` when left out.
        scale: ``s`` (paper: 64).
        margin: cosine margin ``m`` (paper: 0.35).
        sharded: split the class weights over the DDP processes and reduce the softmax across them (Partial FC,
            :mod:`lightning_dml.losses.partial_fc`); on one process the plain loss.
        sample_rate: with ``sharded``, the fraction of each process's class weights in each step's softmax, the
            batch's classes always kept (Partial FC's sampling; 1: all, the exact loss).

    Weights are initialised normal with std 0.01 (the face-recognition code's classifier init).

    pytorch-metric-learning's ``CosFaceLoss(num_classes, embedding_size, margin=0.35, scale=64)`` computes the same
    loss; it stores the weights transposed (``W [embedding_size, num_classes]`` = our ``proxies.T``).
    """

    supports_sampling = True

    def __init__(
        self,
        num_classes: int | None = None,
        embedding_dim: int | None = None,
        scale: float = 64.0,
        margin: float = 0.35,
        sharded: bool = False,
        sample_rate: float = 1.0,
    ) -> None:
        if scale <= 0:
            raise ValueError(f"CosFaceLoss: scale must be > 0, got {scale}")
        self.scale, self.margin = float(scale), float(margin)
        super().__init__(num_classes, embedding_dim, sharded=sharded, sample_rate=sample_rate)

    def reset_parameters(self) -> None:
        if self.proxies is not None:
            nn.init.normal_(self.proxies, std=0.01)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale}, margin={self.margin}"

    def target_cosine(self, cos: Tensor) -> Tensor:
        """The target logit's cosine ``cos(theta_y) - m`` (Eq. 4)."""
        return cos - self.margin

    def proxy_loss(self, x: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        return self.softmax_loss(x, proxies, labels, self.scale, self.target_cosine)
