"""Anchor-chunked pair losses: the ``B x N`` similarity matrix and its graph one block of anchors at a time.

A pair loss of this library (:class:`~lightning_dml.losses.base.PairLoss`) whose value is a sum of per-anchor
terms divided by batch-wide normalisers (counts of anchors, pairs or non-zero terms, each taken through
:func:`~lightning_dml.losses.base.batch_normaliser`) can be evaluated on blocks of ``c`` anchors against the whole
gallery:

1. **normalisers first** (no graph): every block is evaluated once with the normalisers captured instead of
   applied; the captured counts of each normaliser are summed over the blocks and reduced once by
   :func:`~lightning_dml.losses.base.batch_normaliser` (so under DDP's ``global_reduction`` there is one
   all-reduce per normaliser, exactly as the unchunked loss does);
2. **value** (no graph): ``L = sum_blocks T_b / N``, the unchunked value. With one scalar normaliser (all the
   supporting losses but the contrastive loss, whose positive and negative terms have their own counts), the
   capture pass already gave ``T_b`` (the block's loss with ``N = 1``); otherwise every block is evaluated again
   with the global normalisers fixed and the block values are summed;
3. **backward**: :class:`AnchorChunkedLoss` recomputes every block with its graph, back-propagates the incoming
   gradient through it and frees it before the next block.

Each block sees the gallery with its own anchors moved to the front (the gallery order the losses expect: the
anchors are the gallery's first rows, their self-pairs removed by index), so every loss runs unchanged. The memory
held at any time is one block's ``c x N`` matrices and their graph: ``O(c N)`` instead of ``O(B N)``; the cost is
one extra forward pass of the loss (two for the contrastive loss), not of the model. The value and the gradients
equal the unchunked loss up to the order of floating-point sums (tests/test_losses_anchor_chunks.py). Losses are
deterministic functions of their inputs here (the recomputation must give the same blocks); a loss with random
choices does not support chunking. One host read per call (whether the summed block values are finite).
Double backward through a chunked loss is not supported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

__all__ = [
    "AnchorChunkedLoss",
    "anchor_blocks",
    "anchor_chunked_loss",
    "check_anchor_chunk_size",
    "chunk_normaliser",
]

#: one block's loss: ``block(anchors, labels, gallery, gallery_labels) -> scalar``
BlockLoss = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class _Normalisers:
    """The state of :func:`chunk_normaliser` inside a block: capture the counts, or hand out fixed normalisers."""

    def __init__(self, fixed: list[Tensor] | None = None) -> None:
        self.fixed = fixed
        self.counts: list[object] = []
        self.calls = 0

    def __call__(self, count: Tensor | int | None, like: Tensor) -> Tensor:
        k = self.calls
        self.calls += 1
        if self.fixed is not None:
            if k >= len(self.fixed):
                raise RuntimeError("a loss block asked for more batch normalisers than its capture pass")
            return self.fixed[k]
        if isinstance(count, Tensor):
            count = count.detach()
            self.counts.append(count)
            return torch.ones(count.shape, dtype=like.dtype, device=like.device)
        self.counts.append(count)
        return torch.ones((), dtype=like.dtype, device=like.device)


_STATE: ContextVar[_Normalisers | None] = ContextVar("lightning_dml_anchor_chunk_normalisers", default=None)


def chunk_normaliser(count: Tensor | int | None, like: Tensor) -> Tensor | None:
    """Inside a chunked block: the normaliser :func:`~lightning_dml.losses.base.batch_normaliser` must return
    (``1`` while capturing the counts, the global normaliser afterwards); ``None`` outside any block."""
    state = _STATE.get()
    return None if state is None else state(count, like)


@contextmanager
def _normalisers(state: _Normalisers) -> Iterator[_Normalisers]:
    token = _STATE.set(state)
    try:
        yield state
    finally:
        _STATE.reset(token)


def check_anchor_chunk_size(value: object, where: str) -> int | None:
    """``None`` or an integer ``>= 1``; else ``ValueError`` naming the loss and the value."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: anchor_chunk_size must be an integer >= 1 or None, got {value!r}")
    return int(value)


def anchor_blocks(
    num_anchors: int, num_gallery: int, chunk: int, device: torch.device
) -> list[tuple[int, int, Tensor]]:
    """``(start, stop, order)`` of every block of ``chunk`` anchors: ``order`` lists the gallery rows with the
    block's own anchors ``start:stop`` first, then the others in their order."""
    rows = torch.arange(num_gallery, device=device)
    blocks = []
    for start in range(0, num_anchors, chunk):
        stop = min(start + chunk, num_anchors)
        blocks.append((start, stop, torch.cat([rows[start:stop], rows[:start], rows[stop:]])))
    return blocks


