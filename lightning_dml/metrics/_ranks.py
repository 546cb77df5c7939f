"""Stage 3 of the exact search: exact ranks from the approximate pass, and the single-process driver.

Every result this module returns is a function of *exact* scores only (``_scores``), so it equals a float64 brute
force with the **tie rule**: a gallery item ranks ahead of another when its exact score is larger, or when the
scores are equal and its position in the split is smaller. With the bound ``|a - s| <= w_q`` of every approximate
score ``a`` (``Scorer.error_bound``):

* the rank of a positive of exact score ``s`` (the best one for Recall@K, every one for ``map``) is the number of
  items with approximate score ``> s + w`` plus the exact count inside the band ``[s - w, s + w]``; the band is
  resolved by re-scoring its items exactly when it holds another item (for the best positive: only when it decides
  whether ``rank < K`` for a requested K);
* an item whose approximate score is below ``t_k - 2 w`` (``t_k`` = the k-th largest approximate score) cannot be
  among the exact top k, so only the survivors of the candidate buffers are ordered, re-scoring exactly the runs
  whose order is uncertain;
* the score threshold of a false match rate (``fnmr@fmr``) is an order statistic of the exact scores of the
  negative pairs: the pairs whose approximate score falls in its window are re-scored, those above are counted.

:func:`run_search` drives the stages in one process (``_ddp`` splits them over processes).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

import torch
from torch import Tensor

from lightning_dml.metrics._candidates import (
    PairWindows,
    PassState,
    SearchRequest,
    SearchResult,
    accepted_negatives,
    concat_results,
    round_down,
)
from lightning_dml.metrics._device import _Threads
from lightning_dml.metrics._scan import Grid, histogram_pass, initial_state, plan_windows, scan_rows, scan_symmetric
from lightning_dml.metrics._scan import bin_floor, make_windows, positive_scores
from lightning_dml.metrics._scores import Scorer, score_tile
from lightning_dml.metrics._task import RetrievalTask


# ---------------------------------------------------------------------------------------------- ranks of positives
def _rank_best_rows(task: RetrievalTask, scorer: Scorer, grid: Grid, st: PassState) -> Tensor:
    """Exact rank of the best positive for a few query rows (``st`` selected to them): resolve the band."""
    rank = torch.zeros(st.rows.numel(), dtype=torch.long, device=task.device)
    ng = task.g_items.numel()
    for c0 in range(0, ng, grid.gallery_chunk):
        c1 = min(ng, c0 + grid.gallery_chunk)
        a = score_tile(scorer, task, st.rows, c0, c1)
        rank += torch.count_nonzero(a > st.thr_hi.unsqueeze(1), dim=1)
        band = (a >= st.thr_lo.unsqueeze(1)) & (a <= st.thr_hi.unsqueeze(1))
        r, c = band.nonzero(as_tuple=True)
        gpos = c + c0
        neg = ~task.relevant(st.rows[r], gpos)  # no positive is ahead of the best one
        r, gpos = r[neg], gpos[neg]
        if r.numel():
            s = scorer.exact(task.q_items[st.rows[r]], task.g_items[gpos])
            beats = (s > st.s_best[r]) | ((s == st.s_best[r]) & (gpos < st.p_best[r]))
            rank.index_add_(0, r, beats.long())
    return rank


def best_positive_ranks(task: RetrievalTask, scorer: Scorer, grid: Grid, st: PassState) -> Tensor:
    """Rank of the best positive: exact where ``[lo, hi - 1]`` straddles a requested K, else ``lo`` (on the same
    side of every K as the exact rank); with ``st.exact_rank`` exact for every query (the band is resolved wherever
    it holds another item than the best positive: ``hi - lo > 1``). ``-1`` for queries without positive."""
    lo, hi, has = st.lo, st.hi, st.has
    rank = lo.clone()
    if st.exact_rank:
        amb = has & (hi - lo > 1)
    else:
        ks = torch.tensor(st.rank_ks, dtype=torch.long, device=task.device)
        amb = has & ((lo.unsqueeze(1) < ks) & (hi.unsqueeze(1) - 1 >= ks)).any(dim=1)
    ar = amb.nonzero().squeeze(1)
    for s in range(0, ar.numel(), 256):
        sub = ar[s : s + 256]
        rank[sub] = _rank_best_rows(task, scorer, grid, st.select(sub))
    return torch.where(has, rank, torch.full_like(rank, -1))


def all_positive_ranks(task: RetrievalTask, scorer: Scorer, grid: Grid, st: PassState) -> Tensor:
    """Exact rank (items ranked ahead) of every positive, ``[rows, T]`` in the order of ``st.pos_s`` (ascending
    score, the best last), ``-1`` for padding. A band that holds another item than the positive itself is resolved
    by re-scoring its items exactly, every threshold of a row from one re-scan of the row."""
    valid = st.pos_g >= 0
    ranks = torch.where(valid, st.pos_lo, torch.full_like(st.pos_lo, -1))
    amb = valid & (st.pos_hi - st.pos_lo > 1)
    rows_amb = amb.any(dim=1).nonzero().squeeze(1)
    ng = task.g_items.numel()
    for s0 in range(0, rows_amb.numel(), 256):
        sub = rows_amb[s0 : s0 + 256]
        q = st.rows[sub]
        cols = amb[sub].any(dim=0).nonzero().squeeze(1).tolist()
        for c0 in range(0, ng, grid.gallery_chunk):
            c1 = min(ng, c0 + grid.gallery_chunk)
            a = score_tile(scorer, task, q, c0, c1)
            for j in cols:
                need = amb[sub, j].nonzero().squeeze(1)
                part = a[need]
                band = (part >= st.pos_lo_thr[sub[need], j].unsqueeze(1)) & (part <= st.pos_hi_thr[sub[need], j].unsqueeze(1))
                r, c = band.nonzero(as_tuple=True)
                gpos = c + c0
                owner = sub[need][r]
                other = gpos != st.pos_g[owner, j]
                r, gpos, owner = r[other], gpos[other], owner[other]
                if r.numel():
                    s = scorer.exact(task.q_items[st.rows[owner]], task.g_items[gpos])
                    sj, gj = st.pos_s[owner, j], st.pos_g[owner, j]
                    beats = ((s > sj) | ((s == sj) & (gpos < gj))).long()
                    ranks[:, j].index_add_(0, owner, beats)
    return ranks


# ---------------------------------------------------------------------------------------------- neighbour lists
def _topk_rows_full(
    task: RetrievalTask, scorer: Scorer, grid: Grid, rows: Tensor, k: int, w: Tensor
) -> tuple[Tensor, Tensor]:
    """Candidates (approx value, gallery position) of rows whose buffer was too short: full re-scan."""
    ng = task.g_items.numel()
    full = torch.cat(
        [score_tile(scorer, task, rows, c0, min(ng, c0 + grid.gallery_chunk)) for c0 in range(0, ng, grid.gallery_chunk)],
        dim=1,
    )
    kk = min(k, ng)
    t = full.topk(kk, dim=1).values[:, -1]
    cut = round_down(t.double() - 2 * w)
    counts = torch.count_nonzero(full >= cut.unsqueeze(1), dim=1)
    width = max(int(counts.max()), kk)
    return full.topk(width, dim=1)


def _order_candidates(
    task: RetrievalTask, scorer: Scorer, rows: Tensor, cand_v: Tensor, cand_i: Tensor, cut: Tensor, w: Tensor, kk: int,
    exact_scores: bool,
) -> tuple[Tensor, Tensor]:
    """Exact top-kk order of the candidates (approx values sorted descending per row).

    Consecutive candidates whose approximate scores differ by more than ``2 w`` are in their exact order already;
    runs of closer ones ("clusters") are re-scored exactly and sorted by (exact score desc, gallery position asc).
    With ``exact_scores`` every candidate is re-scored (exact neighbour ids and scores); without, only clusters that
    mix relevant and irrelevant items are re-scored, which makes the relevance sequence exact (all the metrics
    need) but leaves the order inside a same-relevance cluster to the approximate scores.
    """
    ng = task.g_items.numel()
    order = torch.argsort(cand_v, dim=1, descending=True, stable=True)
    cand_v = cand_v.gather(1, order)
    cand_i = cand_i.gather(1, order)
    valid = (cand_v >= cut.unsqueeze(1)) & torch.isfinite(cand_v)
    v64 = cand_v.double()
    close = (v64[:, :-1] - v64[:, 1:]) <= 2 * w.unsqueeze(1)
    close &= valid[:, 1:]
    # cluster id: increases at every gap wider than 2w
    starts = torch.ones_like(valid)
    starts[:, 1:] = ~close
    cid = torch.cumsum(starts.long(), dim=1)
    linked = torch.zeros_like(valid)
    linked[:, 1:] |= close
    linked[:, :-1] |= close
    if exact_scores:
        need = valid
    else:
        # only runs that mix relevant and irrelevant items change the relevance sequence
        relv = task.relevant(rows.unsqueeze(1).expand_as(cand_i), cand_i.clamp(max=ng - 1)).long()
        nclu = int(cid.max()) + 1
        zeros = torch.zeros(cid.shape[0], nclu + 1, dtype=torch.long, device=task.device)
        pos_cnt = zeros.scatter_add(1, cid, relv * valid)
        tot_cnt = zeros.scatter_add(1, cid, valid.long())
        mixed = (pos_cnt > 0) & (pos_cnt < tot_cnt)
        need = valid & linked & mixed.gather(1, cid)
    score = torch.where(valid, v64, torch.full_like(v64, -math.inf))
    r, c = need.nonzero(as_tuple=True)
    if r.numel():
        score[r, c] = scorer.exact(task.q_items[rows[r]], task.g_items[cand_i[r, c]])
    gidx = torch.where(valid, cand_i, torch.full_like(cand_i, ng))
    cid = torch.where(valid, cid, torch.full_like(cid, cand_v.shape[1] + 1))
    # tie rule: (cluster asc, exact score desc, gallery position asc) by three stable sorts
    o = torch.argsort(gidx, dim=1, stable=True)
    gidx, score, cid = gidx.gather(1, o), score.gather(1, o), cid.gather(1, o)
    key = torch.where(need.gather(1, o), score, torch.zeros_like(score))
    o = torch.argsort(key, dim=1, descending=True, stable=True)
    gidx, score, cid = gidx.gather(1, o), score.gather(1, o), cid.gather(1, o)
    o = torch.argsort(cid, dim=1, stable=True)
    gidx, score = gidx.gather(1, o)[:, :kk], score.gather(1, o)[:, :kk]
    gidx = torch.where(torch.isfinite(score), gidx, torch.full_like(gidx, -1))
    return gidx, score


def finish(task: RetrievalTask, scorer: Scorer, grid: Grid, st: PassState, request: SearchRequest) -> SearchResult:
    """Exact ranks and neighbour lists of the state's rows from its (complete) counters and buffers."""
    rows, w = st.rows, st.w
    ng = task.g_items.numel()
    pos_ranks = None
    if st.pos_lo is not None:
        pos_ranks = all_positive_ranks(task, scorer, grid, st)
        rank = torch.where(st.has, pos_ranks[:, -1], torch.full_like(st.has, -1, dtype=torch.long))
    elif st.thr_lo is not None:
        rank = best_positive_ranks(task, scorer, grid, st)
    else:
        rank = torch.full((rows.numel(),), -1, dtype=torch.long, device=task.device)
    npos = task.num_relevant[rows]
    k = request.k
    if k <= 0:
        empty = torch.empty(rows.numel(), 0, device=task.device)
        return SearchResult(empty.long(), empty.double(), rank, npos, pos_ranks)
    kk = min(k, ng)
    cand_v, cand_i = st.buf_v, st.buf_i
    cut = round_down(cand_v[:, kk - 1].double() - 2 * w)
    # the buffer must reach below the cut, otherwise a needed candidate may be missing
    bad = (cand_v[:, -1] >= cut) & torch.isfinite(cut) & (cand_v.shape[1] < ng)
    br = bad.nonzero().squeeze(1)
    if br.numel():
        steps = range(0, br.numel(), 64)
        extra = [_topk_rows_full(task, scorer, grid, rows[br[s : s + 64]], kk, w[br[s : s + 64]]) for s in steps]
        width = max(cand_v.shape[1], max(v.shape[1] for v, _ in extra))
        cand_v = torch.nn.functional.pad(cand_v, (0, width - cand_v.shape[1]), value=-math.inf)
        cand_i = torch.nn.functional.pad(cand_i, (0, width - cand_i.shape[1]), value=0)
        for s, (v, i) in zip(steps, extra):
            sub = br[s : s + 64]
            cand_v[sub] = torch.nn.functional.pad(v, (0, width - v.shape[1]), value=-math.inf)
            cand_i[sub] = torch.nn.functional.pad(i, (0, width - i.shape[1]), value=0)
        cut = round_down(cand_v.topk(kk, dim=1).values[:, -1].double() - 2 * w)
    gidx, exact = _order_candidates(task, scorer, rows, cand_v, cand_i, cut, w, kk, request.exact_scores)
    if kk < k:
        gidx = torch.nn.functional.pad(gidx, (0, k - kk), value=-1)
        exact = torch.nn.functional.pad(exact, (0, k - kk), value=-math.inf)
    return SearchResult(gidx, exact, rank, npos, pos_ranks)


