"""ArcFace / additive angular margin loss (Deng et al., "ArcFace", CVPR 2019, Eq. 3)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_dml.losses.proxies import ProxyLoss
from lightning_dml.losses.registry import register_loss

__all__ = ["ArcFaceLoss", "additive_angular_margin"]


def additive_angular_margin(cos: Tensor, margin: float) -> Tensor:
    """``cos(theta + m)`` for ``theta = arccos(cos) <= pi - m``, else ``cos(theta) - m sin(m)``.

    ``cos(theta + m) = cos(theta) cos(m) - sin(theta) sin(m)`` with ``sin(theta) = sqrt(max(1 - cos^2, 1e-12))``
    (finite gradient at ``cos = +-1``). Past ``theta = pi - m``, ``cos(theta + m)`` would increase again with
    ``theta``; the ArcFace code (and pytorch-metric-learning) continue with the linear ``cos(theta) - m sin(m)``,
    which keeps the target logit decreasing in ``theta``. It does not meet ``cos(theta + m)`` there: at ``theta =
    pi - m`` the logit steps from ``-1`` to ``-cos(m) - m sin(m)`` (-1.117 at m = 0.5), as in the authors' code.
    """
    sin = torch.sqrt(torch.clamp(1.0 - cos * cos, min=1e-12))
    shifted = cos * math.cos(margin) - sin * math.sin(margin)
    return torch.where(cos >= math.cos(math.pi - margin), shifted, cos - margin * math.sin(margin))


@register_loss("arcface")
class ArcFaceLoss(ProxyLoss):
    r"""Additive angular margin loss (Deng et al., CVPR 2019, Eq. 3).

    .. math::
        L = -\frac{1}{B} \sum_i \log \frac{e^{s \cos(\theta_{y_i} + m)}}
            {e^{s \cos(\theta_{y_i} + m)} + \sum_{j \ne y_i} e^{s \cos\theta_j}}

    with ``theta_j`` the angle between the embedding and the (normalised) weight of class ``j``. For
    ``theta_y > pi - m`` the target logit is ``cos(theta_y) - m sin(m)`` (see :func:`additive_angular_margin`;
    the official code's rule, not in Eq. 3).

    Args:
        num_classes: number of classes; filled in by ``DMLModule`` when left out.
        embedding_dim: width of the embeddings; filled in by ``DMLModule`` when left out.
        scale: ``s`` (paper: 64).
        margin: angular margin ``m`` in **radians** (paper: 0.5).
        sharded: split the class weights over the DDP processes and reduce the softmax across them (Partial FC,
            :mod:`lightning_dml.losses.partial_fc`); on one process the plain loss.
        sample_rate: with ``sharded``, the fraction of each process's class weights in each step's softmax, the
            batch's classes always kept (Partial FC's sampling; 1: all, the exact loss).

    Weights are initialised normal with std 0.01 (the ArcFace code's classifier init).

    pytorch-metric-learning's ``ArcFaceLoss(num_classes, embedding_size, margin=28.6, scale=64)`` takes the margin
    in **degrees** (its default 28.6 degrees = 0.4992 rad, not exactly the paper's 0.5 rad = 28.648 degrees), its
    width as ``embedding_size``, and stores the weights transposed (``W`` = our ``proxies.T``); with the margin
    converted it computes the same loss.
    """

    #: weights per class (``K`` sub-centres in :class:`SubCenterArcFaceLoss`; the nearest one counts)
    sub_centers: int = 1
    supports_sampling = True

    def __init__(
        self,
        num_classes: int | None = None,
        embedding_dim: int | None = None,
        scale: float = 64.0,
        margin: float = 0.5,
        sharded: bool = False,
        sample_rate: float = 1.0,
    ) -> None:
        if scale <= 0:
            raise ValueError(f"{type(self).__name__}: scale must be > 0, got {scale}")
        if not 0.0 <= margin < math.pi / 2:
            raise ValueError(f"{type(self).__name__}: margin must be in [0, pi/2) radians, got {margin}")
        self.scale, self.margin = float(scale), float(margin)
        super().__init__(
            num_classes, embedding_dim, proxies_per_class=self.sub_centers, sharded=sharded, sample_rate=sample_rate
        )

    def reset_parameters(self) -> None:
        if self.proxies is not None:
            nn.init.normal_(self.proxies, std=0.01)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale}, margin={self.margin}"

    def target_cosine(self, cos: Tensor) -> Tensor:
        """The target logit's cosine ``cos(theta_y + m)`` (Eq. 3; :func:`additive_angular_margin`)."""
        return additive_angular_margin(cos, self.margin)

    def proxy_loss(self, x: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        # the cosine to a class is the one to its nearest sub-centre (max pooling over proxies_per_class; 1 here)
        return self.softmax_loss(x, proxies, labels, self.scale, self.target_cosine, per_class=self.proxies_per_class)
