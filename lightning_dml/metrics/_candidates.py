"""Stage 2 of the exact search, its state: per query the band counters and candidate buffers of the approximate
pass, the pair-score windows of ``fnmr@fmr``, the word-wise primitives that fill them, and how partial states of
several gallery chunks, tiles or processes merge.

A candidate buffer holds, per query, the largest approximate scores seen so far with their gallery positions
(at most ``kc`` of them). Buffers of several gallery chunks, tiles or processes merge by keeping the ``kc``
largest: the result does not depend on the order of merging (ties between equal approximate values are
harmless: every candidate whose order is uncertain is re-scored exactly, see ``_search.ExactSearch``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from fractions import Fraction

import torch
from torch import Tensor


def packable(m: Tensor) -> bool:
    """Whether the bytes of a bool matrix can be read as int64 words (8 columns per word)."""
    return (
        m.device.type == "cpu" and m.ndim == 2 and m.stride(1) == 1 and m.shape[1] % 8 == 0
        and m.stride(0) % 8 == 0 and m.storage_offset() % 8 == 0
    )


def count_true(m: Tensor, dim: int) -> Tensor:
    """Number of True entries of a bool matrix along ``dim`` (int32).

    On the CPU the bytes are summed 8 at a time as int64 words (SWAR: each byte lane counts at most 255 ones, so
    no carry crosses lanes), then the lanes: 10 to 40 times faster than a byte sum, which torch does not
    vectorise well. Elsewhere (CUDA) a byte sum.
    """
    if m.numel() == 0 or not packable(m):  # no entry: no lane to stack
        return m.view(torch.uint8).sum(dim=dim, dtype=torch.int32)
    words = m.view(torch.int64)  # [R, C / 8]
    if dim == 1:
        lanes = torch.stack([words[:, i : i + 255].sum(1) for i in range(0, words.shape[1], 255)], 1)
    else:
        lanes = torch.stack([words[i : i + 255].sum(0) for i in range(0, words.shape[0], 255)], 0)
    return lanes.view(torch.uint8).sum(dim=dim, dtype=torch.int32)


def true_pairs(m: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``m.nonzero(as_tuple=True)`` of a sparse bool matrix (row-major order).

    On the CPU the scan runs over int64 words (8 entries each), and only the non-zero words are unpacked: about 8
    times less to scan than the bytes. Elsewhere: ``nonzero`` restricted to the lines (rows for dim=1, columns
    for dim=0) that hold a True.
    """
    if packable(m):
        r, w = m.view(torch.int64).nonzero(as_tuple=True)
        c = (w * 8).unsqueeze(1) + torch.arange(8, device=m.device)
        r = r.unsqueeze(1).expand_as(c)
        keep = m[r, c]
        return r[keep], c[keep]
    cnt = count_true(m, dim)
    lines = (cnt > 0).nonzero().squeeze(1)
    if lines.numel() == 0:
        e = torch.empty(0, dtype=torch.long, device=m.device)
        return e, e
    if dim == 1:
        r, c = m[lines].nonzero(as_tuple=True)
        return lines[r], c
    r, c = m[:, lines].nonzero(as_tuple=True)
    return r, lines[c]


def round_down(t: Tensor) -> Tensor:
    """float64 -> float32, rounded towards -inf (so comparisons stay conservative)."""
    f = t.to(torch.float32)
    return torch.where(f.double() > t, torch.nextafter(f, torch.full_like(f, -math.inf)), f)


def round_up(t: Tensor) -> Tensor:
    """float64 -> float32, rounded towards +inf."""
    f = t.to(torch.float32)
    return torch.where(f.double() < t, torch.nextafter(f, torch.full_like(f, math.inf)), f)


def exact_rate(value: float | str | Fraction) -> Fraction:
    """A false match rate as an exact rational: a ``Fraction`` as is, a string as the decimal number it writes
    (``"0.29"`` -> 29/100, ``"1e-3"`` -> 1/1000), a float as its shortest decimal ``repr`` (0.29 -> 29/100, not
    the binary value 0.28999999999999998002...)."""
    if isinstance(value, Fraction):
        return value
    text = value.strip() if isinstance(value, str) else repr(float(value))
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):  # a spelling float() reads and Fraction() does not
        return Fraction(repr(float(text)))


