"""HIER: learnable hierarchical proxies in hyperbolic space as a regulariser added to a base loss (Kim et al.,
"HIER: Metric Learning Beyond Class Labels via Hierarchical Regularization", CVPR 2023, Sec. 3, Eqs. 1-5).

The paper: ``M`` learnable proxies ``rho`` in the Poincare ball stand for the nodes of a latent hierarchy. For a
triplet ``(x_i, x_j, x_k)`` whose ``x_i, x_j`` are more alike than ``x_k`` (mined below), the lowest common ancestor
of a set of points is the proxy closest to all of them, ``LCA(S) = argmin_rho max_{x in S} d(x, rho)`` (Eq. 2).
With ``rho_ij = LCA(x_i, x_j)`` and ``rho_ijk = LCA(x_i, x_j, x_k)``, HIER's hierarchical triplet loss (Eq. 3) is

    l = [d(x_i, rho_ij) - d(x_i, rho_ijk) + delta]_+ + [d(x_j, rho_ij) - d(x_j, rho_ijk) + delta]_+
        + [d(x_k, rho_ijk) - d(x_k, rho_ij) + delta]_+

for triplets with ``rho_ij != rho_ijk``, averaged over the mined triplets (those with ``rho_ij = rho_ijk`` count as 0,
as the authors' ``hc_loss * (lca_ij_idx != lca_ijk_idx)`` before ``.mean()``). The same loss over triplets of the
proxies themselves (their LCAs taken among the proxies) organises the proxies (Eq. 4); the total (Eq. 5) is
``base_weight * base(x, y) + weight * (l_samples + l_proxies)``.

Where the paper is silent this follows the authors' code (tjddus9597/HIER-CVPR23, ``hier/losses.py: HIERLoss``,
``hier/train.py``, ``scripts/DINO/*.sh``):

* triplet mining (``get_reciprocal_triplets``): similarity ``exp(-d)`` between the samples (detached), plus 1 for a
  pair of one class; each row's ``topk`` most similar items (itself included) are its neighbours; ``j`` is a
  positive of ``i`` when each is among the other's neighbours (reciprocal), every other item a negative. Anchors
  with at least 2 reciprocal neighbours draw ``triplets_per_anchor`` positives and as many negatives uniformly with
  replacement (``np.random.choice``). The proxies' triplets are mined the same way from their own distances
  (without labels). Deviation: the authors' negatives include the anchor itself (its similarity is set to -1);
  here they do not (such a triplet has ``rho_ijk = rho_ij`` and counts 0 with an arg-min LCA);
* the LCA: the code draws it with a hard Gumbel-softmax (straight-through) at temperature ``tau = 0.1``; here it is
  the paper's arg-min (Eq. 2), without noise; the gradient flows through the distances to the chosen proxies only;
* the samples and the proxies are mapped into the ball by hyptorch's ``ToPoincare(riemannian=True)``
  (:func:`~lightning_dml.models.hyperbolic.to_poincare`: clip to ``clip_r``, ``exp_0``, projection, Riemannian
  gradient); the base loss sees the samples' ball points (it L2-normalises them: the cosine of the Euclidean
  embedding, as the authors' ``PALoss_Angle`` / ``MSLoss_Angle``, with the Riemannian gradient of their head);
* the proxies start as ``randn(M, D) / sqrt(D) * clip_r * 0.9``;
* hyper-parameters of ``scripts/DINO/hier_{CUB,Cars,SOP,Inshop}.sh``: ``num_hproxies 512``, ``hyp_c 0.1``,
  ``clip_r 2.3``, ``mrg 0.1``, ``topk 20``, ``lambda1 1``, ``lambda2 0.5`` and ``t_per_anchor = 50`` (``losses.py``),
  base loss Proxy-Anchor (``--loss PA``: ``alpha 32``, ``mrg 0.1``).

Random draws use a generator seeded with ``seed`` and the number of calls so far, so every process of a DDP run
draws the same triplets (``gather_mode = "global_batch"``: the loss of the gathered global batch on every process);
``triplets_per_anchor=None`` takes every triplet (deterministic, for small batches and tests).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dml.losses.base import check_inputs, label_sets_error, refuse_indices_tuple, upcast
from lightning_dml.losses.registry import build_loss, register_loss
from lightning_dml.models.hyperbolic import check_curvature, poincare_distance_matrix, to_poincare

__all__ = ["HIERLoss", "reciprocal_triplets", "lowest_common_ancestors", "hierarchical_triplet_loss"]

#: base losses of the paper's Table 5 / the authors' ``--loss`` choices that this library has
BASE_LOSSES = ("proxy_anchor", "multi_similarity", "supcon")


def reciprocal_triplets(
    similarity: Tensor, topk: int, per_anchor: int | None, generator: torch.Generator | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """Triplets ``(i, j, k)`` of HIER's mining (module docstring): ``j`` a reciprocal ``topk``-neighbour of ``i``
    (``j != i``), ``k`` any item that is not (``k != i``); anchors with fewer than 2 reciprocal neighbours or no
    negative give none. ``per_anchor``: that many ``j`` and ``k`` drawn uniformly with replacement per anchor;
    ``None``: every (j, k) combination. Returns three index tensors on ``similarity``'s device."""
    n = similarity.shape[0]
    device = similarity.device
    eye = torch.eye(n, dtype=torch.bool, device=device)
    k = min(int(topk), n)
    neighbours = torch.zeros_like(eye).scatter_(1, similarity.topk(k, dim=1).indices, True)
    mutual = neighbours & neighbours.T & ~eye
    negative = ~mutual & ~eye
    valid = (mutual.sum(1) >= 2) & negative.any(1)
    anchors = valid.nonzero().squeeze(1)
    if per_anchor is None:
        a, j, kk = (mutual[:, :, None] & negative[:, None, :] & valid[:, None, None]).nonzero(as_tuple=True)
        return a, j, kk
    if anchors.numel() == 0:
        empty = anchors.new_empty(0)
        return empty, empty, empty
    pos = torch.multinomial(mutual[anchors].to(similarity.dtype), per_anchor, replacement=True, generator=generator)
    neg = torch.multinomial(negative[anchors].to(similarity.dtype), per_anchor, replacement=True, generator=generator)
    return anchors.repeat_interleave(per_anchor), pos.reshape(-1), neg.reshape(-1)


