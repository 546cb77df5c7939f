"""SoftTriple loss (Qian et al., "SoftTriple Loss: Deep Metric Learning Without Triplet Sampling", ICCV 2019)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_dml.losses.base import distance_from_similarity
from lightning_dml.losses.proxies import ProxyLoss, proxy_softmax_loss
from lightning_dml.losses.registry import register_loss

__all__ = ["SoftTripleLoss"]


@register_loss("soft_triple")
class SoftTripleLoss(ProxyLoss):
    r"""SoftTriple loss (Qian et al., ICCV 2019) with its centre regulariser (the
    paper's "adaptive number of centers").

    ``K`` centres ``w_c^k`` per class; the relaxed similarity of an embedding to class ``c`` is

    .. math::
        S'_{i,c} = \sum_k \frac{\exp(\frac{1}{\gamma} x_i^\top w_c^k)}{\sum_{k'} \exp(\frac{1}{\gamma} x_i^\top
        w_c^{k'})} x_i^\top w_c^k,
        \qquad
        \ell_i = -\log \frac{\exp(\lambda (S'_{i,y_i} - \delta))}{\exp(\lambda (S'_{i,y_i} - \delta))
        + \sum_{j \ne y_i} \exp(\lambda S'_{i,j})}

    and the loss is ``mean_i l_i + tau * sum_c sum_{t<s} ||w_c^t - w_c^s||_2 / (C K (K - 1))`` (the regulariser
    that lets similar centres merge, the "adaptive number of centers"; 0 when ``K = 1``).

    Args:
        num_classes: number of classes ``C``; filled in by ``DMLModule`` when left out.
        embedding_dim: width of the embeddings; filled in by ``DMLModule`` when left out.
        centers_per_class: ``K`` (paper: 10).
        la: ``lambda`` (paper: 20).
        gamma: ``gamma`` (paper: 0.1).
        tau: weight of the regulariser (paper: 0.2).
        margin: ``delta`` (paper: 0.01).

    Centres are the rows of ``proxies`` (class ``c``'s in rows ``c K .. c K + K - 1``), initialised as in the paper's
    code (``kaiming_uniform_(a=sqrt(5))`` of the ``[D, C K]`` matrix, i.e. uniform in ``+-1/sqrt(C K)``).

    pytorch-metric-learning's ``SoftTripleLoss(num_classes, embedding_size, centers_per_class=10, la=20,
    gamma=0.1, margin=0.01)`` has **no** centre regulariser: it equals ours with ``tau=0`` (its ``fc`` is our
    ``proxies.T``).
    """

    def __init__(
        self,
        num_classes: int | None = None,
        embedding_dim: int | None = None,
        centers_per_class: int = 10,
        la: float = 20.0,
        gamma: float = 0.1,
        tau: float = 0.2,
        margin: float = 0.01,
    ) -> None:
        if la <= 0 or gamma <= 0 or tau < 0:
            raise ValueError(f"SoftTripleLoss: need la > 0, gamma > 0, tau >= 0, got la={la}, gamma={gamma}, tau={tau}")
        self.la, self.gamma, self.tau, self.margin = float(la), float(gamma), float(tau), float(margin)
        super().__init__(num_classes, embedding_dim, proxies_per_class=centers_per_class)

    def reset_parameters(self) -> None:
        if self.proxies is not None:
            bound = 1.0 / math.sqrt(self.proxies.shape[0])
            nn.init.uniform_(self.proxies, -bound, bound)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, centers_per_class={self.proxies_per_class}, la={self.la}, gamma={self.gamma}, "
            f"tau={self.tau}, margin={self.margin}"
        )

    def target_similarity(self, relaxed: Tensor) -> Tensor:
        """The target logit's relaxed similarity ``S'_{i,y_i} - delta``."""
        return relaxed - self.margin

    def center_regularizer(self, centers: Tensor) -> Tensor:
        """``tau * sum_c sum_{t<s} ||w_c^t - w_c^s||_2 / (C K (K - 1))`` of the unit centres ``[C K, D]``."""
        C, K = self.num_classes, self.proxies_per_class
        centers = centers.view(C, K, -1)
        dist = distance_from_similarity(torch.bmm(centers, centers.transpose(1, 2)).clamp(-1.0, 1.0))
        upper = torch.triu(torch.ones(K, K, dtype=torch.bool, device=centers.device), diagonal=1)
        return self.tau * dist[:, upper].sum() / (C * K * (K - 1))

    def proxy_loss(self, x: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        K = self.proxies_per_class
        # the softmax over the classes of la * S'_{i,c}, S' pooled from the K centres, and the regulariser of the
        # unit centres, in one closed-form backward
        regularizer = self.center_regularizer if self.tau > 0 and K > 1 else None
        return proxy_softmax_loss(
            x, proxies, labels, self.la, self.target_similarity, per_class=K, gamma=self.gamma, proxy_term=regularizer
        )
