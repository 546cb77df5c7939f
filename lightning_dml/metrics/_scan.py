"""Stage 2 of the exact search: the approximate pass over score tiles, which fills the :class:`PassState`.

First each query gets its exact best positive score (and, for ``map``, the exact score of every positive) and the
float32 band around it (:func:`initial_state`); then one pass over the tiles of approximate scores
(:func:`~lightning_dml.metrics._scores.score_tile`) counts, per query, the items certainly and possibly ranked ahead
of those thresholds, keeps a buffer of candidate neighbours, and, for ``fnmr@fmr``, counts and collects the pairs
around the pair-score windows (:class:`~lightning_dml.metrics._candidates.PairWindows`):

* :func:`scan_rows`: query blocks against gallery chunks (query/gallery tasks);
* :func:`scan_symmetric`: all-vs-all, each off-diagonal tile ``X_i X_j^T`` serving both (i, j) and (j, i).

Element-wise work runs on one CPU thread (the products use all of them, see ``_device._Threads``); on CUDA every
step is a device kernel. Nothing here is exact yet: stage 3 (``_ranks``) turns the counts and buffers into exact
ranks and neighbour lists.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from fractions import Fraction

import torch
from torch import Tensor

from lightning_dml.metrics._candidates import (
    PairWindows,
    PassState,
    SearchRequest,
    packable,
    count_true,
    insert_pairs,
    insert_rows,
    merge_chunk,
    round_down,
    round_up,
    true_pairs,
)
from lightning_dml.metrics._device import _Threads
from lightning_dml.metrics._progress import track
from lightning_dml.metrics._scores import Scorer, score_tile
from lightning_dml.metrics._task import RetrievalTask


@dataclass(frozen=True)
class Grid:
    """The tile grid of the search: blocks of ``query_block`` queries, chunks of ``gallery_chunk`` gallery items
    (the symmetric pass uses square tiles of ``query_block``)."""

    query_block: int
    gallery_chunk: int

    def num_blocks(self, task: RetrievalTask) -> int:
        return (task.q_items.numel() + self.query_block - 1) // self.query_block

    def block_rows(self, task: RetrievalTask, b: int) -> Tensor:
        nq = task.q_items.numel()
        return torch.arange(b * self.query_block, min(nq, (b + 1) * self.query_block), device=task.device)

    def symmetric(self, task: RetrievalTask) -> bool:
        """Use the symmetric tile pass: all-vs-all with at least 4 tiles per side."""
        return task.symmetric and self.num_blocks(task) >= 4


# ---------------------------------------------------------------------------------------------- initial state
def _positive_approx(task: RetrievalTask, scorer: Scorer, rows: Tensor, owner: Tensor, gpos: Tensor) -> Tensor:
    """Approximate scores of the (query row, positive) pairs: gathered dot products, or, for the large classes of
    single-label tasks, one matrix product per class (the memory traffic of a gather grows with D per pair)."""
    q_items = task.q_items[rows]
    a = torch.empty(owner.numel(), dtype=torch.float64, device=task.device)
    large = torch.zeros_like(owner, dtype=torch.bool)
    if not task.multilabel:
        large = torch.bincount(owner, minlength=rows.numel())[owner] > 16
    small = ~large
    if bool(small.any()):
        a[small] = scorer.approx_pairs(q_items[owner[small]], task.g_items[gpos[small]]).double()
    if bool(large.any()):
        li = large.nonzero().squeeze(1)
        lab = task.labels[q_items[owner[li]]]
        for c in torch.unique(lab).tolist():
            sel = li[lab == c]
            uo, inv_o = torch.unique(owner[sel], return_inverse=True)
            ug, inv_g = torch.unique(gpos[sel], return_inverse=True)
            a[sel] = scorer.approx(q_items[uo], task.g_items[ug])[inv_o, inv_g].double()
    return a


def _best_positive(task: RetrievalTask, scorer: Scorer, rows: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
    """Exact best positive score and its gallery position for each query row (-inf / -1 if none).

    Positives are scored approximately; only those within ``2 w`` of the approximate maximum can be the exact best
    (or tie with it), and only those are re-scored exactly. Ties: the smaller gallery position.
    """
    nr = rows.numel()
    best = torch.full((nr,), -math.inf, dtype=torch.float64, device=task.device)
    best_pos = torch.full((nr,), -1, dtype=torch.long, device=task.device)
    owner, gpos = task.positives(rows)
    if owner.numel() == 0:
        return best, best_pos
    a = _positive_approx(task, scorer, rows, owner, gpos)
    m = torch.full((nr,), -math.inf, dtype=torch.float64, device=task.device).scatter_reduce_(
        0, owner, a, reduce="amax"
    )
    near = a >= m[owner] - 2 * w[owner]
    owner, gpos = owner[near], gpos[near]
    s = scorer.exact(task.q_items[rows][owner], task.g_items[gpos])
    best.scatter_reduce_(0, owner, s, reduce="amax")
    is_best = s == best[owner]
    first = torch.full((nr,), task.g_items.numel(), dtype=torch.long, device=task.device)
    first.scatter_reduce_(0, owner[is_best], gpos[is_best], reduce="amin")
    return best, torch.where(torch.isfinite(best), first, best_pos)


def positive_scores(task: RetrievalTask, scorer: Scorer, rows: Tensor) -> tuple[Tensor, Tensor]:
    """Exact scores and gallery positions of every positive of the rows, ``[rows, T]`` ascending by (score, then
    gallery position descending: the rank order read backwards), padded with ``-inf`` / ``-1`` at the front."""
    nr = rows.numel()
    owner, gpos = task.positives(rows)
    width = max(1, int(task.num_relevant[rows].max())) if nr else 1
    s_out = torch.full((nr, width), -math.inf, dtype=torch.float64, device=task.device)
    g_out = torch.full((nr, width), -1, dtype=torch.long, device=task.device)
    if owner.numel() == 0:
        return s_out, g_out
    s = scorer.exact(task.q_items[rows][owner], task.g_items[gpos])
    # sort by (owner asc, score asc, position desc): three stable sorts, least significant key first
    o = torch.argsort(gpos, descending=True, stable=True)
    o = o[torch.argsort(s[o], stable=True)]
    o = o[torch.argsort(owner[o], stable=True)]
    owner, gpos, s = owner[o], gpos[o], s[o]
    counts = torch.bincount(owner, minlength=nr)
    col = torch.arange(owner.numel(), device=task.device) - (torch.cumsum(counts, 0) - counts)[owner]
    col = col + (width - counts)[owner]  # right-aligned: the best positive in the last column
    s_out[owner, col] = s
    g_out[owner, col] = gpos
    return s_out, g_out


def initial_state(task: RetrievalTask, scorer: Scorer, rows: Tensor, request: SearchRequest) -> PassState:
    """Bounds, exact best positive (and every positive's score for ``positive_ranks``) with their bands, empty
    counters and buffers for the query rows ``rows``."""
    ng = task.g_items.numel()
    dev = task.device
    w = scorer.error_bound(task.q_items[rows], task.g_items)
    has = task.num_relevant[rows] > 0
    nr = rows.numel()
    inf = torch.full((nr,), math.inf, dtype=torch.float32, device=dev)
    if request.best_positive():
        s_best = torch.full((nr,), -math.inf, dtype=torch.float64, device=dev)
        p_best = torch.full((nr,), -1, dtype=torch.long, device=dev)
        for s in range(0, nr, 8192):
            s_best[s : s + 8192], p_best[s : s + 8192] = _best_positive(task, scorer, rows[s : s + 8192], w[s : s + 8192])
        thr_hi = torch.where(has, round_up(s_best + w), inf)
        thr_lo = torch.where(has, round_down(s_best - w), inf)
    else:
        s_best = p_best = thr_hi = thr_lo = None
    extra = {}
    if request.positive_ranks:
        pos_s, pos_g = positive_scores(task, scorer, rows)
        valid = pos_g >= 0
        wide = w.unsqueeze(1)
        big = torch.full_like(pos_s, math.inf, dtype=torch.float32)
        extra = {
            "pos_s": pos_s, "pos_g": pos_g,
            # padding thresholds +inf: never exceeded; ascending order kept (padding sits in front, so put it at -inf
            # for the search order and mask it out of the counts afterwards)
            "pos_hi_thr": torch.where(valid, round_up(pos_s + wide), big.neg()),
            "pos_lo_thr": torch.where(valid, round_down(pos_s - wide), big.neg()),
            "pos_lo": torch.zeros(pos_s.shape, dtype=torch.long, device=dev),
            "pos_hi": torch.zeros(pos_s.shape, dtype=torch.long, device=dev),
        }
    k = request.k
    kc = min(ng, k + max(8, k // 2)) if k > 0 else 0
    zeros = torch.zeros(nr, dtype=torch.long, device=dev)
    return PassState(
        rows=rows, w=w, has=has, s_best=s_best, p_best=p_best, thr_lo=thr_lo, thr_hi=thr_hi, lo=zeros,
        hi=zeros.clone(), kc=kc, buf_v=torch.empty(nr, 0, device=dev),
        buf_i=torch.empty(nr, 0, dtype=torch.long, device=dev), rank_ks=tuple(request.rank_ks),
        exact_rank=request.exact_rank, **extra,
    )


# ---------------------------------------------------------------------------------------------- counting
def _count_positive_bands(a: Tensor, st: PassState, sub: Tensor, dim: int) -> None:
    """Per positive of the queries ``sub`` (state rows) on one side of a tile, add the items above its band
    (``pos_lo``) and at or above its band's bottom (``pos_hi``): one ``searchsorted`` per side against the sorted
    thresholds, then a histogram per query row."""
    part = a if dim == 1 else a.T
    hi_thr, lo_thr = st.pos_hi_thr[sub], st.pos_lo_thr[sub]
    t = hi_thr.shape[1]
    rows = torch.arange(part.shape[0], device=a.device).unsqueeze(1) * (t + 1)
    # number of thresholds strictly below the value: the value is above exactly those positives' bands
    above = torch.searchsorted(hi_thr.contiguous(), part.contiguous(), side="left", out_int32=True)
    hist = torch.bincount((above + rows).reshape(-1), minlength=part.shape[0] * (t + 1)).view(-1, t + 1)
    # hist[:, j] items exceed exactly the j lowest thresholds: threshold j (ascending) is exceeded by sum_{j' > j}
    st.pos_lo[sub] += hist.flip(1).cumsum(1).flip(1)[:, 1:]
    reach = torch.searchsorted(lo_thr.contiguous(), part.contiguous(), side="right", out_int32=True)
    hist = torch.bincount((reach + rows).reshape(-1), minlength=part.shape[0] * (t + 1)).view(-1, t + 1)
    st.pos_hi[sub] += hist.flip(1).cumsum(1).flip(1)[:, 1:]


def _count_side(a: Tensor, m: Tensor, st: PassState, rows: Tensor, dim: int, kmax: int) -> None:
    """Add the band counts of one side of a tile (dim=1: rows of ``a`` are queries; dim=0: columns).

    A query whose certain count ``lo`` already reaches ``kmax`` (the largest K: a miss for every K) is left out of
    further counting (its rank stays a lower bound on the right side of every K; with ``exact_rank`` ``kmax``
    exceeds the gallery and every query is counted to the end); only the still-active queries are compared when
    they are a minority.
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


def _count_windows(
    windows: PairWindows, a: Tensor, m: Tensor, rows: Tensor, c0: int, weight: int
) -> None:
    """Add a tile's pairs to the pair-score windows: count those above each window, collect those inside it.

    ``a`` holds query rows ``rows`` against gallery positions ``[c0, c0 + a.shape[1])``; ``weight`` is the number
    of pairs an entry stands for (2 for an off-diagonal tile of the symmetric pass: (q, g) and (g, q) have the same
    exact score). The in-window mask is the "at or above the bottom" mask without the "above the top" one, taken
    word by word.
    """
    above = torch.empty(a.shape, dtype=torch.bool, device=a.device)
    for i in range(windows.low.numel()):
        if windows.sparse[i]:  # few pairs at or above the bottom: extract them all, split them by value
            torch.ge(a, windows.cut_below[i], out=m)
            r, c = true_pairs(m, 1)
            if r.numel():
                over = a[r, c] > windows.cut_above[i]
                windows.above[i] += over.sum() * weight
                r, c = r[~over], c[~over]
                windows.q_rows.append(rows[r])
                windows.gpos.append(c + c0)
                windows.window.append(torch.full_like(r, i * 2 + (weight - 1)))
            continue
        torch.gt(a, windows.cut_above[i], out=above)
        windows.above[i] += count_true(above, 1).sum() * weight
        torch.ge(a, windows.cut_below[i], out=m)
        if packable(m) and packable(above):
            inside = (m.view(torch.int64) & ~above.view(torch.int64)).view(torch.bool)
        else:
            inside = m & ~above
        r, c = true_pairs(inside, 1)
        if r.numel():
            windows.q_rows.append(rows[r])
            windows.gpos.append(c + c0)
            windows.window.append(torch.full_like(r, i * 2 + (weight - 1)))  # window index and weight, packed


def tile_counts(
    st: PassState, windows: PairWindows | None, a: Tensor, m: Tensor, rows: Tensor, c0: int, kmax: int,
    cols: Tensor | None = None, weight: int = 1,
) -> None:
    """Every count of one tile: the best-positive bands, every positive's bands, the pair windows.

    ``rows``: the state rows of the tile's rows; ``cols``: those of its columns too (off-diagonal symmetric tiles,
    where the columns are queries as well); ``weight``: pairs per entry for the windows.
    """
    if st.thr_lo is not None:
        _count_side(a, m, st, rows, 1, kmax)
        if cols is not None:
            _count_side(a, m, st, cols, 0, kmax)
    if st.pos_lo is not None:
        _count_positive_bands(a, st, rows, 1)
        if cols is not None:
            _count_positive_bands(a, st, cols, 0)
    if windows is not None:
        _count_windows(windows, a, m, st.rows[rows], c0, weight)


# ---------------------------------------------------------------------------------------------- passes
def scan_rows(task: RetrievalTask, scorer: Scorer, grid: Grid, st: PassState, windows: PairWindows | None = None) -> None:
    """Approximate pass of the state's rows against the whole gallery, chunk by chunk."""
    rows = st.rows
    ng = task.g_items.numel()
    kmax = st.count_limit(task.g_items.numel())
    mask = torch.empty(rows.numel(), min(ng, grid.gallery_chunk), dtype=torch.bool, device=task.device)
    local = torch.arange(rows.numel(), device=task.device)
    for c0 in track(range(0, ng, grid.gallery_chunk), "retrieval: gallery chunks"):
        c1 = min(ng, c0 + grid.gallery_chunk)
        a = score_tile(scorer, task, rows, c0, c1)
        m = mask[:, : c1 - c0]
        with _Threads(1):
            tile_counts(st, windows, a, m, local, c0, kmax)
            if st.kc > 0:
                st.buf_v, st.buf_i = merge_chunk(st.buf_v, st.buf_i, a, c0, st.kc, m)


def tiles(num_blocks: int) -> list[tuple[int, int]]:
    """Upper-triangular tiles (i <= j) of the global tile grid."""
    return [(i, j) for i in range(num_blocks) for j in range(i, num_blocks)]


def scan_symmetric(
    task: RetrievalTask, scorer: Scorer, grid: Grid, st: PassState, part: tuple[int, int] = (0, 1),
    windows: PairWindows | None = None,
) -> None:
    """Approximate pass over the tiles ``t`` with ``t % world == rank`` (``part = (rank, world)``).

    Each off-diagonal tile ``X_i X_j^T`` is used twice: rows are queries of block i against gallery block j,
    columns queries of block j against gallery block i, halving the products (relevance and exclusion are
    symmetric relations in all-vs-all). Every diagonal tile is computed by every process to seed the candidate
    thresholds; only the owner counts it. ``st`` must cover all rows; counters and buffers hold this process's
    share (merge with :func:`~lightning_dml.metrics._candidates.merge_states`).
    """
    rank, world = part
    dev = task.device
    n = task.q_items.numel()
    bs = grid.query_block
    nb = grid.num_blocks(task)
    kc = st.kc
    kmax = st.count_limit(task.g_items.numel())
    tau = torch.full((n,), -math.inf, device=dev)
    mask = torch.empty(min(n, bs), min(n, bs), dtype=torch.bool, device=dev)
    tile_ids = {t: idx for idx, t in enumerate(tiles(nb))}

    # diagonal tiles: thresholds for everyone, counts and candidates for the owner
    for i in range(nb):
        r = grid.block_rows(task, i)
        a = score_tile(scorer, task, r, i * bs, i * bs + r.numel())
        own = tile_ids[(i, i)] % world == rank
        if kc > 0:
            v, idx = a.topk(min(kc, a.shape[1]), dim=1)
            if v.shape[1] == kc:
                tau[r] = v[:, -1]
            if own:
                st.buf_v, st.buf_i = insert_rows(st.buf_v, st.buf_i, r, v, idx + i * bs, kc)
        if own:
            with _Threads(1):
                tile_counts(st, windows, a, mask[: r.numel(), : r.numel()], r, i * bs, kmax)
    for (i, j), idx_t in track(tile_ids.items(), "retrieval: tiles", total=len(tile_ids)):
        if i == j or idx_t % world != rank:
            continue
        ri, rj = grid.block_rows(task, i), grid.block_rows(task, j)
        a = score_tile(scorer, task, ri, j * bs, j * bs + rj.numel())
        m = mask[: ri.numel(), : rj.numel()]
        with _Threads(1):
            tile_counts(st, windows, a, m, ri, j * bs, kmax, cols=rj, weight=2)
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


# ---------------------------------------------------------------------------------------------- pair windows
#: bits of the order-preserving float32 key kept by the pair-score histograms (2^20 bins: 11 significant bits)
KEY_BITS = 20


def float_key(a: Tensor) -> Tensor:
    """Histogram bin of float32 values: the top :data:`KEY_BITS` bits of an order-preserving integer key (monotone
    non-decreasing in the value; every bin is a half-open interval of float32 values, see :func:`bin_floor`)."""
    b = a.contiguous().view(torch.int32)
    key = b ^ ((b >> 31) & 0x7FFFFFFF)  # negative floats: magnitude bits flipped, so the int order is the float order
    return (key >> (32 - KEY_BITS)).long() + (1 << (KEY_BITS - 1))


#: the histogram bin of -inf (the excluded pairs)
NEG_INF_BIN = 2047


def bin_floor(bins: Tensor) -> Tensor:
    """The smallest float32 value of each histogram bin (float64), ``-inf`` for the lowest bin."""
    key = ((bins - (1 << (KEY_BITS - 1))) << (32 - KEY_BITS)).to(torch.int32)
    b = key ^ ((key >> 31) & 0x7FFFFFFF)
    v = b.view(torch.float32).double()
    return torch.where(torch.isnan(v) | (bins <= 0), torch.full_like(v, -math.inf), v)


def _histogram(a: Tensor) -> Tensor:
    """Histogram (:func:`float_key` bins) of a tile's approximate scores, its excluded pairs (``-inf``) left out:
    they all fall into the bin of ``-inf``, :data:`NEG_INF_BIN`, which no finite float32 shares."""
    hist = torch.bincount(float_key(a).reshape(-1), minlength=1 << KEY_BITS)
    hist[NEG_INF_BIN] = 0
    return hist


def _sample_histogram(task: RetrievalTask, scorer: Scorer, grid: Grid, rows: Tensor) -> Tensor:
    """Histogram (:func:`float_key` bins) of the approximate scores of query rows ``rows`` against the gallery,
    excluded pairs left out."""
    hist = torch.zeros(1 << KEY_BITS, dtype=torch.long, device=task.device)
    ng = task.g_items.numel()
    for c0 in range(0, ng, grid.gallery_chunk):
        hist += _histogram(score_tile(scorer, task, rows, c0, min(ng, c0 + grid.gallery_chunk)))
    return hist


def plan_windows(
    task: RetrievalTask, scorer: Scorer, grid: Grid, fmrs: tuple[Fraction, ...], neg_total: int, bound: float,
    sample: int = 256, z: float = 6.0,
) -> PairWindows:
    """Windows of exact pair scores expected to hold the threshold of each false match rate, from a sample.

    The approximate scores of ``sample`` evenly spaced queries against the whole gallery give the fraction of
    sample pairs above each value; each window spans the values where that fraction is within ``z`` binomial
    standard deviations of the rate, widened by ``bound`` (the approximation error) on each side. A window that misses its threshold is detected exactly and
    repaired by :func:`histogram_windows` (no figure depends on the sample).
    """
    nq = task.q_items.numel()
    count = min(nq, sample)
    rows = (torch.arange(count, device=task.device) * nq) // max(count, 1)
    hist = _sample_histogram(task, scorer, grid, rows).flip(0)  # descending values
    above_bins = torch.cumsum(hist, 0)  # pairs at or above each bin (descending)
    pairs = int(above_bins[-1])
    bins = torch.arange(hist.numel() - 1, -1, -1, device=task.device)
    low, high, sparse = [], [], []
    for rate in fmrs:
        f = float(rate)  # an estimate only: the exact count is taken in _ranks
        target = f * pairs  # the sample's pairs ranked above the threshold (positives included: a fine estimate)
        spread = z * math.sqrt(max(target * (1 - f), 1.0)) + 1
        hi_i = int(torch.searchsorted(above_bins, max(target - spread, 0.0), side="right"))
        lo_i = int(torch.searchsorted(above_bins, target + spread, side="left"))
        top = math.inf if hi_i == 0 else float(bin_floor(bins[hi_i - 1 : hi_i])[0])
        bottom = -math.inf if lo_i >= hist.numel() else float(bin_floor(bins[lo_i : lo_i + 1])[0])
        low.append(bottom - bound)  # sample approximate scores -> exact scores
        high.append(top + bound)
        # the sample's pairs at or above the pass's cut (bottom - 2 bound): few for the far upper tail
        cut_bin = int(float_key(torch.tensor([bottom - 2 * bound], dtype=torch.float32))) if math.isfinite(bottom) else 0
        sparse.append(float(hist[: hist.numel() - cut_bin].sum()) <= SPARSE_FRACTION * max(pairs, 1))
    return make_windows(low, high, bound, task.device, sparse)


#: a window whose bottom is expected to have at most this fraction of the pairs at or above it is ``sparse``
SPARSE_FRACTION = 0.01


def make_windows(
    low: list[float], high: list[float], bound: float, device: torch.device, sparse: list[bool] | None = None
) -> PairWindows:
    """Empty :class:`PairWindows` for exact-score windows ``[low[i], high[i]]`` and approximation bound ``bound``
    (``sparse``: which windows lie in the far upper tail; default none)."""
    lo = torch.tensor(low, dtype=torch.float64, device=device)
    hi = torch.tensor(high, dtype=torch.float64, device=device)
    return PairWindows(
        low=lo, high=hi, cut_above=round_up(hi + bound), cut_below=round_down(lo - bound),
        above=torch.zeros(lo.numel(), dtype=torch.long, device=device), q_rows=[], gpos=[], window=[],
        sparse=list(sparse) if sparse is not None else [False] * len(low),
    )


def histogram_pass(
    task: RetrievalTask, scorer: Scorer, grid: Grid, part: tuple[int, int] = (0, 1)
) -> Tensor:
    """Histogram (:func:`float_key` bins) of the approximate scores of every non-excluded pair, over this
    process's share of the tiles (the fallback of :func:`plan_windows`; sum it over the processes)."""
    rank, world = part
    hist = torch.zeros(1 << KEY_BITS, dtype=torch.long, device=task.device)
    ng = task.g_items.numel()

    def add(a: Tensor, weight: int) -> None:
        hist.add_(_histogram(a), alpha=weight)

    if grid.symmetric(task):
        bs = grid.query_block
        for (i, j), idx in {t: n for n, t in enumerate(tiles(grid.num_blocks(task)))}.items():
            if idx % world == rank:
                rows = grid.block_rows(task, i)
                add(score_tile(scorer, task, rows, j * bs, min(ng, (j + 1) * bs)), 1 if i == j else 2)
        return hist
    for b in range(rank, grid.num_blocks(task), world):
        rows = grid.block_rows(task, b)
        for c0 in range(0, ng, grid.gallery_chunk):
            add(score_tile(scorer, task, rows, c0, min(ng, c0 + grid.gallery_chunk)), 1)
    return hist
