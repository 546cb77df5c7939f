"""General Pair-based Weighting loss (Liu et al.), pair form (GPW Eq. 18) and triplet form (GPW Eq. 21)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss, batch_normaliser, distance_from_similarity, masked_softmax
from lightning_dml.losses.registry import register_loss
from lightning_dml.miners import (
    batch_hard_mining,
    multi_similarity_mining,
    threshold_mining,
    triplet_margin_mining,
    triplet_margin_pair_mining,
)

__all__ = ["GeneralPairWeightingLoss", "GPW_PRESETS"]

#: named configurations of GPW Section V (CUB/Cars values of Tables IV/V; SOP values go in the SOP configs)
GPW_PRESETS: dict[str, dict[str, object]] = {
    "pair_p": dict(form="pair", mining="threshold", weighting="power", m1=0.0, m2=0.8, p=0.0, q=1.0),
    "pair_e": dict(form="pair", mining="threshold", weighting="exp", m1=0.0, m2=0.8, alpha=0.0, beta=2.0),
    "triplet_p": dict(form="triplet", mining="margin", weighting="power", margin=0.1, p=5.0),
    "triplet_e": dict(form="triplet", mining="margin", weighting="exp", margin=0.1, alpha=40.0),
}
_FALLBACK = dict(m1=0.0, m2=0.8, margin=0.1, p=0.0, q=0.0, alpha=0.0, beta=0.0, eps=0.1, normalize=True)
_PAIR_MINING = ("threshold", "ms", "triplet_margin", "batch_hard")
_TRIPLET_MINING = ("margin", "batch_hard")
_WEIGHTING = ("constant", "power", "exp")


@register_loss("general_pair_weighting")
class GeneralPairWeightingLoss(PairLoss):
    r"""General Pair-based Weighting loss (GPW Algorithm 1).

    Distance: Euclidean ``D`` of L2-normalised embeddings (GPW Eq. 1). All weights are computed from ``sg(D)``
    (GPW footnote 6) and are therefore exactly the gradient ``dL/dD`` of the loss (GPW Eq. 4).

    * Pair form (Eq. 18): ``L_i = sum_{mined pos} w+ [D_ij - m1]_+ + sum_{mined neg} w- [m2 - D_ij]_+``.
      Mining (``mining``): ``"threshold"`` (Eqs. 16-17: ``D >= m1`` positives, ``D <= m2`` negatives),
      ``"ms"`` (Eqs. 22-23 with ``eps``, on top of the thresholds), ``"triplet_margin"`` (pairs taking part in a
      triplet kept by Eq. 19, on top of the thresholds), ``"batch_hard"`` (Eq. 20, on top of the thresholds).
      Weights (``weighting``): ``"constant"`` (Eqs. 24-25), ``"power"`` (Eqs. 26-27: ``(D - m1)^p``,
      ``(m2 - D)^q``), ``"exp"`` (Eqs. 29-30: ``exp(alpha (D - m1))``, ``exp(beta (m2 - D))``).
    * Triplet form (Eq. 21): ``L_i = sum_{mined (j,k)} w_ijk [D_ij - D_ik + m]_+`` over triplets kept by the
      triplet margin rule (Eq. 19, ``mining="margin"``) or the batch-hard triplet (``"batch_hard"``). Weights
      constant (Eq. 25), ``(D_ij - D_ik + m)^p`` (Eq. 28) or ``exp(alpha (D_ij - D_ik + m))`` (Eq. 31).
      Computed on ``[B, K_max, N]`` tensors, never ``B^3`` (SPEC 9.2).
    * ``normalize`` (Eqs. 32-34): per anchor, positive and negative (or triplet) weights are divided by their sum
      over the anchor's mined set (exponential weights through a stable softmax). Without it the loss is a sum.
    * Reduction (Algorithm 1): ``L = 1/B sum_i L_i`` over every anchor.

    Presets (``preset``, GPW Tables IV/V, CUB/Cars): ``pair_p`` (m1=0, m2=0.8, p=0, q=1), ``pair_e`` (m1=0,
    m2=0.8, alpha=0, beta=2), ``triplet_p`` (m=0.1, p=5), ``triplet_e`` (m=0.1, alpha=40); all normalised.
    Any explicitly given argument overrides the preset; ``preset="custom"`` starts from constant-weight
    threshold mining (m1=0, m2=0.8).

    Degenerate batches: an anchor without mined pairs (triplets) has ``L_i = 0`` and still counts in 1/B; weights
    that are all 0 (power weights at the boundary) give 0, never 0/0.
    """

    #: under DDP: anchors scored against the gathered batch, batch-wide reductions (losses.base)
    gather_mode = "references"
    label_sets_reason = (
        "label sets are not implemented for it yet (its definition only asks which pairs are positive, so it could "
        "take them: see docs/losses/README.md)"
    )

    def __init__(
        self,
        preset: str = "pair_e",
        form: str | None = None,
        mining: str | None = None,
        weighting: str | None = None,
        m1: float | None = None,
        m2: float | None = None,
        margin: float | None = None,
        p: float | None = None,
        q: float | None = None,
        alpha: float | None = None,
        beta: float | None = None,
        eps: float | None = None,
        normalize: bool | None = None,
    ) -> None:
        super().__init__()
        if preset == "custom":
            base: dict[str, object] = dict(form="pair", mining="threshold", weighting="constant")
        elif preset in GPW_PRESETS:
            base = dict(GPW_PRESETS[preset])
        else:
            raise ValueError(f"preset must be one of {sorted(GPW_PRESETS) + ['custom']}, got {preset!r}")
        given = dict(form=form, mining=mining, weighting=weighting, m1=m1, m2=m2, margin=margin, p=p, q=q,
                     alpha=alpha, beta=beta, eps=eps, normalize=normalize)
        cfg = {**_FALLBACK, **base, **{k: v for k, v in given.items() if v is not None}}
        self.preset = preset
        self.form, self.mining, self.weighting = str(cfg["form"]), str(cfg["mining"]), str(cfg["weighting"])
        self.m1, self.m2, self.margin = float(cfg["m1"]), float(cfg["m2"]), float(cfg["margin"])  # type: ignore
        self.p, self.q = float(cfg["p"]), float(cfg["q"])  # type: ignore[arg-type]
        self.alpha, self.beta, self.eps = float(cfg["alpha"]), float(cfg["beta"]), float(cfg["eps"])  # type: ignore
        self.normalize_weights = bool(cfg["normalize"])
        self._validate()

    def _validate(self) -> None:
        if self.form not in ("pair", "triplet"):
            raise ValueError(f"form must be 'pair' or 'triplet', got {self.form!r}")
        allowed = _PAIR_MINING if self.form == "pair" else _TRIPLET_MINING
        if self.mining not in allowed:
            raise ValueError(f"mining for the {self.form} form must be one of {allowed}, got {self.mining!r}")
        if self.weighting not in _WEIGHTING:
            raise ValueError(f"weighting must be one of {_WEIGHTING}, got {self.weighting!r}")
        if not 0 <= self.m1 <= self.m2:
            raise ValueError(f"need 0 <= m1 <= m2 (GPW Eqs. 16-17), got m1={self.m1}, m2={self.m2}")
        if self.margin < 0 or self.p < 0 or self.q < 0 or self.eps < 0:
            raise ValueError("margin, p, q and eps must be >= 0")

    def extra_repr(self) -> str:
        return (
            f"form={self.form!r}, mining={self.mining!r}, weighting={self.weighting!r}, m1={self.m1}, m2={self.m2}, "
            f"margin={self.margin}, p={self.p}, q={self.q}, alpha={self.alpha}, beta={self.beta}, eps={self.eps}, "
            f"normalize={self.normalize_weights}"
        )

    # ----------------------------------------------------------------------------------------------- pair form
    def _mine_pairs(self, dist: Tensor, pos: Tensor, neg: Tensor) -> tuple[Tensor, Tensor]:
        kp, kn = threshold_mining(dist, pos, neg, self.m1, self.m2)
        if self.mining == "ms":
            mp, mn = multi_similarity_mining(-dist, pos, neg, self.eps)
        elif self.mining == "triplet_margin":
            mp, mn = triplet_margin_pair_mining(dist, pos, neg, self.margin)
        elif self.mining == "batch_hard":
            mp, mn = batch_hard_mining(dist, pos, neg)
        else:
            return kp, kn
        return kp & mp, kn & mn

    def _weights(self, x: Tensor, mask: Tensor, power: float, scale: float, dim: int) -> Tensor:
        """Detached weights of the hinge arguments ``x`` (>= 0 on ``mask``), normalised along ``dim`` if asked."""
        x = x.detach()
        if self.weighting == "exp":
            if self.normalize_weights:
                return masked_softmax(scale * x, mask, dim=dim)
            return torch.where(mask, torch.exp(scale * x), 0.0)
        w = (x.clamp(min=0.0) ** power) * mask if self.weighting == "power" else mask.to(x.dtype)
        if self.normalize_weights:
            w = w / w.sum(dim=dim, keepdim=True).clamp(min=torch.finfo(w.dtype).tiny)
        return w

    def _pair_form(self, dist: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        kp, kn = self._mine_pairs(dist.detach(), pos, neg)
        xp, xn = dist - self.m1, self.m2 - dist
        wp = self._weights(xp, kp, self.p, self.alpha, dim=1)
        wn = self._weights(xn, kn, self.q, self.beta, dim=1)
        per_anchor = (wp * torch.relu(xp)).sum(1) + (wn * torch.relu(xn)).sum(1)
        return per_anchor.sum() / batch_normaliser(dist.shape[0], dist)

    # -------------------------------------------------------------------------------------------- triplet form
    def _triplet_form(self, dist: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        B = dist.shape[0]
        if self.mining == "batch_hard":
            hp, hn = batch_hard_mining(dist.detach(), pos, neg)
            t = (dist * hp).sum(1) - (dist * hn).sum(1) + self.margin
            kept = hp.any(1) & hn.any(1) & (t.detach() >= 0)
            w = self._weights(t[:, None], kept[:, None], self.p, self.alpha, dim=1)[:, 0]
            return (w * torch.relu(t)).sum() / batch_normaliser(B, dist)
        index, _, kept = triplet_margin_mining(dist.detach(), pos, neg, self.margin)
        t = dist.gather(1, index)[:, :, None] - dist[:, None, :] + self.margin  # [B, K, N]
        flat_t, flat_kept = t.reshape(B, -1), kept.reshape(B, -1)
        w = self._weights(flat_t, flat_kept, self.p, self.alpha, dim=1)
        return (w * torch.relu(flat_t)).sum() / batch_normaliser(B, dist)

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        dist = distance_from_similarity(sim)
        if self.form == "pair":
            return self._pair_form(dist, pos, neg)
        return self._triplet_form(dist, pos, neg)
