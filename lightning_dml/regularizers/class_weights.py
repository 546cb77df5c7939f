"""Regularizers of a loss's class weights (proxies, classifier rows, SoftTriple's centres):
:class:`RegularFaceRegularizer` (Zhao et al., CVPR 2019) and :class:`SparseCentersRegularizer` (pml, after
SoftTriple, Qian et al., ICCV 2019)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import normalize_embeddings
from lightning_dml.regularizers.base import Regularizer, register_regularizer

__all__ = ["RegularFaceRegularizer", "SparseCentersRegularizer"]


@register_regularizer("regular_face")
class RegularFaceRegularizer(Regularizer):
    r"""RegularFace's exclusive regularization (Zhao, Xu, Cheng, Feng, "RegularFace: Deep Face Recognition via
    Exclusive Regularization", CVPR 2019, Eq. 5-6): the mean, over the rows, of the cosine to the most similar
    other row,

    .. math::
        R = \frac1N \sum_i \max_{j \ne i} \cos(x_i, x_j)

    as pml's ``RegularFaceRegularizer`` (after the authors' code at kaizhao.net/regularface): the nearest row is
    chosen without gradient (``torch.max``, its first index on ties), the gradient flows through the chosen cosine.
    The paper applies it to the classifier's weights (``target: loss_weights``); needs at least 2 rows. A zero row has
    cosine 0 to every row.
    """

    default_target = "loss_weights"

    def per_row(self, x: Tensor) -> Tensor:
        if x.shape[0] < 2:
            raise ValueError(f"RegularFaceRegularizer needs at least 2 rows, got {x.shape[0]}")
        unit = normalize_embeddings(x)
        cos = unit @ unit.T
        with torch.no_grad():
            others = cos.clone()
            others.fill_diagonal_(torch.finfo(cos.dtype).min)
            nearest = others.max(dim=1).indices
        return cos.gather(1, nearest[:, None]).squeeze(1)


@register_regularizer("sparse_centers")
class SparseCentersRegularizer(Regularizer):
    r"""pml's ``SparseCentersRegularizer``: the ``K`` centres of each class (rows ``c K .. c K + K - 1``, the layout
    of :class:`~lightning_dml.losses.SoftTripleLoss` and of pml's weight columns) are pulled together,

    .. math::
        R = \frac{1}{C K (K - 1)} \sum_c \sum_{k < k'} \sqrt{2 - \min(2 \cos(x_{ck}, x_{ck'}), 2)}

    SoftTriple's centre regulariser (Qian et al., ICCV 2019, Eq. 12, the distance :math:`\sqrt{2 - 2 w^\top w'}`
    of unit centres) as pml writes it (its ``2.0 + small_val`` rounds to 2). Two centres of cosine 1 (identical
    directions) give 0 with gradient 0, as pml under torch 2.14 (whose ``clamp`` passes no gradient at the bound);
    here the zero gradient does not depend on that version: a pair at the bound is left out with ``torch.where``.
    Nearly identical centres: pml's value and gradient.

    Args:
        num_classes: ``C``; ``None``: taken from the loss when the regularizer is on a proxy loss's weights.
        centers_per_class: ``K >= 2``; ``None``: the loss's ``proxies_per_class``.
    """

    default_target = "loss_weights"

    def __init__(self, num_classes: int | None = None, centers_per_class: int | None = None) -> None:
        super().__init__()
        if num_classes is not None and (isinstance(num_classes, bool) or int(num_classes) != num_classes
                                        or num_classes < 1):
            raise ValueError(f"SparseCentersRegularizer: num_classes must be an integer >= 1, got {num_classes!r}")
        if centers_per_class is not None and (isinstance(centers_per_class, bool)
                                              or int(centers_per_class) != centers_per_class
                                              or centers_per_class < 2):
            raise ValueError(
                f"SparseCentersRegularizer: centers_per_class must be an integer >= 2, got {centers_per_class!r}"
            )
        self.num_classes = None if num_classes is None else int(num_classes)
        self.centers_per_class = None if centers_per_class is None else int(centers_per_class)

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}, centers_per_class={self.centers_per_class}"

    def complete_from(self, loss: object) -> None:
        """Fill in ``num_classes`` / ``centers_per_class`` left out from a proxy loss's sizes."""
        if self.num_classes is None:
            self.num_classes = getattr(loss, "num_classes", None)
        if self.centers_per_class is None:
            per_class = getattr(loss, "proxies_per_class", None)
            if per_class is not None and per_class < 2:
                raise ValueError(
                    f"SparseCentersRegularizer needs at least 2 centres per class; {type(loss).__name__} has "
                    f"proxies_per_class={per_class}"
                )
            self.centers_per_class = per_class

    def forward(self, x: Tensor) -> Tensor:
        if self.num_classes is None or self.centers_per_class is None:
            raise ValueError(
                "SparseCentersRegularizer needs num_classes and centers_per_class (given, or taken from the proxy "
                "loss it regularises)"
            )
        classes, per_class = self.num_classes, self.centers_per_class
        if x.ndim != 2 or x.shape[0] != classes * per_class:
            raise ValueError(
                f"SparseCentersRegularizer with {classes} classes of {per_class} centres takes "
                f"[{classes * per_class}, D] weights, got shape {tuple(x.shape)}"
            )
        with torch.autocast(device_type=x.device.type, enabled=False):  # fp32 under mixed precision
            unit = normalize_embeddings(x).reshape(classes, per_class, -1)
            cos = unit @ unit.transpose(1, 2)  # [C, K, K]: each class's centres against each other
        upper = torch.triu(torch.ones(per_class, per_class, dtype=torch.bool, device=x.device), diagonal=1)
        pairs = torch.clamp(2.0 * cos[:, upper], max=2)
        gap = 2.0 - pairs
        positive = gap > 0
        tiny = torch.finfo(gap.dtype).tiny  # keeps the left-out branch's gradient finite (torch.where takes 0 of it)
        distances = torch.where(positive, torch.sqrt(torch.clamp(gap, min=tiny)), torch.zeros_like(gap))
        return distances.sum() / (2 * classes * int(upper.sum()))
