"""Autograd-aware gathering of the other DDP processes' embeddings (the ``ref_embeddings`` path under DDP)."""

from __future__ import annotations

from typing import List, Tuple

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["gather_from_other_ranks"]


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] == rows:
        return x
    pad = x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))
    return torch.cat([x, pad])


class _AllGather(torch.autograd.Function):
    """All-gather whose backward sums every rank's gradient for each rank's rows (all-reduce, then own slice)."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tuple[Tensor, ...]:  # type: ignore[override]
        out = [torch.empty_like(x) for _ in range(dist.get_world_size())]
        dist.all_gather(out, x.contiguous())
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads: Tensor) -> Tensor:  # type: ignore[override]
        stacked = torch.stack([g.contiguous() for g in grads])
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM)
        return stacked[dist.get_rank()]


def gather_from_other_ranks(embeddings: Tensor, labels: Tensor) -> Tuple[Tensor, Tensor]:
    """Embeddings and labels of every OTHER rank, for use as ``ref_embeddings`` / ``ref_labels``.

    The embeddings are gathered with an autograd-aware all-gather (:class:`_AllGather`) whose backward sends each
    rank the sum of the gradients all ranks computed for its rows (an all-reduce; works on gloo and NCCL). With the loss averaged over each rank's local
    anchors and DDP averaging the parameter gradients over ``W`` ranks, the result equals one process holding the
    global batch (for equal local batch sizes; see ``tests/distributed/run_gather_loss.py``). Ranks may hold
    different batch sizes (rows are padded for the collective and trimmed afterwards).

    Returns empty ``[0, D]`` / ``[0]`` tensors when torch.distributed is not initialised or the world size is 1.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return embeddings[:0], labels[:0]
    world, rank = dist.get_world_size(), dist.get_rank()
    size = torch.tensor([embeddings.shape[0]], device=embeddings.device)
    sizes: List[Tensor] = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    counts = [int(s.item()) for s in sizes]
    rows = max(counts)
    gathered = _AllGather.apply(_pad_rows(embeddings, rows))
    label_list = [torch.zeros(rows, dtype=labels.dtype, device=labels.device) for _ in range(world)]
    dist.all_gather(label_list, _pad_rows(labels, rows).contiguous())
    others = [r for r in range(world) if r != rank]
    ref = torch.cat([gathered[r][: counts[r]] for r in others])
    ref_labels = torch.cat([label_list[r][: counts[r]] for r in others])
    return ref, ref_labels