# ---------------------------------------------------------------------------------------------- pair thresholds
@dataclass
class PairThresholds:
    """Exact verification figures per false match rate (``fnmr@fmr``), in the scorer's units.

    Attributes:
        fmrs: the requested false match rates.
        thresholds: ``theta``: a pair is accepted as a match when its score is ``> theta``; the largest negative
            score ``theta`` with at most ``floor(fmr * negatives)`` negative pairs above it (exact rational
            arithmetic: :func:`~lightning_dml.metrics._candidates.accepted_negatives`; ``-inf`` when every negative
            may be accepted).
        fmr: the false match rate at ``theta`` (``<= fmrs``).
        fnmr: the false non-match rate at ``theta``: positive pairs with score ``<= theta`` over all positives
            (0.0 when there is no positive pair).
        positives, negatives: the numbers of positive and negative (query, gallery) pairs.
    """

    fmrs: tuple[Fraction, ...]
    thresholds: list[float]
    fmr: list[float]
    fnmr: list[float]
    positives: int
    negatives: int


def pair_totals(task: RetrievalTask) -> tuple[int, int]:
    """(positive pairs, negative pairs) of the task: every non-excluded (query, gallery) pair is one or the other."""
    pos = int(task.num_relevant.sum())
    pairs = task.q_items.numel() * task.g_items.numel() - int(task.num_excluded().sum())
    return pos, pairs - pos


