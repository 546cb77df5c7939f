"""Sub-center ArcFace with dynamic margins (Ha, Liu, Liu and Liao, "Google Landmark Recognition 2020 Competition
Third Place Solution", arXiv 2010.05350; pytorch-metric-learning 3.0's ``DynamicArcFaceLoss``)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from lightning_dml.losses.proxies import proxy_softmax_loss
from lightning_dml.losses.registry import register_loss
from lightning_dml.losses.subcenter_arcface import SubCenterArcFaceLoss

__all__ = ["DynamicArcFaceLoss", "dynamic_margins", "additive_angular_margins"]


def dynamic_margins(counts: Tensor, a: float, b: float, lambda0: float) -> Tensor:
    """The margin of every class from its number of training items ``n``: ``a n^{-lambda0} + b`` (radians)."""
    return a * counts.to(torch.float64).pow(-lambda0) + b


def additive_angular_margins(cos: Tensor, margins: Tensor) -> Tensor:
    """``cos(theta + m)`` with one margin per element (ArcFace Eq. 3), and past ``theta = pi - m`` the linear
    ``cos(theta) - m sin(m)`` of the ArcFace code: :func:`~lightning_dml.losses.arcface.additive_angular_margin`
    with a tensor of margins (``sin(theta)`` floored at ``1e-6``, a finite gradient at ``cos = +-1``)."""
    margins = margins.to(cos.dtype)
    sin = torch.sqrt(torch.clamp(1.0 - cos * cos, min=1e-12))
    shifted = cos * torch.cos(margins) - sin * torch.sin(margins)
    return torch.where(cos >= torch.cos(math.pi - margins), shifted, cos - margins * torch.sin(margins))


@register_loss("dynamic_arcface")
class DynamicArcFaceLoss(SubCenterArcFaceLoss):
    r"""Sub-center ArcFace whose angular margin depends on the class's frequency (Ha et al., arXiv 2010.05350):

    .. math::
        m_c = a\, n_c^{-\lambda_0} + b

    with ``n_c`` the number of training items of class ``c``: rare classes get larger margins (long-tailed
    landmark data). The loss is :class:`~lightning_dml.losses.SubCenterArcFaceLoss` (ArcFace Eq. 3 on the angle to
    the nearest of ``K`` sub-centres) with item ``i``'s target logit ``s cos(theta_{y_i} + m_{y_i})``.

    Args:
        num_classes: number of classes; filled in by ``DMLModule`` when left out.
        embedding_dim: width of the embeddings; filled in by ``DMLModule`` when left out.
        class_counts: ``n_c`` for the ``num_classes`` classes (class index order), each ``>= 1``; filled in by
            ``DMLModule`` from the data module's training split when left out (``train_class_counts``, in the order
            of ``train_class_ids``: see :meth:`set_class_counts`). Saved with the loss's state (a buffer).
        sub_centers: ``K`` (3, pml 3's default loss, ``SubCenterArcFaceLoss``; 1 is ArcFace with dynamic margins).
        scale: ``s`` (64).
        a, b, lambda0: the margin function's constants (0.5, 0.05, 0.25: pml 3's defaults). Every margin must lie in
            ``[0, pi/2)``.

    pml 3's ``DynamicArcFaceLoss(n, loss_func=SubCenterArcFaceLoss, lambda0, a, b, **kwargs)`` sets the wrapped
    loss's margin to the batch's ``m_{y_i}`` before each call (radians); this is that loss with pml's weights
    transposed (``W = proxies.T``). Per-sample against the proxies: exact under DDP without gathering
    (``gather_distributed=True`` is rejected, as for every per-sample proxy loss). Degenerate batches: as
    sub-center ArcFace (any batch is defined; identical embeddings give the same finite loss for every item).
    """

    #: ``DMLModule`` fills in ``class_counts`` through :meth:`set_class_counts` (the data module's training split)
    needs_class_counts: bool = True
    #: no Partial FC sharding / sampling here (the margins are per class of the whole softmax)
    supports_sampling: bool = False

    def __init__(
        self,
        num_classes: int | None = None,
        embedding_dim: int | None = None,
        class_counts: Sequence[int] | Tensor | None = None,
        sub_centers: int = 3,
        scale: float = 64.0,
        a: float = 0.5,
        b: float = 0.05,
        lambda0: float = 0.25,
    ) -> None:
        if min(a, b, lambda0) < 0 or not math.isfinite(a + b + lambda0):
            raise ValueError(f"DynamicArcFaceLoss: need finite a, b, lambda0 >= 0, got a={a}, b={b}, lambda0={lambda0}")
        if a + b >= math.pi / 2:
            raise ValueError(f"DynamicArcFaceLoss: the largest margin a + b = {a + b} must be < pi/2 radians")
        self.a, self.b, self.lambda0 = float(a), float(b), float(lambda0)
        super().__init__(num_classes, embedding_dim, sub_centers=sub_centers, scale=scale, margin=b)
        self.register_buffer("class_counts", None)
        self.register_load_state_dict_pre_hook(_create_counts_from_state_dict)
        if class_counts is not None:
            self.set_class_counts(class_counts)

    def extra_repr(self) -> str:
        return (f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}, scale={self.scale}, "
                f"sub_centers={self.proxies_per_class}, a={self.a}, b={self.b}, lambda0={self.lambda0}")

    def set_class_counts(self, counts: Sequence[int] | Tensor) -> DynamicArcFaceLoss:
        """Set ``n_c``, the training items of every class (class index order). ``ValueError`` unless they are
        ``num_classes`` integers ``>= 1`` (``num_classes`` is taken from them when unknown). Returns ``self``."""
        counts = torch.as_tensor(counts)
        if counts.ndim != 1 or counts.is_floating_point() or counts.is_complex() or counts.numel() == 0:
            raise ValueError(f"DynamicArcFaceLoss: class_counts must be a list of integers, got {counts.tolist()}")
        if bool((counts < 1).any()):
            raise ValueError(f"DynamicArcFaceLoss: every class count must be >= 1, got {int(counts.min())}")
        if self.num_classes is None:
            self.complete(num_classes=counts.numel())
        if counts.numel() != self.num_classes:
            raise ValueError(
                f"DynamicArcFaceLoss has num_classes={self.num_classes} but class_counts has {counts.numel()} entries"
            )
        device = self.proxies.device if self.proxies is not None else None
        self.class_counts = counts.to(device=device, dtype=torch.long)
        return self

    def proxy_loss(self, x: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        if self.class_counts is None:
            raise ValueError(
                "DynamicArcFaceLoss has no class_counts: pass class_counts (items per class), call "
                "set_class_counts(...), or train it with DMLModule, which counts the data module's training labels"
            )
        margins = dynamic_margins(self.class_counts, self.a, self.b, self.lambda0).to(x.dtype)[labels]
        return proxy_softmax_loss(
            x, proxies, labels, self.scale, lambda cos: additive_angular_margins(cos, margins),
            per_class=self.proxies_per_class,
        )


def _create_counts_from_state_dict(module: DynamicArcFaceLoss, state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook: a loss without counts takes the saved ones' shape (then loads their values)."""
    saved = state_dict.get(prefix + "class_counts")
    if module.class_counts is None and isinstance(saved, Tensor):
        module.class_counts = torch.zeros_like(saved, dtype=torch.long)
