"""Slow loop references of the proxy and classification losses, written from the papers' equations (float64).

Each function takes raw embeddings ``z [B, D]``, integer labels ``y [B]`` and the raw proxies (``[C, D]``, or
``[C * K, D]`` with class ``c``'s rows ``c K .. c K + K - 1``) and returns a 0-dim float64 tensor differentiable
w.r.t. ``z`` and the proxies. Every sum of the equations is a Python loop; nothing is shared with the library.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _unit_rows(z: Tensor) -> list[Tensor]:
    z = z.double()
    return [z[i] / z[i].norm() for i in range(z.shape[0])]


def _cos(a: Tensor, b: Tensor) -> Tensor:
    return torch.dot(a, b)


def _softmax_ce(logits: list[Tensor], target: int) -> Tensor:
    """``-log(exp(l_t) / sum_j exp(l_j))``, written out (stable: the largest logit is subtracted)."""
    top = max(v.detach().item() for v in logits)
    total = sum(torch.exp(v - top) for v in logits)
    return -(logits[target] - top - torch.log(total))


def proxy_anchor(z, y, proxies, alpha=32.0, delta=0.1) -> Tensor:
    """Proxy-Anchor, Kim et al. CVPR 2020 Eq. 4."""
    x, p = _unit_rows(z), _unit_rows(proxies)
    labels = [int(v) for v in y]
    pos_sum = torch.zeros((), dtype=torch.float64)
    neg_sum = torch.zeros((), dtype=torch.float64)
    with_pos = 0
    for c in range(len(p)):
        pos = [x[i] for i in range(len(x)) if labels[i] == c]
        neg = [x[i] for i in range(len(x)) if labels[i] != c]
        if pos:
            with_pos += 1
            pos_sum = pos_sum + torch.log(1 + sum(torch.exp(-alpha * (_cos(e, p[c]) - delta)) for e in pos))
        if neg:
            neg_sum = neg_sum + torch.log(1 + sum(torch.exp(alpha * (_cos(e, p[c]) + delta)) for e in neg))
    return pos_sum / with_pos + neg_sum / len(p)


def normalized_softmax(z, y, proxies, temperature=0.05) -> Tensor:
    """NormSoftmax, Zhai & Wu BMVC 2019: cross-entropy of cosines / T."""
    x, p = _unit_rows(z), _unit_rows(proxies)
    terms = [_softmax_ce([_cos(x[i], w) / temperature for w in p], int(y[i])) for i in range(len(x))]
    return sum(terms) / len(terms)


def proxy_nca(z, y, proxies, temperature=1.0, exclude_positive=True) -> Tensor:
    """ProxyNCA (Movshovitz-Attias et al. ICCV 2017; denominator over negative proxies) and ProxyNCA++ (Teh et
    al. ECCV 2020; temperature, denominator over all proxies)."""
    x, p = _unit_rows(z), _unit_rows(proxies)
    out = []
    for i in range(len(x)):
        t = int(y[i])
        d = [torch.sum((x[i] - w) ** 2) for w in p]
        num = torch.exp(-d[t] / temperature)
        den = sum(torch.exp(-d[c] / temperature) for c in range(len(p)) if not (exclude_positive and c == t))
        out.append(-torch.log(num / den))
    return sum(out) / len(out)


def cosface(z, y, proxies, scale=64.0, margin=0.35) -> Tensor:
    """LMCL, Wang et al. CVPR 2018 Eq. 4."""
    x, p = _unit_rows(z), _unit_rows(proxies)
    out = []
    for i in range(len(x)):
        t = int(y[i])
        logits = [scale * (_cos(x[i], p[c]) - (margin if c == t else 0.0)) for c in range(len(p))]
        out.append(_softmax_ce(logits, t))
    return sum(out) / len(out)


def _arc_target(cos: Tensor, margin: float) -> Tensor:
    """``cos(theta + m)`` (ArcFace Eq. 3) for ``theta <= pi - m``; the official code's ``cos - m sin m`` beyond."""
    theta = torch.acos(cos)
    if theta.detach().item() <= math.pi - margin:
        return torch.cos(theta + margin)
    return cos - margin * math.sin(margin)


def arcface(z, y, proxies, scale=64.0, margin=0.5, sub_centers=1) -> Tensor:
    """ArcFace, Deng et al. CVPR 2019 Eq. 3; with ``sub_centers > 1`` sub-center ArcFace (ECCV 2020): the angle
    to a class is the angle to its nearest sub-centre."""
    x, p = _unit_rows(z), _unit_rows(proxies)
    num_classes = len(p) // sub_centers
    out = []
    for i in range(len(x)):
        t = int(y[i])
        cos = [max((_cos(x[i], p[c * sub_centers + k]) for k in range(sub_centers)), key=lambda v: v.detach().item())
               for c in range(num_classes)]
        logits = [scale * (_arc_target(cos[c], margin) if c == t else cos[c]) for c in range(num_classes)]
        out.append(_softmax_ce(logits, t))
    return sum(out) / len(out)


def soft_triple(z, y, proxies, centers_per_class=10, la=20.0, gamma=0.1, tau=0.2, margin=0.01) -> Tensor:
    """SoftTriple, Qian et al. ICCV 2019: relaxed similarity, margin softmax, centre regulariser."""
    x, w = _unit_rows(z), _unit_rows(proxies)
    K = centers_per_class
    C = len(w) // K
    out = []
    for i in range(len(x)):
        t = int(y[i])
        relaxed = []
        for c in range(C):
            s = [_cos(x[i], w[c * K + k]) for k in range(K)]
            weights = [torch.exp(v / gamma) for v in s]
            relaxed.append(sum(a * b for a, b in zip(weights, s)) / sum(weights))
        logits = [la * (relaxed[c] - (margin if c == t else 0.0)) for c in range(C)]
        out.append(_softmax_ce(logits, t))
    loss = sum(out) / len(out)
    if tau > 0 and K > 1:
        reg = sum(
            torch.norm(w[c * K + t] - w[c * K + s]) for c in range(C) for t in range(K) for s in range(t + 1, K)
        )
        loss = loss + tau * reg / (C * K * (K - 1))
    return loss
