"""Slow loop references written from the papers, for the part-3b losses (issue 29): plain Python loops over anchors
and pairs in float64, differentiable by autograd. A pair ``(i, j)``, ``j != i``, is positive when the labels agree
or, for label sets (``[B, L]`` padded with -1), when the sets intersect."""

from __future__ import annotations

import torch
from torch import Tensor


def _unit(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def _same(labels: Tensor, gallery_labels: Tensor, i: int, j: int) -> bool:
    if labels.ndim == 1:
        return bool(labels[i] == gallery_labels[j])
    a = {int(v) for v in labels[i] if v >= 0}
    b = {int(v) for v in gallery_labels[j] if v >= 0}
    return bool(a & b)


def _gallery(z: Tensor, y: Tensor, ref: Tensor | None, ref_y: Tensor | None) -> tuple[Tensor, Tensor]:
    if ref is None:
        return z, y
    if y.ndim == 2 or ref_y.ndim == 2:
        y2 = y if y.ndim == 2 else y[:, None]
        r2 = ref_y if ref_y.ndim == 2 else ref_y[:, None]
        width = max(y2.shape[1], r2.shape[1])
        pad = lambda t: torch.cat([t, t.new_full((t.shape[0], width - t.shape[1]), -1)], dim=1)  # noqa: E731
        return torch.cat([z, ref]), torch.cat([pad(y2), pad(r2)])
    return torch.cat([z, ref]), torch.cat([y, ref_y])


def p2sgrad(z: Tensor, proxies: Tensor, y: Tensor) -> Tensor:
    """P2SGrad (Zhang et al., CVPR 2019, Eq. 11 as a squared error, mean over the B x C entries)."""
    x, w = _unit(z), _unit(proxies)
    total = z.new_zeros(())
    for i in range(z.shape[0]):
        for j in range(w.shape[0]):
            cos = torch.clamp(x[i] @ w[j], -1.0, 1.0)
            total = total + (cos - (1.0 if j == int(y[i]) else 0.0)) ** 2
    return total / (z.shape[0] * w.shape[0])


def pnp(z: Tensor, y: Tensor, variant: str = "Dq", anneal: float = 0.01, alpha: float = 1.0, b: float = 2.0,
        ref: Tensor | None = None, ref_y: Tensor | None = None) -> Tensor:
    """PNP (Li et al., AAAI 2022): for every anchor with a positive, the mean over its positives and itself of
    f(sum over its negatives of sigmoid((s_qn - s_qp) / tau)); the mean over those anchors."""
    g, gy = _gallery(z, y, ref, ref_y)
    x, xg = _unit(z), _unit(g)
    f = {
        "O": lambda r: r,
        "Ds": lambda r: torch.log(1 + r),
        "Dq": lambda r: 1 - 1 / (1 + r) ** alpha,
        "Iu": lambda r: (1 + r) * torch.log(1 + r),
        "Ib": lambda r: (b * r - torch.log(1 + b * r)) / b**2,
    }[variant]
    terms = []
    for q in range(z.shape[0]):
        positives = [j for j in range(g.shape[0]) if j != q and _same(y, gy, q, j)]
        negatives = [j for j in range(g.shape[0]) if j != q and not _same(y, gy, q, j)]
        if not positives:
            continue
        per = []
        for p in positives + [q]:
            s_qp = x[q] @ xg[p]
            rank = sum((torch.sigmoid((x[q] @ xg[n] - s_qp) / anneal) for n in negatives), z.new_zeros(()))
            per.append(f(rank))
        terms.append(sum(per) / len(per))
    return sum(terms) / len(terms) if terms else z.new_zeros(())


def snr_contrastive(z: Tensor, y: Tensor, pos_margin: float = 0.0, neg_margin: float = 1.0,
                    ref: Tensor | None = None, ref_y: Tensor | None = None) -> Tensor:
    """Contrastive loss on d(a, b) = var(b - a) / var(a) (Yuan et al., CVPR 2019, Eq. 6), mean over non-zero terms
    of each pair set (ordered pairs)."""
    g, gy = _gallery(z, y, ref, ref_y)
    x, xg = _unit(z), _unit(g)
    pos, neg = [], []
    for i in range(z.shape[0]):
        for j in range(g.shape[0]):
            if j == i:
                continue
            d = torch.var(xg[j] - x[i]) / torch.var(x[i])
            if _same(y, gy, i, j):
                pos.append(torch.relu(d - pos_margin))
            else:
                neg.append(torch.relu(neg_margin - d))
    out = z.new_zeros(())
    for terms in (pos, neg):
        nonzero = [t for t in terms if float(t.detach()) > 0]
        if nonzero:
            out = out + sum(nonzero) / len(nonzero)
    return out


def tcm(z: Tensor, y: Tensor, lambda_plus=1.0, lambda_minus=1.0, margin_plus=0.9, margin_minus=0.5,
        ref: Tensor | None = None, ref_y: Tensor | None = None) -> Tensor:
    """TCM (Zhang et al., arXiv 2307.04047): mean hinge over the positives below m+ and the negatives above m-."""
    g, gy = _gallery(z, y, ref, ref_y)
    x, xg = _unit(z), _unit(g)
    pos, neg = [], []
    for i in range(z.shape[0]):
        for j in range(g.shape[0]):
            if j == i:
                continue
            s = x[i] @ xg[j]
            if _same(y, gy, i, j):
                if float(s.detach()) <= margin_plus:
                    pos.append(margin_plus - s)
            elif float(s.detach()) >= margin_minus:
                neg.append(s - margin_minus)
    out = z.new_zeros(())
    if pos:
        out = out + lambda_plus * sum(pos) / len(pos)
    if neg:
        out = out + lambda_minus * sum(neg) / len(neg)
    return out




def _jaccard(y: Tensor, gy: Tensor, i: int, j: int) -> float:
    a = {int(v) for v in (y[i] if y.ndim == 2 else y[i:i + 1]) if v >= 0}
    b = {int(v) for v in (gy[j] if gy.ndim == 2 else gy[j:j + 1]) if v >= 0}
    return len(a & b) / len(a | b) if a | b else 0.0


def multi_supcon(z: Tensor, y: Tensor, temperature: float = 0.1, threshold: float = 0.3,
                 ref: Tensor | None = None, ref_y: Tensor | None = None) -> Tensor:
    """SupCon L_out (Khosla et al. Eq. 2) with positives J(Y_i, Y_j) > threshold; mean over anchors with one."""
    g, gy = _gallery(z, y, ref, ref_y)
    x, xg = _unit(z), _unit(g)
    terms = []
    for i in range(z.shape[0]):
        others = [j for j in range(g.shape[0]) if j != i]
        positives = [j for j in others if _jaccard(y, gy, i, j) > threshold]
        if not positives:
            continue
        log_den = torch.logsumexp(torch.stack([x[i] @ xg[j] / temperature for j in others]), dim=0)
        terms.append(sum(log_den - x[i] @ xg[p] / temperature for p in positives) / len(positives))
    return sum(terms) / len(terms) if terms else z.new_zeros(())


def decoupled_contrastive(z: Tensor, y: Tensor, temperature: float = 0.1,
                          ref: Tensor | None = None, ref_y: Tensor | None = None) -> Tensor:
    """DCL (Yeh et al., ECCV 2022): -s_ip / tau + log sum_n exp(s_in / tau) over the positive pairs whose anchor has
    a negative; their mean."""
    g, gy = _gallery(z, y, ref, ref_y)
    x, xg = _unit(z), _unit(g)
    terms = []
    for i in range(z.shape[0]):
        others = [j for j in range(g.shape[0]) if j != i]
        negatives = [j for j in others if not _same(y, gy, i, j)]
        if not negatives:
            continue
        log_den = torch.logsumexp(torch.stack([x[i] @ xg[n] / temperature for n in negatives]), dim=0)
        terms += [log_den - x[i] @ xg[p] / temperature for p in others if _same(y, gy, i, p)]
    return sum(terms) / len(terms) if terms else z.new_zeros(())


def selectively_contrastive_triplet(z: Tensor, y: Tensor, temperature: float = 0.1, penalty: float = 1.0,
                                    positive: str = "easiest", ref: Tensor | None = None,
                                    ref_y: Tensor | None = None) -> Tensor:
    """SCT (Xuan et al., ECCV 2020): per anchor its easiest (or hardest) positive and hardest negative (the first in
    index order on ties); lambda S_an if S_an > S_ap, else -log softmax of (S_ap, S_an) / tau at S_ap; the mean."""
    g, gy = _gallery(z, y, ref, ref_y)
    x, xg = _unit(z), _unit(g)
    terms = []
    for i in range(z.shape[0]):
        others = [j for j in range(g.shape[0]) if j != i]
        positives = [j for j in others if _same(y, gy, i, j)]
        negatives = [j for j in others if not _same(y, gy, i, j)]
        if not positives or not negatives:
            continue
        s = {j: x[i] @ xg[j] for j in others}
        key = (lambda j: -float(s[j].detach())) if positive == "easiest" else (lambda j: float(s[j].detach()))
        p = min(positives, key=key)  # min keeps the first of equal keys
        n = min(negatives, key=lambda j: -float(s[j].detach()))
        if float(s[n].detach()) > float(s[p].detach()):
            terms.append(penalty * s[n])
        else:
            terms.append(-torch.log_softmax(torch.stack([s[p], s[n]]) / temperature, dim=0)[0])
    return sum(terms) / len(terms) if terms else z.new_zeros(())
