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
from typing import Any

import torch

from lightning_dml.distributed import all_gather_uneven, get_rank, get_world_size
from lightning_dml.metrics._candidates import SearchResult, concat_results, merge_states
from lightning_dml.metrics._device import PRECISIONS, _Threads
from lightning_dml.metrics._scan import scan_symmetric
from lightning_dml.metrics._search import ExactSearch


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


def run_distributed(
    search: ExactSearch, k: int, rank_ks: tuple[int, ...], group: Any = None, exact_scores: bool = False
) -> SearchResult:
    """Multi-process search: every process gets the result for all queries, identical everywhere.

    Every process must hold the same ``search`` (same embeddings, items and tile sizes).
    """
    rank, world = get_rank(group), get_world_size(group)
    dev = search.device
    mine = list(range(rank, search.num_blocks, world))
    with _Threads(1):
        if search.use_symmetric():
            st = search.prepare_state(torch.arange(search.q_items.numel(), device=dev), k, rank_ks)
            scan_symmetric(search, st, (rank, world))
            width = st.kc
            buf_v = torch.nn.functional.pad(st.buf_v, (0, width - st.buf_v.shape[1]), value=-math.inf)
            buf_i = torch.nn.functional.pad(st.buf_i, (0, width - st.buf_i.shape[1]), value=0)
            lo, hi, vs, is_ = all_gather_uneven(st.lo, st.hi, buf_v, buf_i, group=group)
            merged = merge_states([st.with_counts(*p) for p in zip(lo, hi, vs, is_)])
            parts = [search.finish(merged.select(search.block_rows(b)), k, exact_scores) for b in mine]
        else:
            parts = [search.run_block(b, k, rank_ks, exact_scores) for b in mine]
    res = concat_results(parts, k, dev)
    rows = torch.cat([search.block_rows(b) for b in mine]) if mine else torch.empty(0, dtype=torch.long, device=dev)
    g_rows, g_nb, g_sc, g_rank, g_npos = all_gather_uneven(
        rows, res.neighbors, res.scores, res.first_positive_rank, res.num_positives, group=group
    )
    order = torch.cat(g_rows)
    out = SearchResult(*(torch.empty_like(torch.cat(t)) for t in (g_nb, g_sc, g_rank, g_npos)))
    fields = (out.neighbors, out.scores, out.first_positive_rank, out.num_positives)
    for dst, src in zip(fields, (g_nb, g_sc, g_rank, g_npos)):
        dst[order] = torch.cat(src)
    return out

