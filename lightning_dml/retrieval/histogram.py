"""Exact histograms of the scores of every positive and every negative (query, gallery) pair.

The two distributions the pair losses reason about (Multi-Similarity, Wang et al., CVPR 2019, Fig. 1 and Sec. 3;
the slack margin of the tuplet margin loss), over the whole evaluated set instead of one training batch: every
(query, gallery) pair that the retrieval metrics rank, with the same relevance and exclusions
(the task of :func:`~lightning_dml.metrics.functional.build_search`: a query never meets itself, items of its sequence are
ignored), is counted once, in the positive histogram when relevant, else in the negative one.

Exact and cheap: the scores come from the exact engine's approximate tiles (one matrix product per tile, no
``N x N`` matrix) with their rigorous per-query error bound ``w_q`` (:meth:`Scorer.error_bound`). A pair's bin is
``bin(s) = clamp(floor((s - low) / width), 0, bins - 1)`` of its exact float64 score ``s``; ``bin`` is monotone,
so where ``bin(a - w_q) == bin(a + w_q)`` for the approximate score ``a``, that is the exact score's bin too, and
only the pairs whose interval straddles an edge are re-scored exactly (:meth:`Scorer.exact`). The counts are
therefore those of a float64 brute force, whatever the tile sizes, the precision of the approximate pass, the
device or the number of processes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_dml.distributed import get_rank, get_world_size
from lightning_dml.metrics import functional as F
from lightning_dml.metrics.functional import score_tile

__all__ = ["pair_score_histogram"]

#: query rows of a tile handled at once by the bin computation (bounds its float64 temporaries)
_ROWS = 256


def _bins(values: Tensor, low: float, width: float, bins: int) -> Tensor:
    """``clamp(floor((values - low) / width), 0, bins - 1)`` of float64 values, as int64 (monotone in the value)."""
    return torch.floor((values - low) / width).clamp_(0, bins - 1).long()


def _count_tile(
    counts: Tensor, a: Tensor, w: Tensor, q_items: Tensor, g_items: Tensor, owner: Tensor, gcol: Tensor,
    scorer: Any, low: float, width: float,
) -> None:
    """Add the pairs of an approximate tile ``a`` (rows: ``q_items``, columns: ``g_items``; ``-inf``: excluded) to
    ``counts[0]`` (every pair) and its positives ``(owner row, column)`` to ``counts[1]``, each pair in the bin of
    its exact score: from ``a +- w`` per row, the pairs whose interval straddles an edge re-scored exactly."""
    bins = counts.shape[1]
    for r0 in range(0, a.shape[0], _ROWS):
        sub = a[r0 : r0 + _ROWS].double()
        bound = w[r0 : r0 + _ROWS, None]
        valid = torch.isfinite(sub)
        sub = torch.where(valid, sub, torch.zeros_like(sub))
        below = _bins(sub - bound, low, width, bins)
        redo = valid & (below != _bins(sub + bound, low, width, bins))
        if bool(redo.any()):
            r, c = redo.nonzero(as_tuple=True)
            below[r, c] = _bins(scorer.exact(q_items[r0 + r], g_items[c]), low, width, bins)
        counts[0] += torch.bincount(below[valid], minlength=bins)
        mine = (owner >= r0) & (owner < r0 + _ROWS)
        counts[1] += torch.bincount(below[owner[mine] - r0, gcol[mine]], minlength=bins)


def pair_score_histogram(
    embeddings: Tensor,
    labels: Tensor,
    *,
    indices: Tensor | None = None,
    query_mask: Tensor | None = None,
    gallery_mask: Tensor | None = None,
    sequence: Tensor | None = None,
    metric: str = "cosine",
    bins: int = 100,
    precision: str = "auto",
    device: torch.device | str | None = None,
    query_block: int | None = None,
    gallery_chunk: int | None = None,
    tile_memory: int | None = None,
    distributed: bool = False,
    process_group: Any = None,
    validate: bool = True,
) -> dict[str, list[float] | list[int]]:
    """Histograms of the exact scores of every positive and every negative (query, gallery) pair.

    The pairs, relevance and exclusions are those of :func:`~lightning_dml.metrics.functional.retrieval_stats`
    with the same arguments (all-vs-all, or query against gallery with the masks; label sets; sequences). The
    ``bins`` equal-width bins span ``[-1, 1]`` for the cosine metric and ``[-(2 max |x|)^2, 0]`` for the Euclidean
    metric (negative squared distances: every pair's score lies within), each bin ``[edge_j, edge_j+1)``, the last
    one closed.

    Args:
        embeddings, labels, indices, query_mask, gallery_mask, sequence: as for
            :func:`~lightning_dml.metrics.functional.retrieval_stats`.
        metric: ``"cosine"`` or ``"euclidean"``.
        bins: number of bins (>= 1).
        precision, device, query_block, gallery_chunk, tile_memory: as for ``retrieval_stats`` (the counts do not
            depend on them).
        distributed: under an initialised ``torch.distributed`` run, every process passes the same full set,
            scores its share of the query blocks, and the counts are summed: every process returns the full,
            identical histograms.
        process_group: the process group of ``distributed``.
        validate: check the inputs.

    Returns:
        ``{"edges": [bins + 1 floats], "positive": [bins ints], "negative": [bins ints]}`` (edges on the scale of
        the raw embeddings' scores, as :class:`~lightning_dml.retrieval.RetrievalResults` reports them).
    """
    if int(bins) < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    bins = int(bins)
    ps = F.prepare(
        embeddings, labels, indices, query_mask, gallery_mask, sequence=sequence, device=device, validate=validate
    )
    task, scorer, grid = F.build_search(
        ps, metric=metric, precision=precision, query_block=query_block, gallery_chunk=gallery_chunk,
        tile_memory=tile_memory, distributed=distributed, process_group=process_group,
    )
    if metric == "cosine":
        low, high = -1.0, 1.0
    else:  # scores of the scaled set: -|x_q - x_g|^2 >= -(|x_q| + |x_g|)^2 >= -(2 max |x|)^2
        reach = 2.0 * float(scorer.norms64.max())
        low, high = -(reach * reach) * (1.0 + 2.0**-40), 0.0
        if low == 0.0:
            low = -1.0
    width = (high - low) / bins
    counts = torch.zeros(2, bins, dtype=torch.long, device=task.device)  # all pairs, positives
    rank, world = (get_rank(process_group), get_world_size(process_group)) if distributed else (0, 1)
    ng = task.g_items.numel()
    for b in range(rank, grid.num_blocks(task), world):
        rows = grid.block_rows(task, b)
        q_items = task.q_items[rows]
        owner, gpos = task.positives(rows)
        for c0 in range(0, ng, grid.gallery_chunk):
            c1 = min(ng, c0 + grid.gallery_chunk)
            a = score_tile(scorer, task, rows, c0, c1)
            w = scorer.error_bound(q_items, task.g_items[c0:c1])
            mine = (gpos >= c0) & (gpos < c1)  # positives are never excluded pairs
            _count_tile(counts, a, w, q_items, task.g_items[c0:c1], owner[mine], gpos[mine] - c0, scorer, low, width)
    if distributed and world > 1:
        torch.distributed.all_reduce(counts, op=torch.distributed.ReduceOp.SUM, group=process_group)
    scale = scorer.score_scale
    edges = [(low + j * width) / scale for j in range(bins)] + [high / scale]
    if metric == "euclidean":
        edges[-1] = 0.0
    positive = counts[1].tolist()
    negative = (counts[0] - counts[1]).tolist()
    if any(v < 0 for v in negative) or not all(math.isfinite(e) for e in edges):
        raise RuntimeError("pair_score_histogram: inconsistent counts (a bug)")
    return {"edges": edges, "positive": positive, "negative": negative}
