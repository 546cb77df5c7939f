"""Angular mining (Wang et al., "Deep Metric Learning with Angular Loss", ICCV 2017, Eq. 5; pml's ``AngularMiner``):
the triplets whose angle at the negative exceeds a threshold."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_dml.miners.base import Miner, MiningBatch, triplets_from_keep
from lightning_dml.miners.pairs import positive_index

__all__ = ["AngularMiner"]

#: the ``eps`` of ``torch.nn.functional.pairwise_distance``, with which pml measures the distances
_PAIRWISE_EPS = 1e-6


class AngularMiner(Miner):
    r"""Triplets ``(a, p, n)`` with :math:`\arctan(D_{ap} / (2 D_{nc})) > \alpha`, ``c = (x_a + x_p) / 2`` the
    centre of the anchor-positive pair (Angular-loss paper Eq. 5), ``angle`` = :math:`\alpha` in degrees.

    On unit vectors ``D_nc^2 = 1 + (1 + S_ap) / 2 - S_an - S_pn``, so the angles come from ``S`` on ``[B, K, N]``
    tensors; the distances include ``torch.nn.functional.pairwise_distance``'s ``eps = 1e-6`` as pml's (so that exact
    duplicates give pml's angles, e.g. ``atan(1/2)`` for three identical vectors). The embeddings are L2-normalised
    first (pml 2.9's AngularMiner computes the angle on the raw embeddings although its distance normalises: the
    two agree on unit-norm embeddings). ``D_nc = 0`` gives ``atan2(D_ap, 0)`` = 90 degrees, as pml's ``atan(inf)``.
    """

    output = "triplets"

    def __init__(self, angle: float = 20.0) -> None:
        super().__init__()
        if not 0.0 <= float(angle) <= 90.0:
            raise ValueError(f"angle must be in [0, 90] degrees, got {angle}")
        self.angle = float(angle)

    def extra_repr(self) -> str:
        return f"angle={self.angle}"

    def mine(self, b: MiningBatch) -> tuple[Tensor, ...]:
        index, valid = positive_index(b.pos)
        s_ap = b.sim.gather(1, index)  # [B, K]
        s_gg = b.sim if b.gallery.shape[0] == b.anchors.shape[0] else (b.gallery @ b.gallery.T).clamp(-1.0, 1.0)
        s_pn = s_gg[index]  # [B, K, N]: similarity of each positive to every gallery item
        # squared distances with torch's pairwise_distance eps (||x - y + eps||, as pml measures them):
        # ||x - y + eps 1||^2 = ||x - y||^2 + 2 eps (sum x - sum y) + dim eps^2 (exact duplicates stay apart)
        dim, eps = b.anchors.shape[1], _PAIRWISE_EPS
        sums = b.gallery.sum(dim=1)
        sum_a, sum_p = sums[: b.anchors.shape[0], None], sums[index]
        d_ap2 = (2.0 - 2.0 * s_ap).clamp(min=0.0) + 2.0 * eps * (sum_a - sum_p) + dim * eps * eps
        nc2 = (1.0 + (1.0 + s_ap[:, :, None]) / 2.0 - b.sim[:, None, :] - s_pn).clamp(min=0.0)
        nc2 = nc2 + 2.0 * eps * (sums[None, None, :] - ((sum_a + sum_p) / 2.0)[:, :, None]) + dim * eps * eps
        d_ap, nc = torch.sqrt(d_ap2.clamp(min=0.0)), torch.sqrt(nc2.clamp(min=0.0))
        angles = torch.atan2(d_ap[:, :, None].expand_as(nc), 2.0 * nc)
        keep = (angles > math.radians(self.angle)) & valid[:, :, None] & b.neg[:, None, :]
        return triplets_from_keep(index, keep)
