"""The DDP split of the exact search: every process scores its share of a global grid on its own device.

The work is split on a grid that does not depend on the number of processes: symmetric tiles ``t`` (all-vs-all)
or query blocks ``b`` (In-Shop) go to process ``t % world`` (``b % world``). Partial band counters and candidate
buffers are merged across processes, each process finishes its share of query blocks exactly, and the per-query
results are gathered. Every per-query result is a function of exact scores only, hence independent of the
number of processes. Only tensor collectives of :mod:`lightning_dml.distributed` are used, so the tensors stay on
each process's device (gloo on CPU, NCCL on CUDA).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import torch

from lightning_dml.distributed import all_gather_uneven, get_rank, get_world_size
from lightning_dml.metrics._candidates import (
    PairWindows,
    SearchRequest,
    SearchResult,
    concat_results,
    merge_states,
)
from lightning_dml.metrics._device import PRECISIONS, _Threads
from lightning_dml.metrics._ranks import (
    PairThresholds,
    pairs_pass,
    finish,
    guaranteed_windows,
    pair_bound,
    pair_totals,
    resolve_windows,
    sorted_positive_scores,
    thresholds_of,
)
from lightning_dml.metrics._scan import (
    Grid,
    histogram_pass,
    initial_state,
    make_windows,
    plan_windows,
    scan_rows,
    scan_symmetric,
)
from lightning_dml.metrics._scores import Scorer
from lightning_dml.metrics._task import RetrievalTask


#: codes of the precisions in the settings gathered by :func:`agree_search_settings`, most precise first
_PRECISION_CODES = ("fp32", "tf32", "bf16")
_METRIC_CODES = ("cosine", "euclidean")


def agree_search_settings(
    requested: str,
    resolved: str,
    metric: str,
    tiles: tuple[int, int],
    shape: tuple[int, int],
    device: torch.device,
    group: Any = None,
) -> tuple[str, tuple[int, int]]:
    """One precision and one tile grid for every process, agreed collectively before the search.

    Every process passes its own settings (one all-gather of a few integers):

    * ``requested`` (the user's ``precision``), ``metric`` and ``shape`` (``(N, D)`` of the evaluated set) must be
      the same on every process, else ``ValueError`` naming each rank's value on every rank (all of them raise: no
      process waits for the others in a collective);
    * ``resolved`` (what ``"auto"`` became on this process's device) may differ between processes (different
      GPUs, CPUs): the most precise one wins (fp32 over TF32 over bf16), so no process computes in a precision
      some other process did not choose;
    * ``tiles`` (query block, gallery chunk), sized per device: the element-wise minimum.

    Returns ``(precision, tiles)``, identical on every process.
    """
    codes = PRECISIONS.index(requested), _PRECISION_CODES.index(resolved), _METRIC_CODES.index(metric)
    row = torch.tensor([[*codes, *tiles, *shape]], dtype=torch.long, device=device)
    (parts,) = all_gather_uneven(row, group=group)
    table = torch.cat(parts).tolist()
    for column, name, names in ((0, "precision", PRECISIONS), (2, "metric", _METRIC_CODES)):
        values = [r[column] for r in table]
        if len(set(values)) > 1:
            per_rank = ", ".join(f"rank {i}: {names[v]!r}" for i, v in enumerate(values))
            raise ValueError(f"distributed retrieval: the processes were given different {name} ({per_rank}); "
                             f"give every process the same {name}")
    shapes = [tuple(r[5:7]) for r in table]
    if len(set(shapes)) > 1:
        per_rank = ", ".join(f"rank {i}: {s[0]} x {s[1]}" for i, s in enumerate(shapes))
        raise ValueError(f"distributed retrieval: every process must pass the same evaluated set, got {per_rank}")
    precision = _PRECISION_CODES[min(r[1] for r in table)]
    return precision, (min(r[3] for r in table), min(r[4] for r in table))


def _gather_windows(windows: PairWindows, group: Any) -> PairWindows:
    """Windows with the counts and collected pairs of every process."""
    dev = windows.above.device
    empty = torch.empty(0, dtype=torch.long, device=dev)
    q = torch.cat(windows.q_rows) if windows.q_rows else empty
    g = torch.cat(windows.gpos) if windows.gpos else empty
    w = torch.cat(windows.window) if windows.window else empty
    (above,) = all_gather_uneven(windows.above.unsqueeze(0), group=group)
    qs, gs, ws = all_gather_uneven(q, g, w, group=group)
    total = torch.cat(above).sum(dim=0)
    return replace(windows, above=total, q_rows=qs, gpos=gs, window=ws)


def _agreed_windows(windows: PairWindows, bound: float, group: Any) -> PairWindows:
    """Rank 0's windows on every process (the sample's approximate scores may differ in their last bits between
    processes; the windows only need to be the same everywhere, not to be any particular ones)."""
    sparse = torch.tensor(windows.sparse, dtype=torch.float64, device=windows.low.device)
    (edges,) = all_gather_uneven(torch.stack([windows.low, windows.high, sparse]).unsqueeze(0), group=group)
    low, high, flags = edges[0][0]
    return make_windows(low.tolist(), high.tolist(), bound, windows.low.device, [bool(v) for v in flags.tolist()])


def _windows_pass(
    task: RetrievalTask, scorer: Scorer, grid: Grid, windows: PairWindows, part: tuple[int, int], group: Any
) -> PairWindows:
    pairs_pass(task, scorer, grid, windows, part)
    return _gather_windows(windows, group)


def run_distributed(
    task: RetrievalTask, scorer: Scorer, grid: Grid, request: SearchRequest, group: Any = None
) -> tuple[SearchResult, PairThresholds | None]:
    """Multi-process search: every process gets the result for all queries (and the pair thresholds), identical
    everywhere. Every process must hold the same task, scorer inputs and grid (:func:`agree_search_settings`)."""
    rank, world = get_rank(group), get_world_size(group)
    dev = task.device
    if request.positive_ranks:  # every positive's exact rank gives the first one's
        request = replace(request, rank_ks=(), exact_rank=False)
    nb = grid.num_blocks(task)
    mine = list(range(rank, nb, world))
    with _Threads(1):
        windows = pos_sorted = None
        if request.fmrs:
            pos_sorted = sorted_positive_scores(task, scorer)
            bound = pair_bound(task, scorer)
            windows = plan_windows(task, scorer, grid, request.fmrs, pair_totals(task)[1], bound)
            windows = _agreed_windows(windows, bound, group)
        if grid.symmetric(task):
            st = initial_state(task, scorer, torch.arange(task.q_items.numel(), device=dev), request)
            scan_symmetric(task, scorer, grid, st, (rank, world), windows)
            counts = st.counts()
            if st.kc > 0:
                pad = st.kc - st.buf_v.shape[1]
                counts["buf_v"] = torch.nn.functional.pad(st.buf_v, (0, pad), value=-math.inf)
                counts["buf_i"] = torch.nn.functional.pad(st.buf_i, (0, pad), value=0)
            names = list(counts)
            gathered = all_gather_uneven(*(counts[n] for n in names), group=group)
            merged = merge_states([st.with_counts(dict(zip(names, p))) for p in zip(*gathered)])
            parts = [finish(task, scorer, grid, merged.select(grid.block_rows(task, b)), request) for b in mine]
        else:
            parts = []
            for b in mine:
                st = initial_state(task, scorer, grid.block_rows(task, b), request)
                scan_rows(task, scorer, grid, st, windows)
                parts.append(finish(task, scorer, grid, st, request))
        pairs = None
        if request.fmrs:
            windows = _gather_windows(windows, group)
            figures = resolve_windows(task, scorer, windows, request.fmrs, pos_sorted)
            if any(f is None for f in figures):  # the same answer on every process: the windows are merged
                (hist,) = all_gather_uneven(histogram_pass(task, scorer, grid, (rank, world)).unsqueeze(0), group=group)
                windows = guaranteed_windows(torch.cat(hist).sum(dim=0), request.fmrs, task, pos_sorted, bound)
                windows = _windows_pass(task, scorer, grid, windows, (rank, world), group)
                figures = resolve_windows(task, scorer, windows, request.fmrs, pos_sorted)
            pairs = thresholds_of(request.fmrs, figures, task)
    res = concat_results(parts, request.k, dev)
    rows = torch.cat([grid.block_rows(task, b) for b in mine]) if mine else torch.empty(0, dtype=torch.long, device=dev)
    fields = [res.neighbors, res.scores, res.first_positive_rank, res.num_positives]
    if res.positive_ranks is not None or (request.positive_ranks and not mine):
        width = max(1, int(task.num_relevant.max())) if task.num_relevant.numel() else 1
        ranks = res.positive_ranks if res.positive_ranks is not None else torch.empty(0, width, dtype=torch.long, device=dev)
        fields.append(torch.nn.functional.pad(ranks, (width - ranks.shape[1], 0), value=-1))
    if not mine:  # an idle process still takes part in the collective with well-shaped empty blocks
        fields[0] = fields[0].reshape(0, request.k)
        fields[1] = fields[1].reshape(0, request.k)
    g_rows, *g_fields = all_gather_uneven(rows, *fields, group=group)
    order = torch.cat(g_rows)
    out = []
    for src in g_fields:
        cat = torch.cat(src)
        dst = torch.empty_like(cat)
        dst[order] = cat
        out.append(dst)
    return SearchResult(*out), pairs
