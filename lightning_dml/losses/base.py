"""Shared pieces of every pair loss, in the spirit of the General Pair Weighting (GPW) paper.

A pair loss is: a ``B x N`` similarity or distance matrix between the ``B`` anchors of the batch and the ``N``
gallery items (the batch itself plus optional reference items), boolean masks from mining
(:mod:`lightning_dml.miners`), weights, and a reduction over the ``B`` anchors. This module holds

* :func:`check_inputs` - shape / dtype / device / NaN-Inf validation with ``ValueError`` naming the problem,
* :func:`similarity_matrix`, :func:`distance_from_similarity` - SPEC 0.3 numerics (fp32, clamp, sqrt floor 1e-12),
* :func:`lse0`, :func:`masked_softmax` - masked log-sum-exp ``log(1 + sum exp)`` and masked softmax (SPEC 0.2),
* :class:`PairLoss` - the ``loss(embeddings, labels, ref_embeddings=None, ref_labels=None, indices_tuple=None)``
  interface (``indices_tuple``: a miner's pairs or triplets, :mod:`lightning_dml.miners.indices`) and the
  class attributes every loss declares (its "anatomy", read by :mod:`lightning_dml.checks` and the module),
* :func:`global_reduction` / :func:`batch_normaliser` - batch-wide reductions under DDP (see below), and
* :class:`ClosedFormPairFunction` - one autograd function whose backward is ``(W + W^T) F``, used by losses that
  know their pair weights ``W = dL/dS`` in closed form (GPW Eq. 4 / MS Eq. 2).

Batch-wide reductions under DDP (``DMLModule(gather_distributed=True)``, ``gather_mode = "references"``)
------------------------------------------------------------------------------------------------------
Process ``r`` of ``W`` holds ``B_r`` anchors and scores them against the global batch (its own rows plus the other
processes' rows as references, gathered with an autograd-aware all-gather). Every such loss is a sum of terms over
(anchor, gallery) pairs or anchors, divided by a batch-wide normaliser ``N`` (a count of pairs, of non-zero terms,
of anchors; ``N = 1`` for a ``sum`` reduction). The single-process loss of the global batch is
``L = (sum_r T_r) / N_global`` with ``T_r`` the sum of process ``r``'s terms and ``N_global = sum_r N_r``.
Process ``r`` returns ``L_r = W T_r / N_global``:

* value: the mean of ``L_r`` over the processes is ``L`` (what Lightning's ``sync_dist`` logging shows);
* gradient: the all-gather's backward hands every process the sum, over all processes, of the gradients of its own
  rows, so process ``r``'s parameter gradient is ``d(sum_s L_s)/d(theta_r)``; DDP then averages the parameter
  gradients over the ``W`` processes: ``(1/W) d(sum_s L_s)/d(theta) = d(sum_s T_s / N_global)/d(theta) = dL/d(theta)``.
  Loss parameters (a learnable margin) get ``(1/W) sum_s dL_s/d(beta) = dL/d(beta)`` the same way.

So a ``sum`` reduction is multiplied by ``W`` on each process, and a mean divides by the all-reduced count and
multiplies by ``W``: :func:`batch_normaliser` returns ``N_global / W`` (``1 / W`` for a sum) inside
:func:`global_reduction`, and ``max(N, 1)`` (``1``) outside it; the counts are detached (they carry no gradient)
and all-reduced in one collective per call. Every process must call it the same number of times per loss call.
Inside an anchor block of a chunked loss (:mod:`lightning_dml.losses.chunking`) it returns the block's share:
``1`` while the counts are captured, then the normaliser of the counts summed over all blocks.
Losses whose terms couple anchors beyond such a normaliser declare ``gather_mode = "global_batch"`` instead (see
:mod:`lightning_dml.losses.distributed`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_dml.distributed import get_world_size
from lightning_dml.losses.chunking import anchor_chunked_loss, check_anchor_chunk_size, chunk_normaliser
from lightning_dml.input_checks import check_embeddings, check_finite, check_integer_labels, check_labels
from lightning_dml.input_checks import check_same_device
from lightning_dml.miners import cat_labels, label_masks
from lightning_dml.miners.indices import check_indices_tuple, restrict_masks
from lightning_dml.scaling import l2_normalize

__all__ = [
    "DIST_EPS",
    "check_inputs",
    "check_label_sets",
    "label_sets_error",
    "indices_tuple_error",
    "refuse_indices_tuple",
    "label_set_losses",
    "upcast",
    "normalize_embeddings",
    "similarity_matrix",
    "distance_from_similarity",
    "squared_distance_from_similarity",
    "distance_and_derivative",
    "lse0",
    "masked_lse",
    "masked_softmax",
    "masked_mean",
    "GATHER_MODES",
    "global_reduction",
    "batch_normaliser",
    "ClosedFormPairFunction",
    "PairLoss",
]

#: floor of ``2 - 2 S`` before the square root (SPEC 0.3 rule 2)
DIST_EPS = 1e-12

PairGradFn = Callable[[Tensor], tuple[Tensor, object]]

#: values of a loss's ``gather_mode`` (``None``: the loss cannot be trained with ``gather_distributed=True``)
GATHER_MODES = ("references", "global_batch")

_GLOBAL_REDUCTION: ContextVar[bool] = ContextVar("lightning_dml_global_reduction", default=False)


@contextmanager
def global_reduction(enabled: bool = True) -> Iterator[None]:
    """Within this context the losses' :func:`batch_normaliser` reduces over all DDP processes (module docstring).

    Entered by :func:`lightning_dml.losses.distributed.gathered_loss` around a ``"references"`` loss call; outside a
    distributed run (world size 1) it changes nothing.
    """
    token = _GLOBAL_REDUCTION.set(enabled)
    try:
        yield
    finally:
        _GLOBAL_REDUCTION.reset(token)


def batch_normaliser(count: Tensor | int | None, like: Tensor) -> Tensor:
    """The divisor of a batch-wide reduction: ``max(count, 1)``, or ``1`` for a sum (``count=None``).

    Inside :func:`global_reduction` under DDP: ``max(sum over processes of count, 1) / W`` (``1 / W`` for a sum),
    so that ``total / batch_normaliser(count)`` makes the processes' losses sum to ``W`` times the global-batch loss
    (derivation in the module docstring). ``count`` may hold several counts (one collective for all); it is
    detached. ``like`` gives the dtype and device of the result.
    """
    in_block = chunk_normaliser(count, like)
    if in_block is not None:
        return in_block
    world = get_world_size() if _GLOBAL_REDUCTION.get() else 1
    if count is None:
        return torch.full((), 1.0 / world, dtype=like.dtype, device=like.device)
    if isinstance(count, Tensor):
        count = count.detach()
    else:  # a host count (number of anchors): a fill, no host-to-device copy
        count = torch.full((), int(count), dtype=torch.long, device=like.device)
    if world > 1:
        count = count.clone()  # integer counts are summed exactly
        dist.all_reduce(count)
    return count.to(like.dtype).clamp(min=1) / world


def indices_tuple_error(loss: object) -> ValueError:
    """The one error for an ``indices_tuple`` (a miner's output) given to a loss that cannot take it: names the
    loss and why (its ``indices_tuple_reason``). Raised by :meth:`PairLoss.compute_mined` and by the losses that
    override ``forward`` (:func:`refuse_indices_tuple`)."""
    reason = getattr(loss, "indices_tuple_reason", None)
    reason = reason or "its definition does not score a chosen set of pairs or triplets"
    return ValueError(f"{type(loss).__name__} does not take indices_tuple (a miner's output): {reason}")


def refuse_indices_tuple(loss: object, indices_tuple: object, ref_embeddings: object = None) -> None:
    """For a loss whose own ``forward`` cannot take a miner's tuple: :func:`indices_tuple_error` when one is given,
    by keyword or in pml's positional place (a tuple where ``ref_embeddings`` goes, as :meth:`PairLoss.forward`
    reads it)."""
    if indices_tuple is not None or isinstance(ref_embeddings, (tuple, list)):
        raise indices_tuple_error(loss)


def label_set_losses() -> list[str]:
    """Registry names of the losses that take label sets (``supports_label_sets``), sorted."""
    from lightning_dml.losses.registry import LOSSES  # the registry is complete once the package is imported

    return sorted(name for name, cls in LOSSES.items() if getattr(cls, "supports_label_sets", False) is True)


def label_sets_error(loss: object, shape: tuple[int, ...] | None = None) -> ValueError:
    """The one error for label sets given to a loss that cannot take them: names the loss, why (its
    ``label_sets_reason``) and what to use instead."""
    name = type(loss).__name__
    got = f" (labels of shape {list(shape)})" if shape is not None else ""
    reason = getattr(loss, "label_sets_reason", None) or "its definition needs one class per item"
    return ValueError(
        f"{name} cannot train on label sets{got}: {reason}. Use one label per item ([B] class ids), or a loss that "
        f"takes label sets (a pair positive when the sets intersect): {', '.join(label_set_losses())}"
    )


def check_label_sets(
    labels: object, length: int, name: str = "labels", *, of: str = "embeddings", where: str | None = None
) -> None:
    """``labels`` must be ``[length]`` class ids or ``[length, L]`` label sets: integers ``>= 0`` padded with ``-1``
    (:mod:`lightning_dml.miners.pairs`). One host read for label sets (their smallest value)."""
    if not isinstance(labels, Tensor) or labels.ndim != 2:
        check_labels(labels, length, name, of=of, where=where)
        return
    prefix = f"{where}: " if where else ""
    check_integer_labels(labels, name, where=where)
    if labels.shape[0] != length:
        raise ValueError(f"{prefix}{name} has {labels.shape[0]} rows (label sets) but {of} has {length} rows")
    if labels.shape[1] == 0:
        raise ValueError(f"{prefix}{name} are label sets of width L = 0; give at least one column (-1 pads)")
    if labels.numel() and int(labels.min()) < -1:
        row = int((labels < -1).any(dim=1).nonzero()[0])
        raise ValueError(
            f"{prefix}{name} (label sets) must hold class ids >= 0 padded with -1, found {int(labels[row].min())} in "
            f"row {row}"
        )


def check_inputs(
    embeddings: Tensor,
    labels: Tensor,
    ref_embeddings: Tensor | None = None,
    ref_labels: Tensor | None = None,
    where: str | None = None,
    label_sets: bool = False,
) -> None:
    """Validate a loss call with :mod:`lightning_dml.input_checks`; ``ValueError`` saying what is wrong and where
    (``where``, e.g. the loss's class name, prefixes the message). ``label_sets``: ``[B, L]`` label sets are
    accepted too (:func:`check_label_sets`)."""
    check_embeddings(embeddings, "embeddings", where=where)
    check = check_label_sets if label_sets else check_labels
    check(labels, embeddings.shape[0], "labels", where=where)
    check_same_device(labels, embeddings, "labels", where=where)
    check_finite(embeddings, "embeddings", where=where)
    if (ref_embeddings is None) != (ref_labels is None):
        raise ValueError(f"{where + ': ' if where else ''}ref_embeddings and ref_labels must be given together")
    if ref_embeddings is None:
        return
    check_embeddings(ref_embeddings, "ref_embeddings", where=where, allow_empty=True)
    check(ref_labels, ref_embeddings.shape[0], "ref_labels", of="ref_embeddings", where=where)
    prefix = f"{where}: " if where else ""
    if ref_embeddings.shape[1] != embeddings.shape[1]:
        raise ValueError(
            f"{prefix}ref_embeddings have dim {ref_embeddings.shape[1]} but embeddings have dim {embeddings.shape[1]}"
        )
    if ref_embeddings.dtype != embeddings.dtype:
        raise ValueError(
            f"{prefix}ref_embeddings dtype {ref_embeddings.dtype} differs from embeddings dtype {embeddings.dtype}"
        )
    check_same_device(ref_embeddings, embeddings, "ref_embeddings", where=where)
    check_same_device(ref_labels, embeddings, "ref_labels", where=where)
    check_finite(ref_embeddings, "ref_embeddings", where=where)


def upcast(x: Tensor) -> Tensor:
    """fp16 / bf16 (and fp32) -> fp32; fp64 stays fp64 (used by the exactness tests)."""
    return x if x.dtype == torch.float64 else x.float()


def normalize_embeddings(x: Tensor) -> Tensor:
    """fp32 upcast and scale-safe L2 normalisation (:func:`lightning_dml.scaling.l2_normalize`: any magnitude,
    a zero vector stays zero)."""
    return l2_normalize(upcast(x), dim=1, eps=1e-12)


def similarity_matrix(anchors: Tensor, gallery: Tensor) -> Tensor:
    """Inner products ``S = A G^T`` in fp32, clamped to ``[-1, 1]`` (SPEC 0.3 rule 1; for unit vectors)."""
    return (upcast(anchors) @ upcast(gallery).T).clamp(-1.0, 1.0)


def distance_from_similarity(sim: Tensor) -> Tensor:
    """Euclidean distance on the unit sphere ``D = sqrt(max(2 - 2S, 1e-12))`` (SPEC 0.3 rule 2)."""
    return torch.sqrt(torch.clamp(2.0 - 2.0 * sim, min=DIST_EPS))


def squared_distance_from_similarity(sim: Tensor) -> Tensor:
    """Squared Euclidean distance on the unit sphere ``D^2 = max(2 - 2S, 0)`` (no square root, no floor needed)."""
    return torch.clamp(2.0 - 2.0 * sim, min=0.0)


def distance_and_derivative(sim: Tensor, squared: bool = False) -> tuple[Tensor, Tensor]:
    """``D`` (or ``D^2``) from ``S`` and ``dD/dS`` as autograd computes it through the clamps (no autograd)."""
    gap = 2.0 - 2.0 * sim
    if squared:
        return gap.clamp(min=0.0), torch.where(gap >= 0.0, -2.0, 0.0)
    dist = torch.sqrt(gap.clamp(min=DIST_EPS))
    return dist, torch.where(gap >= DIST_EPS, -1.0 / dist, 0.0)


def lse0(x: Tensor, mask: Tensor, dim: int = 1) -> Tensor:
    """``log(1 + sum_{mask} exp(x))`` along ``dim`` (SPEC 0.2 LSE0).

    Masked entries are ignored; an empty row gives exactly 0 with zero gradient. Stable for large ``x``.
    """
    x = x.masked_fill(~mask, float("-inf"))
    shift = x.amax(dim=dim, keepdim=True).clamp(min=0.0).detach()
    total = torch.exp(x - shift).sum(dim=dim, keepdim=True) + torch.exp(-shift)
    return (shift + torch.log(total)).squeeze(dim)


def masked_lse(x: Tensor, mask: Tensor, dim: int = 1) -> Tensor:
    """``log(sum_{mask} exp(x))`` along ``dim``; an empty row gives ``-inf`` (callers must mask it out)."""
    x = x.masked_fill(~mask, float("-inf"))
    shift = x.amax(dim=dim, keepdim=True).detach()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    return (shift + torch.log(torch.exp(x - shift).sum(dim=dim, keepdim=True))).squeeze(dim)


def masked_softmax(x: Tensor, mask: Tensor, dim: int = 1) -> Tensor:
    """Softmax of ``x`` over the True entries of ``mask``; masked entries and all-False rows give 0."""
    x = x.masked_fill(~mask, float("-inf"))
    shift = x.amax(dim=dim, keepdim=True).detach()
    shift = torch.where(torch.isfinite(shift), shift, torch.zeros_like(shift))
    e = torch.exp(x - shift)
    return e / e.sum(dim=dim, keepdim=True).clamp(min=torch.finfo(e.dtype).tiny)


def masked_mean(x: Tensor, mask: Tensor, dim: int = 1) -> Tensor:
    """Mean of ``x`` over the True entries of ``mask``; an empty row gives 0 (a per-row mean: local to the row)."""
    return (x * mask).sum(dim=dim) / mask.sum(dim=dim).clamp(min=1)


class ClosedFormPairFunction(torch.autograd.Function):
    """Loss from a similarity matrix with a closed-form backward (GPW Eq. 4, MS Eq. 2).

    ``forward(anchors, gallery, fn)`` evaluates the raw products ``R = A G^T`` and ``fn(R) -> (loss, W)``
    where ``W = dL/dS`` (``S = clamp(R, -1, 1)``) is computed by the loss itself without autograd. The backward is
    ``W G`` for the anchors and ``W^T A`` for the gallery; when ``gallery is None`` the gallery is the batch and
    the gradient is ``(W + W^T) A``. ``W`` may also be given
    sparse, as ``(rows, cols, values)`` of its non-zero entries; the backward is then two ``index_add`` over those
    pairs instead of a ``B x N x D`` product. No ``B x B`` autograd intermediates are kept.
    """

    @staticmethod
    def forward(ctx, anchors: Tensor, gallery: Tensor | None, fn: PairGradFn) -> Tensor:  # type: ignore[override]
        g = anchors if gallery is None else gallery
        raw = anchors @ g.T
        out = fn(raw)
        loss, weights = out[0], out[1]
        ctx.sparse = isinstance(weights, tuple)
        if ctx.sparse:
            # (rows, cols, values): only the listed pairs have a non-zero weight
            rows, cols, vals = weights
            r = raw[rows, cols]
            vals = vals * ((r >= -1.0) & (r <= 1.0))  # the clamp passes no gradient outside [-1, 1]
            ctx.save_for_backward(anchors, gallery, rows, cols, vals)
            return loss
        weights = weights.masked_fill((raw < -1.0) | (raw > 1.0), 0.0)
        ctx.save_for_backward(anchors, gallery, weights)
        return loss

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        if ctx.sparse:
            anchors, gallery, rows, cols, vals = ctx.saved_tensors
            g = anchors if gallery is None else gallery
            grad_a = torch.zeros_like(anchors).index_add_(0, rows, vals[:, None] * g[cols])
            grad_g = torch.zeros_like(g).index_add_(0, cols, vals[:, None] * anchors[rows])
            if gallery is None:
                return grad_out * (grad_a + grad_g), None, None
            return grad_out * grad_a, grad_out * grad_g, None
        anchors, gallery, weights = ctx.saved_tensors
        if gallery is None:
            # two products: forming W + W^T first is slower on CPU (strided transpose read)
            grad_a = weights @ anchors + weights.T @ anchors
            return grad_out * grad_a, None, None
        grad_a = grad_out * (weights @ gallery) if ctx.needs_input_grad[0] else None
        grad_g = grad_out * (weights.T @ anchors) if ctx.needs_input_grad[1] else None
        return grad_a, grad_g, None


class PairLoss(nn.Module):
    """Base class: validation, fp32 upcast, normalisation and the reference-gallery path.

    Subclasses implement :meth:`pair_loss` (``S``, masks -> scalar, differentiable by autograd) and may implement
    :meth:`pair_loss_and_grad` (same value plus ``dL/dS`` in closed form), which is then used for speed when
    ``closed_form=True``.

    Call: ``loss(embeddings [B, D], labels [B], ref_embeddings=None [M, D], ref_labels=None [M])``; returns an fp32
    scalar (computed in fp32 with autocast disabled; fp64 inputs are computed and returned in fp64). Reference items
    are extra gallery columns: every anchor of the batch is scored against the batch (its self-pair removed by
    index) and the ``M`` references; the reduction is over the ``B`` batch anchors.

    A loss with ``supports_label_sets = True`` also takes label sets ``labels [B, L]`` (``ref_labels [M, L']``)
    padded with ``-1``: a pair is positive when the two sets intersect (:mod:`lightning_dml.miners.pairs`, the one
    place that turns labels into pair masks); the others raise :func:`label_sets_error`.
    """

    # ---- the loss's anatomy: what it needs and supports (read by lightning_dml.checks and DMLModule; a subclass
    # overrides them as class attributes, or per instance where an option changes them)
    #: whether the loss L2-normalises the embeddings (all but N-pair)
    normalize: bool = True
    #: whether the loss can score the batch against reference items (``ref_embeddings``)
    supports_ref: bool = True
    #: whether every training batch must hold a positive pair (two items of one class)
    needs_positive_pairs: bool = True
    #: whether the loss holds learnable parameters (its own optimizer group in ``DMLModule``)
    has_parameters: bool = False
    #: whether the loss needs ``num_classes`` (filled in by ``DMLModule`` through its ``complete`` method)
    needs_num_classes: bool = False
    #: whether the loss needs the embedding width alone (``CrossBatchMemory``'s memory), filled in the same way
    needs_embedding_dim: bool = False
    #: the batch sampler the loss's batch structure needs (``"npair"``), or None for any P x K batch
    required_sampler: str | None = None
    #: how the loss runs under ``DMLModule(gather_distributed=True)``
    #: (:func:`lightning_dml.losses.distributed.gathered_loss`): ``"references"`` - each process scores its
    #: anchors against the other processes' embeddings with batch-wide :func:`batch_normaliser` reductions;
    #: ``"global_batch"`` - every process computes the loss of the whole gathered batch (for losses whose terms
    #: couple anchors; exact, at W times the loss's compute); ``None`` - not supported, rejected when fit starts.
    #: The default is the one that is exact for any deterministic loss.
    gather_mode: str | None = "global_batch"
    #: whether the loss takes label sets (``[B, L]`` padded with -1, a pair positive when the sets intersect): true
    #: for the losses whose definition only asks "is this pair positive" (:mod:`lightning_dml.miners.pairs`)
    supports_label_sets: bool = False
    #: why it does not (named in :func:`label_sets_error`; read when ``supports_label_sets`` is False)
    label_sets_reason: str | None = None
    #: whether the loss takes ``anchor_chunk_size`` (:mod:`lightning_dml.losses.chunking`): true for the losses
    #: whose value is a sum of per-anchor terms over batch-wide :func:`batch_normaliser` counts
    supports_anchor_chunks: bool = False
    #: whether the loss takes ``indices_tuple`` (a miner's pairs or triplets, :mod:`lightning_dml.miners.indices`):
    #: true for the losses whose definition is over a set of pairs (their ``pair_loss`` restricted to the tuple's
    #: masks) or of triplets (``triplet_tuple_loss``); the others refuse it with ``indices_tuple_reason``
    supports_indices_tuple: bool = False
    #: why it does not (named in the refusal)
    indices_tuple_reason: str | None = None

    def __init__(self) -> None:
        super().__init__()
        self.closed_form = True
        #: score the anchors ``anchor_chunk_size`` at a time (``None``: all at once); see :meth:`set_anchor_chunk_size`
        self.anchor_chunk_size: int | None = None

    def set_anchor_chunk_size(self, value: int | None) -> None:
        """Build the ``B x N`` similarity matrix and its graph ``value`` anchors at a time, recomputed in the
        backward (:mod:`lightning_dml.losses.chunking`): memory ``O(value x N)`` instead of ``O(B x N)``, the same
        value and gradients. ``None`` turns it off. ``ValueError`` for a loss without ``supports_anchor_chunks``."""
        name = type(self).__name__
        value = check_anchor_chunk_size(value, name)
        if value is not None and not self.supports_anchor_chunks:
            raise ValueError(
                f"{name}({self.extra_repr()}) does not take anchor_chunk_size: its terms are not a sum over anchors "
                "with batch-wide counts (docs/losses/README.md, section 'Memory: anchor_chunk_size')"
            )
        self.anchor_chunk_size = value

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
        indices_tuple: tuple[Tensor, ...] | None = None,
    ) -> Tensor:
        """Loss of the batch (module docstring); ``indices_tuple``: a miner's pairs ``(a1, p, a2, n)`` or triplets
        ``(a, p, n)`` that restrict the loss's pairs or triplets (:mod:`lightning_dml.miners.indices`). pml's
        positional order ``loss(embeddings, labels, indices_tuple, ref_emb, ref_labels)`` is accepted too: a tuple
        in the third place is the indices tuple."""
        if isinstance(ref_embeddings, (tuple, list)):  # pml's order: (embeddings, labels, indices_tuple, ref_emb, ...)
            indices_tuple, ref_embeddings, ref_labels = ref_embeddings, ref_labels, indices_tuple  # type: ignore
        if not self.supports_label_sets and any(isinstance(t, Tensor) and t.ndim == 2 for t in (labels, ref_labels)):
            raise label_sets_error(self, tuple(labels.shape))
        check_inputs(
            embeddings, labels, ref_embeddings, ref_labels, where=type(self).__name__,
            label_sets=self.supports_label_sets,
        )
        if ref_embeddings is not None and not self.supports_ref:
            raise ValueError(
                f"{type(self).__name__} cannot score against ref_embeddings (its batch structure is fixed); "
                "call it without ref_embeddings / ref_labels"
            )
        device_type = embeddings.device.type
        with torch.autocast(device_type=device_type, enabled=False):
            anchors = normalize_embeddings(embeddings) if self.normalize else upcast(embeddings)
            if ref_embeddings is None:
                gallery, gallery_labels = None, labels
            else:
                ref = normalize_embeddings(ref_embeddings) if self.normalize else upcast(ref_embeddings)
                gallery, gallery_labels = torch.cat([anchors, ref]), cat_labels(labels, ref_labels)
            chunk = self.anchor_chunk_size
            if indices_tuple is not None:
                n_gallery = anchors.shape[0] if gallery is None else gallery.shape[0]
                loss = self.compute_mined(anchors, labels, gallery, gallery_labels, indices_tuple, n_gallery)
            elif chunk is not None and anchors.shape[0] > chunk:
                params = [p for p in self.parameters() if p.requires_grad]
                loss = anchor_chunked_loss(
                    self.compute, anchors, labels, gallery, gallery_labels, chunk, params, batch_normaliser
                )
            else:
                loss = self.compute(anchors, labels, gallery, gallery_labels)
        return upcast(loss)

    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        """Loss of normalised fp32 ``anchors`` against ``gallery`` (``None`` = the batch itself)."""
        pos, neg = label_masks(labels, gallery_labels)
        if getattr(self, "detach_gallery", False):
            # the gallery side is a constant (RLL's gradient path): only the anchor rows get a gradient
            gallery = (anchors if gallery is None else gallery).detach()
        if self.closed_form and self._has_closed_form():
            return ClosedFormPairFunction.apply(
                anchors, gallery, lambda raw: self.pair_loss_and_grad(raw.clamp(-1.0, 1.0), pos, neg)
            )
        g = anchors if gallery is None else gallery
        return self.pair_loss(similarity_matrix(anchors, g), pos, neg)

    def compute_mined(
        self,
        anchors: Tensor,
        labels: Tensor,
        gallery: Tensor | None,
        gallery_labels: Tensor,
        indices_tuple: tuple[Tensor, ...],
        num_gallery: int,
    ) -> Tensor:
        """Loss restricted to ``indices_tuple`` (:mod:`lightning_dml.miners.indices`): a triplet tuple to a loss
        with ``triplet_tuple_loss`` scores exactly those triplets; otherwise :meth:`pair_loss` (or its closed form)
        runs on the label masks restricted to the tuple's pairs. Refused (``ValueError``, one line) by a loss
        without ``supports_indices_tuple`` and with ``anchor_chunk_size``."""
        name = type(self).__name__
        if not self.supports_indices_tuple:
            raise indices_tuple_error(self)
        if self.anchor_chunk_size is not None:
            raise ValueError(f"{name}: indices_tuple does not combine with anchor_chunk_size; set one of them")
        tuples = check_indices_tuple(indices_tuple, anchors.shape[0], num_gallery, anchors.device, where=name)
        pos, neg = label_masks(labels, gallery_labels)
        if getattr(self, "detach_gallery", False):
            gallery = (anchors if gallery is None else gallery).detach()
        g = anchors if gallery is None else gallery
        if len(tuples) == 3 and hasattr(self, "triplet_tuple_loss"):
            a, p, n = tuples
            restrict_masks((a, p, a, n), pos, neg, where=name)  # the triplets agree with the labels
            sim_ap = (anchors[a] * g[p]).sum(dim=1).clamp(-1.0, 1.0)
            sim_an = (anchors[a] * g[n]).sum(dim=1).clamp(-1.0, 1.0)
            return self.triplet_tuple_loss(sim_ap, sim_an, (a, p, n))
        pos, neg = restrict_masks(tuples, pos, neg, where=name)
        closed = self.closed_form and self._has_closed_form()  # off per instance too (a pml reducer: autograd)
        if closed and type(self).pair_loss_and_grad is not PairLoss.pair_loss_and_grad:
            return ClosedFormPairFunction.apply(
                anchors, gallery, lambda raw: self.pair_loss_and_grad(raw.clamp(-1.0, 1.0), pos, neg)
            )
        return self.pair_loss(similarity_matrix(anchors, g), pos, neg)

    def _has_closed_form(self) -> bool:
        return type(self).pair_loss_and_grad is not PairLoss.pair_loss_and_grad

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        """Scalar loss from the ``B x N`` similarity matrix and the label masks (autograd path)."""
        raise NotImplementedError

    def pair_loss_and_grad(self, sim: Tensor, pos: Tensor, neg: Tensor) -> tuple[Tensor, Tensor]:
        """Scalar loss and ``dL/dS`` in closed form (optional fast path)."""
        raise NotImplementedError
