"""Multi-class N-pair loss and its one-vs-one variant (Sohn, NeurIPS 2016, Eqs. 7-8)."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_dml.losses.base import PairLoss

__all__ = ["NPairLoss", "npair_indices"]

_VARIANTS = ("mc", "ovo")


def npair_indices(labels: Tensor) -> Tuple[Tensor, Tensor]:
    """The N-pair structure of a batch: for every class with at least two samples, its first two occurrences.

    Returns ``(anchor_index, positive_index)``, each ``[N]``, ordered by label. Extra samples of a class beyond
    the second and classes with a single sample are not used.
    """
    sorted_labels, order = torch.sort(labels, stable=True)
    start = torch.ones_like(sorted_labels, dtype=torch.bool)
    start[1:] = sorted_labels[1:] != sorted_labels[:-1]
    first = start.nonzero().flatten()
    second = first + 1
    has_pair = second < labels.shape[0]
    first, second = first[has_pair], second[has_pair]
    has_pair = sorted_labels[second] == sorted_labels[first]
    return order[first[has_pair]], order[second[has_pair]]


class NPairLoss(PairLoss):
    r"""Multi-class N-pair loss (N-pair paper Eq. 7) or N-pair-ovo (Eq. 8), with L2 regularisation (Sec. 3.2.2).

    Similarity: the raw inner product ``f_i^T f_j`` (the embeddings are NOT normalised, as in the paper).
    The batch gives ``N`` pairs ``(x_i, x_i^+)`` of ``N`` distinct classes: the first two samples of every class
    with at least two (see :func:`npair_indices`); with logits ``l_ij = f_i^T f_j^+``,

    * ``"mc"``: ``L = 1/N sum_i log(1 + sum_{j != i} exp(l_ij - l_ii)) = CrossEntropy(l, arange(N))``;
      ``symmetric=True`` averages it with the swapped roles ``CrossEntropy(l^T, arange(N))`` (footnote 2);
    * ``"ovo"``: ``L = 1/N sum_i sum_{j != i} log(1 + exp(l_ij - l_ii))`` (symmetric: averaged likewise);

    plus ``l2_reg * mean ||f||^2`` over the ``2N`` embeddings of the pairs. The paper gives no coefficient;
    0.005 is the common re-implementation value (the TF/Paddle ports use ``0.25 * 0.002 * (mean||a||^2 +
    mean||p||^2)``, i.e. our ``l2_reg = 0.001`` reproduces them).

    The pair structure is fixed by the batch, so reference embeddings are refused (ValueError).

    Degenerate batches: no class with two samples -> 0; a single pair (N = 1) -> only the regulariser.
    """

    normalize = False
    supports_ref = False

    def __init__(self, l2_reg: float = 0.005, symmetric: bool = False, variant: str = "mc") -> None:
        super().__init__()
        if l2_reg < 0:
            raise ValueError(f"l2_reg must be >= 0, got {l2_reg}")
        if variant not in _VARIANTS:
            raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")
        self.l2_reg, self.symmetric, self.variant = float(l2_reg), symmetric, variant

    def extra_repr(self) -> str:
        return f"l2_reg={self.l2_reg}, symmetric={self.symmetric}, variant={self.variant!r}"

    def _one_direction(self, logits: Tensor) -> Tensor:
        target = torch.arange(logits.shape[0], device=logits.device)
        if self.variant == "mc":
            return F.cross_entropy(logits, target)
        off = ~torch.eye(logits.shape[0], dtype=torch.bool, device=logits.device)
        diff = logits - logits.diagonal()[:, None]
        return (F.softplus(diff) * off).sum(1).mean()

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Optional[Tensor], gallery_labels: Tensor) -> Tensor:
        a_idx, p_idx = npair_indices(labels)
        if a_idx.numel() == 0:
            return anchors.sum() * 0.0
        n = a_idx.shape[0]
        both = anchors[torch.cat([a_idx, p_idx])]  # one gather (one scatter in the backward)
        a, p = both[:n], both[n:]
        logits = a @ p.T
        loss = self._one_direction(logits)
        if self.symmetric:
            loss = 0.5 * (loss + self._one_direction(logits.T))
        if self.l2_reg > 0:
            loss = loss + self.l2_reg * 0.5 * (a.pow(2).sum(1).mean() + p.pow(2).sum(1).mean())
        return loss
