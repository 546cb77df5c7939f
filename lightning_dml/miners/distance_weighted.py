"""Distance-weighted sampling (Wu et al., "Sampling Matters in Deep Embedding Learning", ICCV 2017, Sec. 4)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.miners.pairs import negative_mask, positive_table

__all__ = ["distance_weighted_log_weights", "distance_weighted_probabilities", "distance_weighted_sampling"]


def distance_weighted_log_weights(dist: Tensor, dim: int, cutoff: float = 0.5) -> Tensor:
    r"""``log q(d)^{-1}`` up to a constant, for pairwise distances ``d`` of unit vectors in ``R^dim``.

    The distances of uniformly spread points on the unit sphere follow
    ``q(d) ∝ d^{n-2} [1 - d^2 / 4]^{(n-3)/2}`` (Sampling-Matters Eq. 3, ``n = dim``); sampling with weight
    ``q(d)^{-1}`` (Eq. 4) spreads the sampled negatives over all distances. Distances are clipped below at
    ``cutoff`` (the paper's clip of the weights, "lambda"; 0.5 in the authors' code) and above at just under 2.
    """
    d = dist.clamp(min=cutoff, max=2.0 - 1e-4)
    return (2.0 - dim) * torch.log(d) - ((dim - 3) / 2.0) * torch.log(1.0 - 0.25 * d * d)


def distance_weighted_sampling(
    dist: Tensor,
    labels: Tensor,
    gallery_labels: Tensor | None = None,
    dim: int | None = None,
    cutoff: float = 0.5,
    nonzero_loss_cutoff: float = 1.4,
    generator: torch.Generator | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Triplets ``(anchor, positive, negative)`` as in the Sampling-Matters code: every positive pair ``(a, p)``
    gets one negative ``n`` drawn from the anchor's negatives with probability ``∝ q(D_an)^{-1}``
    (:func:`distance_weighted_log_weights`), among the negatives closer than ``nonzero_loss_cutoff`` (1.4 in the
    authors' code: farther ones cannot give a non-zero margin loss).

    Args:
        dist: ``B x N`` Euclidean distances of unit vectors (the gallery starts with the ``B`` anchors); no
            gradient is taken.
        labels: ``[B]`` anchor labels or ``[B, L]`` label sets (:mod:`lightning_dml.miners.pairs`: positive when
            the sets intersect); ``gallery_labels``: ``[N]`` / ``[N, L']`` (default ``labels``).
        dim: the embedding dimension ``n`` of Eq. 3 (required).
        generator: random generator for the draw (``torch.multinomial``, with replacement).

    An anchor none of whose negatives lies within ``nonzero_loss_cutoff`` draws uniformly from all its negatives
    (the authors' code draws uniformly from the whole batch there); an anchor without negatives gives no triplet.
    Returns three ``[T]`` index tensors (anchor rows, gallery columns), ``T`` = the number of positive pairs of
    anchors that have a negative.
    """
    if dim is None or dim < 1:
        raise ValueError(f"distance_weighted_sampling needs the embedding dimension dim >= 1, got {dim}")
    if gallery_labels is None:
        gallery_labels = labels
    weights, has_neg = _negative_weights(dist.detach(), labels, gallery_labels, dim, cutoff, nonzero_loss_cutoff)
    weights = torch.where(has_neg[:, None], weights, 1.0)  # rows without negatives: any valid draw, dropped below
    rows, cols, valid = positive_table(labels, gallery_labels)
    k = cols.shape[1]
    if k == 0:
        empty = torch.zeros(0, dtype=torch.long, device=dist.device)
        return empty, empty, empty
    negatives = torch.multinomial(weights, k, replacement=True, generator=generator)
    keep = valid & has_neg[:, None]
    return rows[keep], cols[keep], negatives[keep]


def _negative_weights(
    dist: Tensor, labels: Tensor, gallery_labels: Tensor, dim: int, cutoff: float, nonzero_loss_cutoff: float
) -> tuple[Tensor, Tensor]:
    """Unnormalised ``B x N`` draw weights of each anchor's negatives (:func:`distance_weighted_sampling`) and
    which anchors have a negative."""
    neg = negative_mask(labels, gallery_labels)
    log_w = distance_weighted_log_weights(dist, dim, cutoff)
    near = neg & (dist < nonzero_loss_cutoff)
    has_near = near.any(dim=1, keepdim=True)
    allowed = torch.where(has_near, near, neg)
    log_w = log_w.masked_fill(~allowed, -torch.inf)
    shift = log_w.amax(dim=1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, 0.0)
    return torch.exp(log_w - shift), neg.any(dim=1)


def distance_weighted_probabilities(
    dist: Tensor,
    labels: Tensor,
    gallery_labels: Tensor | None = None,
    dim: int | None = None,
    cutoff: float = 0.5,
    nonzero_loss_cutoff: float = 1.4,
) -> Tensor:
    """``B x N``: the probability with which :func:`distance_weighted_sampling` draws gallery item ``n`` as the
    negative of anchor ``a`` (rows sum to 1; an anchor without negatives gets a row of zeros)."""
    if dim is None or dim < 1:
        raise ValueError(f"distance_weighted_probabilities needs the embedding dimension dim >= 1, got {dim}")
    if gallery_labels is None:
        gallery_labels = labels
    weights, has_neg = _negative_weights(dist.detach(), labels, gallery_labels, dim, cutoff, nonzero_loss_cutoff)
    weights = weights * has_neg[:, None]
    return weights / weights.sum(dim=1, keepdim=True).clamp(min=torch.finfo(weights.dtype).tiny)
