"""Circle loss (Sun et al., "Circle Loss: A Unified Perspective of Pair Similarity Optimization", CVPR 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_dml.losses.base import PairLoss, batch_normaliser, masked_lse
from lightning_dml.losses.registry import register_loss

__all__ = ["CircleLoss"]


@register_loss("circle")
class CircleLoss(PairLoss):
    r"""Circle loss with pair-wise labels (Circle paper Eq. 6: Eq. 4's self-paced loss with margins).

    Similarity: cosine ``s = f_i . f_j`` of L2-normalised embeddings. For every anchor with positive
    similarities ``s_p^i`` and negative similarities ``s_n^j`` in the batch (and references):

    .. math::
        L = \log\Big[1 + \sum_j e^{\gamma \alpha_n^j (s_n^j - \Delta_n)} \sum_i e^{-\gamma \alpha_p^i (s_p^i - \Delta_p)}\Big]

    with ``alpha_p = [O_p - s_p]_+``, ``alpha_n = [s_n - O_n]_+`` (Eq. 5) and the paper's setting
    ``O_p = 1 + m``, ``O_n = -m``, ``Delta_p = 1 - m``, ``Delta_n = m`` (derived with the decision boundary, Eq. 7). As in the authors' code (and pytorch-metric-learning), the
    weights ``alpha`` are treated as constants: no gradient flows through them. The loss is averaged over the
    anchors that have at least one positive and one negative.

    Args:
        m: relaxation margin (paper: 0.25 for face recognition and person re-ID, 0.4 for fine-grained image
            retrieval; default 0.25, pml's default 0.4).
        gamma: scale factor (paper: 256 face recognition, 128 re-ID, 80 fine-grained retrieval; default 256,
            pml's default 80).
        anchor_chunk_size: score the anchors this many at a time, each block's ``B x N`` matrices recomputed in
            the backward (memory ``O(chunk x N)``, same value and gradients; :mod:`lightning_dml.losses.chunking`).

    Degenerate batches: an anchor without a positive or without a negative has no term (Eq. 6 gives 0 for it,
    and it does not count in the mean); a batch without any such anchor (one class, all singletons) gives 0
    with zero gradient.
    """

    #: a mean of per-anchor (per-pair) terms over the global gallery: exact under DDP with all-reduced counts
    gather_mode = "references"
    #: anchor_chunk_size: a sum of per-anchor terms over batch-wide counts (losses.chunking)
    supports_anchor_chunks = True
    #: label sets ([B, L], positive = the sets intersect): the loss only asks which pairs are positive
    supports_label_sets = True
    #: indices_tuple (a miner's output, lightning_dml.miners.indices): the tuple's pairs as masks, as pml's CircleLoss
    supports_indices_tuple = True

    def __init__(self, m: float = 0.25, gamma: float = 256.0, anchor_chunk_size: int | None = None) -> None:
        super().__init__()
        if not 0 <= m < 1:
            raise ValueError(f"m must be in [0, 1), got {m}")
        if not gamma > 0:
            raise ValueError(f"gamma must be > 0, got {gamma}")
        self.m, self.gamma = float(m), float(gamma)
        self.set_anchor_chunk_size(anchor_chunk_size)

    def extra_repr(self) -> str:
        return f"m={self.m}, gamma={self.gamma}"

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        m, gamma = self.m, self.gamma
        s = sim.detach()
        logit_p = -gamma * torch.relu(1.0 + m - s) * (sim - (1.0 - m))
        logit_n = gamma * torch.relu(s + m) * (sim - m)
        valid = pos.any(dim=1) & neg.any(dim=1)
        # rows without a term get a full (finite) mask and are dropped below: no -inf, no NaN gradient
        fill = ~valid[:, None]
        per_anchor = F.softplus(masked_lse(logit_p, pos | fill) + masked_lse(logit_n, neg | fill))
        total = torch.where(valid, per_anchor, 0.0).sum()
        return total / batch_normaliser(valid.sum(), total)