def resolve_windows(
    task: RetrievalTask, scorer: Scorer, windows: PairWindows, fmrs: tuple[Fraction, ...], pos_sorted: Tensor,
) -> list[tuple[float, float, float] | None]:
    """Per false match rate, ``(theta, fmr, fnmr)`` from the merged windows, or None where the window does not hold
    the threshold (the caller then repairs the window). ``pos_sorted``: exact scores of every positive pair,
    ascending."""
    n_pos, n_neg = pair_totals(task)
    out: list[tuple[float, float, float] | None] = []
    if windows.q_rows:
        q_rows, gpos = torch.cat(windows.q_rows), torch.cat(windows.gpos)
        packed = torch.cat(windows.window)
        s_all = scorer.exact(task.q_items[q_rows], task.g_items[gpos])
        rel_all = task.relevant(q_rows, gpos)
    else:
        q_rows = gpos = packed = torch.empty(0, dtype=torch.long, device=task.device)
        s_all = torch.empty(0, dtype=torch.float64, device=task.device)
        rel_all = torch.empty(0, dtype=torch.bool, device=task.device)
    for i, f in enumerate(fmrs):
        k = accepted_negatives(f, n_neg) + 1  # theta: the k-th largest negative score
        if k > n_neg:
            out.append((-math.inf, 1.0 if n_neg else 0.0, 0.0))
            continue
        sel = (packed // 2) == i
        s, weight, rel = s_all[sel], (packed[sel] % 2) + 1, rel_all[sel]
        order = torch.argsort(s)
        s, weight, rel = s[order], weight[order], rel[order]
        # collected weight at or above each sorted position (a trailing 0: none at or above len(s))
        suffix = torch.cat([torch.flip(torch.cumsum(torch.flip(weight, [0]), 0), [0]), weight.new_zeros(1)])
        above = int(windows.above[i])
        low, high = float(windows.low[i]), float(windows.high[i])

        def negatives(v: Tensor, side: str) -> Tensor:
            """#negative pairs with exact score >= v (side="left") or > v (side="right"), for v in the window."""
            collected = suffix[torch.searchsorted(s, v, side=side)]
            pos = pos_sorted.numel() - torch.searchsorted(pos_sorted, v, side=side)
            return above + collected - pos

        edges = torch.tensor([low, high], dtype=torch.float64, device=task.device)
        if not (int(negatives(edges[1:], "right")) < k <= int(negatives(edges[:1], "left"))):
            out.append(None)
            continue
        cand = s[~rel & (s >= low) & (s <= high)]
        theta = float(cand[negatives(cand, "left") >= k].max())
        t = torch.tensor([theta], dtype=torch.float64, device=task.device)
        fmr = int(negatives(t, "right")) / n_neg
        fnmr = int(torch.searchsorted(pos_sorted, t, side="right")) / n_pos if n_pos else 0.0
        out.append((theta, fmr, fnmr))
    return out


def guaranteed_windows(
    hist: Tensor, fmrs: tuple[Fraction, ...], task: RetrievalTask, pos_sorted: Tensor, bound: float
) -> PairWindows:
    """Windows that certainly hold each threshold, from the histogram of every pair's approximate score
    (:func:`~lightning_dml.metrics._scan.histogram_pass`): exact counts are bracketed by the approximate ones
    shifted by ``bound``."""
    _, n_neg = pair_totals(task)
    bins = torch.arange(hist.numel(), device=hist.device)
    floor = bin_floor(bins)  # lowest value of each bin
    at_or_above = torch.flip(torch.cumsum(torch.flip(hist, [0]), 0), [0])  # approx >= floor[b]
    low, high = [], []
    for f in fmrs:
        k = accepted_negatives(f, n_neg) + 1
        # U = floor[b] + bound: #neg{S > U} <= #{A > floor[b]} - #pos{S > U} <= at_or_above[b] - #pos{S > U}
        u = floor + bound
        pos_gt = pos_sorted.numel() - torch.searchsorted(pos_sorted, u, side="right")
        ok_hi = (at_or_above - pos_gt) < k
        ok_hi &= torch.isfinite(floor)
        b_hi = int(ok_hi.nonzero()[0]) if bool(ok_hi.any()) else hist.numel() - 1
        # L = floor[b] - bound: #neg{S >= L} >= #{A >= floor[b]} - #pos{S >= L} >= at_or_above[b] - #pos{S >= L}
        lo_v = floor - bound
        pos_ge = pos_sorted.numel() - torch.searchsorted(pos_sorted, lo_v, side="left")
        ok_lo = ((at_or_above - pos_ge) >= k) & torch.isfinite(floor)
        b_lo = int(ok_lo.nonzero()[-1]) if bool(ok_lo.any()) else 0
        high.append(float(u[b_hi]) if bool(ok_hi.any()) else math.inf)
        low.append(float(lo_v[b_lo]) if bool(ok_lo.any()) else -math.inf)
    return make_windows(low, high, bound, task.device)


# ---------------------------------------------------------------------------------------------- driver
def _pass(
    task: RetrievalTask, scorer: Scorer, grid: Grid, request: SearchRequest, windows: PairWindows | None
) -> list[SearchResult]:
    if grid.symmetric(task):
        st = initial_state(task, scorer, torch.arange(task.q_items.numel(), device=task.device), request)
        scan_symmetric(task, scorer, grid, st, windows=windows)
        return [finish(task, scorer, grid, st.select(grid.block_rows(task, b)), request) for b in range(grid.num_blocks(task))]
    parts = []
    for b in range(grid.num_blocks(task)):
        st = initial_state(task, scorer, grid.block_rows(task, b), request)
        scan_rows(task, scorer, grid, st, windows)
        parts.append(finish(task, scorer, grid, st, request))
    return parts


def sorted_positive_scores(task: RetrievalTask, scorer: Scorer) -> Tensor:
    """Exact scores of every positive pair of the task, ascending."""
    rows = torch.arange(task.q_items.numel(), device=task.device)
    s, g = positive_scores(task, scorer, rows)
    return torch.sort(s[g >= 0]).values


def pair_bound(task: RetrievalTask, scorer: Scorer) -> float:
    """One bound on the approximation error of every (query, gallery) pair: the largest per-query bound."""
    return float(scorer.error_bound(task.q_items, task.g_items).max()) if task.q_items.numel() else 0.0


def run_search(
    task: RetrievalTask, scorer: Scorer, grid: Grid, request: SearchRequest
) -> tuple[SearchResult, PairThresholds | None]:
    """The whole search in one process: every query against the gallery, and the pair thresholds if requested.

    ``request.exact_scores=False`` re-scores only the candidates whose relevance order is uncertain: the relevance
    sequence is exact, but runs of near-tied items of one relevance keep gallery order and approximate ``scores``.
    """
    if request.positive_ranks:  # every positive's exact rank gives the first one's
        request = replace(request, rank_ks=(), exact_rank=False)
    with _Threads(1):
        windows = pos_sorted = None
        if request.fmrs:
            pos_sorted = sorted_positive_scores(task, scorer)
            bound = pair_bound(task, scorer)
            windows = plan_windows(task, scorer, grid, request.fmrs, pair_totals(task)[1], bound)
        result = concat_results(_pass(task, scorer, grid, request, windows), request.k, task.device)
        if not request.fmrs:
            return result, None
        figures = resolve_windows(task, scorer, windows, request.fmrs, pos_sorted)
        if any(f is None for f in figures):
            hist = histogram_pass(task, scorer, grid)
            windows = guaranteed_windows(hist, request.fmrs, task, pos_sorted, bound)
            pairs_pass(task, scorer, grid, windows)
            figures = resolve_windows(task, scorer, windows, request.fmrs, pos_sorted)
    return result, thresholds_of(request.fmrs, figures, task)


def thresholds_of(
    fmrs: tuple[Fraction, ...], figures: list[tuple[float, float, float] | None], task: RetrievalTask
) -> PairThresholds:
    """The :class:`PairThresholds` of resolved window figures (every one must be resolved)."""
    if any(f is None for f in figures):
        raise RuntimeError("fnmr@fmr: a guaranteed window did not hold its threshold (a bug)")
    n_pos, n_neg = pair_totals(task)
    return PairThresholds(
        fmrs, [f[0] for f in figures], [f[1] for f in figures], [f[2] for f in figures], n_pos, n_neg
    )


def pairs_pass(
    task: RetrievalTask, scorer: Scorer, grid: Grid, windows: PairWindows, part: tuple[int, int] = (0, 1)
) -> None:
    """A pass that only fills pair windows (this process's share of the tiles)."""
    request = SearchRequest(k=0, rank_ks=())
    if grid.symmetric(task):
        st = initial_state(task, scorer, torch.arange(task.q_items.numel(), device=task.device), request)
        scan_symmetric(task, scorer, grid, st, part, windows)
        return
    rank, world = part
    for b in range(rank, grid.num_blocks(task), world):
        scan_rows(task, scorer, grid, initial_state(task, scorer, grid.block_rows(task, b), request), windows)
