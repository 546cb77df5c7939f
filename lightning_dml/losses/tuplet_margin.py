"""Tuplet Margin Loss with slack margin and the intra-pair variance term (Yu & Tao, TML Eqs. 13, 15-17)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss, lse0, similarity_matrix
from lightning_dml.losses.registry import register_loss
from lightning_dml.miners import label_masks

__all__ = ["TupletMarginLoss"]

_NEGATIVES = ("random_per_class", "all")


def _one_negative_per_class(candidates: Tensor, gallery_labels: Tensor, generator: torch.Generator | None) -> Tensor:
    """For every row, keep one uniformly random True column of ``candidates`` per gallery class (TML Sec. 3.2)."""
    classes = torch.unique(gallery_labels, return_inverse=True)[1]
    keys = torch.rand(candidates.shape, device=candidates.device, generator=generator)
    keys = keys.masked_fill(~candidates, -1.0)
    best = torch.full((candidates.shape[0], int(classes.max()) + 1), -1.0, device=candidates.device)
    best = best.scatter_reduce(1, classes.expand_as(keys), keys, reduce="amax", include_self=True)
    return candidates & (keys == best.gather(1, classes.expand_as(keys)))


@register_loss("tuplet_margin")
class TupletMarginLoss(PairLoss):
    r"""Tuplet Margin Loss (TML Eq. 13) plus the intra-pair variance regulariser (Eqs. 15-17).

    Similarity: cosine of L2-normalised embeddings. For every ordered positive pair ``(a, p)`` (TML Sec. 3.2) and
    its negatives ``n``:

    .. math::
        L_{tuplet} = \log\Big(1 + \sum_n e^{s(\cos\theta_{an} - \cos(\theta_{ap} - \beta))}\Big)

    averaged over the tuplets, with ``theta_ap = acos(clamp(cos_ap, -1 + 1e-7, 1 - 1e-7))`` and a stable LSE0.
    The negatives are one random negative of every other class (``negatives="random_per_class"``, the paper's
    selection) or all negatives of the anchor (``"all"``, deterministic; pytorch-metric-learning's choice).
    Intra-pair variance (Eqs. 15-16) with ``mu`` the mean cosine over all positive / all negative pairs:
    ``L_pos = mean [(1 - eps) mu_ap - cos_ap]_+^2``, ``L_neg = mean [cos_an - (1 + eps) mu_an]_+^2``;
    total (Eq. 17) ``L = L_tuplet + variance_weight (L_pos + L_neg)``.

    Args:
        scale: ``s`` (64), slack: ``beta`` in radians (0.1 = 5.73 degrees), variance_weight: ``lambda`` (0.5),
        variance_eps: ``eps`` (0.01), negatives: see above, detach_mean: stop the gradient through ``mu`` (the
        paper does not say; False lets it flow, as pytorch-metric-learning does), seed: optional seed of the
        random negative choice (None = torch's global generator).

    Degenerate batches: no positive pair -> the tuplet and ``L_pos`` terms are 0; no negative pair -> ``L_neg``
    is 0 and each tuplet's LSE0 over an empty set is 0.
    """

    label_sets_reason = (
        "its tuplets take one negative from each other class (TML Sec. 3.2) and its variance regulariser is per "
        "positive pair of a class, both built from one class id per item"
    )

    def __init__(
        self,
        scale: float = 64.0,
        slack: float = 0.1,
        variance_weight: float = 0.5,
        variance_eps: float = 0.01,
        negatives: str = "random_per_class",
        detach_mean: bool = False,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if scale <= 0:
            raise ValueError(f"scale must be > 0, got {scale}")
        if not 0 <= slack < math.pi:
            raise ValueError(f"slack must be in [0, pi) radians, got {slack}")
        if variance_weight < 0 or variance_eps < 0:
            raise ValueError("variance_weight and variance_eps must be >= 0")
        if negatives not in _NEGATIVES:
            raise ValueError(f"negatives must be one of {_NEGATIVES}, got {negatives!r}")
        self.scale, self.slack = float(scale), float(slack)
        self.variance_weight, self.variance_eps = float(variance_weight), float(variance_eps)
        self.negatives, self.detach_mean = negatives, detach_mean
        self._generator: torch.Generator | None = None
        self.seed = seed

    def extra_repr(self) -> str:
        return (
            f"scale={self.scale}, slack={self.slack}, variance_weight={self.variance_weight}, "
            f"variance_eps={self.variance_eps}, negatives={self.negatives!r}, detach_mean={self.detach_mean}"
        )

    def _gen(self, device: torch.device) -> torch.Generator | None:
        if self.seed is None:
            return None
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        g = anchors if gallery is None else gallery
        sim = similarity_matrix(anchors, g)
        pos, neg = label_masks(labels, gallery_labels)
        a_idx, p_idx = pos.nonzero(as_tuple=True)
        zero = sim.sum() * 0.0
        if a_idx.numel() > 0:
            cos_ap = sim[a_idx, p_idx]
            theta = torch.acos(cos_ap.clamp(-1 + 1e-7, 1 - 1e-7))
            target = torch.cos(theta - self.slack)
            candidates = neg[a_idx]
            if self.negatives == "random_per_class":
                candidates = _one_negative_per_class(candidates, gallery_labels, self._gen(sim.device))
            logits = self.scale * (sim[a_idx] - target[:, None])
            tuplet = lse0(logits, candidates).mean()
        else:
            tuplet = zero
        if self.variance_weight == 0:
            return tuplet
        return tuplet + self.variance_weight * (self._variance(sim, pos, positive=True) + self._variance(sim, neg, positive=False))

    def _variance(self, sim: Tensor, mask: Tensor, positive: bool) -> Tensor:
        """Intra-pair variance term, TML Eq. 15 (positives) or Eq. 16 (negatives); 0 for an empty set."""
        values = sim[mask]
        if values.numel() == 0:
            return sim.sum() * 0.0
        mu = values.mean()
        if self.detach_mean:
            mu = mu.detach()
        if positive:
            return torch.relu((1 - self.variance_eps) * mu - values).pow(2).mean()
        return torch.relu(values - (1 + self.variance_eps) * mu).pow(2).mean()
