"""Slow loop references of the pair losses, written directly from the papers' equations (float64).

Each function takes raw embeddings ``z [B, D]`` and integer labels ``y [B]`` (lists are fine) and returns a 0-dim
float64 tensor that is differentiable w.r.t. ``z``. No vectorisation, no shared code with the library: every sum
of the equations is a Python loop. Optional ``ref`` / ``ref_labels`` append gallery items (anchors = batch only).

Pairs: by default ``(i, j)`` is positive when ``y_i == y_j``. The optional ``same`` (an ``N x N`` nested list or
bool tensor over the gallery: the batch, then the references) replaces label equality: ``same[i][j]`` says whether
``i`` and ``j`` are a positive pair (label sets: whether the sets intersect). Either way an item is never its own
positive nor its own negative (by index), and every other pair is positive or negative.
"""

from __future__ import annotations

import math
from typing import List, Optional, Sequence

import torch
from torch import Tensor


def _unit(z: Tensor) -> List[Tensor]:
    z = z.double()
    return [z[i] / z[i].norm().clamp(min=1e-12) for i in range(z.shape[0])]


def _label_list(y) -> list:
    """Labels as ints; label set rows (``[N, L]``) as tuples, usable only together with ``same``."""
    return [tuple(int(x) for x in v) if torch.as_tensor(v).ndim else int(v) for v in y]


def _gallery(z, y, ref, ref_labels, normalize=True):
    f = _unit(z) if normalize else [z.double()[i] for i in range(z.shape[0])]
    labels = _label_list(y)
    if ref is not None:
        f = f + (_unit(ref) if normalize else [ref.double()[i] for i in range(ref.shape[0])])
        labels = labels + _label_list(ref_labels)
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
                     on_empty="keep", ref=None, ref_labels=None, same=None) -> Tensor:
    """MS paper Eq. 15 with the mining of Eqs. 11-12 (ablations per SPEC 3.4, GPW 'without +1')."""
    f, labels = _gallery(z, y, ref, ref_labels)
    B, N = z.shape[0], len(f)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(B):
        P, Ng = _sets(labels, i, N, same)
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


def _sets(labels, i, N, same=None):
    """Positives and negatives of anchor ``i``: by label equality, or by the pair matrix ``same`` (module docstring)."""
    if same is not None:
        P = [j for j in range(N) if j != i and bool(same[i][j])]
        Ng = [j for j in range(N) if j != i and not bool(same[i][j])]
        return P, Ng
    if isinstance(labels[i], tuple):
        raise ValueError("label sets need the pair matrix same=...")
    P = [j for j in range(N) if j != i and labels[j] == labels[i]]
    Ng = [j for j in range(N) if labels[j] != labels[i]]
    return P, Ng


def _relu(x: Tensor) -> Tensor:
    # gradient 0 at exactly 0 in every torch version, as torch.relu in the losses: clamp's gradient at its bound
    # is 1 in torch 2.11 and 0 in 2.14 (the GPU machine's 2.11 failed the tie tests with clamp)
    return torch.where(x > 0, x, torch.zeros_like(x))


def contrastive(z, y, pos_margin=0.0, neg_margin=0.8, squared=False, squared_hinge=False, reduction="mean_nonzero",
                ref=None, ref_labels=None, same=None) -> Tensor:
    """GPW Eq. 11 (Eq. 36 with squared distances, Eq. 35 with squared hinges)."""
    f, labels = _gallery(z, y, ref, ref_labels)
    B, N = z.shape[0], len(f)
    pos_terms, neg_terms = [], []
    for i in range(B):
        P, Ng = _sets(labels, i, N, same)
        for j in P:
            d = 2.0 - 2.0 * _cos(f[i], f[j]) if squared else _dist(f[i], f[j])
            d = _relu(d) if squared else d
            h = _relu(d - pos_margin)
            pos_terms.append(h * h if squared_hinge else h)
        for j in Ng:
            d = _relu(2.0 - 2.0 * _cos(f[i], f[j])) if squared else _dist(f[i], f[j])
            h = _relu(neg_margin - d)
            neg_terms.append(h * h if squared_hinge else h)
    return _reduce(pos_terms, reduction) + _reduce(neg_terms, reduction)


