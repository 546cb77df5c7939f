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
from lightning_dml.metrics._device import _Threads
from lightning_dml.metrics._scan import scan_symmetric
from lightning_dml.metrics._search import ExactSearch


def common_min(values: tuple[int, ...], device: torch.device, group: Any = None) -> tuple[int, ...]:
    """The element-wise minimum of integer tuples over all processes (e.g. tile sizes sized per device)."""
    (parts,) = all_gather_uneven(torch.tensor([values], dtype=torch.long, device=device), group=group)
    return tuple(int(v) for v in torch.cat(parts).min(dim=0).values.tolist())


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

