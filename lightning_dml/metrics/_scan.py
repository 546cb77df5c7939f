"""The approximate passes over the gallery: query blocks against gallery chunks, or symmetric tiles.

Both fill a :class:`~lightning_dml.metrics._candidates.PassState`: per query the band counts around its exact
best positive score (``lo``: items certainly ranked ahead; ``hi``: items possibly ranked ahead) and a buffer of
candidate neighbours. Element-wise work runs on one CPU thread (the products use all of them, see
``_device._Threads``); on CUDA every step is a device kernel.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from lightning_dml.metrics._candidates import PassState, count_true, insert_pairs, insert_rows, merge_chunk, true_pairs
from lightning_dml.metrics._device import _Threads
from lightning_dml.metrics._progress import track

if TYPE_CHECKING:
    from lightning_dml.metrics._search import ExactSearch


def scan_rows(search: ExactSearch, st: PassState) -> None:
    """Approximate pass of the state's rows against the whole gallery, chunk by chunk."""
    rows = st.rows
    ng = search.g_items.numel()
    need_rank = st.thr_lo is not None
    mask = torch.empty(rows.numel(), min(ng, search.gallery_chunk), dtype=torch.bool, device=search.device)
    for c0 in track(range(0, ng, search.gallery_chunk), "retrieval: gallery chunks"):
        c1 = min(ng, c0 + search.gallery_chunk)
        a = search.approx_rows(rows, c0, c1)
        m = mask[:, : c1 - c0]
        with _Threads(1):
            if need_rank:
                torch.gt(a, st.thr_hi.unsqueeze(1), out=m)
                st.lo += count_true(m, 1)
                torch.ge(a, st.thr_lo.unsqueeze(1), out=m)
                st.hi += count_true(m, 1)
            if st.kc > 0:
                st.buf_v, st.buf_i = merge_chunk(st.buf_v, st.buf_i, a, c0, st.kc, m)


def tiles(num_blocks: int) -> list[tuple[int, int]]:
    """Upper-triangular tiles (i <= j) of the global tile grid."""
    return [(i, j) for i in range(num_blocks) for j in range(i, num_blocks)]


def scan_symmetric(search: ExactSearch, st: PassState, part: tuple[int, int] = (0, 1)) -> None:
    """Approximate pass over the tiles ``t`` with ``t % world == rank`` (``part = (rank, world)``).

    Each off-diagonal tile ``X_i X_j^T`` is used twice: rows are queries of block i against gallery
    block j, columns queries of block j against gallery block i, halving the products. Every diagonal
    tile is computed by every process to seed the candidate thresholds; only the owner counts it.
    ``st`` must cover all rows; counters and buffers hold this process's share (merge with
    :func:`~lightning_dml.metrics._candidates.merge_states`).
    """
    rank, world = part
    dev = search.device
    n = search.q_items.numel()
    bs = search.query_block
    nb = search.num_blocks
    need_rank = st.thr_lo is not None
    kc = st.kc
    tau = torch.full((n,), -math.inf, device=dev)
    mask = torch.empty(min(n, bs), min(n, bs), dtype=torch.bool, device=dev)
    tile_ids = {t: idx for idx, t in enumerate(tiles(nb))}
    kmax = max(st.rank_ks) if need_rank else 0

    def block(i: int) -> Tensor:
        return torch.arange(i * bs, min(n, (i + 1) * bs), device=dev)

    # diagonal tiles: thresholds for everyone, counts and candidates for the owner
    for i in range(nb):
        r = block(i)
        a = search.approx_rows(r, i * bs, i * bs + r.numel())
        own = tile_ids[(i, i)] % world == rank
        if kc > 0:
            v, idx = a.topk(min(kc, a.shape[1]), dim=1)
            if v.shape[1] == kc:
                tau[r] = v[:, -1]
            if own:
                st.buf_v, st.buf_i = insert_rows(st.buf_v, st.buf_i, r, v, idx + i * bs, kc)
        if own and need_rank:
            m = mask[: r.numel(), : r.numel()]
            torch.gt(a, st.thr_hi[r].unsqueeze(1), out=m)
            st.lo[r] += count_true(m, 1)
            torch.ge(a, st.thr_lo[r].unsqueeze(1), out=m)
            st.hi[r] += count_true(m, 1)
    for (i, j), idx_t in track(tile_ids.items(), "retrieval: tiles", total=len(tile_ids)):
        if i == j or idx_t % world != rank:
            continue
        ri, rj = block(i), block(j)
        a = search.scorer.approx(search.q_items[ri], search.g_items[rj])
        m = mask[: ri.numel(), : rj.numel()]
        with _Threads(1):
            if need_rank:
                _count_side(a, m, st, ri, 1, kmax)
                _count_side(a, m, st, rj, 0, kmax)
            if kc > 0:
                q, v, g = (torch.cat(t) for t in zip(*_candidates_tile(a, m, tau, ri, rj)))
                if q.numel():
                    st.buf_v, st.buf_i = insert_pairs(st.buf_v, st.buf_i, q, v, g, kc)
                    if st.buf_v.shape[1] >= kc:  # raise the thresholds of the queries that received candidates
                        upd = torch.unique(q)
                        tau[upd] = torch.maximum(tau[upd], st.buf_v[upd, kc - 1])