def _reduce(terms, reduction):
    if not terms:
        return torch.zeros((), dtype=torch.float64)
    total = sum(terms)
    if reduction == "sum":
        return total
    if reduction == "mean":
        return total / len(terms)
    nonzero = sum(1 for t in terms if float(t.detach()) > 0)
    return total / max(nonzero, 1)


def triplet(z, y, margin=0.1, mining="all", squared=False, reduction="mean_nonzero", ref=None, ref_labels=None,
            same=None):
    """GPW Eq. 12 / Eq. 37 over all triplets, or the batch-hard triplet per anchor (Eq. 20)."""
    f, labels = _gallery(z, y, ref, ref_labels)
    B, N = z.shape[0], len(f)

    def d(i, j):
        return _relu(2.0 - 2.0 * _cos(f[i], f[j])) if squared else _dist(f[i], f[j])

    terms = []
    for i in range(B):
        P, Ng = _sets(labels, i, N, same)
        if mining == "batch_hard":
            if not P or not Ng:
                continue
            j = max(P, key=lambda t: float(d(i, t).detach()))
            k = min(Ng, key=lambda t: float(d(i, t).detach()))
            terms.append(_relu(d(i, j) - d(i, k) + margin))
            continue
        for j in P:
            for k in Ng:
                terms.append(_relu(d(i, j) - d(i, k) + margin))
    return _reduce(terms, reduction)


def lifted_structure(z, y, margin=1.0, variant="original", alpha=2.0, beta=50.0, ref=None, ref_labels=None,
                     same=None):
    """Original lifted structure (Song et al.), GPW Eq. 14, generalised (MS Eq. 6, distance form), MS Eq. 16."""
    f, labels = _gallery(z, y, ref, ref_labels)
    B, N = z.shape[0], len(f)
    zero = torch.zeros((), dtype=torch.float64)
    if variant == "star":
        total = zero
        for i in range(B):
            P, Ng = _sets(labels, i, N, same)
            if P:
                total = total + _log_sum_exp([-alpha * _cos(f[i], f[k]) for k in P]) / alpha
            if Ng:
                total = total + _log_sum_exp([beta * _cos(f[i], f[k]) for k in Ng]) / beta
        return total / B
    if variant == "generalized":
        total = zero
        for i in range(B):
            P, Ng = _sets(labels, i, N, same)
            if P and Ng:
                total = total + _relu(_log_sum_exp([_dist(f[i], f[j]) for j in P])
                                      + _log_sum_exp([margin - _dist(f[i], f[k]) for k in Ng]))
        return total / B
    terms = []
    for i in range(B):
        P, _ = _sets(labels, i, N, same)
        for j in P:
            Ni = _sets(labels, i, N, same)[1]
            Nj = _sets(labels, j, N, same)[1]
            if variant == "original":
                exps = [margin - _dist(f[i], f[k]) for k in Ni] + [margin - _dist(f[j], f[l]) for l in Nj]
                if not exps:
                    terms.append(zero)
                    continue
                J = _log_sum_exp(exps) + _dist(f[i], f[j])
                terms.append(_relu(J) ** 2)
            else:  # gpw Eq. 14
                if not Ni or not Nj:
                    terms.append(zero)
                    continue
                terms.append(_relu(_dist(f[i], f[j]) + _log_sum_exp([margin - _dist(f[i], f[k]) for k in Ni])
                                   + _log_sum_exp([margin - _dist(f[j], f[l]) for l in Nj])))
    if not terms:
        return zero
    return sum(terms) / (2 * len(terms)) if variant == "original" else sum(terms) / len(terms)


def binomial_deviance(z, y, alpha=2.0, beta=50.0, lam=0.5, ref=None, ref_labels=None, same=None):
    """MS Eq. 9, averaged over the B anchors."""
    f, labels = _gallery(z, y, ref, ref_labels)
    B, N = z.shape[0], len(f)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(B):
        P, Ng = _sets(labels, i, N, same)
        if P:
            total = total + sum(torch.log1p(torch.exp(alpha * (lam - _cos(f[i], f[j])))) for j in P) / len(P)
        if Ng:
            total = total + sum(torch.log1p(torch.exp(beta * (_cos(f[i], f[j]) - lam))) for j in Ng) / len(Ng)
    return total / B