def lowest_common_ancestors(
    to_proxies: Tensor, i: Tensor, j: Tensor, k: Tensor, block: int = 8192
) -> tuple[Tensor, Tensor]:
    """Indices of ``LCA(x_i, x_j)`` and ``LCA(x_i, x_j, x_k)`` per triplet (Eq. 2: arg-min over the proxies of the
    largest distance, first index on ties), without gradient, ``block`` triplets at a time (``[block, M]``
    temporaries)."""
    d = to_proxies.detach()
    lca_ij, lca_ijk = [], []
    for start in range(0, i.numel(), block):
        stop = start + block
        max_ij = torch.maximum(d[i[start:stop]], d[j[start:stop]])
        lca_ij.append(max_ij.argmin(dim=1))
        lca_ijk.append(torch.maximum(d[k[start:stop]], max_ij).argmin(dim=1))
    return torch.cat(lca_ij), torch.cat(lca_ijk)


def hierarchical_triplet_loss(
    to_proxies: Tensor, i: Tensor, j: Tensor, k: Tensor, margin: float
) -> Tensor:
    """HIER's Eq. 3 averaged over the triplets ``(i, j, k)`` from the ``[N, M]`` distances of the points to the
    proxies: LCAs by :func:`lowest_common_ancestors`; triplets whose two LCAs coincide count 0. The gradient reaches
    the six distances each triplet reads (not the ``[T, M]`` rows). No triplet: 0 (with a gradient path)."""
    if i.numel() == 0:
        return to_proxies.sum() * 0.0
    lca_ij, lca_ijk = lowest_common_ancestors(to_proxies, i, j, k)
    loss = (
        torch.relu(to_proxies[i, lca_ij] - to_proxies[i, lca_ijk] + margin)
        + torch.relu(to_proxies[j, lca_ij] - to_proxies[j, lca_ijk] + margin)
        + torch.relu(to_proxies[k, lca_ijk] - to_proxies[k, lca_ij] + margin)
    )
    loss = torch.where(lca_ij != lca_ijk, loss, torch.zeros_like(loss))
    return loss.mean()


