"""Hyp-ViT's pairwise cross-entropy on the hyperbolic distance (Ermolov et al., "Hyperbolic Vision Transformers:
Combining Improvements in Metric Learning", CVPR 2022, Sec. 3.3, Eq. 5).

The paper: for a positive pair ``(z_i, z_j)`` of the batch, ``l_ij = -log( exp(-d(z_i, z_j) / tau) /
sum_{k != i} exp(-d(z_i, z_k) / tau) )`` with ``d`` the Poincare distance (Eq. 4) of the embeddings mapped into the
ball. Where the paper is silent this follows the authors' code (htdt/hyp_metric, ``train.py``:
``contrastive_loss``):

* the batch holds ``K`` samples of each class (``UniqueClassSampler``, ``num_samples``); sample ``v`` of every class
  is "view ``v``". Here the view of an item is its occurrence index among the items of its label (the first item of
  a label is view 0, ...), which is the authors' ``z.view(B // K, K, D)[:, v]`` for their class-contiguous batches;
* for every ordered pair of views ``(v, w)``, ``v != w``, each anchor of view ``v`` is classified against the items
  of view ``w`` and the OTHER items of view ``v`` (``cat([logits01, logits00 - 1e9 I])``), target: its class's item
  of view ``w``. The other views' items are not candidates (for ``K = 2``: every other item of the batch is);
* cross-entropy mean over the anchors of each view pair, summed over the ``K (K - 1)`` ordered view pairs (the
  authors' ``loss += l``; ``2 x`` the mean for ``K = 2``). A class without an item in view ``w`` has no anchor for
  ``(v, w)`` (uneven batches; the authors' sampler never makes them); a view pair without anchors adds 0;
* the embeddings are Euclidean (the output of ``DMLModule``'s linear head) and mapped into the ball here by the last
  layer of the authors' head (:func:`~lightning_dml.models.hyperbolic.to_poincare`: clip to ``clip_r = 2.3``,
  ``exp_0``, projection; no Riemannian gradient, ``riemannian=False`` in their ``init_model``);
* defaults of their ``Config``: ``c = 0.1``, ``tau = 0.2``, ``clip_r = 2.3``.

Deviations: the distance is evaluated from the Gram matrix (exact closed form,
:func:`~lightning_dml.models.hyperbolic.poincare_distance_matrix`) without hyptorch's ``+1e-5`` in the Moebius
denominator and its ``artanh`` clamp at ``1 - 1e-5`` (the clipped points stay within ``sqrt(c) ||x|| <= tanh(
sqrt(c) clip_r)``, far from where those guards act).

Under ``DMLModule(gather_distributed=True)`` the loss is that of the gathered global batch (``gather_mode =
"global_batch"``): views are occurrence indices in rank order, as for one process holding the concatenation (the
authors' DDP code gathers the batch and computes the same loss on it).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_dml.losses.base import PairLoss, check_inputs, label_sets_error, refuse_indices_tuple, upcast
from lightning_dml.losses.registry import register_loss
from lightning_dml.models.hyperbolic import check_curvature, poincare_distance_matrix, to_poincare

__all__ = ["HypViTLoss", "view_indices", "hyp_vit_loss"]


def view_indices(labels: Tensor) -> Tensor:
    """Occurrence index of each item among the items of its label: ``[0, 0, 1, 2, 1]`` for ``[a, b, a, a, b]``."""
    same = labels[:, None] == labels[None, :]
    earlier = torch.ones_like(same).tril(diagonal=-1)
    return (same & earlier).sum(dim=1)


def hyp_vit_loss(distances: Tensor, labels: Tensor, tau: float) -> Tensor:
    """Hyp-ViT's loss (module docstring) from the ``[B, B]`` distances of the batch's ball points and its labels.

    For anchor ``a`` (view ``v``) and positive ``p`` (view ``w``): ``CE(a, p) = d(a, p) / tau + log sum_{n in C}
    exp(-d(a, n) / tau)`` over ``C`` = the items of views ``v`` and ``w`` except ``a``; the loss is ``sum over
    positive pairs of CE(a, p) / (number of anchors of the view pair (v, w))``.
    """
    n = labels.shape[0]
    views = view_indices(labels)
    num_views = int(views.max()) + 1 if n else 1
    one_hot = F.one_hot(views, num_views).to(distances.dtype)  # [B, V]
    logits = -distances / tau
    eye = torch.eye(n, dtype=torch.bool, device=distances.device)
    shift = logits.masked_fill(eye, float("-inf")).amax(dim=1, keepdim=True).detach()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    exp = torch.exp(logits - shift).masked_fill(eye, 0.0)
    per_view = exp @ one_hot  # [B, V]: sum of exp over the items of each view, the anchor left out
    own = per_view.gather(1, views[:, None])  # the anchor's own view
    # partition function of anchor a against view w: its own view plus view w (own counted once when w == v)
    log_z = shift + torch.log((per_view + own).clamp(min=torch.finfo(exp.dtype).tiny))  # [B, V]
    positive = (labels[:, None] == labels[None, :]) & ~eye
    ce = log_z.gather(1, views[None, :].expand(n, n)) - logits  # CE(a, p) for p in column p
    # anchors of the view pair (v, w): items of view v whose label has an item of view w
    has_view = (positive.to(distances.dtype) @ one_hot) > 0  # [B, V]: a has a positive in view w
    counts = one_hot.T @ has_view.to(distances.dtype)  # [V, V]: anchors of (v, w)
    weight = counts[views[:, None], views[None, :]].clamp(min=1.0)
    terms = torch.where(positive, ce / weight, torch.zeros_like(ce))
    return terms.sum()


@register_loss("hyp_vit")
class HypViTLoss(PairLoss):
    """Hyp-ViT's pairwise cross-entropy on the Poincare distance (Ermolov et al., CVPR 2022, Eq. 5; module
    docstring for what follows the authors' code).

    Args:
        c: curvature of the ball is ``-c`` (``hyp_c``, 0.1).
        tau: temperature of the cross-entropy (``t``, 0.2).
        clip_r: feature clipping radius before the exponential map (2.3); ``None``: no clipping.

    Call: ``loss(embeddings [B, D], labels [B])``: Euclidean embeddings (mapped into the ball here), a P x K batch
    (``K >= 2`` for any term). No reference embeddings (the view structure is the batch's), no label sets (a view is
    the k-th item of one class).
    """

    normalize = False
    supports_ref = False
    gather_mode = "global_batch"
    supports_label_sets = False
    label_sets_reason = "its views are the k-th items of each class (one class per item, as the authors' sampler)"

    def __init__(self, c: float = 0.1, tau: float = 0.2, clip_r: float | None = 2.3) -> None:
        super().__init__()
        self.c, self.clip_r = check_curvature(c, clip_r, type(self).__name__)
        tau = float(tau)
        if not math.isfinite(tau) or tau <= 0:
            raise ValueError(f"HypViTLoss: tau must be a finite number > 0, got {tau}")
        self.tau = tau

    def extra_repr(self) -> str:
        return f"c={self.c}, tau={self.tau}, clip_r={self.clip_r}"

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
            raise ValueError(
                f"{name} cannot score against ref_embeddings (its views are the batch's own items); call it without "
                "ref_embeddings / ref_labels"
            )
        check_inputs(embeddings, labels, where=name)
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            points = to_poincare(upcast(embeddings), self.c, self.clip_r)
            distances = poincare_distance_matrix(points, points, self.c)
            return hyp_vit_loss(distances, labels, self.tau)