def npair(z, y, l2_reg=0.005, symmetric=False, variant="mc"):
    """N-pair paper Eq. 7 (mc) / Eq. 8 (ovo) on the first two samples of every class; raw inner products."""
    labels = [int(v) for v in y]
    zz = z.double()
    pairs = []
    for c in sorted(set(labels)):
        idx = [i for i, v in enumerate(labels) if v == c]
        if len(idx) >= 2:
            pairs.append((idx[0], idx[1]))
    zero = torch.zeros((), dtype=torch.float64)
    if not pairs:
        return zero
    A = [zz[a] for a, _ in pairs]
    P = [zz[p] for _, p in pairs]
    n = len(pairs)

    def one(X, Y):
        total = zero
        for i in range(n):
            if variant == "mc":
                total = total + _log1p_sum_exp([torch.dot(X[i], Y[j]) - torch.dot(X[i], Y[i]) for j in range(n) if j != i])
            else:
                for j in range(n):
                    if j != i:
                        # log(1 + exp(x)) evaluated without overflow (raw inner products can be huge)
                        total = total + torch.logaddexp(zero, torch.dot(X[i], Y[j]) - torch.dot(X[i], Y[i]))
        return total / n

    loss = one(A, P)
    if symmetric:
        loss = 0.5 * (loss + one(P, A))
    reg = 0.5 * (sum(torch.dot(a, a) for a in A) / n + sum(torch.dot(p, p) for p in P) / n)
    return loss + l2_reg * reg


def ranked_list(z, y, alpha=1.2, margin=0.4, temperature=10.0, lam=1.0, detach_gallery=True, ref=None,
                ref_labels=None):
    """RLL Eqs. 8-14; with detach_gallery the other items of anchor i's list are constants."""
    f, labels = _gallery(z, y, ref, ref_labels)
    B, N = z.shape[0], len(f)
    total = torch.zeros((), dtype=torch.float64)
    for i in range(B):
        P, Ng = _sets(labels, i, N)
        g = [t.detach() if detach_gallery else t for t in f]

        def d(j):
            return torch.sqrt(torch.clamp(2.0 - 2.0 * torch.clamp(torch.dot(f[i], g[j]), -1.0, 1.0), min=1e-12))

        Pstar = [j for j in P if float(d(j).detach()) > alpha - margin]
        Nstar = [j for j in Ng if float(d(j).detach()) < alpha]
        if Pstar:
            total = total + sum(d(j) - (alpha - margin) for j in Pstar) / len(Pstar)
        if Nstar:
            w = {j: math.exp(temperature * (alpha - float(d(j).detach()))) for j in Nstar}
            wsum = sum(w.values())
            total = total + lam * sum(w[j] / wsum * (alpha - d(j)) for j in Nstar)
    return total / B


def tuplet_margin_all_negatives(z, y, scale=64.0, slack=0.1, variance_weight=0.5, variance_eps=0.01,
                                detach_mean=False, ref=None, ref_labels=None):
    """TML Eq. 13 over every positive pair with all of the anchor's negatives, plus Eqs. 15-17."""
    f, labels = _gallery(z, y, ref, ref_labels)
    B, N = z.shape[0], len(f)
    tuplets, pos_cos, neg_cos = [], [], []
    for i in range(B):
        P, Ng = _sets(labels, i, N)
        for j in P:
            c_ap = _cos(f[i], f[j])
            theta = torch.acos(torch.clamp(c_ap, -1 + 1e-7, 1 - 1e-7))
            tuplets.append(_log1p_sum_exp([scale * (_cos(f[i], f[k]) - torch.cos(theta - slack)) for k in Ng]))
            pos_cos.append(c_ap)
        neg_cos.extend(_cos(f[i], f[k]) for k in Ng)
    zero = torch.zeros((), dtype=torch.float64)
    loss = sum(tuplets) / len(tuplets) if tuplets else zero
    if variance_weight == 0:
        return loss
    lpos = lneg = zero
    if pos_cos:
        mu = sum(pos_cos) / len(pos_cos)
        mu = mu.detach() if detach_mean else mu
        lpos = sum(_relu((1 - variance_eps) * mu - c) ** 2 for c in pos_cos) / len(pos_cos)
    if neg_cos:
        mu = sum(neg_cos) / len(neg_cos)
        mu = mu.detach() if detach_mean else mu
        lneg = sum(_relu(c - (1 + variance_eps) * mu) ** 2 for c in neg_cos) / len(neg_cos)
    return loss + variance_weight * (lpos + lneg)


