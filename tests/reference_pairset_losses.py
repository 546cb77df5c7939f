"""Slow loop references of the pair and set losses, written from the papers' equations (float64).

Each function takes raw embeddings ``z [N, D]`` and integer labels ``y [N]``; the first ``n_anchors`` rows (all by
default) are the anchors / queries and all ``N`` rows are the gallery (an anchor never pairs with itself, by
index). They return a 0-dim float64 tensor differentiable w.r.t. ``z``. Every sum of the equations is a Python
loop over items; nothing is shared with the library.

Pairs: by default ``(i, j)`` is positive when ``y_i == y_j``. The optional ``same`` (an ``N x N`` nested list or
bool tensor over all ``N`` rows) replaces label equality: ``same[i][j]`` says whether ``i`` and ``j`` are a positive
pair (label sets: whether the sets intersect; ``y`` is then unused). Either way an item is never its own positive
nor its own negative (by index), and every other pair is positive or negative.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _unit_rows(z: Tensor) -> list[Tensor]:
    z = z.double()
    return [z[i] / z[i].norm() for i in range(z.shape[0])]


def _lse(values: list[Tensor]) -> Tensor:
    """``log sum exp`` of a list of scalars (stable)."""
    top = max(v.detach().item() for v in values)
    return top + torch.log(sum(torch.exp(v - top) for v in values))


def _sets(y: Tensor, i: int, same=None) -> tuple[list[int], list[int]]:
    if same is not None:
        others = [j for j in range(len(same)) if j != i]
        return [j for j in others if bool(same[i][j])], [j for j in others if not bool(same[i][j])]
    labels = [int(v) for v in y]
    pos = [j for j in range(len(labels)) if j != i and labels[j] == labels[i]]
    neg = [j for j in range(len(labels)) if labels[j] != labels[i]]
    return pos, neg


def _anchors_with_positives(y: Tensor, n_anchors: int | None, same=None):
    """``(i, positives, all other indices)`` for every anchor ``i`` that has a positive."""
    for i in range(n_anchors or len(y)):
        pos, _ = _sets(y, i, same)
        if pos:
            yield i, pos, [j for j in range(len(y)) if j != i]


def _mean(terms: list[Tensor], z: Tensor) -> Tensor:
    return sum(terms) / len(terms) if terms else z.double().sum() * 0.0


def circle(z, y, m=0.25, gamma=256.0, n_anchors=None, same=None) -> Tensor:
    """Circle loss, Sun et al. CVPR 2020 Eq. 6 (alpha_p = [1 + m - s_p]_+, alpha_n = [s_n + m]_+, Delta_p = 1 - m,
    Delta_n = m; alphas constant), mean over anchors with a positive and a negative."""
    x = _unit_rows(z)
    terms = []
    for i in range(n_anchors or len(x)):
        pos, neg = _sets(y, i, same)
        if not pos or not neg:
            continue
        lp = []
        for j in pos:
            s = torch.dot(x[i], x[j])
            lp.append(-gamma * max(1 + m - s.item(), 0.0) * (s - (1 - m)))
        ln = []
        for j in neg:
            s = torch.dot(x[i], x[j])
            ln.append(gamma * max(s.item() + m, 0.0) * (s - m))
        # log(1 + sum_n e^{..} sum_p e^{..}) = softplus(lse_n + lse_p)
        terms.append(torch.nn.functional.softplus(_lse(ln) + _lse(lp)))
    return _mean(terms, z)


def supcon(z, y, temperature=0.1, n_anchors=None, same=None) -> Tensor:
    """SupCon L_out, Khosla et al. NeurIPS 2020 Eq. 2, mean over anchors with a positive."""
    x = _unit_rows(z)
    terms = []
    for i, pos, others in _anchors_with_positives(y, n_anchors, same):
        log_den = _lse([torch.dot(x[i], x[a]) / temperature for a in others])
        terms.append(-sum(torch.dot(x[i], x[p]) / temperature - log_den for p in pos) / len(pos))
    return _mean(terms, z)


def ntxent(z, y, temperature=0.1, n_anchors=None) -> Tensor:
    """NT-Xent, Chen et al. ICML 2020 Eq. 1 with labels: each positive pair's denominator is that positive plus the
    anchor's negatives; mean over all ordered positive pairs."""
    x = _unit_rows(z)
    terms = []
    for i in range(n_anchors or len(x)):
        pos, neg = _sets(y, i)
        for p in pos:
            lp = torch.dot(x[i], x[p]) / temperature
            terms.append(_lse([lp] + [torch.dot(x[i], x[n]) / temperature for n in neg]) - lp)
    return _mean(terms, z)


def nca(z, y, scale=1.0, objective="log", n_anchors=None, same=None) -> Tensor:
    """NCA, Goldberger et al. 2004: p_ij = softmax_{j != i}(-scale ||x_i - x_j||^2) (Eq. 1), p_i = sum_{C_i} p_ij
    (Eq. 2); loss -mean log p_i (or -mean p_i, Eq. 3) over anchors with a positive."""
    x = _unit_rows(z)
    terms = []
    for i, pos, others in _anchors_with_positives(y, n_anchors, same):
        logits = {j: -scale * (x[i] - x[j]).pow(2).sum() for j in others}
        den = sum(torch.exp(logits[j]) for j in others)
        p_i = sum(torch.exp(logits[j]) for j in pos) / den
        terms.append(-torch.log(p_i) if objective == "log" else -p_i)
    return _mean(terms, z)