def _block_value(block: BlockLoss, gallery: Tensor, labels: Tensor, gallery_labels: Tensor,
                 span: tuple[int, int, Tensor]) -> Tensor:
    start, stop, order = span
    return block(gallery[start:stop], labels[start:stop], gallery[order], gallery_labels[order])


class AnchorChunkedLoss(torch.autograd.Function):
    """``sum_blocks block_b(gallery)`` under fixed normalisers, with each block recomputed in the backward.

    ``forward(ctx, run, num_blocks, value, gallery, *params)``: ``run(b, gallery)`` is block ``b``'s loss (global
    normalisers fixed inside); ``value`` is the loss if already known (else the blocks are summed); ``params`` are
    the loss's learnable parameters, which receive their gradient from the recomputation.
    """

    @staticmethod
    def forward(ctx, run: Callable[[int, Tensor], Tensor], num_blocks: int,  # type: ignore[override]
                value: Tensor | None, gallery: Tensor, *params: Tensor) -> Tensor:
        if value is not None:
            total = value.clone()
        else:
            with torch.no_grad():
                total = run(0, gallery)
                for b in range(1, num_blocks):
                    total = total + run(b, gallery)
        ctx.run, ctx.num_blocks = run, num_blocks
        ctx.save_for_backward(gallery, *params)
        return total

    @staticmethod
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        gallery, *params = ctx.saved_tensors
        wanted = [i for i, t in enumerate([gallery, *params]) if ctx.needs_input_grad[3 + i]]
        grads: list[Tensor | None] = [None] * (1 + len(params))
        if not wanted:
            return (None, None, None, *grads)
        with torch.enable_grad(), torch.autocast(device_type=gallery.device.type, enabled=False):
            for b in range(ctx.num_blocks):
                g = gallery.detach().requires_grad_(True)
                inputs = [g, *params]
                out = ctx.run(b, g)
                got = torch.autograd.grad(out, [inputs[i] for i in wanted], grad_out, allow_unused=True)
                for i, d in zip(wanted, got):
                    if d is not None:
                        grads[i] = d if grads[i] is None else grads[i] + d
        return (None, None, None, *grads)


def anchor_chunked_loss(
    block: BlockLoss,
    anchors: Tensor,
    labels: Tensor,
    gallery: Tensor | None,
    gallery_labels: Tensor,
    chunk: int,
    params: list[Tensor],
    reduce_count: Callable[[object, Tensor], Tensor],
) -> Tensor:
    """The loss ``block(anchors, labels, gallery, gallery_labels)`` computed ``chunk`` anchors at a time (module
    docstring); equal to the unchunked call up to the order of sums.

    ``gallery`` is ``None`` (the batch itself) or holds the anchors as its first rows; ``reduce_count(total, like)``
    turns the summed counts of one normaliser into the normaliser
    (:func:`~lightning_dml.losses.base.batch_normaliser`, which all-reduces under DDP's ``global_reduction``).
    """
    g = anchors if gallery is None else gallery
    spans = anchor_blocks(anchors.shape[0], g.shape[0], chunk, anchors.device)
    # 1. the normalisers' counts, summed over the blocks
    captured: list[list[object]] = []
    unnormalised = []  # each block's loss with every normaliser 1
    with torch.no_grad():
        for span in spans:
            with _normalisers(_Normalisers()) as state:
                like = _block_value(block, g, labels, gallery_labels, span)
            captured.append(state.counts)
            unnormalised.append(like)
    if any(len(c) != len(captured[0]) for c in captured):
        raise RuntimeError("the loss called batch_normaliser a different number of times in different anchor blocks")
    fixed = []
    for k in range(len(captured[0])):
        parts = [c[k] for c in captured]
        total = None if parts[0] is None else sum(parts[1:], parts[0])
        fixed.append(reduce_count(total, like))
    value = None
    if len(fixed) == 1 and fixed[0].ndim == 0:  # L = (sum_b T_b) / N: the capture pass gave the T_b
        value = torch.stack(unnormalised).sum() / fixed[0]
        if not bool(torch.isfinite(value)):  # a sum beyond the float range whose mean is not: sum T_b / N instead
            value = None

    # 2. + 3. the value under the global normalisers, each block recomputed with its graph in the backward
    def run(b: int, gallery_: Tensor) -> Tensor:
        with _normalisers(_Normalisers(fixed)) as state:
            out = _block_value(block, gallery_, labels, gallery_labels, spans[b])
        if state.calls != len(fixed):
            raise RuntimeError("the loss called batch_normaliser a different number of times than its capture pass")
        return out

    return AnchorChunkedLoss.apply(run, len(spans), value, g, *params)