def general_pair_weighting(z, y, form="pair", mining="threshold", weighting="constant", m1=0.0, m2=0.8, margin=0.1,
                           p=0.0, q=0.0, alpha=0.0, beta=0.0, eps=0.1, normalize=True, ref=None, ref_labels=None):
    """GPW Algorithm 1: Eq. 18 / Eq. 21 with the mining of Eqs. 16-17, 19, 20, 22-23 and weights of Eqs. 24-34.

    Weights are plain Python floats (constants, GPW footnote 6); hinges keep the gradient.
    """
    f, labels = _gallery(z, y, ref, ref_labels)
    B, N = z.shape[0], len(f)
    total = torch.zeros((), dtype=torch.float64)

    def wfun(x, power, scale):
        if weighting == "constant":
            return 1.0
        if weighting == "power":
            return max(x, 0.0) ** power
        return math.exp(scale * x)

    for i in range(B):
        P, Ng = _sets(labels, i, N)
        D = {j: _dist(f[i], f[j]) for j in range(N)}
        Df = {j: float(D[j].detach()) for j in range(N)}
        if form == "triplet":
            trip = []
            if mining == "batch_hard":
                if P and Ng:
                    j = max(P, key=lambda t: Df[t])
                    k = min(Ng, key=lambda t: Df[t])
                    if Df[j] - Df[k] + margin >= 0:
                        trip.append((j, k))
            else:
                trip = [(j, k) for j in P for k in Ng if Df[j] + margin >= Df[k]]  # Eq. 19
            ws = [wfun(Df[j] - Df[k] + margin, p, alpha) for j, k in trip]
            s = sum(ws)
            for (j, k), w in zip(trip, ws):
                w = (w / s if s > 0 else 0.0) if normalize else w
                total = total + w * _relu(D[j] - D[k] + margin)
            continue
        kp = [j for j in P if Df[j] >= m1]  # Eq. 16
        kn = [k for k in Ng if Df[k] <= m2]  # Eq. 17
        if mining == "ms":  # Eqs. 22-23
            min_neg = min([Df[k] for k in Ng], default=math.inf)
            max_pos = max([Df[j] for j in P], default=-math.inf)
            kp = [j for j in kp if Df[j] >= min_neg - eps]
            kn = [k for k in kn if Df[k] <= max_pos + eps]
        elif mining == "batch_hard":
            kp = [j for j in kp if P and j == max(P, key=lambda t: Df[t])]
            kn = [k for k in kn if Ng and k == min(Ng, key=lambda t: Df[t])]
        elif mining == "triplet_margin":
            kp = [j for j in kp if any(Df[j] + margin >= Df[k] for k in Ng)]
            kn = [k for k in kn if any(Df[j] + margin >= Df[k] for j in P)]
        wp = [wfun(Df[j] - m1, p, alpha) for j in kp]
        wn = [wfun(m2 - Df[k], q, beta) for k in kn]
        sp, sn = sum(wp), sum(wn)
        for j, w in zip(kp, wp):
            w = (w / sp if sp > 0 else 0.0) if normalize else w
            total = total + w * _relu(D[j] - m1)
        for k, w in zip(kn, wn):
            w = (w / sn if sn > 0 else 0.0) if normalize else w
            total = total + w * _relu(m2 - D[k])
    return total / B