def accepted_negatives(rate: float | str | Fraction, negatives: int) -> int:
    """``floor(rate x negatives)`` in exact arithmetic: the negative pairs a false match rate lets through
    (``fnmr@fmr``; float64 gives ``floor(0.29 x 100) = 28``)."""
    return math.floor(exact_rate(rate) * int(negatives))


@dataclass(frozen=True)
class SearchRequest:
    """What one search computes, beside each query's best positive.

    Attributes:
        k: length of the exact neighbour lists (0: none).
        rank_ks: the K for which "rank of the first positive < K" must be exact (Recall@K).
        exact_scores: neighbour scores all exact (``knn``); else exact where the relevance order needs it.
        positive_ranks: the exact rank of every positive of every query (``map``, the mean average precision over
            the whole ranking).
        fmrs: false match rates at which the exact score threshold over all negative pairs is wanted
            (``fnmr@fmr``), as exact rationals (:class:`fractions.Fraction`; a float ``F`` stands for the decimal
            number ``repr(F)``).
        exact_rank: the rank of the first positive exact for every query (``mrr``), not only on the right side of
            every K of ``rank_ks``.
    """

    k: int = 1
    rank_ks: tuple[int, ...] = (1,)
    exact_scores: bool = False
    positive_ranks: bool = False
    fmrs: tuple[Fraction, ...] = ()
    exact_rank: bool = False

    def best_positive(self) -> bool:
        """Whether the pass tracks each query's best positive (its rank is asked for, and ``map`` does not give
        it already)."""
        return bool(self.rank_ks) or self.exact_rank


@dataclass
class PassState:
    """Per-query state of the approximate pass (rows = positions into the query list).

    The band of a threshold ``s`` (an exact score) is ``[thr_lo, thr_hi]`` = ``s -+ w`` rounded outwards to
    float32: an item whose approximate score is above ``thr_hi`` is certainly ranked ahead, one below ``thr_lo``
    certainly behind; ``lo`` counts the former, ``hi`` both the former and the band.
    """

    rows: Tensor
    w: Tensor  # error bound per query (float64)
    has: Tensor  # query has at least one positive
    s_best: Tensor | None  # exact best positive score
    p_best: Tensor | None  # its gallery position
    thr_lo: Tensor | None  # float32 band around s_best
    thr_hi: Tensor | None
    lo: Tensor  # items with approx > thr_hi (certainly ranked ahead)
    hi: Tensor  # items with approx >= thr_lo (possibly ranked ahead, best positive included)
    kc: int  # candidate buffer width
    buf_v: Tensor  # [rows, <=kc] largest approximate scores, descending
    buf_i: Tensor  # their gallery positions
    rank_ks: tuple[int, ...] = ()  # the K whose "rank < K" decisions must be exact
    exact_rank: bool = False  # the rank of the best positive exact for every query (SearchRequest.exact_rank)
    # every positive (SearchRequest.positive_ranks): [rows, T] ascending by exact score, padded with -inf / -1
    pos_s: Tensor | None = None  # exact scores
    pos_g: Tensor | None = None  # gallery positions
    pos_lo_thr: Tensor | None = None  # float32 bands (padding: +inf, never reached)
    pos_hi_thr: Tensor | None = None
    pos_lo: Tensor | None = None  # counts per positive, as lo / hi above
    pos_hi: Tensor | None = None

    _PER_ROW = ("rows", "w", "has", "s_best", "p_best", "thr_lo", "thr_hi", "lo", "hi", "buf_v", "buf_i", "pos_s",
                "pos_g", "pos_lo_thr", "pos_hi_thr", "pos_lo", "pos_hi")

    def select(self, rows: Tensor) -> PassState:
        """The state of a subset of rows (``rows`` index into this state's rows)."""
        return replace(self, **{f: None if getattr(self, f) is None else getattr(self, f)[rows] for f in self._PER_ROW})

    def with_counts(self, counts: dict[str, Tensor]) -> PassState:
        """The same queries with other counters and buffers (those of another process): keys of :attr:`COUNTS`."""
        return replace(self, **counts)

    #: the fields a process fills during the pass (merged over processes by :func:`merge_states`)
    COUNTS = ("lo", "hi", "buf_v", "buf_i", "pos_lo", "pos_hi")

    def counts(self) -> dict[str, Tensor]:
        """The fields of :attr:`COUNTS` that are set."""
        return {f: getattr(self, f) for f in self.COUNTS if getattr(self, f) is not None}

    def count_limit(self, num_gallery: int) -> int:
        """A query whose certain count ``lo`` reaches this is left out of further best-positive counting: the
        largest K of :attr:`rank_ks` (its rank is then on the right side of every K), or, with
        :attr:`exact_rank`, more than the gallery holds (every query counted to the end)."""
        if self.exact_rank:
            return num_gallery + 1
        return max(self.rank_ks) if self.rank_ks else 0


