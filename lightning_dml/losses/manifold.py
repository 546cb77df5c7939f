"""Manifold similarity loss with hard proxies (Aziere and Todorovic, "Ensemble Deep Manifold Similarity Learning
using Hard Proxies", CVPR 2019, Sec. 3-4, Eqs. 1-8)."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from lightning_dml.losses.base import lse0
from lightning_dml.losses.proxies import ProxyLoss, normalize_proxies
from lightning_dml.losses.registry import register_loss

__all__ = ["ManifoldLoss", "manifold_similarity", "proxy_hinge_lse"]


def manifold_similarity(x: Tensor, proxies: Tensor, alpha: float) -> Tensor:
    """The random-walk manifold similarity ``F = (1 - alpha) (I - alpha S_bar)^{-1}`` over the graph of the ``B``
    unit embeddings ``x`` and the ``K`` unit proxies (paper Eqs. 1-3; ``(B + K) x (B + K)``).

    Edges ``S_ij = exp(max(cos_ij, 0) / 0.5)`` (no self-loops), ``S_bar = D^{-1/2} S D^{-1/2}`` with ``D`` the
    degrees, as pytorch-metric-learning's ``ManifoldLoss``. Every off-diagonal edge is at least 1, so the degrees
    are positive and ``I - alpha S_bar`` is symmetric positive definite for ``alpha < 1`` (the eigenvalues of
    ``S_bar`` lie in ``[-1, 1]``): it is inverted through its Cholesky factor, in the inputs' dtype.
    """
    nodes = torch.cat([x, proxies])
    n = nodes.shape[0]
    sim = torch.exp((nodes @ nodes.T).clamp(min=0.0) / 0.5)
    eye = torch.eye(n, dtype=sim.dtype, device=sim.device)
    sim = sim * (1.0 - eye)
    root = sim.sum(dim=1).rsqrt()
    walk = eye - alpha * (root[:, None] * sim * root[None, :])
    return (1.0 - alpha) * torch.cholesky_inverse(torch.linalg.cholesky(walk))


def proxy_hinge_lse(scores: Tensor, labels: Tensor, margin: float) -> Tensor:
    """``mean_i log(1 + sum_{j != y_i, z_ij >= 0} e^{z_ij})`` with ``z_ij = scores_ij - scores_{i y_i} + margin``
    (paper Eqs. 6-7 as pml: a proxy counts only where it violates the margin; the own proxy never)."""
    rows = torch.arange(scores.shape[0], device=scores.device)
    z = scores - scores[rows, labels][:, None] + margin
    mask = z >= 0.0
    mask[rows, labels] = False
    return lse0(z, mask).mean()


@register_loss("manifold")
class ManifoldLoss(ProxyLoss):
    r"""Manifold similarity loss with hard proxies (Aziere and Todorovic, CVPR 2019).

    The ``B`` embeddings and ``K`` proxies are the nodes of a graph whose random-walk similarity is
    ``F = (1 - alpha) (I - alpha S_bar)^{-1}`` (:func:`manifold_similarity`, Eqs. 1-3). Each embedding is assigned
    its proxy ``y_i`` (the paper's hard proxy); the loss is the intrinsic term on the manifold similarities of the
    embeddings to the proxies and the context term on the cosine between the rows of ``F`` of the embedding and of
    each proxy (how alike their similarity profiles over the whole graph are), Eqs. 6-8:

    .. math::
        L = \frac{1}{B} \sum_i \log\Big(1 + \sum_{k \ne y_i,\, z_{ik} \ge 0} e^{z_{ik}}\Big)
          + \lambda_C \frac{1}{B} \sum_i \log\Big(1 + \sum_{k \ne y_i,\, c_{ik} \ge 0} e^{c_{ik}}\Big)

    with ``z_ik = F_{i,k} - F_{i,y_i} + m`` and ``c_ik = cos(F_i, F_k) - cos(F_i, F_{y_i}) + m`` (rows of ``F``,
    proxies indexed after the ``B`` embeddings). A proxy within the margin of the own proxy's score counts, the
    others add nothing (the hinge of pytorch-metric-learning's ``ManifoldLoss``, whose conventions this follows).

    Args:
        num_classes: ``K``, the number of proxies; filled in by ``DMLModule`` (one proxy per training class).
        embedding_dim: the embedding width; filled in by ``DMLModule``.
        lambda_c: ``lambda_C`` (1), the context term's weight; must be finite (pml's ``lambdaC = inf`` for the
            context term alone gives ``inf``: use a large weight, or scale the loss).
        alpha: the random walk's ``alpha`` in ``(0, 1)`` (0.8).
        margin: ``m`` (5e-4).

    Labels: the index of each embedding's proxy in ``[0, K)`` (``DMLModule`` maps the training classes to them:
    the class is the hard proxy). pml draws random proxy assignments when none are given; pml's
    ``ManifoldLoss(l, K)(emb, indices_tuple=labels)`` is ``ManifoldLoss(K, l)(emb, labels)`` here. Proxies are
    initialised standard normal (pml's). Cost: the ``(B + K)`` square inverse, ``O((B + K)^3)`` (pml inverts
    with LU in fp32; this one with Cholesky in the inputs' dtype).

    Degenerate batches: one class, singletons and identical embeddings are finite (the graph's degrees are at
    least ``B + K - 1``). The graph couples the whole batch: under DDP each process computes the loss of the
    gathered global batch (``gather_mode = "global_batch"``). Label sets are rejected (one proxy per item).
    """

    gather_mode = "global_batch"

    def __init__(
        self,
        num_classes: int | None = None,
        embedding_dim: int | None = None,
        lambda_c: float = 1.0,
        alpha: float = 0.8,
        margin: float = 5e-4,
    ) -> None:
        if not (0.0 <= lambda_c < math.inf):
            raise ValueError(f"ManifoldLoss: lambda_c must be finite and >= 0, got {lambda_c}")
        if not 0.0 < alpha < 1.0:
            raise ValueError(f"ManifoldLoss: alpha must be in (0, 1), got {alpha}")
        if not math.isfinite(margin):
            raise ValueError(f"ManifoldLoss: margin must be finite, got {margin}")
        self.lambda_c, self.alpha, self.margin = float(lambda_c), float(alpha), float(margin)
        super().__init__(num_classes, embedding_dim)

    def reset_parameters(self) -> None:
        if self.proxies is not None:
            nn.init.normal_(self.proxies)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, lambda_c={self.lambda_c}, alpha={self.alpha}, margin={self.margin}"

    def proxy_loss(self, x: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        b = x.shape[0]
        f = manifold_similarity(x, normalize_proxies(proxies), self.alpha)
        intrinsic = proxy_hinge_lse(f[:b, b:], labels, self.margin)
        rows, profiles = f[:b], f[b:]
        norms = torch.linalg.vector_norm(rows, dim=1)[:, None] * torch.linalg.vector_norm(profiles, dim=1)[None, :]
        context = (rows @ profiles.T) / norms.clamp(min=1e-8)
        return intrinsic + self.lambda_c * proxy_hinge_lse(context, labels, self.margin)
