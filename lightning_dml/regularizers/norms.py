"""Regularizers of each row's own entries: :class:`LpRegularizer` (pml ``LpRegularizer``) and
:class:`ZeroMeanRegularizer` (pml ``ZeroMeanRegularizer``)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.regularizers.base import Regularizer, register_regularizer

__all__ = ["LpRegularizer", "ZeroMeanRegularizer"]


@register_regularizer("lp")
class LpRegularizer(Regularizer):
    r"""Mean ``L_p`` norm of the rows raised to ``power``: :math:`\frac1N \sum_i \lVert x_i \rVert_p^{\,power}`
    (pml ``LpRegularizer(p, power)``; ``p=2, power=2`` is the L2 embedding penalty of the N-pair paper, Sohn,
    NeurIPS 2016, Sec. 3.2.2). A zero row has value 0 and gradient 0 (torch's subgradient of the norm at 0).

    Args:
        p: the order of the norm (> 0).
        power: the exponent applied to each norm.
    """

    def __init__(self, p: float = 2, power: float = 1) -> None:
        super().__init__()
        if not p > 0 or isinstance(p, bool):
            raise ValueError(f"LpRegularizer: p must be > 0, got {p!r}")
        self.p = float(p)
        self.power = float(power)

    def extra_repr(self) -> str:
        return f"p={self.p:g}, power={self.power:g}"

    def per_row(self, x: Tensor) -> Tensor:
        norms = torch.linalg.vector_norm(x, ord=self.p, dim=1)
        return norms if self.power == 1 else norms**self.power


@register_regularizer("zero_mean")
class ZeroMeanRegularizer(Regularizer):
    r"""Mean absolute sum of each row's entries, :math:`\frac1N \sum_i |\sum_d x_{id}|` (pml
    ``ZeroMeanRegularizer``): pushes every row's entries to sum (average) to zero. A row summing to exactly 0 has
    gradient 0 (``sign(0) = 0``)."""

    def per_row(self, x: Tensor) -> Tensor:
        return torch.abs(torch.sum(x, dim=1))
