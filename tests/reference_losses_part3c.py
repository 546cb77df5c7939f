"""Slow loop references written from the papers, for the part-3c losses (issue 29): plain Python loops in float64,
differentiable by autograd, sharing no code with the library."""

from __future__ import annotations

import math

import torch
from torch import Tensor


def _unit(x: Tensor) -> Tensor:
    return x / x.norm(dim=-1, keepdim=True)


def instance(z: Tensor, y: Tensor, gamma: float = 64.0) -> Tensor:
    """Instance loss (Zheng et al., TOMM 2020, Eq. 1) in the authors' batch form: item i's softmax over the gamma-
    scaled cosines to every batch item, its target the item at the rank of y_i among the sorted distinct labels."""
    x = _unit(z)
    distinct = sorted({int(v) for v in y})
    total = z.new_zeros(())
    for i in range(z.shape[0]):
        logits = [gamma * (x[i] @ x[j]) for j in range(z.shape[0])]
        target = distinct.index(int(y[i]))
        total = total - (logits[target] - torch.logsumexp(torch.stack(logits), dim=0))
    return total / z.shape[0]


def manifold(z: Tensor, proxies: Tensor, y: Tensor, lambda_c: float = 1.0, alpha: float = 0.8,
             margin: float = 5e-4, steps: int = 400) -> Tensor:
    """Manifold loss (Aziere and Todorovic, CVPR 2019): the random walk's similarity as its series
    ``F = (1 - alpha) sum_t (alpha S_bar)^t`` (Eq. 2's fixed point, no matrix inverse), then the intrinsic and
    context hinge-log-sum-exp terms by loops over items and proxies."""
    nodes = torch.cat([_unit(z), _unit(proxies)])
    n, b, k = nodes.shape[0], z.shape[0], proxies.shape[0]
    s = [[torch.exp(torch.clamp(nodes[i] @ nodes[j], min=0.0) / 0.5) if i != j else nodes.new_zeros(())
          for j in range(n)] for i in range(n)]
    s = torch.stack([torch.stack(row) for row in s])
    degree = s.sum(dim=1)
    s_bar = s / torch.sqrt(degree[:, None] * degree[None, :])
    term = (1.0 - alpha) * torch.eye(n, dtype=z.dtype)
    f = term
    for _ in range(steps):  # alpha^400 < 1e-38 for alpha = 0.8
        term = alpha * s_bar @ term
        f = f + term

    def hinge_lse(score) -> Tensor:
        total = z.new_zeros(())
        for i in range(b):
            own = int(y[i])
            violations = [score(i, c) - score(i, own) + margin for c in range(k) if c != own]
            kept = [v for v in violations if float(v.detach()) >= 0.0]
            total = total + torch.log(1.0 + sum((torch.exp(v) for v in kept), z.new_zeros(())))
        return total / b

    intrinsic = hinge_lse(lambda i, c: f[i, b + c])
    context = hinge_lse(lambda i, c: (f[i] @ f[b + c]) / (f[i].norm() * f[b + c].norm()))
    return intrinsic + lambda_c * context


def dynamic_arcface(z: Tensor, proxies: Tensor, y: Tensor, counts: Tensor, sub_centers: int = 3,
                    scale: float = 64.0, a: float = 0.5, b: float = 0.05, lambda0: float = 0.25) -> Tensor:
    """Sub-center ArcFace with the dynamic margin ``m_c = a n_c^{-lambda0} + b`` of class ``c`` (Ha et al.,
    arXiv 2010.05350): per item, the angle to the nearest sub-centre of each class, ``cos(theta_y + m_y)`` for its
    own class (``cos(theta_y) - m_y sin(m_y)`` past ``theta_y = pi - m_y``), softmax cross-entropy; the mean."""
    x, w = _unit(z), _unit(proxies)
    classes = proxies.shape[0] // sub_centers
    total = z.new_zeros(())
    for i in range(z.shape[0]):
        own = int(y[i])
        m = a * float(counts[own]) ** (-lambda0) + b
        logits = []
        for c in range(classes):
            cos = max((x[i] @ w[c * sub_centers + t] for t in range(sub_centers)), key=lambda v: float(v.detach()))
            if c == own:
                theta = torch.acos(torch.clamp(cos, -1.0, 1.0))
                cos = torch.cos(theta + m) if float(theta.detach()) <= math.pi - m else cos - m * math.sin(m)
            logits.append(scale * cos)
        total = total - (logits[own] - torch.logsumexp(torch.stack(logits), dim=0))
    return total / z.shape[0]