def angular(z, y, alpha=math.pi / 4, n_anchors=None) -> Tensor:
    """Angular loss, Wang et al. ICCV 2017 Eq. 8 with f_{a,p,n} = 4 tan^2(alpha) (x_a + x_p)^T x_n
    - 2 (1 + tan^2(alpha)) x_a^T x_p, over every ordered positive pair (a, p); mean over those pairs."""
    x = _unit_rows(z)
    t2 = math.tan(alpha) ** 2
    terms = []
    for a in range(n_anchors or len(x)):
        pos, neg = _sets(y, a)
        for p in pos:
            f = [4 * t2 * torch.dot(x[a] + x[p], x[n]) - 2 * (1 + t2) * torch.dot(x[a], x[p]) for n in neg]
            terms.append(torch.log(1 + sum(torch.exp(v) for v in f)) if f else z.double().sum() * 0.0)
    return _mean(terms, z)


def fastap(z, y, num_bins=10, n_anchors=None, same=None) -> Tensor:
    """FastAP, Cakir et al. CVPR 2019 Eqs. 9-11: squared distances in [0, 4], L + 1 triangular bins of width 4/L,
    FastAP_q = 1/N+ sum_l h+_l H+_l / H_l; loss 1 - mean over queries with a positive."""
    x = _unit_rows(z)
    delta = 4.0 / num_bins
    terms = []
    for q in range(n_anchors or len(x)):
        pos, neg = _sets(y, q, same)
        if not pos:
            continue
        d = {j: (x[q] - x[j]).pow(2).sum() for j in pos + neg}
        cum_pos = cum_all = 0.0
        ap = 0.0
        for b in range(num_bins + 1):
            centre = b * delta
            h_pos = sum(torch.relu(1 - (d[j] - centre).abs() / delta) for j in pos)
            h_neg = sum(torch.relu(1 - (d[j] - centre).abs() / delta) for j in neg) if neg else 0.0
            cum_pos = cum_pos + h_pos
            cum_all = cum_all + h_pos + h_neg
            if float(cum_all.detach() if torch.is_tensor(cum_all) else cum_all) > 0:
                ap = ap + h_pos * cum_pos / cum_all
        terms.append(1 - ap / len(pos))
    return _mean(terms, z)


def smooth_ap(z, y, temperature=0.01, n_anchors=None, include_query=False, same=None) -> Tensor:
    """Smooth-AP, Brown et al. ECCV 2020 Eqs. 11-13 with G(x) = sigmoid(x / tau), D_ij = s_j - s_i; mean of 1 - AP
    over queries with a positive. ``include_query=True`` keeps the query in its own gallery and positive set (the
    authors' code and pytorch-metric-learning)."""
    x = _unit_rows(z)
    terms = []
    for q in range(n_anchors or len(x)):
        pos, neg = _sets(y, q, same)
        if include_query:
            pos = [q] + pos
        if not pos:
            continue
        s = {j: torch.dot(x[q], x[j]) for j in pos + neg}
        ap = 0.0
        for i in pos:
            g = {j: torch.sigmoid((s[j] - s[i]) / temperature) for j in pos + neg if j != i}
            rank_pos = 1 + sum(g[j] for j in pos if j != i)
            rank_all = 1 + sum(g.values())
            ap = ap + rank_pos / rank_all
        terms.append(1 - ap / len(pos))
    return _mean(terms, z)


def margin(z, y, triplets, beta, alpha=0.2, nu=0.0) -> Tensor:
    """Margin loss, Wu et al. ICCV 2017 Eqs. 4-5 on given triplets (a, p, n): sum of [alpha + D_ap - beta]_+,
    [alpha - D_an + beta]_+ and nu beta over the triplets, divided by the number of non-zero hinge terms (the
    authors' code). ``beta``: per-class tensor indexed by the anchor's label."""
    x = _unit_rows(z)
    total = z.double().sum() * 0.0
    count = 0
    for a, p, n in triplets:
        b = beta[int(y[a])].double()
        lp = torch.relu(alpha + (x[a] - x[p]).norm() - b)
        ln = torch.relu(alpha - (x[a] - x[n]).norm() + b)
        count += int(lp.item() > 0) + int(ln.item() > 0)
        total = total + lp + ln + nu * b
    return total / max(count, 1)


def npair_multi_positive(z, y, l2_reg=0.0) -> Tensor:
    """N-pair paper Eq. 9 (NCA-style, raw inner products): mean over anchors with a positive of
    -log(sum_{j != i, y_j = y_i} e^{f_i.f_j} / sum_{j != i} e^{f_i.f_j}), plus l2_reg * mean ||f_i||^2 of those
    anchors."""
    f = z.double()
    terms, norms = [], []
    for i in range(len(f)):
        pos, _ = _sets(y, i)
        if not pos:
            continue
        others = [j for j in range(len(f)) if j != i]
        terms.append(_lse([torch.dot(f[i], f[j]) for j in others]) - _lse([torch.dot(f[i], f[j]) for j in pos]))
        norms.append(f[i].pow(2).sum())
    if not terms:
        return f.sum() * 0.0
    return sum(terms) / len(terms) + l2_reg * sum(norms) / len(norms)
