"""Per-query state of the approximate pass: band counters and candidate buffers, and how they merge.

A candidate buffer holds, per query, the largest approximate scores seen so far with their gallery positions
(at most ``kc`` of them). Buffers of several gallery chunks, tiles or processes merge by keeping the ``kc``
largest: the result does not depend on the order of merging (ties between equal approximate values are
harmless: every candidate whose order is uncertain is re-scored exactly, see ``_search.ExactSearch``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor


def _packable(m: Tensor) -> bool:
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
    if not _packable(m):
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
    if _packable(m):
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


@dataclass
class PassState:
    """Per-query state of the approximate pass (rows = positions into the query list)."""

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

    def select(self, rows: Tensor) -> PassState:
        """The state of a subset of rows (``rows`` index into this state's rows)."""

        def sel(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[rows]

        return PassState(
            self.rows[rows], self.w[rows], self.has[rows], sel(self.s_best), sel(self.p_best), sel(self.thr_lo),
            sel(self.thr_hi), self.lo[rows], self.hi[rows], self.kc, self.buf_v[rows], self.buf_i[rows],
            self.rank_ks,
        )

    def with_counts(self, lo: Tensor, hi: Tensor, buf_v: Tensor, buf_i: Tensor) -> PassState:
        """The same queries with other counters and buffers (those of another process)."""
        return PassState(
            self.rows, self.w, self.has, self.s_best, self.p_best, self.thr_lo, self.thr_hi, lo, hi, self.kc,
            buf_v, buf_i, self.rank_ks,
        )


@dataclass
class SearchResult:
    """Exact search results for a set of queries.

    Attributes:
        neighbors: ``(Q, k)`` gallery positions (into ``g_items``) of the k nearest neighbours, in rank
            order under the tie rule; ``-1`` where the gallery has fewer than k items.
        scores: ``(Q, k)`` exact float64 scores of those neighbours (``-inf`` for padding).
        first_positive_rank: ``(Q,)`` number of gallery items ranked ahead of the query's best same-label
            item, ``-1`` when the query has no same-label item in the gallery.
        num_positives: ``(Q,)`` number of same-label gallery items (the query itself excluded): R.
    """

    neighbors: Tensor
    scores: Tensor
    first_positive_rank: Tensor
    num_positives: Tensor


def concat_results(parts: list[SearchResult], k: int, device: torch.device | None = None) -> SearchResult:
    """Concatenate per-block results in order."""
    if not parts:
        return SearchResult(
            torch.empty(0, k, dtype=torch.long, device=device),
            torch.empty(0, k, dtype=torch.float64, device=device),
            torch.empty(0, dtype=torch.long, device=device),
            torch.empty(0, dtype=torch.long, device=device),
        )
    return SearchResult(
        torch.cat([p.neighbors for p in parts]),
        torch.cat([p.scores for p in parts]),
        torch.cat([p.first_positive_rank for p in parts]),
        torch.cat([p.num_positives for p in parts]),
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
    lo = sum((s.lo for s in states[1:]), base.lo.clone())
    hi = sum((s.hi for s in states[1:]), base.hi.clone())
    kc = base.kc
    if kc > 0:
        v = torch.cat([s.buf_v for s in states], dim=1)
        i = torch.cat([s.buf_i for s in states], dim=1)
        width = min(kc, v.shape[1])
        v, j = v.topk(width, dim=1)
        i = i.gather(1, j)
    else:
        v, i = base.buf_v, base.buf_i
    return base.with_counts(lo, hi, v, i)