@register_loss("hier")
class HIERLoss(nn.Module):
    """HIER (Kim et al., CVPR 2023): a base loss plus the hierarchical-proxy regulariser (module docstring).

    Args:
        base: the base loss's registry name (``"proxy_anchor"``, ``"multi_similarity"``, ``"supcon"``).
        base_args: its hyper-parameters (``None``: its defaults, which are the HIER code's for Proxy-Anchor).
        num_classes: classes of the training split (for a base loss with class proxies); filled in by
            ``DMLModule`` when left out.
        embedding_dim: width of the embedding (the hierarchical proxies' width); filled in the same way.
        num_proxies: number of hierarchical proxies ``M`` (``num_hproxies``, 512).
        c: curvature ``-c`` of the ball (``hyp_c``, 0.1).
        clip_r: clipping radius before the exponential map (2.3).
        margin: ``delta`` of Eq. 3 (``mrg``, 0.1).
        topk: neighbours of the reciprocal mining (``topk``, 20 in the scripts).
        triplets_per_anchor: triplets drawn per anchor (50); ``None``: all.
        weight: weight of the HIER term (``lambda2``, 0.5); base_weight: of the base loss (``lambda1``, 1).
        riemannian: the Riemannian gradient on the ball points (the authors' ``ToPoincare(riemannian=True)``).
        seed: seed of the triplet draws (with the call count: equal on every DDP process).
    """

    normalize = False
    supports_ref = False
    needs_positive_pairs = False
    has_parameters = True
    needs_num_classes = True
    needs_embedding_dim = False
    required_sampler: str | None = None
    gather_mode = "global_batch"
    supports_label_sets = False
    label_sets_reason = "its base losses with class proxies score each item against the proxy of its one class"
    supports_anchor_chunks = False

    def __init__(
        self,
        base: str = "proxy_anchor",
        base_args: dict[str, Any] | None = None,
        num_classes: int | None = None,
        embedding_dim: int | None = None,
        num_proxies: int = 512,
        c: float = 0.1,
        clip_r: float | None = 2.3,
        margin: float = 0.1,
        topk: int = 20,
        triplets_per_anchor: int | None = 50,
        weight: float = 0.5,
        base_weight: float = 1.0,
        riemannian: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        if base not in BASE_LOSSES:
            raise ValueError(f"{name}: base must be one of {', '.join(BASE_LOSSES)} (HIER's base losses), got {base!r}")
        self.c, self.clip_r = check_curvature(c, clip_r, name)
        for label, value, minimum in (("num_proxies", num_proxies, 2), ("topk", topk, 2)):
            if int(value) != value or value < minimum:
                raise ValueError(f"{name}: {label} must be an integer >= {minimum}, got {value}")
        per_anchor = triplets_per_anchor
        if per_anchor is not None and (int(per_anchor) != per_anchor or per_anchor < 1):
            raise ValueError(f"{name}: triplets_per_anchor must be an integer >= 1 or None, got {triplets_per_anchor}")
        for label, value in (("margin", margin), ("weight", weight), ("base_weight", base_weight)):
            if not math.isfinite(float(value)) or value < 0:
                raise ValueError(f"{name}: {label} must be a finite number >= 0, got {value}")
        self.base_name = base
        self.base_args = dict(base_args or {})
        self.base = build_loss(base, **self.base_args)
        self.num_proxies, self.topk = int(num_proxies), int(topk)
        self.triplets_per_anchor = None if triplets_per_anchor is None else int(triplets_per_anchor)
        self.margin, self.weight, self.base_weight = float(margin), float(weight), float(base_weight)
        self.riemannian, self.seed = bool(riemannian), int(seed)
        self.calls = 0
        self.num_classes: int | None = None
        self.embedding_dim: int | None = None
        self.register_parameter("proxies", None)
        self.complete(num_classes, embedding_dim)

    # ------------------------------------------------------------------ sizes and parameters
    @property
    def is_complete(self) -> bool:
        """Whether the hierarchical proxies (and the base loss's class proxies, if any) exist."""
        return self.proxies is not None and getattr(self.base, "is_complete", True)

    def complete(self, num_classes: int | None = None, embedding_dim: int | None = None) -> HIERLoss:
        """Fill in the sizes (``DMLModule`` calls it at fit start); creates the proxies once the width is known."""
        name = type(self).__name__
        for attr, value in (("num_classes", num_classes), ("embedding_dim", embedding_dim)):
            current = getattr(self, attr)
            if value is not None and current is not None and int(value) != current:
                raise ValueError(
                    f"{name} was configured with {attr}={current}, but the model gives {attr}={int(value)}: leave "
                    f"{attr} out of the loss config, or make the two agree"
                )
            if value is not None:
                if int(value) < 1:
                    raise ValueError(f"{name}: {attr} must be >= 1, got {value}")
                setattr(self, attr, int(value))
        if hasattr(self.base, "complete"):
            self.base.complete(num_classes=self.num_classes, embedding_dim=self.embedding_dim)
        if self.proxies is None and self.embedding_dim is not None:
            self.proxies = nn.Parameter(torch.empty(self.num_proxies, self.embedding_dim))
            self.reset_parameters()
        return self

    def reset_parameters(self) -> None:
        """The authors' start: ``randn(M, D) / sqrt(D) * clip_r * 0.9`` (``clip_r`` 2.3 when clipping is off)."""
        if self.proxies is not None:
            radius = self.clip_r if self.clip_r is not None else 2.3
            with torch.no_grad():
                self.proxies.normal_().mul_(radius * 0.9 / math.sqrt(self.embedding_dim))
        if hasattr(self.base, "reset_parameters"):
            self.base.reset_parameters()

    def extra_repr(self) -> str:
        return (
            f"base={self.base_name!r}, num_proxies={self.num_proxies}, c={self.c}, clip_r={self.clip_r}, "
            f"margin={self.margin}, topk={self.topk}, triplets_per_anchor={self.triplets_per_anchor}, "
            f"weight={self.weight}, base_weight={self.base_weight}"
        )

    # ------------------------------------------------------------------ call
    def _generator(self, device: torch.device) -> torch.Generator | None:
        if self.triplets_per_anchor is None:
            return None
        generator = torch.Generator(device=device)
        generator.manual_seed(self.seed * 1_000_003 + self.calls)
        return generator

    def hier_term(self, points: Tensor, labels: Tensor, proxies: Tensor, generator: torch.Generator | None) -> Tensor:
        """``l_samples + l_proxies`` (Eqs. 3-4) of ball points ``[B, D]`` and ball proxies ``[M, D]``."""
        n = points.shape[0]
        nodes = torch.cat([points, proxies])
        dist = poincare_distance_matrix(nodes, nodes, self.c)
        same = (labels[:, None] == labels[None, :]).to(dist.dtype)
        sim = torch.exp(-dist[:n, :n]).detach() + same
        i, j, k = reciprocal_triplets(sim, self.topk, self.triplets_per_anchor, generator)
        loss = hierarchical_triplet_loss(dist[:n, n:], i, j, k, self.margin)
        sim_p = torch.exp(-dist[n:, n:]).detach()
        i, j, k = reciprocal_triplets(sim_p, self.topk, self.triplets_per_anchor, generator)
        return loss + hierarchical_triplet_loss(dist[n:, n:], i, j, k, self.margin)

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
        indices_tuple: tuple[Tensor, ...] | None = None,
    ) -> Tensor:
        refuse_indices_tuple(self, indices_tuple, ref_embeddings)  # a miner's tuple: the one-line refusal
        name = type(self).__name__
        if isinstance(labels, Tensor) and labels.ndim == 2:
            raise label_sets_error(self, tuple(labels.shape))
        if ref_embeddings is not None or ref_labels is not None:
            raise ValueError(f"{name} scores the batch against its proxies and takes no ref_embeddings / ref_labels")
        if not self.is_complete:
            raise ValueError(
                f"{name} has no proxies yet: give num_classes and embedding_dim, or train it in DMLModule (which "
                "fills them in)"
            )
        check_inputs(embeddings, labels, where=name)
        if embeddings.shape[1] != self.embedding_dim:
            raise ValueError(
                f"{name}: embeddings have dim {embeddings.shape[1]}, its proxies were built for {self.embedding_dim}"
            )
        generator = self._generator(embeddings.device)
        self.calls += 1
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            x = upcast(embeddings)
            points = to_poincare(x, self.c, self.clip_r, self.riemannian)
            proxies = to_poincare(self.proxies.to(x.dtype), self.c, self.clip_r, self.riemannian)
            base = self.base(points, labels)
            total = self.base_weight * base
            if self.weight > 0:
                total = total + self.weight * self.hier_term(points, labels, proxies, generator)
        return upcast(total)
