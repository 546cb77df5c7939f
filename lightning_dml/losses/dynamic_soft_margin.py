"""Dynamic Soft Margin loss (Zhang & Rusinkiewicz, "Learning Local Descriptors With a CDF-Based Dynamic Soft Margin",
ICCV 2019)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss, batch_normaliser, distance_from_similarity, similarity_matrix
from lightning_dml.losses.registry import register_loss
from lightning_dml.miners import label_masks

__all__ = ["DynamicSoftMarginLoss", "triplet_differences"]

_UPDATES = ("authors", "pml")


def triplet_differences(dist: Tensor, pos: Tensor, neg: Tensor) -> tuple[Tensor, Tensor]:
    """``x_apn = D_ap - D_an`` of every triplet as a ``[B, P, N]`` tensor and its validity mask.

    ``P`` is the largest number of positives of an anchor: each anchor's positives are packed to the front of the
    second axis (a stable sort of its positive mask), so the work is ``B x P x N``, not ``B x N x N``.
    """
    n_pos = pos.sum(dim=1)
    width = int(n_pos.max()) if pos.numel() else 0
    order = torch.sort(pos.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :width]
    d_ap = dist.gather(1, order)
    valid_p = torch.arange(width, device=dist.device)[None, :] < n_pos[:, None]
    x = d_ap[:, :, None] - dist[:, None, :]
    return x, valid_p[:, :, None] & neg[:, None, :]


@register_loss("dynamic_soft_margin")
class DynamicSoftMarginLoss(PairLoss):
    r"""Dynamic Soft Margin loss (DSM paper Sec. 3, in pml's discretisation).

    For every triplet ``(a, p, n)`` (``p`` a positive, ``n`` a negative of anchor ``a``) with Euclidean distances of
    L2-normalised embeddings, ``x = D_ap - D_an``. The paper replaces the fixed margin of a triplet loss by a soft
    margin whose gradient is the empirical CDF ``Phi`` of ``x`` (Sec. 3.2: ``dL/dx = Phi(x)``), estimated from a
    histogram of ``num_bins`` bins on ``[min_val, -min_val]`` that is a running average over batches (Sec. 3.3).
    As in pytorch-metric-learning's ``DynamicSoftMarginLoss`` (the paper's discretisation is followed from its
    code):

    .. math::
        L = \frac{1}{T} \sum_{(a,p,n)} \mathrm{sg}\big(\Phi[\lfloor (x - m_0)/\delta \rfloor]\big)\, x,
        \qquad \delta = 2|m_0| / \text{num\_bins}

    with ``T`` the number of triplets, ``Phi`` the cumulative sum of the histogram nodes, and the histogram updated
    before it is read: each ``x`` adds ``1 - frac`` to node ``floor(u)`` and ``frac`` to the next one
    (``u = (x - m_0)/delta``), giving the batch's histogram ``h_b``; the running one becomes
    ``(1 - momentum) h + momentum h_b / sum(h_b)`` (``histogram_update="authors"``, the authors' code
    lg-zhang/dynamic-soft-margin-pytorch, ``modules/dynamic_soft_margin.py``) or, as pml,
    ``normalise((1 - momentum) h + momentum h_b)`` (``"pml"``: the batch's unnormalised masses, so a batch of
    ``T`` triplets weighs ``momentum T`` against the history's 1). The first batch sets it (momentum 1): both rules
    agree there. The authors' grid of ``nbins`` nodes on ``[-2, 2]`` is ours with ``num_bins = nbins - 1``; their
    triplets are HardNet's hardest negatives of patch pairs, ours (as pml's) every triplet of the batch.

    Differences from pml, on purpose: the CDF weight is a constant (``sg``, stop-gradient), so the gradient is
    the paper's ``Phi(x) dx``; pml lets the gradient flow into the histogram (and through it into the previous
    batch's graph). The histogram has one more node (``num_bins + 1``) and ``u`` is clipped to
    ``[0, num_bins]``, so that ``x`` at or beyond the top of the range (``D_ap - D_an >= -min_val - delta``, where
    pml indexes past its histogram and fails) is counted in the top node; below ``min_val`` it is counted in the
    first. The histogram is updated in training mode only (``loss.train()``); in eval mode the stored one is read
    (the batch's own when none is stored yet). It is a buffer (saved in checkpoints).

    Args:
        min_val: ``m_0 < 0``, the lower end of the histogram's range (pml: -2, the smallest ``x`` of unit vectors).
        num_bins: number of bins (pml 10).
        momentum: weight of the current batch's histogram in the running one (pml and the authors: 0.01).
        histogram_update: ``"authors"`` (default) or ``"pml"``, the update rule above.

    Label sets (``[B, L]``): a pair is positive when the sets intersect. Under ``gather_distributed`` every process
    computes the loss of the gathered batch (the histogram is global). Degenerate batches (one class, singletons):
    no triplet gives 0 with zero gradient and leaves the histogram unchanged; identical embeddings give ``x = 0``
    (finite).
    """

    gather_mode = "global_batch"
    supports_label_sets = True

    def __init__(
        self, min_val: float = -2.0, num_bins: int = 10, momentum: float = 0.01, histogram_update: str = "authors"
    ) -> None:
        super().__init__()
        if not min_val < 0:
            raise ValueError(f"min_val must be < 0, got {min_val}")
        if isinstance(num_bins, bool) or int(num_bins) != num_bins or num_bins < 1:
            raise ValueError(f"num_bins must be an integer >= 1, got {num_bins!r}")
        if not 0.0 < momentum <= 1.0:
            raise ValueError(f"momentum must be in (0, 1], got {momentum}")
        if histogram_update not in _UPDATES:
            raise ValueError(f"histogram_update must be one of {_UPDATES}, got {histogram_update!r}")
        self.min_val, self.num_bins, self.momentum = float(min_val), int(num_bins), float(momentum)
        self.histogram_update = histogram_update
        self.delta = 2.0 * abs(self.min_val) / self.num_bins
        self.register_buffer("histogram", torch.zeros(self.num_bins + 1))

    def extra_repr(self) -> str:
        return (
            f"min_val={self.min_val}, num_bins={self.num_bins}, momentum={self.momentum}, "
            f"histogram_update={self.histogram_update!r}"
        )

    def _bins(self, x: Tensor) -> tuple[Tensor, Tensor]:
        u = ((x - self.min_val) / self.delta).clamp(0.0, float(self.num_bins))
        idx = u.floor().clamp(max=self.num_bins - 1)
        return idx.long(), u - idx

    def updated_histogram(self, x: Tensor) -> Tensor:
        """The running histogram after a batch whose triplet differences are ``x`` (1-D, detached)."""
        hist = self.histogram.to(x.dtype)
        idx, frac = self._bins(x)
        momentum = self.momentum if bool(hist.sum() != 0) else 1.0
        batch = torch.zeros_like(hist).scatter_add(0, idx, 1.0 - frac).scatter_add(0, idx + 1, frac)
        if self.histogram_update == "authors":
            batch = batch / batch.sum()
        new = (1.0 - momentum) * hist + momentum * batch
        return new / new.sum()

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        g = anchors if gallery is None else gallery
        dist = distance_from_similarity(similarity_matrix(anchors, g))
        pos, neg = label_masks(labels, gallery_labels)
        x, valid = triplet_differences(dist, pos, neg)
        x = x[valid]
        if x.numel() == 0:
            return dist.sum() * 0.0
        with torch.no_grad():
            if self.training or not bool(self.histogram.sum() != 0):
                hist = self.updated_histogram(x.detach())
                if self.training:
                    self.histogram.copy_(hist)
            else:
                hist = self.histogram.to(x.dtype)
            cdf = torch.cumsum(hist, 0)[self._bins(x.detach())[0]]
        return (cdf * x).sum() / batch_normaliser(x.numel(), x)
