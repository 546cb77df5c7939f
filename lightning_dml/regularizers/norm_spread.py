"""Regularizers of the spread of the row norms: :class:`CenterInvariantRegularizer` (Wu et al. 2017) and
:class:`SphericalEmbeddingRegularizer` (Zhang et al., NeurIPS 2020)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.regularizers.base import Regularizer, register_regularizer

__all__ = ["CenterInvariantRegularizer", "SphericalEmbeddingRegularizer"]


@register_regularizer("center_invariant")
class CenterInvariantRegularizer(Regularizer):
    r"""Center invariant loss (Wu, Liu, Huang, Wang, "Deep Face Recognition with Center Invariant Loss", ACM MM
    Thematic Workshops 2017, Eq. 5): every class centre should have the same squared norm,

    .. math::
        R = \frac{1}{N} \sum_i \frac{1}{4} \big(\lVert x_i \rVert_p^2 - \bar r\big)^2, \qquad
        \bar r = \frac1N \sum_k \lVert x_k \rVert_p^2

    averaged over the rows as pml's ``CenterInvariantRegularizer`` (the paper sums over the classes; the mean is
    that sum divided by ``N``). The paper applies it to the class centres (``target: loss_weights``); pml also allows
    embeddings. All rows of one norm give 0 with gradient 0.

    Args:
        p: the order of the norm (pml: ``LpDistance(p=...)``, 2 by default).
    """

    default_target = "loss_weights"

    def __init__(self, p: float = 2) -> None:
        super().__init__()
        if not p > 0 or isinstance(p, bool):
            raise ValueError(f"CenterInvariantRegularizer: p must be > 0, got {p!r}")
        self.p = float(p)

    def extra_repr(self) -> str:
        return f"p={self.p:g}"

    def per_row(self, x: Tensor) -> Tensor:
        squared = torch.linalg.vector_norm(x, ord=self.p, dim=1) ** 2
        return (squared - squared.mean()) ** 2 / 4


@register_regularizer("spherical_embedding")
class SphericalEmbeddingRegularizer(Regularizer):
    r"""Spherical embedding constraint, SEC (Zhang, Chen, Yang, Zhang, Zhou, "Deep Metric Learning with Spherical
    Embedding", NeurIPS 2020, Eq. 5): the embeddings' norms should not spread,

    .. math::
        R = \frac1N \sum_i \big(\lVert x_i \rVert_2 - \mu\big)^2

    with :math:`\mu` the mean norm. As in the authors' code (``Dyfine/SphericalEmbedding``, ``learner.py``):
    :math:`\mu` carries no gradient and is a running mean, ``mu <- (1 - momentum) mu + momentum mean_i ||x_i||``,
    started at the first batch's mean norm; ``momentum=1`` (their default, ``--norm_momentum 1.0``) makes it the
    batch's mean norm, and then the value and the gradient equal the paper's formula with :math:`\mu` the batch
    mean (the gradient through :math:`\mu` is ``sum_i 2 (||x_i|| - mu) = 0``). The running mean updates only in
    training mode and is saved with the model (buffers ``running_norm``, ``has_running_norm``). A zero row has
    gradient 0. Under ``DMLModule(gather_distributed=True)`` each process regularises its own batch (its own mean
    norm).

    Args:
        momentum: weight of the batch's mean norm in the running mean, in ``(0, 1]``.
    """

    def __init__(self, momentum: float = 1.0) -> None:
        super().__init__()
        if not 0 < momentum <= 1:
            raise ValueError(f"SphericalEmbeddingRegularizer: momentum must be in (0, 1], got {momentum!r}")
        self.momentum = float(momentum)
        self.stateful = self.momentum < 1
        self.register_buffer("running_norm", torch.zeros((), dtype=torch.float64))
        self.register_buffer("has_running_norm", torch.zeros((), dtype=torch.bool))

    def extra_repr(self) -> str:
        return f"momentum={self.momentum:g}"

    def per_row(self, x: Tensor) -> Tensor:
        norms = torch.linalg.vector_norm(x, ord=2, dim=1)
        mean = norms.detach().mean()
        if self.momentum < 1:
            if self.training:
                with torch.no_grad():
                    if bool(self.has_running_norm):
                        new = (1 - self.momentum) * self.running_norm + self.momentum * mean.double()
                    else:
                        new = mean.double()
                    self.running_norm.copy_(new)
                    self.has_running_norm.fill_(True)
            if bool(self.has_running_norm):
                mean = self.running_norm.to(norms.dtype)
        return (norms - mean) ** 2
