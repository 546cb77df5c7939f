"""Threshold-Consistent Margin loss, TCM (Zhang et al., "Threshold-Consistent Margin Loss for Open-World Deep Metric
Learning", arXiv 2307.04047 / ICLR 2024)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss, batch_normaliser
from lightning_dml.losses.registry import register_loss

__all__ = ["ThresholdConsistentMarginLoss"]


@register_loss("threshold_consistent_margin")
class ThresholdConsistentMarginLoss(PairLoss):
    r"""Threshold-Consistent Margin loss (Zhang et al., arXiv 2307.04047): hinge penalties on the hard pairs only,
    each averaged over the pairs that violate their margin.

    .. math::
        L = \lambda^+ \frac{\sum_{s_{ij} \le m^+,\ y_{ij}=1} (m^+ - s_{ij})}{|\{s_{ij} \le m^+,\ y_{ij}=1\}|}
          + \lambda^- \frac{\sum_{s_{ij} \ge m^-,\ y_{ij}=0} (s_{ij} - m^-)}{|\{s_{ij} \ge m^-,\ y_{ij}=0\}|}

    over the ordered pairs ``(i, j)``, ``j != i``, of cosine similarities ``s`` (an empty set's term is 0). The
    paper adds it as a regulariser to a base loss; like pytorch-metric-learning's ``ThresholdConsistentMarginLoss``
    (whose code this follows for the reduction, equation numbers not re-checked) it is a loss of its own here:
    combine it with another through the module's list of loss terms. A pair exactly at its margin counts in the
    denominator with a zero term (pml's ``<=`` / ``>=``).

    Args:
        lambda_plus, lambda_minus: weights of the positive and negative terms (paper / pml: 1, 1).
        margin_plus, margin_minus: ``m+`` and ``m-`` (pml: 0.9 and 0.5).

    Label sets: a pair is positive when the sets intersect. Under DDP each process scores its anchors against the
    gathered batch with batch-wide counts (``gather_mode = "references"``). Degenerate batches: no positive (or no
    negative) pair gives that term 0; identical embeddings give ``s = 1`` (only negatives are penalised).
    """

    gather_mode = "references"
    supports_label_sets = True
    #: indices_tuple (a miner's output, lightning_dml.miners.indices): the tuple's pairs as masks (pml's ThresholdConsistentMarginLoss on tuples without repeated pairs)
    supports_indices_tuple = True
    needs_positive_pairs = False

    def __init__(
        self,
        lambda_plus: float = 1.0,
        lambda_minus: float = 1.0,
        margin_plus: float = 0.9,
        margin_minus: float = 0.5,
    ) -> None:
        super().__init__()
        if lambda_plus < 0 or lambda_minus < 0:
            raise ValueError(f"need lambda_plus, lambda_minus >= 0, got {lambda_plus}, {lambda_minus}")
        if not (-1.0 <= margin_minus <= 1.0 and -1.0 <= margin_plus <= 1.0):
            raise ValueError(
                f"margins are cosines in [-1, 1], got margin_plus={margin_plus}, margin_minus={margin_minus}"
            )
        self.lambda_plus, self.lambda_minus = float(lambda_plus), float(lambda_minus)
        self.margin_plus, self.margin_minus = float(margin_plus), float(margin_minus)

    def extra_repr(self) -> str:
        return (
            f"lambda_plus={self.lambda_plus}, lambda_minus={self.lambda_minus}, margin_plus={self.margin_plus}, "
            f"margin_minus={self.margin_minus}"
        )

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        hard_p = pos & (sim <= self.margin_plus)
        hard_n = neg & (sim >= self.margin_minus)
        total_p = torch.where(hard_p, self.margin_plus - sim, 0.0).sum()
        total_n = torch.where(hard_n, sim - self.margin_minus, 0.0).sum()
        count_p, count_n = batch_normaliser(torch.stack([hard_p.sum(), hard_n.sum()]), sim)
        return self.lambda_plus * total_p / count_p + self.lambda_minus * total_n / count_n
