"""The losses under DDP with ``DMLModule(gather_distributed=True)``: every loss equals one process holding the
global batch (the concatenation of all processes' batches in rank order), for every reduction option.

Each loss declares how (its ``gather_mode`` class attribute, see :class:`~lightning_dml.losses.base.PairLoss`):

* ``"references"``: the process scores its own anchors against the other processes' embeddings, gathered by
  :func:`gather_from_other_ranks` as ``ref_embeddings``, inside
  :func:`~lightning_dml.losses.base.global_reduction`: batch-wide counts are all-reduced and the loss is scaled by
  the world size ``W`` to undo DDP's gradient average (derivation in :mod:`lightning_dml.losses.base`). The value
  differs between processes; their mean is the global-batch loss.
* ``"global_batch"``: every process gathers all embeddings (autograd-aware) and computes the loss of the whole
  global batch. The all-gather's backward sums the ``W`` identical gradients of each process's rows (``W`` times
  the global-batch gradient), and DDP's average over ``W`` processes divides it out again; loss parameters get the
  same gradient on every process. Used where terms couple anchors beyond a count (Proxy-Anchor's per-proxy sums,
  the original lifted structure, the tuplet-margin variance, Cross-Batch Memory's queue, ranking losses). The
  value is the global-batch loss on every process.
* ``None``: rejected by :func:`lightning_dml.checks.check_gather_combination` when fit starts (N-pair's fixed
  batch structure; the per-sample proxy and classification losses, which are exact under DDP without gathering
  when the processes hold equal batch sizes).

Random choices inside a loss (tuplet margin's random negatives) are the same on every process only with the
loss's ``seed`` set.

Label sets (``[B, L]`` padded with -1, for the losses with ``supports_label_sets``) are gathered like labels after
padding every process's block to the widest ``L`` (one extra all-reduce); every process must then hold label sets
(a data module yields the same kind on every process).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import torch.distributed as dist

from lightning_dml.distributed import all_gather_uneven, get_rank, get_world_size
from lightning_dml.losses.base import global_reduction
from lightning_dml.miners.pairs import as_label_sets

__all__ = ["gather_from_other_ranks", "gathered_loss"]


def _common_width(labels: Tensor) -> Tensor:
    """Label sets padded with -1 to the widest ``L`` over the processes (labels ``[B]`` unchanged)."""
    if labels.ndim != 2:
        return labels
    width = torch.tensor([labels.shape[1]], dtype=torch.long, device=labels.device)
    dist.all_reduce(width, op=dist.ReduceOp.MAX)
    return as_label_sets(labels, int(width.item()))


def gather_from_other_ranks(embeddings: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Embeddings and labels of every OTHER rank, for use as ``ref_embeddings`` / ``ref_labels``.

    The embeddings are gathered with an autograd-aware all-gather
    (:func:`lightning_dml.distributed.all_gather_uneven` with ``with_grad=True``) whose backward sends each rank
    the sum of the gradients all ranks computed for its rows (an all-reduce; works on gloo and NCCL). Ranks may
    hold different batch sizes (rows are padded for the collective and trimmed afterwards). Called by
    :func:`gathered_loss` for ``"references"`` losses, whose batch-wide reductions then make the result equal one
    process holding the global batch.

    Returns empty ``[0, D]`` / ``[0]`` tensors when torch.distributed is not initialised or the world size is 1.
    """
    if get_world_size() == 1:
        return embeddings[:0], labels[:0]
    emb_parts, label_parts = all_gather_uneven(embeddings, _common_width(labels), with_grad=True)
    rank = get_rank()
    others = [r for r in range(len(emb_parts)) if r != rank]
    return torch.cat([emb_parts[r] for r in others]), torch.cat([label_parts[r] for r in others])


def gathered_loss(loss: nn.Module, embeddings: Tensor, labels: Tensor) -> Tensor:
    """``loss`` of this process's batch under DDP such that, after DDP's gradient average, the gradients (and the
    mean value over processes) equal one process holding the global batch (module docstring).

    Outside a distributed run (world size 1) this is ``loss(embeddings, labels)``. A loss with
    ``gather_mode=None`` raises ``ValueError`` (``DMLModule`` rejects it before training starts).
    """
    if get_world_size() == 1:
        return loss(embeddings, labels)
    mode = getattr(loss, "gather_mode", None)
    if mode == "references":
        ref_embeddings, ref_labels = gather_from_other_ranks(embeddings, labels)
        with global_reduction():
            return loss(embeddings, labels, ref_embeddings=ref_embeddings, ref_labels=ref_labels)
    if mode == "global_batch":
        emb_parts, label_parts = all_gather_uneven(embeddings, _common_width(labels), with_grad=True)
        return loss(torch.cat(emb_parts), torch.cat(label_parts))
    raise ValueError(
        f"{type(loss).__name__} declares gather_mode={mode!r}: it cannot be trained with gather_distributed=True"
    )
