"""Autograd-aware gathering of the other DDP processes' embeddings (the ``ref_embeddings`` path under DDP)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.distributed import all_gather_uneven, get_rank, get_world_size

__all__ = ["gather_from_other_ranks"]


def gather_from_other_ranks(embeddings: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Embeddings and labels of every OTHER rank, for use as ``ref_embeddings`` / ``ref_labels``.

    The embeddings are gathered with an autograd-aware all-gather
    (:func:`lightning_dml.distributed.all_gather_uneven` with ``with_grad=True``) whose backward sends each rank
    the sum of the gradients all ranks computed for its rows (an all-reduce; works on gloo and NCCL). With the
    loss averaged over each rank's local anchors and DDP averaging the parameter gradients over ``W`` ranks, the
    result equals one process holding the global batch (for equal local batch sizes; see
    ``tests/distributed/run_gather_loss.py``). Ranks may hold different batch sizes (rows are padded for the
    collective and trimmed afterwards).

    Returns empty ``[0, D]`` / ``[0]`` tensors when torch.distributed is not initialised or the world size is 1.
    """
    if get_world_size() == 1:
        return embeddings[:0], labels[:0]
    emb_parts, label_parts = all_gather_uneven(embeddings, labels, with_grad=True)
    rank = get_rank()
    others = [r for r in range(len(emb_parts)) if r != rank]
    return torch.cat([emb_parts[r] for r in others]), torch.cat([label_parts[r] for r in others])