@dataclass
class PairWindows:
    """Exact-score windows over all (query, gallery) pairs, one per false match rate (``fnmr@fmr``).

    For window ``i`` = ``[low[i], high[i]]`` (exact scores) and a bound ``W`` on every pair's approximation error,
    the pass counts the pairs whose approximate score is above ``high[i] + W`` (``above[i]``: their exact score is
    certainly above the window) and collects those with approximate score in ``[low[i] - W, high[i] + W]`` (every
    pair whose exact score lies in the window is among them). Every exact count ``#{S > v}`` with ``v`` in the
    window is then ``above[i]`` + the collected pairs' exact count. Excluded pairs are never counted.

    A window expected to have few pairs at or above its bottom (``sparse``: the far upper tail, the usual low false
    match rates) is served by one comparison per tile and a sparse extraction of those pairs, split by value into
    counted and collected ones; the others by two comparisons (above the top: counted; at or above the bottom and
    not above the top: collected).
    """

    low: Tensor  # float64 [m]
    high: Tensor  # float64 [m]
    cut_above: Tensor  # float32 [m]: approx > cut_above[i] counts as above window i
    cut_below: Tensor  # float32 [m]: approx >= cut_below[i] (and not above) is collected
    above: Tensor  # int64 [m]
    sparse: list[bool]  # window i lies in the far upper tail: one comparison and a sparse extraction serve it
    q_rows: list[Tensor]  # collected pairs: query rows, gallery positions, window index
    gpos: list[Tensor]
    window: list[Tensor]


@dataclass
class SearchResult:
    """Exact search results for a set of queries.

    Attributes:
        neighbors: ``(Q, k)`` gallery positions (into ``g_items``) of the k nearest neighbours, in rank
            order under the tie rule; ``-1`` where the gallery has fewer than k items.
        scores: ``(Q, k)`` exact float64 scores of those neighbours (``-inf`` for padding).
        first_positive_rank: ``(Q,)`` number of gallery items ranked ahead of the query's best positive,
            ``-1`` when the query has no positive.
        num_positives: ``(Q,)`` number of positives (relevant, not excluded): R.
        positive_ranks: ``(Q, T)`` exact rank (items ahead) of each positive, ascending, ``-1`` padding; or None.
    """

    neighbors: Tensor
    scores: Tensor
    first_positive_rank: Tensor
    num_positives: Tensor
    positive_ranks: Tensor | None = None


def concat_results(parts: list[SearchResult], k: int, device: torch.device | None = None) -> SearchResult:
    """Concatenate per-block results in order."""
    if not parts:
        return SearchResult(
            torch.empty(0, k, dtype=torch.long, device=device),
            torch.empty(0, k, dtype=torch.float64, device=device),
            torch.empty(0, dtype=torch.long, device=device),
            torch.empty(0, dtype=torch.long, device=device),
        )
    ranks = None
    if parts[0].positive_ranks is not None:
        width = max(p.positive_ranks.shape[1] for p in parts)
        ranks = torch.cat([torch.nn.functional.pad(p.positive_ranks, (0, width - p.positive_ranks.shape[1]), value=-1)
                           for p in parts])
    return SearchResult(
        torch.cat([p.neighbors for p in parts]),
        torch.cat([p.scores for p in parts]),
        torch.cat([p.first_positive_rank for p in parts]),
        torch.cat([p.num_positives for p in parts]),
        ranks,
    )


def _pad_width(buf_v: Tensor, buf_i: Tensor, width: int) -> tuple[Tensor, Tensor]:
    extra = width - buf_v.shape[1]
    if extra <= 0:
        return buf_v, buf_i
    return (
        torch.nn.functional.pad(buf_v, (0, extra), value=-math.inf),
        torch.nn.functional.pad(buf_i, (0, extra), value=0),
    )