#: the shared threshold of a tile is this quantile of its queries' thresholds; the queries below it are compared
#: on their own
_SHARED_QUANTILE = 1 / 128


def _candidates_tile(a: Tensor, m: Tensor, tau: Tensor, ri: Tensor, rj: Tensor) -> list[tuple[Tensor, Tensor, Tensor]]:
    """Candidates of both sides of a tile (rows: queries ``ri`` against gallery ``rj``; columns: the reverse), as
    triples (query row, approximate score, gallery position).

    An entry can only matter to a query if it reaches the query's threshold ``tau`` (the kc-th largest score merged
    so far). One comparison of the tile with a shared scalar threshold ``ts`` (a low quantile of the thresholds of
    both blocks) and one sparse extraction serve both sides; the extracted entries are then filtered per side.
    The few queries whose own threshold lies below ``ts`` also get their entries in ``[tau, ts)``, from their own
    rows or columns.
    """
    t_r, t_c = tau[ri], tau[rj]
    both = torch.cat([t_r, t_c])
    finite = both[both > -math.inf]
    if finite.numel() == 0:
        return [_candidates_side(a, m, t_r, ri, rj, 1), _candidates_side(a, m, t_c, rj, ri, 0)]
    ts = finite.kthvalue(max(1, math.ceil(finite.numel() * _SHARED_QUANTILE))).values
    torch.ge(a, ts, out=m)
    r, c = true_pairs(m, 1)
    v = a[r, c]
    out = []
    keep = v >= t_r[r]
    out.append((ri[r[keep]], v[keep], rj[c[keep]]))
    keep = v >= t_c[c]
    out.append((rj[c[keep]], v[keep], ri[r[keep]]))
    low = (t_r < ts).nonzero().squeeze(1)
    if low.numel():
        out.append(_below_shared(a.index_select(0, low), t_r[low], ts, ri[low], rj, 1))
    low = (t_c < ts).nonzero().squeeze(1)
    if low.numel():
        out.append(_below_shared(a.index_select(1, low), t_c[low], ts, rj[low], ri, 0))
    return out


def _below_shared(
    part: Tensor, t: Tensor, ts: Tensor, queries: Tensor, gallery: Tensor, dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Entries of the queries' own rows (dim=1) or columns (dim=0) of a tile with ``t <= score < ts``."""
    shape = (-1, 1) if dim == 1 else (1, -1)
    hit = (part >= t.view(shape)) & (part < ts)
    r, c = hit.nonzero(as_tuple=True)
    q, g = (r, c) if dim == 1 else (c, r)
    return queries[q], part[r, c], gallery[g]


def _candidates_side(
    a: Tensor, m: Tensor, t: Tensor, queries: Tensor, gallery: Tensor, dim: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Candidates of one side of a tile (dim=1: rows of ``a`` are the queries; dim=0: columns) with thresholds ``t``."""
    shape = (-1, 1) if dim == 1 else (1, -1)
    torch.ge(a, t.view(shape), out=m)
    r, c = true_pairs(m, dim)
    q, g = (r, c) if dim == 1 else (c, r)
    return queries[q], a[r, c], gallery[g]


def _count_side(a: Tensor, m: Tensor, st: PassState, rows: Tensor, dim: int, kmax: int) -> None:
    """Add the band counts of one side of a tile (dim=1: rows of ``a`` are queries; dim=0: columns).

    A query whose certain count ``lo`` already reaches the largest K is a miss for every K, so it is
    left out of further counting (its rank stays a lower bound on the right side of every K); only the
    still-active queries are compared when they are a minority.
    """
    active = st.has[rows] & (st.lo[rows] < kmax)
    na = int(active.sum())
    if na == 0:
        return
    if na * 2 > rows.numel():
        sub, part, mm = rows, a, m
    else:
        idx = active.nonzero().squeeze(1)
        sub = rows[idx]
        part = a.index_select(1 - dim, idx)
        mm = torch.empty(part.shape, dtype=torch.bool, device=a.device)
    shape = (-1, 1) if dim == 1 else (1, -1)
    torch.gt(part, st.thr_hi[sub].view(shape), out=mm)
    st.lo[sub] += count_true(mm, dim)
    torch.ge(part, st.thr_lo[sub].view(shape), out=mm)
    st.hi[sub] += count_true(mm, dim)
