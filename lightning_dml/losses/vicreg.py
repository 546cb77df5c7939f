"""VICReg (Bardes, Ponce and LeCun, "VICReg: Variance-Invariance-Covariance Regularization for Self-Supervised
Learning", ICLR 2022, Eqs. 1-6)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss
from lightning_dml.losses.registry import register_loss

__all__ = ["VICRegLoss", "vicreg_terms"]


def vicreg_terms(z: Tensor, z2: Tensor, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """The three VICReg terms of two aligned views ``[n, d]``: invariance ``s`` (Eq. 5, the mean squared error),
    variance ``(v(Z) + v(Z')) / 2`` (Eq. 1, hinge of the std at 1, halved as in the authors' code) and covariance
    ``c(Z) + c(Z')`` (Eq. 4: squared off-diagonal covariances over ``d``)."""
    n, d = z.shape
    invariance = (z - z2).square().mean()
    variance, covariance = z.new_zeros(()), z.new_zeros(())
    for view in (z, z2):
        centred = view - view.mean(dim=0)
        std = torch.sqrt(centred.square().sum(dim=0) / (n - 1) + eps)
        variance = variance + torch.relu(1.0 - std).mean() / 2.0
        cov = centred.T @ centred / (n - 1)
        covariance = covariance + (cov.square().sum() - cov.diagonal().square().sum()) / d
    return invariance, variance, covariance


@register_loss("vicreg")
class VICRegLoss(PairLoss):
    r"""VICReg (Bardes et al., ICLR 2022, Eq. 6) on the two views of each item:

    .. math::
        L = \lambda\, s(Z, Z') + \mu\, [v(Z) + v(Z')] + \nu\, [c(Z) + c(Z')]

    with ``s`` the mean squared distance of the aligned views (Eq. 5), ``v`` the mean over the ``d`` dimensions of
    ``max(0, 1 - sqrt(Var(z_j) + eps))`` (Eq. 1; halved, as in the authors' code and pytorch-metric-learning) and
    ``c`` the sum of the squared off-diagonal covariances divided by ``d`` (Eq. 4). On the **raw** embeddings
    (no normalisation; no labels in the definition).

    The views: every label of the batch (and of ``ref_embeddings``, if given) must occur exactly twice; its two
    items are one item's two views (the first in ``Z``, the second in ``Z'``). pml's
    ``VICRegLoss()(emb, ref_emb=ref)`` is ``loss(emb, arange(n), ref, arange(n))`` here. A P x K sampler with
    ``samples_per_class: 2`` trains it with two images of a class as the two views.

    Args:
        invariance_lambda: ``lambda`` (25), variance_mu: ``mu`` (25), covariance_v: ``nu`` (1), eps: (1e-4), the
            paper's values.

    Needs at least two pairs (an unbiased variance). Label sets are rejected (the views are paired by their one
    label). Under DDP the variance and covariance are batch statistics but the pairing by label does not survive
    gathering (two processes may draw the same class): ``gather_distributed`` is rejected at fit start. Identical
    embeddings: invariance and covariance 0, variance ``mu (1 - sqrt(eps))`` (finite gradient: ``eps > 0``).
    """

    normalize = False
    gather_mode = None
    supports_label_sets = False
    label_sets_reason = "its two views of an item are paired by their one label (each label exactly twice)"

    def __init__(
        self, invariance_lambda: float = 25.0, variance_mu: float = 25.0, covariance_v: float = 1.0, eps: float = 1e-4
    ) -> None:
        super().__init__()
        if min(invariance_lambda, variance_mu, covariance_v) < 0 or eps <= 0:
            raise ValueError(
                f"VICRegLoss: need weights >= 0 and eps > 0, got lambda={invariance_lambda}, mu={variance_mu}, "
                f"nu={covariance_v}, eps={eps}"
            )
        self.invariance_lambda, self.variance_mu = float(invariance_lambda), float(variance_mu)
        self.covariance_v, self.eps = float(covariance_v), float(eps)

    def extra_repr(self) -> str:
        return (
            f"invariance_lambda={self.invariance_lambda}, variance_mu={self.variance_mu}, "
            f"covariance_v={self.covariance_v}, eps={self.eps}"
        )

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        items = anchors if gallery is None else gallery
        order = torch.argsort(gallery_labels, stable=True)
        _, counts = torch.unique_consecutive(gallery_labels[order], return_counts=True)
        if counts.numel() < 2 or bool((counts != 2).any()):
            raise ValueError(
                "VICRegLoss pairs the two views of each item by label: every label must occur exactly twice "
                f"(at least two labels); got {gallery_labels.numel()} items with label counts from "
                f"{int(counts.min())} to {int(counts.max())}. Use samples_per_class: 2, or labels = item ids of the "
                "two views"
            )
        invariance, variance, covariance = vicreg_terms(items[order[0::2]], items[order[1::2]], self.eps)
        return self.invariance_lambda * invariance + self.variance_mu * variance + self.covariance_v * covariance