def insert_rows(buf_v: Tensor, buf_i: Tensor, rows: Tensor, v: Tensor, i: Tensor, kc: int) -> tuple[Tensor, Tensor]:
    """Merge dense candidate rows ``(v, i)`` into the buffers of ``rows`` keeping the kc largest."""
    return insert_pairs(buf_v, buf_i, rows.repeat_interleave(v.shape[1]), v.reshape(-1), i.reshape(-1), kc)


def insert_pairs(buf_v: Tensor, buf_i: Tensor, q: Tensor, v: Tensor, g: Tensor, kc: int) -> tuple[Tensor, Tensor]:
    """Merge candidate triples (query row q, value v, gallery position g) into the buffers (top kc)."""
    n = buf_v.shape[0]
    dev = buf_v.device
    order = torch.argsort(q, stable=True)
    q, v, g = q[order], v[order], g[order]
    counts = torch.bincount(q, minlength=n)
    width = int(counts.max())
    pos = torch.arange(q.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[q]
    rows = torch.unique(q)
    local = torch.full((n,), -1, dtype=torch.long, device=dev)
    local[rows] = torch.arange(rows.numel(), device=dev)
    nv = torch.full((rows.numel(), width), -math.inf, device=dev)
    ni = torch.zeros((rows.numel(), width), dtype=torch.long, device=dev)
    nv[local[q], pos] = v
    ni[local[q], pos] = g
    cv = torch.cat([buf_v[rows], nv], dim=1)
    ci = torch.cat([buf_i[rows], ni], dim=1)
    width_new = min(kc, cv.shape[1])
    if cv.shape[1] > width_new:
        cv, j = cv.topk(width_new, dim=1)
        ci = ci.gather(1, j)
    buf_v, buf_i = _pad_width(buf_v, buf_i, width_new)
    cv, ci = _pad_width(cv, ci, buf_v.shape[1])
    buf_v[rows] = cv
    buf_i[rows] = ci
    return buf_v, buf_i


def merge_chunk(buf_v: Tensor, buf_i: Tensor, a: Tensor, c0: int, kc: int, m: Tensor) -> tuple[Tensor, Tensor]:
    """Keep the kc largest approximate scores per row (values, gallery positions) across gallery chunks.

    ``a`` holds the scores of gallery positions ``[c0, c0 + a.shape[1])``; ``m`` is a bool work matrix of
    ``a``'s shape. Once a row's buffer is full, only entries >= its current kc-th value can enter, so a
    comparison and a sparse extraction replace a full ``topk`` of the chunk.
    """
    dev = a.device
    if buf_v.shape[1] < kc:
        v, i = a.topk(min(kc, a.shape[1]), dim=1)
        buf_v = torch.cat([buf_v, v], dim=1)
        buf_i = torch.cat([buf_i, i + c0], dim=1)
    else:
        torch.ge(a, buf_v[:, kc - 1 :], out=m)
        r, c = true_pairs(m, 1)
        if r.numel() == 0:
            return buf_v, buf_i
        nr = a.shape[0]
        counts = torch.bincount(r, minlength=nr)
        width = int(counts.max())
        pos = torch.arange(r.numel(), device=dev) - (torch.cumsum(counts, 0) - counts)[r]
        v = torch.full((nr, width), -math.inf, device=dev)
        i = torch.zeros((nr, width), dtype=torch.long, device=dev)
        v[r, pos] = a[r, c]
        i[r, pos] = c + c0
        buf_v = torch.cat([buf_v, v], dim=1)
        buf_i = torch.cat([buf_i, i], dim=1)
    if buf_v.shape[1] > kc:
        buf_v, j = buf_v.topk(kc, dim=1)
        buf_i = buf_i.gather(1, j)
    return buf_v, buf_i


def merge_states(states: list[PassState]) -> PassState:
    """Combine the partial counters and candidate buffers of several processes (same rows, same order)."""
    base = states[0]
    counts = {}
    for name in ("lo", "hi", "pos_lo", "pos_hi"):
        if getattr(base, name) is not None:
            counts[name] = sum((getattr(s, name) for s in states[1:]), getattr(base, name).clone())
    if base.kc > 0:
        v = torch.cat([s.buf_v for s in states], dim=1)
        i = torch.cat([s.buf_i for s in states], dim=1)
        width = min(base.kc, v.shape[1])
        v, j = v.topk(width, dim=1)
        counts["buf_v"], counts["buf_i"] = v, i.gather(1, j)
    return base.with_counts(counts)
