"""The library's DDP collectives, in one place: used by the losses, the metric and the callbacks.

* :func:`all_gather_with_grad`: all-gather whose backward sends each process the sum of the gradients every
  process computed for its rows (the cross-process ``ref_embeddings`` of the losses).
* :func:`all_gather_uneven`: all-gather of row blocks whose first dimension differs between processes (padded
  for the collective, trimmed afterwards); optionally autograd-aware.
* :func:`all_gather_object`: all-gather of picklable Python objects.
* :func:`is_distributed`, :func:`get_world_size`, :func:`get_rank`.

Every function works on gloo and NCCL (tensors stay on the caller's device; for NCCL that is the process's
CUDA device) and, when ``torch.distributed`` is not available or not initialised, behaves as a world of one
process (the gathers return the caller's own data, without any collective).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "AllGatherGrad",
    "all_gather_object",
    "all_gather_uneven",
    "all_gather_with_grad",
    "get_rank",
    "get_world_size",
    "is_distributed",
]


def is_distributed() -> bool:
    """Whether ``torch.distributed`` is available and its default process group initialised."""
    return dist.is_available() and dist.is_initialized()


def get_world_size(group: Any = None) -> int:
    """Number of processes in ``group`` (the default group when None); 1 outside a distributed run."""
    return dist.get_world_size(group) if is_distributed() else 1


def get_rank(group: Any = None) -> int:
    """This process's rank in ``group`` (the default group when None); 0 outside a distributed run."""
    return dist.get_rank(group) if is_distributed() else 0


class AllGatherGrad(torch.autograd.Function):
    """All-gather of equally shaped tensors whose backward sums every process's gradient for each process's rows.

    Forward: ``x`` of shape ``[N, ...]`` on every process -> a tuple of ``world`` tensors (one per rank). Backward:
    the gradients of the gathered tensors are all-reduced (summed over processes) and each process keeps the
    slice of its own rank, so a loss that uses the rows of other processes sends them their gradient.
    """

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any = None) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.group = group
        out = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(out, x.contiguous(), group=group)
        return tuple(out)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        stacked = torch.stack([g.contiguous() for g in grads])
        dist.all_reduce(stacked, op=dist.ReduceOp.SUM, group=ctx.group)
        return stacked[dist.get_rank(ctx.group)], None


def all_gather_with_grad(x: Tensor, group: Any = None) -> list[Tensor]:
    """Every process's ``x`` (same shape on all processes), in rank order, autograd-aware (:class:`AllGatherGrad`).

    Outside a distributed run: ``[x]``.
    """
    if get_world_size(group) == 1:
        return [x]
    return list(AllGatherGrad.apply(x, group))


def _pad_rows(x: Tensor, rows: int) -> Tensor:
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros((rows - x.shape[0],) + tuple(x.shape[1:]))])


def all_gather_uneven(*tensors: Tensor, group: Any = None, with_grad: bool = False) -> tuple[list[Tensor], ...]:
    """All-gather tensors whose first dimension may differ between processes.

    All ``tensors`` of one process must share their first dimension (e.g. embeddings ``[n, D]`` and labels
    ``[n]``); the number of dimensions, the dtype and the device of each must agree across processes, and so must
    the trailing dimensions of every process that holds rows (a process with no rows may hold e.g. ``[0, 0]``: its
    block takes the others' trailing shape). The shapes are exchanged in one collective, every tensor is padded
    to the longest block for its all-gather, and the padding is dropped.

    Args:
        tensors: the local blocks.
        group: the process group (default group when None).
        with_grad: gather the tensors that require grad with :class:`AllGatherGrad` (the backward returns to
            each process the sum of all processes' gradients for its rows).

    Returns:
        One list per input tensor, each with ``world_size`` blocks in rank order (the caller's own block at index
        :func:`get_rank`). Outside a distributed run: ``([t] for t in tensors)``.
    """
    if not tensors:
        raise ValueError("all_gather_uneven needs at least one tensor")
    rows = tensors[0].shape[0]
    if any(t.shape[0] != rows for t in tensors):
        raise ValueError(
            f"all_gather_uneven: all tensors must have the same number of rows, got {[t.shape[0] for t in tensors]}"
        )
    world = get_world_size(group)
    if world == 1:
        return tuple([t] for t in tensors)
    shape = torch.tensor([d for t in tensors for d in t.shape], dtype=torch.long, device=tensors[0].device)
    shapes_list = [torch.empty_like(shape) for _ in range(world)]
    dist.all_gather(shapes_list, shape, group=group)
    shapes = torch.stack(shapes_list).tolist()  # [world, sum of ndims]
    counts = [s[0] for s in shapes]
    longest = max(counts)
    full = next((s for s in shapes if s[0] > 0), shapes[0])  # trailing dims of a process that holds rows
    out: list[list[Tensor]] = []
    start = 0
    for t in tensors:
        trailing = tuple(full[start + 1 : start + t.ndim])
        start += t.ndim
        local = t if rows > 0 else t.new_zeros((0,) + trailing)
        if tuple(local.shape[1:]) != trailing:
            raise ValueError(
                f"all_gather_uneven: trailing shape {tuple(local.shape[1:])} on rank {get_rank(group)} differs "
                f"from {trailing} on another process"
            )
        padded = _pad_rows(local, longest)
        if with_grad and t.requires_grad:
            parts = list(AllGatherGrad.apply(padded, group))
        else:
            parts = [torch.empty_like(padded) for _ in range(world)]
            dist.all_gather(parts, padded.contiguous(), group=group)
        out.append([p[:n] for p, n in zip(parts, counts)])
    return tuple(out)


def all_gather_object(obj: Any, group: Any = None) -> list[Any]:
    """Every process's picklable ``obj``, in rank order (``torch.distributed.all_gather_object``).

    Tensors inside ``obj`` are pickled with their device (under NCCL move them to CPU first if the receivers
    should not load them onto that device). Outside a distributed run: ``[obj]``.
    """
    world = get_world_size(group)
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    dist.all_gather_object(out, obj, group=group)
    return out
