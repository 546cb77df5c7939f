"""Gradient caching: embed a batch in chunks so that activation memory is bounded by the chunk, not the batch.

Gao, Zhang, Han and Callan, "Scaling Deep Contrastive Learning Batch Size under Memory Limited Setup" (RepL4NLP
2021), Sec. 3: (1) embed the batch chunk by chunk without keeping the chunks' activations; (2) compute the loss over
the whole batch (under DDP with ``gather_distributed``: over the gathered global batch) and its gradient with
respect to the embeddings, the "gradient cache"; (3) run each chunk's forward again, this time with its graph, and
back-propagate the cached embedding gradients of its rows into the parameters. The parameter gradients are the sum
over chunks of ``J_chunk^T g_chunk``, which is the gradient of the unchunked step (the chain rule, split by rows).

:func:`chunked_embeddings` expresses the three steps as ONE autograd graph: every chunk runs under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, which keeps only the chunk's input and output
(step 1); the caller computes the loss on the concatenated embeddings and calls ``backward`` once; the autograd
engine reaches each chunk's checkpoint only after the loss's backward has produced the gradient of all embeddings
(step 2), recomputes that chunk's activations when its backward first needs them, and frees them as it goes
(step 3). The engine runs the nodes of the most recently created chunk first, so one chunk's activations are live
at a time. Because the whole step is one ``backward`` of one loss, everything a trainer does with that loss is
unchanged: automatic optimization, precision plugins (the autocast state of the first pass is replayed), gradient
clipping, gradient accumulation, schedulers, and DDP, whose gradient all-reduce runs once per step (each
parameter's gradient accumulator fires once, after all chunks) rather than once per chunk.

Replayed state:

* random draws (dropout, timm's drop-path): the CPU RNG state and that of the inputs' accelerator (CUDA) are saved
  before each chunk's first pass and restored for its second (``preserve_rng_state=True``), so both passes draw the
  same masks;
* BatchNorm layers in training mode: their running statistics are updated in the first pass only (the second pass
  runs them with ``momentum=0`` and gives back the ``num_batches_tracked`` increment), so a step updates them
  once per chunk, as the first pass saw the chunks. Their *batch* statistics are those of the chunk, not of the
  batch: the loss and gradients then differ from the unchunked step. Frozen BatchNorm (eval mode, running
  statistics) and per-sample normalisations (LayerNorm: ViTs) are exact.

Cost: one more forward of the embedding model per step (about a third more compute for a forward + backward).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

__all__ = ["batch_statistics_layers", "check_chunk_size", "chunked_embeddings", "running_statistics_kept"]

#: BatchNorm layers: in training mode they normalise with the statistics of the batch they see (here: a chunk)
_BATCH_NORMS = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)


def check_chunk_size(chunk_size: Any, name: str = "embedding_chunk_size") -> int | None:
    """``chunk_size`` as an ``int`` (``None``: no chunking); a non-integer or a value below 1 raises ``ValueError``
    naming ``name``."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"{name} must be a positive integer or None, got {chunk_size!r}")
    return int(chunk_size)


def batch_statistics_layers(module: nn.Module) -> list[nn.Module]:
    """The BatchNorm layers of ``module`` in training mode: with chunking they normalise each chunk by its own
    statistics, so the step is not the unchunked one (see the module docstring)."""
    return [m for m in module.modules() if isinstance(m, _BATCH_NORMS) and m.training]


@contextmanager
def running_statistics_kept(module: nn.Module) -> Iterator[None]:
    """Within the block, normalisation layers of ``module`` that track running statistics in training mode leave
    them as they were: ``momentum`` is 0 (the running mean and variance are multiplied by 1 and added 0 times the
    batch's, in place, so their autograd versions stay consistent) and ``num_batches_tracked`` is set back after."""
    layers = [
        m for m in module.modules()
        if m.training and getattr(m, "track_running_stats", False) and getattr(m, "running_mean", None) is not None
    ]
    saved = [(m, m.momentum, m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None)
             for m in layers]
    for m in layers:
        m.momentum = 0.0
    try:
        yield
    finally:
        for m, momentum, tracked in saved:
            m.momentum = momentum
            if tracked is not None:
                with torch.no_grad():
                    m.num_batches_tracked.copy_(tracked)


def _concat(outputs: list[Any]) -> Tensor | list[Tensor]:
    first = outputs[0]
    if isinstance(first, Tensor):
        return torch.cat(outputs)
    return [torch.cat([out[i] for out in outputs]) for i in range(len(first))]


def chunked_embeddings(
    embed: Callable[[Tensor], Tensor | Sequence[Tensor]],
    images: Tensor,
    chunk_size: int | None,
    model: nn.Module,
) -> Tensor | list[Tensor]:
    """``embed(images)`` computed in chunks of ``chunk_size`` rows with gradient caching (module docstring).

    Args:
        embed: maps a batch of images to its embeddings (``[n, D]``) or to a sequence of them (one per level).
        images: the batch, ``[B, ...]``.
        chunk_size: rows per chunk (the last chunk may be smaller); ``None``, or a batch of at most one chunk, or
            grad mode off: ``embed(images)`` unchanged.
        model: the module(s) ``embed`` runs, whose running normalisation statistics the second pass must not
            update again.

    Returns:
        The embeddings of the whole batch (a list of them, one per level, when ``embed`` returns a sequence), in the
        rows' order, with a graph whose backward recomputes one chunk at a time.
    """
    if chunk_size is None or images.shape[0] <= chunk_size or not torch.is_grad_enabled():
        return embed(images)

    def contexts() -> tuple[Any, Any]:  # (first pass, second pass)
        return nullcontext(), running_statistics_kept(model)

    outputs = [
        checkpoint(embed, chunk, use_reentrant=False, preserve_rng_state=True, context_fn=contexts)
        for chunk in images.split(chunk_size)
    ]
    return _concat(outputs)
