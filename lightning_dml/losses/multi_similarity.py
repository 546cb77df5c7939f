"""Multi-Similarity loss (Wang et al., CVPR 2019) and its ablation variants."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import ClosedFormPairFunction, PairLoss, batch_normaliser, lse0, masked_lse
from lightning_dml.losses.base import masked_mean
from lightning_dml.losses.registry import register_loss
from lightning_dml.miners import is_label_sets, label_masks, multi_similarity_mining

__all__ = ["MultiSimilarityLoss"]

_ON_EMPTY = ("keep", "skip")


@register_loss("multi_similarity")
class MultiSimilarityLoss(PairLoss):
    r"""Multi-Similarity loss, MS paper Eq. 15 with the Similarity-P mining of Eqs. 11-12.

    Similarity: cosine ``S_ij = f_i . f_j`` of L2-normalised embeddings.

    .. math::
        L = \frac{1}{B}\sum_i \Big\{\frac{1}{\alpha}\log\big[1+\sum_{k\in P_i} e^{-\alpha(S_{ik}-\lambda)}\big]
            + \frac{1}{\beta}\log\big[1+\sum_{k\in N_i} e^{\beta(S_{ik}-\lambda)}\big]\Big\}

    with ``P_i``/``N_i`` the mined positives/negatives of anchor ``i`` (MS Eqs. 11-12: a negative is kept if
    ``S_ij > min_Pos S - eps``, a positive if ``S_ij < max_Neg S + eps``). Its gradient w.r.t. ``S_ij`` is
    ``-w+_ij / B`` for mined positives and ``w-_ij / B`` for mined negatives, the pair weights of MS Eqs. 13-14.

    Args:
        alpha: positive scale (paper 2).
        beta: negative scale (paper 50).
        lam: similarity margin lambda (0.5: the authors' code and pytorch-metric-learning; the paper text says 1).
        eps: mining margin epsilon (paper 0.1).
        mining: apply the MS mining (False = "MS weighting" ablation of Table 2: all pairs).
        weighting: apply the MS weighting (False = "MS mining" ablation: the mined pairs with equal weights, loss
            ``mean_{N_i} S - mean_{P_i} S`` per anchor, averaged over the batch; SPEC 3.4).
        plus_one: keep the "+1" inside the logs. ``False`` is the GPW paper's "MS loss (v2)" without +1
            (``(1/alpha) log sum_{P_i} exp(...)``; an empty set contributes 0).
        on_empty: ``"keep"`` (formula-faithful) keeps the non-empty term of an anchor whose other mined set is
            empty; ``"skip"`` (the released code's rule) drops the whole anchor if either mined set is empty.
            Skipped anchors still count in the 1/B divisor.
        anchor_chunk_size: score the anchors this many at a time, each block's ``B x N`` matrices recomputed in
            the backward (memory ``O(chunk x N)``, same value and gradients; :mod:`lightning_dml.losses.chunking`).

    Degenerate batches: an anchor with no mined pair (one class, one-sample class, easy batch) contributes 0;
    the loss of a batch with no mined pair at all is exactly 0 with zero gradient.
    """

    #: under DDP: anchors scored against the gathered batch, batch-wide reductions (losses.base)
    gather_mode = "references"
    #: anchor_chunk_size: a sum of per-anchor terms over batch-wide counts (losses.chunking)
    supports_anchor_chunks = True
    #: label sets ([B, L], positive = the sets intersect): the loss only asks which pairs are positive
    supports_label_sets = True
    #: indices_tuple (a miner's output, lightning_dml.miners.indices): the tuple's pairs as masks (pml's MultiSimilarityLoss); mining=True mines within them
    supports_indices_tuple = True

    def __init__(
        self,
        alpha: float = 2.0,
        beta: float = 50.0,
        lam: float = 0.5,
        eps: float = 0.1,
        mining: bool = True,
        weighting: bool = True,
        plus_one: bool = True,
        on_empty: str = "keep",
        anchor_chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        if not alpha > 0 or not beta > 0:
            raise ValueError(f"alpha and beta must be > 0, got alpha={alpha}, beta={beta}")
        if eps < 0:
            raise ValueError(f"eps must be >= 0, got {eps}")
        if on_empty not in _ON_EMPTY:
            raise ValueError(f"on_empty must be one of {_ON_EMPTY}, got {on_empty!r}")
        self.alpha, self.beta, self.lam, self.eps = float(alpha), float(beta), float(lam), float(eps)
        self.mining, self.weighting, self.plus_one, self.on_empty = mining, weighting, plus_one, on_empty
        self.set_anchor_chunk_size(anchor_chunk_size)

    def extra_repr(self) -> str:
        return (
            f"alpha={self.alpha}, beta={self.beta}, lam={self.lam}, eps={self.eps}, mining={self.mining}, "
            f"weighting={self.weighting}, plus_one={self.plus_one}, on_empty={self.on_empty!r}"
        )

    def mine(self, sim: Tensor, pos: Tensor, neg: Tensor) -> tuple[Tensor, Tensor]:
        """Mined positive and negative masks (MS Eqs. 11-12, or all pairs without mining)."""
        if self.mining:
            return multi_similarity_mining(sim, pos, neg, self.eps)
        return pos, neg

    def _anchor_weight(self, kp: Tensor, kn: Tensor, dtype: torch.dtype) -> Tensor:
        if self.on_empty == "skip":
            return (kp.any(dim=1) & kn.any(dim=1)).to(dtype)
        return torch.ones(kp.shape[0], device=kp.device, dtype=dtype)

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        kp, kn = self.mine(sim, pos, neg)
        keep = self._anchor_weight(kp, kn, sim.dtype)
        if not self.weighting:
            per_anchor = masked_mean(sim, kn) - masked_mean(sim, kp)
        elif self.plus_one:
            per_anchor = lse0(-self.alpha * (sim - self.lam), kp) / self.alpha + lse0(
                self.beta * (sim - self.lam), kn
            ) / self.beta
        else:
            lp = masked_lse(-self.alpha * (sim - self.lam), kp) / self.alpha
            ln = masked_lse(self.beta * (sim - self.lam), kn) / self.beta
            per_anchor = torch.where(kp.any(1), lp, 0.0) + torch.where(kn.any(1), ln, 0.0)
        return (per_anchor * keep).sum() / batch_normaliser(sim.shape[0], sim)

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        """Closed form on float 0/1 masks (same formulas as :meth:`pair_loss_and_grad`, fewer slow bool kernels)."""
        if not (self.closed_form and self.weighting):
            return super().compute(anchors, labels, gallery, gallery_labels)

        def fn(raw: Tensor) -> tuple[Tensor, Tensor]:
            sim = raw.clamp(-1.0, 1.0)
            posf, negf = _float_label_masks(labels, gallery_labels, sim.dtype)
            has_pos, has_neg = posf.amax(1) > 0, negf.amax(1) > 0
            # hardest positive / negative (MS Eqs. 11-12), read back from S at their index: exact values
            hard_pos = sim.gather(1, torch.sub(sim, posf, alpha=4.0).argmin(1, keepdim=True)).squeeze(1)
            hard_neg = sim.gather(1, torch.add(sim, negf, alpha=4.0).argmax(1, keepdim=True)).squeeze(1)
            hard_pos = torch.where(has_pos, hard_pos, torch.inf)
            hard_neg = torch.where(has_neg, hard_neg, -torch.inf)
            if self.mining:
                kn = negf.mul_(_step(sim - (hard_pos - self.eps)[:, None]))
                kp = posf.mul_(_step((hard_neg + self.eps)[:, None] - sim))
            else:
                kn, kp = negf, posf
            # the largest kept value of each set is its hardest pair whenever the set is not empty
            wn, ln = self._lse_weights(sim, kn, self.beta, hard_neg, sign=1.0)
            wp, lp = self._lse_weights(sim, kp, self.alpha, hard_pos, sign=-1.0)
            keep = torch.ones_like(ln) if self.on_empty == "keep" else kp.amax(1) * kn.amax(1)
            keep = keep / batch_normaliser(sim.shape[0], sim)
            loss = ((lp / self.alpha + ln / self.beta) * keep).sum()
            return loss, wn.sub_(wp).mul_(keep[:, None])

        return ClosedFormPairFunction.apply(anchors, gallery, fn)

    def _lse_weights(self, sim: Tensor, kept: Tensor, scale: float, hardest: Tensor, sign: float) -> tuple[Tensor, Tensor]:
        """``log([1 +] sum_kept exp(sign*scale*(S - lam)))`` per row and its softmax weights (float masks)."""
        shift = sign * scale * (hardest - self.lam)
        nonempty = kept.amax(1) > 0
        shift = torch.where(nonempty & torch.isfinite(shift), shift, 0.0)
        if self.plus_one:
            shift = shift.clamp(min=0.0)
        # exponents below -87 would give fp32 denormals (slow): raise them to -87; their terms are < 2e-38. A kept
        # entry's exponent is <= 0 (the shift is its set's hardest), but the entries the mask drops next (the
        # self-pair, the other set) can exceed it by up to 2 * scale: capped at 80, their exp stays finite and the
        # mask gives 0 (not 0 * inf = NaN, which scales above ~170 gave)
        e = torch.mul(sim, sign * scale).sub_((sign * scale * self.lam + shift)[:, None]).clamp_(-87.0, 80.0).exp_()
        e.mul_(kept)
        total = e.sum(1)
        if self.plus_one:
            total = total + torch.exp(-shift)
            lse = shift + torch.log(total)
        else:
            lse = torch.where(nonempty, shift + torch.log(total.clamp(min=torch.finfo(sim.dtype).tiny)), 0.0)
        return e.div_(total.clamp(min=torch.finfo(sim.dtype).tiny)[:, None]), lse

    def pair_loss_and_grad(self, sim: Tensor, pos: Tensor, neg: Tensor) -> tuple[Tensor, Tensor]:
        kp, kn = self.mine(sim, pos, neg)
        keep = self._anchor_weight(kp, kn, sim.dtype)[:, None] / batch_normaliser(sim.shape[0], sim)
        if not self.weighting:
            np_, nn_ = kp.sum(1, keepdim=True).clamp(min=1), kn.sum(1, keepdim=True).clamp(min=1)
            w = kn.to(sim.dtype) / nn_ - kp.to(sim.dtype) / np_
            loss = ((w * sim).sum(1, keepdim=True) * keep).sum()
            return loss, w * keep
        ninf = float("-inf")
        xp = torch.where(kp, sim, torch.inf).mul_(-self.alpha).add_(self.alpha * self.lam)  # -a(S-l), -inf masked
        xn = torch.where(kn, sim, ninf).mul_(self.beta).sub_(self.beta * self.lam)  # b(S-l), -inf masked
        lp, wp = _lse_and_softmax(xp, self.plus_one)
        ln, wn = _lse_and_softmax(xn, self.plus_one)
        loss = ((lp / self.alpha + ln / self.beta)[:, None] * keep).sum()
        grad = (wn - wp).mul_(keep)
        return loss, grad


def _lse_and_softmax(x: Tensor, plus_one: bool) -> tuple[Tensor, Tensor]:
    """Row-wise ``log([1 +] sum exp x)`` and its gradient (softmax with an optional virtual zero logit).

    Entries equal to ``-inf`` are masked; an all-masked row gives 0 and zero weights. Exponents are raised to
    -87 before ``exp`` and ``exp(-87)`` is subtracted afterwards (clamped at 0): terms below ~2e-38 next to a row
    maximum of 1 - fp32 denormals, which are very slow on CPUs - become 0, and masked entries give exactly 0.
    """
    shift = x.amax(dim=1, keepdim=True)
    shift = torch.where(torch.isfinite(shift), shift, 0.0)
    if plus_one:
        shift = shift.clamp(min=0.0)
    floor = torch.exp(torch.tensor(-87.0, dtype=x.dtype)).item()
    e = torch.exp((x - shift).clamp_(min=-87.0)).sub_(floor).clamp_(min=0.0)
    total = e.sum(dim=1, keepdim=True)
    if plus_one:
        total = total + torch.exp(-shift)
        lse = shift + torch.log(total)
    else:
        lse = torch.where(total > 0, shift + torch.log(total.clamp(min=torch.finfo(x.dtype).tiny)), 0.0)
    weights = e.div_(total.clamp(min=torch.finfo(x.dtype).tiny))
    return lse.squeeze(1), weights


def _step(x: Tensor) -> Tensor:
    """1.0 where ``x > 0`` else 0.0, with float arithmetic only (CPU bool<->float kernels are slow)."""
    return torch.sign(x).clamp_(min=0.0)


def _float_label_masks(labels: Tensor, gallery_labels: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """``(pos, neg)`` as 0/1 float matrices (self-pairs removed by index); labels are first renumbered 0..C-1
    so that they are exact in floating point. Label sets: :func:`~lightning_dml.miners.label_masks` as floats."""
    if is_label_sets(labels) or is_label_sets(gallery_labels):
        pos, neg = label_masks(labels, gallery_labels)
        return pos.to(dtype), neg.to(dtype)
    B = labels.shape[0]
    ids = torch.unique(torch.cat([labels, gallery_labels]), return_inverse=True)[1].to(dtype)
    neg = (ids[:B, None] - ids[None, B:]).abs_().clamp_(max=1.0)
    pos = torch.sub(1.0, neg)
    pos[:, :B].diagonal().zero_()
    return pos, neg
