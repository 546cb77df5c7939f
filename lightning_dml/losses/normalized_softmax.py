"""Normalized softmax loss (Zhai & Wu, "Classification is a Strong Baseline for Deep Metric Learning", BMVC 2019)."""

from __future__ import annotations

from torch import Tensor

from lightning_dml.losses.proxies import ProxyLoss
from lightning_dml.losses.registry import register_loss

__all__ = ["NormalizedSoftmaxLoss"]


@register_loss("normalized_softmax")
class NormalizedSoftmaxLoss(ProxyLoss):
    r"""Normalized softmax loss (Zhai & Wu, BMVC 2019, "NormSoftmax"): cross-entropy over cosines / T.

    .. math::
        L = -\frac{1}{B} \sum_i \log \frac{\exp(x_i^\top p_{y_i} / T)}{\sum_{c} \exp(x_i^\top p_c / T)}

    with ``x_i`` and the class weights ``p_c`` L2-normalised (the weights are the loss's proxies).

    Args:
        num_classes: number of classes; filled in by ``DMLModule`` when left out.
        embedding_dim: width of the embeddings; filled in by ``DMLModule`` when left out.
        temperature: ``T`` (paper: 0.05).
        sharded: split the class weights over the DDP processes and reduce the softmax across them (Partial FC,
            :mod:`lightning_dml.losses.partial_fc`); on one process the plain loss.
        sample_rate: with ``sharded``, the fraction of each process's class weights in each step's softmax, the
            batch's classes always kept (Partial FC's sampling; 1: all, the exact loss).

    pytorch-metric-learning's ``NormalizedSoftmaxLoss(num_classes, embedding_size, temperature=0.05)`` computes the
    same loss; it stores the weights transposed (``W [embedding_size, num_classes]`` = our ``proxies.T``).
    """

    supports_sampling = True

    def __init__(
        self,
        num_classes: int | None = None,
        embedding_dim: int | None = None,
        temperature: float = 0.05,
        sharded: bool = False,
        sample_rate: float = 1.0,
    ):
        if temperature <= 0:
            raise ValueError(f"NormalizedSoftmaxLoss: temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)
        super().__init__(num_classes, embedding_dim, sharded=sharded, sample_rate=sample_rate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, temperature={self.temperature}"

    def proxy_loss(self, x: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        return self.softmax_loss(x, proxies, labels, 1.0 / self.temperature)
