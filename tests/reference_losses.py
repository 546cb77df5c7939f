"""Slow loop references of the pair losses, written directly from the papers' equations (float64).

Each function takes raw embeddings ``z [B, D]`` and integer labels ``y [B]`` (lists are fine) and returns a 0-dim
float64 tensor that is differentiable w.r.t. ``z``. No vectorisation, no shared code with the library: every sum
of the equations is a Python loop. Optional ``ref`` / ``ref_labels`` append gallery items (anchors = batch only).
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
from torch import Tensor


def _unit(z: Tensor) -> List[Tensor]:
    z = z.double()
    return [z[i] / z[i].norm().clamp(min=1e-12) for i in range(z.shape[0])]


def _gallery(z, y, ref, ref_labels, normalize=True):
    f = _unit(z) if normalize else [z.double()[i] for i in range(z.shape[0])]
    labels = [int(v) for v in y]
    if ref is not None:
        f = f + (_unit(ref) if normalize else [ref.double()[i] for i in range(ref.shape[0])])
        labels = labels + [int(v) for v in ref_labels]
    return f, labels


def _cos(a: Tensor, b: Tensor) -> Tensor:
    return torch.clamp(torch.dot(a, b), -1.0, 1.0)


def _dist(a: Tensor, b: Tensor) -> Tensor:
    # sqrt(2 - 2 cos) with the SPEC 0.3 floor
    return torch.sqrt(torch.clamp(2.0 - 2.0 * _cos(a, b), min=1e-12))


def _log1p_sum_exp(terms: Sequence[Tensor]) -> Tensor:
    """log(1 + sum exp(t)) written as log(exp(0) + sum exp(t)) with a max shift for stability."""
    if len(terms) == 0:
        return torch.zeros((), dtype=torch.float64)
    t = torch.stack(list(terms))
    m = torch.clamp(t.max().detach(), min=0.0)
    return m + torch.log(torch.exp(-m) + torch.exp(t - m).sum())


def _log_sum_exp(terms: Sequence[Tensor]) -> Tensor:
    t = torch.stack(list(terms))
    m = t.max().detach()
    return m + torch.log(torch.exp(t - m).sum())


def multi_similarity(z, y, alpha=2.0, beta=50.0, lam=0.5, eps=0.1, mining=True, weighting=True, plus_one=True,
                     on_empty="keep", ref=None, ref_labels=None) -> Tensor:
    """MS paper Eq. 15 with the mining of Eqs. 11-12 (ablations per SPEC 3.4, GPW 'without +1')."""
    f, labels = _gallery(z, y, ref, ref_labels)
    B, N = z.shape[0], len(f)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(B):
        P = [j for j in range(N) if j != i and labels[j] == labels[i]]
        Ng = [j for j in range(N) if labels[j] != labels[i]]
        S = {j: _cos(f[i], f[j]) for j in range(N)}
        Sd = {j: float(S[j].detach()) for j in range(N)}
        if mining:
            min_pos = min([Sd[j] for j in P], default=math.inf)
            max_neg = max([Sd[j] for j in Ng], default=-math.inf)
            Pi = [j for j in P if Sd[j] < max_neg + eps]
            Ni = [j for j in Ng if Sd[j] > min_pos - eps]
        else:
            Pi, Ni = P, Ng
        if on_empty == "skip" and (len(Pi) == 0 or len(Ni) == 0):
            continue
        if not weighting:
            term = torch.zeros((), dtype=torch.float64)
            if Ni:
                term = term + sum(S[j] for j in Ni) / len(Ni)
            if Pi:
                term = term - sum(S[j] for j in Pi) / len(Pi)
            total = total + term
            continue
        pos_terms = [-alpha * (S[k] - lam) for k in Pi]
        neg_terms = [beta * (S[k] - lam) for k in Ni]
        if plus_one:
            total = total + _log1p_sum_exp(pos_terms) / alpha + _log1p_sum_exp(neg_terms) / beta
        else:
            if Pi:
                total = total + _log_sum_exp(pos_terms) / alpha
            if Ni:
                total = total + _log_sum_exp(neg_terms) / beta
    return total / B
