"""Tuplet Margin Loss with slack margin and the intra-pair variance term (Yu & Tao, TML Eqs. 13, 15-17)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss, batch_normaliser, lse0, refuse_indices_tuple, similarity_matrix
from lightning_dml.losses.chunking import anchor_blocks, check_anchor_chunk_size
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


@dataclass
class _BatchMeans:
    """The batch-wide means of the variance terms (TML Eqs. 15-16) of one chunked call, and the gradients of the
    terms with respect to them: filled from all anchor blocks before the first block is scored (no graph)."""

    num_anchors: int
    mu: Tensor | None = None  # [mu_ap, mu_an]
    counts: Tensor | None = None  # [|P|, |N|] clamped to 1, in the embeddings' dtype
    grad_mu: Tensor | None = None  # [dL_pos / d mu_ap, dL_neg / d mu_an] (None: detach_mean)


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
        random negative choice (None = torch's global generator), anchor_chunk_size: score the anchors this many
        at a time (:mod:`lightning_dml.losses.chunking`), ``negatives="all"`` only (below).

    ``anchor_chunk_size``: the tuplet term is a sum over anchors divided by the number of tuplets; the variance
    terms' means ``mu`` are batch-wide and carry a gradient. A chunked call first computes, block by block
    without a graph, ``mu`` and ``G = dL_pos/d mu_ap`` (``dL_neg/d mu_an``); each block then scores its pairs
    with ``mu`` fixed and adds ``G (sum_block v - sum_block v.detach()) / |P|`` (value 0), whose gradient
    ``G / |P|`` per pair is the chain-rule term through ``mu``: the value and the gradients of the unchunked
    loss. Two more loss passes (one with ``detach_mean``). ``"random_per_class"`` draws its negatives over
    the whole batch at once and is refused (a chunked call would draw other negatives).

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
        anchor_chunk_size: int | None = None,
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
        #: anchor_chunk_size: exact with all negatives; the random ones are drawn over the whole batch at once
        self.supports_anchor_chunks = negatives == "all"
        self.set_anchor_chunk_size(anchor_chunk_size)

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

    def set_anchor_chunk_size(self, value: int | None) -> None:
        """As :meth:`PairLoss.set_anchor_chunk_size`; ``ValueError`` with ``negatives="random_per_class"``."""
        if check_anchor_chunk_size(value, type(self).__name__) is not None and self.negatives != "all":
            raise ValueError(
                f"TupletMarginLoss({self.extra_repr()}) does not take anchor_chunk_size with negatives="
                f"{self.negatives!r}: its random negatives are drawn over the whole batch at once (a chunked call "
                "would draw others); use negatives='all'"
            )
        super().set_anchor_chunk_size(value)

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
        indices_tuple: tuple[Tensor, ...] | None = None,
    ) -> Tensor:
        refuse_indices_tuple(self, indices_tuple, ref_embeddings)  # a miner's tuple: the one-line refusal
        chunk = self.anchor_chunk_size
        if chunk is None or self.variance_weight == 0 or embeddings.shape[0] <= chunk:
            return super().forward(embeddings, labels, ref_embeddings, ref_labels)
        # a chunked call: every block (and its recomputation in the backward) shares this call's batch means
        self.compute = partial(TupletMarginLoss.compute, self, means=_BatchMeans(embeddings.shape[0]))
        try:
            return super().forward(embeddings, labels, ref_embeddings, ref_labels)
        finally:
            del self.compute

    def compute(
        self,
        anchors: Tensor,
        labels: Tensor,
        gallery: Tensor | None,
        gallery_labels: Tensor,
        means: _BatchMeans | None = None,
    ) -> Tensor:
        """The loss of ``anchors`` against ``gallery``; with ``means`` one anchor block of a chunked call whose
        gallery holds the call's ``means.num_anchors`` anchors (in some order) as its first rows."""
        g = anchors if gallery is None else gallery
        sim = similarity_matrix(anchors, g)
        pos, neg = label_masks(labels, gallery_labels)
        a_idx, p_idx = pos.nonzero(as_tuple=True)
        n_pos = batch_normaliser(pos.sum(), sim)  # the number of tuplets = of positive pairs
        if a_idx.numel() > 0:
            cos_ap = sim[a_idx, p_idx]
            theta = torch.acos(cos_ap.clamp(-1 + 1e-7, 1 - 1e-7))
            target = torch.cos(theta - self.slack)
            candidates = neg[a_idx]
            if self.negatives == "random_per_class":
                candidates = _one_negative_per_class(candidates, gallery_labels, self._gen(sim.device))
            logits = self.scale * (sim[a_idx] - target[:, None])
            tuplet = lse0(logits, candidates).sum() / n_pos
        else:
            tuplet = sim.sum() * 0.0
        if self.variance_weight == 0:
            return tuplet
        n_neg = batch_normaliser(neg.sum(), sim)
        if means is None:
            variance = self._variance(sim[pos], n_pos, True) + self._variance(sim[neg], n_neg, False)
        else:
            if means.mu is None:
                self._fill_means(means, g, gallery_labels)
            variance = (self._variance(sim[pos], n_pos, True, means, 0)
                        + self._variance(sim[neg], n_neg, False, means, 1))
        return tuplet + self.variance_weight * variance

    def _hinge(self, values: Tensor, mu: Tensor, positive: bool) -> Tensor:
        """``[(1 - eps) mu - v]_+`` (TML Eq. 15) or ``[v - (1 + eps) mu]_+`` (Eq. 16)."""
        if positive:
            return torch.relu((1 - self.variance_eps) * mu - values)
        return torch.relu(values - (1 + self.variance_eps) * mu)

    def _variance(self, values: Tensor, count: Tensor, positive: bool, means: _BatchMeans | None = None,
                  k: int = 0) -> Tensor:
        """Intra-pair variance term, TML Eq. 15 (positives) or Eq. 16 (negatives), ``sum / count``; 0 for an empty
        set. With ``means``: the block's share under the batch means, plus the chain-rule term through them."""
        if means is None:
            if values.numel() == 0:
                return values.sum()
            mu = values.mean()
            if self.detach_mean:
                mu = mu.detach()
            return self._hinge(values, mu, positive).pow(2).sum() / count
        assert means.mu is not None and means.counts is not None  # filled by _fill_means
        out = self._hinge(values, means.mu[k], positive).pow(2).sum() / count
        if means.grad_mu is not None:  # d/dv of G (s - s.detach()) / |set| is G / |set|: the gradient through mu
            s = values.sum()
            out = out + means.grad_mu[k] * (s - s.detach()) / means.counts[k]
        return out

    def _fill_means(self, means: _BatchMeans, gallery: Tensor, gallery_labels: Tensor) -> None:
        """``mu_ap``, ``mu_an`` over all pairs of the call's anchors (the gallery's first ``num_anchors`` rows) and
        the variance terms' gradients with respect to them, one block of anchors at a time without a graph."""
        b, chunk = means.num_anchors, self.anchor_chunk_size or means.num_anchors
        spans = anchor_blocks(b, gallery.shape[0], chunk, gallery.device)
        with torch.no_grad():
            sums = torch.zeros(2, dtype=gallery.dtype, device=gallery.device)
            counts = torch.zeros(2, dtype=torch.long, device=gallery.device)
            for start, stop, order in spans:
                sim = similarity_matrix(gallery[start:stop], gallery[order])
                pos, neg = label_masks(gallery_labels[start:stop], gallery_labels[order])
                sums += torch.stack([sim[pos].sum(), sim[neg].sum()])
                counts += torch.stack([pos.sum(), neg.sum()])
            n = counts.to(gallery.dtype).clamp(min=1)
            mu = sums / n
            means.mu, means.counts = mu, n
            if self.detach_mean:
                return
            grads = torch.zeros(2, dtype=gallery.dtype, device=gallery.device)
            for start, stop, order in spans:  # the blocks' similarities recomputed, never kept
                sim = similarity_matrix(gallery[start:stop], gallery[order])
                pos, neg = label_masks(gallery_labels[start:stop], gallery_labels[order])
                grads += torch.stack([
                    2 * (1 - self.variance_eps) * self._hinge(sim[pos], mu[0], True).sum(),
                    -2 * (1 + self.variance_eps) * self._hinge(sim[neg], mu[1], False).sum(),
                ])
            means.grad_mu = grads / n
