"""Slow loop references of the issue-29 part-3a losses, written from their papers' equations (float64, plain Python
loops over anchors and pairs). ``positive(i, j)`` says whether items ``i`` and ``j`` form a positive pair (same
class, or intersecting label sets); every other pair of two different items is negative."""

from __future__ import annotations

import math
from typing import Callable

import torch

Positive = Callable[[int, int], bool]


def same_label(labels: torch.Tensor) -> Positive:
    """``positive(i, j)`` for ``[B]`` class ids or ``[B, L]`` label sets padded with -1 (the sets intersect)."""
    if labels.ndim == 1:
        return lambda i, j: bool(labels[i] == labels[j])
    sets = [{int(v) for v in row if v >= 0} for row in labels]
    return lambda i, j: bool(sets[i] & sets[j])


def _unit(x: torch.Tensor) -> torch.Tensor:
    return x / x.norm(dim=1, keepdim=True)


def _dist(u: torch.Tensor, i: int, j: int) -> torch.Tensor:
    return torch.sqrt(torch.clamp(2.0 - 2.0 * torch.dot(u[i], u[j]), min=1e-12))


def generalized_lifted_structure(x: torch.Tensor, positive: Positive, neg_margin: float = 1.0,
                                 pos_margin: float = 0.0, anchors: list[int] | None = None) -> torch.Tensor:
    """Hermans et al. 2017 p. 4: ``1/B sum_i [log sum_p e^{D_ip - m+} + log sum_n e^{m- - D_in}]_+`` over the
    anchors with both sets (the others add 0); ``anchors`` restricts the sum to some anchors."""
    u, b = _unit(x), x.shape[0]
    total = x.sum() * 0.0
    for i in range(b) if anchors is None else anchors:
        ps = [_dist(u, i, j) - pos_margin for j in range(b) if j != i and positive(i, j)]
        ns = [neg_margin - _dist(u, i, j) for j in range(b) if j != i and not positive(i, j)]
        if ps and ns:
            total = total + torch.relu(torch.logsumexp(torch.stack(ps), 0) + torch.logsumexp(torch.stack(ns), 0))
    return total / b


def histogram(x: torch.Tensor, positive: Positive, delta: float = 0.02) -> torch.Tensor:
    """Histogram loss, Ustinova & Lempitsky Eqs. 2-4: interpolated histograms of the unordered positive and negative
    pair similarities, ``sum_r h-_r sum_{q <= r} h+_q``, the kernel ``max(0, 1 - |s - t_r| / delta)`` written out."""
    u, b = _unit(x), x.shape[0]
    nodes = [-1.0 + r * delta for r in range(round(2 / delta) + 1)]
    sp, sn = [], []
    for i in range(b):
        for j in range(i + 1, b):
            (sp if positive(i, j) else sn).append(torch.dot(u[i], u[j]))
    if not sp or not sn:
        return x.sum() * 0.0

    def hist(values):
        return [sum(torch.relu(1.0 - (s - t).abs() / delta) for s in values) / len(values) for t in nodes]

    hp, hn = hist(sp), hist(sn)
    total, cum = x.sum() * 0.0, x.sum() * 0.0
    for r in range(len(nodes)):
        cum = cum + hp[r]
        total = total + hn[r] * cum
    return total


def intra_pair_variance(x: torch.Tensor, positive: Positive, pos_eps: float = 0.01,
                        neg_eps: float = 0.01) -> torch.Tensor:
    """TML Eqs. 15-16 over the ordered pairs, the means not detached."""
    u, b = _unit(x), x.shape[0]
    sp, sn = [], []
    for i in range(b):
        for j in range(b):
            if i != j:
                (sp if positive(i, j) else sn).append(torch.dot(u[i], u[j]))
    total = x.sum() * 0.0
    if sp:
        mu = sum(sp) / len(sp)
        total = total + sum(torch.relu((1 - pos_eps) * mu - s) ** 2 for s in sp) / len(sp)
    if sn:
        mu = sum(sn) / len(sn)
        total = total + sum(torch.relu(s - (1 + neg_eps) * mu) ** 2 for s in sn) / len(sn)
    return total


class DynamicSoftMargin:
    """DSM (Zhang & Rusinkiewicz 2019) in pml's discretisation, one triplet at a time, with a running histogram of
    ``num_bins + 1`` nodes (the CDF weight a constant); ``train=False`` reads the histogram without storing it.
    ``update="authors"``: ``(1 - m) h + m h_batch / sum(h_batch)`` (lg-zhang/dynamic-soft-margin-pytorch);
    ``"pml"``: ``normalise((1 - m) h + m h_batch)``."""

    def __init__(self, min_val: float = -2.0, num_bins: int = 10, momentum: float = 0.01,
                 update: str = "authors") -> None:
        self.min_val, self.num_bins, self.momentum, self.update = min_val, num_bins, momentum, update
        self.delta = 2 * abs(min_val) / num_bins
        self.hist = [0.0] * (num_bins + 1)

    def _bin(self, v: float) -> tuple[int, float]:
        u = min(max((v - self.min_val) / self.delta, 0.0), float(self.num_bins))
        k = min(math.floor(u), self.num_bins - 1)
        return k, u - k

    def __call__(self, x: torch.Tensor, positive: Positive, train: bool = True) -> torch.Tensor:
        u, b = _unit(x), x.shape[0]
        diffs = [_dist(u, a, p) - _dist(u, a, n) for a in range(b) for p in range(b) for n in range(b)
                 if p != a and n != a and positive(a, p) and not positive(a, n)]
        if not diffs:
            return x.sum() * 0.0
        stored = any(h != 0 for h in self.hist)
        if train or not stored:
            m = self.momentum if stored else 1.0
            batch = [0.0] * (self.num_bins + 1)
            for d in diffs:
                k, f = self._bin(float(d.detach()))
                batch[k] += 1 - f
                batch[k + 1] += f
            scale = 1.0 / sum(batch) if self.update == "authors" else 1.0
            hist = [(1 - m) * h + m * scale * c for h, c in zip(self.hist, batch)]
            hist = [h / sum(hist) for h in hist]
            if train:
                self.hist = hist
        else:
            hist = self.hist
        total = x.sum() * 0.0
        for d in diffs:
            total = total + sum(hist[: self._bin(float(d.detach()))[0] + 1]) * d
        return total / len(diffs)
