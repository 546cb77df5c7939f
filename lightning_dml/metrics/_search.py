"""Exact nearest-neighbour search in chunks: a fast approximate pass, then exact fp64 re-scoring.

Every result this module returns is a function of *exact* scores only, so it equals an fp64 brute force:

* ``exact score`` of a (query, gallery) pair: cosine similarity ``<x_q, x_g> / (|x_q| |x_g|)`` of the raw
  embeddings, or the negative squared Euclidean distance ``-|x_q - x_g|^2``, both evaluated in float64
  from the float32 inputs (products of two float32 numbers are exact in float64).
* ``tie rule``: a gallery item ranks ahead of another when its exact score is larger, or when the scores
  are equal and its position in the split (``indices``) is smaller.

The approximate pass multiplies blocks of the embedding matrix in float32 (or bfloat16 where the CPU has
fast bf16 matrix units) and never allocates an N x N matrix. Each approximate score ``a`` carries a rigorous
bound ``|a - s| <= w_q`` on its distance to the exact score ``s``, derived from the rounding of the inputs,
the float32 accumulation (``gamma_D = D u / (1 - D u)``, Higham, *Accuracy and Stability of Numerical
Algorithms*, Eq. 3.4) and, for bf16, the rounding of the product. With that bound

* an item whose approximate score is below ``t_k - 2 w_q`` (``t_k`` = the k-th largest approximate score)
  cannot be among the exact top k, so only the survivors are re-scored exactly;
* the rank of the best positive (what Recall@K needs, for any K) is the number of items with approximate
  score ``> s* + w_q`` plus the exact count inside the band ``[s* - w_q, s* + w_q]``; the band is only
  resolved when it decides whether ``rank < K`` for a requested K.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_dml.metrics._progress import track

_U32 = 2.0**-24  # unit roundoff of float32
_U16 = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)
_PAIR_BLOCK_BYTES = 8 * 2**20  # memory for one batch of gathered pairs (stays in cache)


def tree_sum(t: Tensor) -> Tensor:
    """Sum over the last dimension in a fixed pairwise order (zero padding to a power of two).

    Element-wise additions only, so the result of a row never depends on how many rows are summed
    together or on the thread count: the exact scores are bit-for-bit reproducible across processes.
    """
    d = t.shape[-1]
    p = 1 << max(0, (d - 1).bit_length())
    if p != d:
        t = torch.nn.functional.pad(t, (0, p - d))
    while t.shape[-1] > 1:
        h = t.shape[-1] // 2
        t = t[..., :h] + t[..., h:]
    return t[..., 0]


def _gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): bound on the relative error of an n-term float sum."""
    return n * u / (1.0 - n * u)


@functools.lru_cache(maxsize=1)
def bf16_matmul_is_fast() -> bool:
    """Runtime check: does this CPU multiply bfloat16 matrices clearly faster than float32?

    True only when oneDNN reports native bf16 support (AVX512-BF16 / AMX) *and* a small timed product runs
    at least 1.5x faster in bf16 than in fp32. Without native support torch emulates bf16 and is several
    times slower than fp32, so the search falls back to float32.
    """
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except (AttributeError, RuntimeError):
        return False
    a = torch.randn(1024, 256)
    b = torch.randn(2048, 256)

    def _time(x: Tensor, y: Tensor) -> float:
        x @ y.T
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            x @ y.T
            best = min(best, time.perf_counter() - t0)
        return best

    return _time(a.bfloat16(), b.bfloat16()) * 1.5 < _time(a, b)


def resolve_precision(precision: str) -> str:
    """Map ``"auto"`` to ``"bf16"`` when :func:`bf16_matmul_is_fast`, else ``"fp32"``."""
    if precision not in ("auto", "fp32", "bf16"):
        raise ValueError(f"precision must be 'auto', 'fp32' or 'bf16', got {precision!r}")
    if precision == "auto":
        return "bf16" if bf16_matmul_is_fast() else "fp32"
    return precision


class Scorer:
    """Approximate block scores with a per-query error bound, and exact float64 pair scores.

    Args:
        x: raw embeddings, float32 ``(N, D)``.
        metric: ``"cosine"`` or ``"euclidean"``.
        precision: ``"fp32"`` or ``"bf16"`` for the approximate pass.
    """

    def __init__(self, x: Tensor, metric: str, precision: str) -> None:
        if metric not in ("cosine", "euclidean"):
            raise ValueError(f"metric must be 'cosine' or 'euclidean', got {metric!r}")
        self.x = x.contiguous()
        self.threads = torch.get_num_threads()  # for the matrix products; the rest runs on one thread
        self.metric = metric
        self.precision = precision
        n, d = x.shape
        self.dim = d
        # fp64 norms, chunked so no float64 copy of the whole matrix is made.
        norms64 = torch.empty(n, dtype=torch.float64)
        for s in range(0, n, 8192):
            norms64[s : s + 8192] = torch.sqrt(tree_sum(x[s : s + 8192].double().square()))
        self.norms64 = norms64
        if metric == "cosine":
            rep = torch.empty_like(x)
            for s in range(0, n, 8192):
                rep[s : s + 8192] = (x[s : s + 8192].double() / norms64[s : s + 8192].unsqueeze(1)).float()
            # each normalised coordinate is rounded once from float64: relative error <= u32 (+ fp64 noise)
            self._eta = _U32 * (1 + 1e-6)
        else:
            rep = x
            self._eta = 0.0
        if precision == "bf16":
            low = rep.to(torch.bfloat16)
            resid = torch.empty(n, dtype=torch.float64)
            for s in range(0, n, 8192):
                resid[s : s + 8192] = torch.linalg.vector_norm(
                    rep[s : s + 8192].double() - low[s : s + 8192].double(), dim=1
                )
            self.rep = low
            self.resid = resid
        else:
            self.rep = rep.contiguous()
            self.resid = torch.zeros(n, dtype=torch.float64)
        self.rep_norm = torch.empty(n, dtype=torch.float64)
        for s in range(0, n, 8192):
            self.rep_norm[s : s + 8192] = torch.linalg.vector_norm(self.rep[s : s + 8192].double(), dim=1)
        if metric == "euclidean":
            self.sq32 = (x * x).sum(dim=1)  # float32 squared norms used by the approximate pass

    # ---------------------------------------------------------------- approximate
    def approx(self, q_items: Tensor, g_items: Tensor) -> Tensor:
        """Approximate scores ``(len(q_items), len(g_items))`` in float32."""
        with _Threads(self.threads):
            prod = self.rep[q_items] @ self.rep[g_items].T
        prod = prod.float()
        if self.metric == "cosine":
            return prod
        return prod.mul_(2.0).sub_(self.sq32[g_items].unsqueeze(0)).sub_(self.sq32[q_items].unsqueeze(1))

    def error_bound(self, q_items: Tensor, g_items: Tensor) -> Tensor:
        """Per-query bound ``w_q >= |approx(q, g) - exact(q, g)|`` for every gallery item g (float64)."""
        d = self.dim
        gam = _gamma(d, _U32)
        lowp = self.precision == "bf16" or torch.get_float32_matmul_precision() != "highest"
        g_norm = float(self.rep_norm[g_items].max())
        g_res = float(self.resid[g_items].max())
        q_norm = self.rep_norm[q_items]
        q_res = self.resid[q_items]
        # |<q_hat, g_hat> - <q_rep, g_rep>| + float32 accumulation of <q_hat, g_hat>
        dot_err = q_res * (g_norm + g_res) + q_norm * g_res + gam * q_norm * g_norm
        if lowp:
            # bf16 product (or a reduced-precision fp32 matmul mode): inputs may be rounded to 8 bits
            # and the result rounded to bf16 (relative 2^-8 of a value at most |q| |g| (1 + 2^-7)).
            if self.precision != "bf16":
                dot_err = dot_err + 2 * _U16 * q_norm * g_norm * (1 + _U16)
            dot_err = dot_err + _U16 * q_norm * g_norm * (1 + 2**-6)
        if self.metric == "cosine":
            eta = self._eta
            # each normalised vector is the exact unit vector times (1 + eps_i), |eps_i| <= eta
            w = dot_err + 2 * eta + eta * eta
        else:
            g_raw = float(torch.sqrt(self.sq32[g_items].double().max()))
            q_raw = torch.sqrt(self.sq32[q_items].double())
            mag = 2 * q_raw * g_raw + g_raw**2 + q_raw**2
            w = 2 * dot_err + gam * (g_raw**2 + q_raw**2) * 1.01 + 4 * _U32 * mag
        # fp64 evaluation of the exact score (relative gamma_D in double), plus a small safety factor
        return w * 1.125 + 1e-12 * (1.0 + (0.0 if self.metric == "cosine" else mag))

    # ---------------------------------------------------------------- exact
    @functools.cached_property
    def x64(self) -> Tensor:
        """Float64 copy of the embeddings (exact: every float32 is a float64), made on first use."""
        return self.x.double()

    def exact(self, q_items: Tensor, g_items: Tensor) -> Tensor:
        """Exact float64 scores of the pairs ``(q_items[i], g_items[i])`` (1-D tensors of equal length)."""
        out = torch.empty(q_items.numel(), dtype=torch.float64)
        step = max(1, (2 * 2**20) // (8 * self.dim))  # 2 MB operands: the pair batch stays in cache
        x64 = self.x64
        for s in range(0, q_items.numel(), step):
            qi = q_items[s : s + step]
            gi = g_items[s : s + step]
            a = x64[qi]
            b = x64[gi]
            if self.metric == "cosine":
                out[s : s + step] = tree_sum(a.mul_(b)) / (self.norms64[qi] * self.norms64[gi])
            else:
                out[s : s + step] = -tree_sum(a.sub_(b).square_())
        return out

    def approx_pairs(self, q_items: Tensor, g_items: Tensor) -> Tensor:
        """Approximate scores of pairs (float32 sums of the approximate representation; error <= w_q)."""
        out = torch.empty(q_items.numel(), dtype=torch.float32)
        step = max(1, _PAIR_BLOCK_BYTES // (8 * self.dim))
        for s in range(0, q_items.numel(), step):
            qi = q_items[s : s + step]
            gi = g_items[s : s + step]
            dot = (self.rep[qi].float() * self.rep[gi].float()).sum(dim=1)
            if self.metric == "cosine":
                out[s : s + step] = dot
            else:
                out[s : s + step] = 2 * dot - self.sq32[gi] - self.sq32[qi]
        return out


class _Threads:
    """Run a section with ``n`` intra-op threads (restores the previous setting).

    The search runs its element-wise work (comparisons, counts, gathers on tiles of about 1M entries) on
    one thread and only the matrix products on all of them: splitting such small operations across
    OpenMP threads costs more than it saves, and far more when the CPU is shared with other processes
    (measured here: the whole SOP-like search 3x slower on 2 busy cores with 2 threads everywhere).
    """

    def __init__(self, n: int = 1) -> None:
        self.n = max(1, int(n))
        self.prev = 0

    def __enter__(self) -> None:
        self.prev = torch.get_num_threads()
        if self.prev != self.n:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        if self.prev != self.n:
            torch.set_num_threads(self.prev)


_OneThread = _Threads


def _count(m: Tensor, dim: int) -> Tensor:
    """Number of True entries of a bool matrix along ``dim`` (a byte sum: much faster than count_nonzero)."""
    return m.view(torch.uint8).sum(dim=dim, dtype=torch.int32)


def _true_pairs(m: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """``m.nonzero()`` restricted to the lines (rows for dim=1, columns for dim=0) that hold a True."""
    cnt = _count(m, dim)
    lines = (cnt > 0).nonzero().squeeze(1)
    if lines.numel() == 0:
        e = torch.empty(0, dtype=torch.long)
        return e, e
    if dim == 1:
        r, c = m[lines].nonzero(as_tuple=True)
        return lines[r], c
    r, c = m[:, lines].nonzero(as_tuple=True)
    return r, lines[c]


def _down(t: Tensor) -> Tensor:
    """float64 -> float32, rounded towards -inf (so comparisons stay conservative)."""
    f = t.to(torch.float32)
    return torch.where(f.double() > t, torch.nextafter(f, torch.full_like(f, -math.inf)), f)


def _up(t: Tensor) -> Tensor:
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


class ExactSearch:
    """Chunked exact search of ``q_items`` against ``g_items`` (both positions into the scorer's rows).

    A pair whose query and gallery item are the same row is excluded (by index, never by value).
    ``g_items`` must be sorted ascending: gallery position order is the tie-break order.
    """

    def __init__(
        self,
        scorer: Scorer,
        labels: Tensor,
        q_items: Tensor,
        g_items: Tensor,
        query_block: int = 1024,
        gallery_chunk: int = 8192,
    ) -> None:
        if g_items.numel() > 1 and bool((g_items[1:] <= g_items[:-1]).any()):
            raise ValueError("gallery items must be sorted and unique")
        self.scorer = scorer
        self.labels = labels
        self.q_items = q_items
        self.g_items = g_items
        self.query_block = int(query_block)
        self.gallery_chunk = int(gallery_chunk)
        ng = g_items.numel()
        # position of each query's own row in the gallery (or -1)
        pos = torch.searchsorted(g_items, q_items).clamp_(max=max(ng - 1, 0))
        self.self_gpos = torch.where(
            (ng > 0) & (g_items[pos] == q_items) if ng > 0 else torch.zeros_like(q_items, dtype=torch.bool),
            pos,
            torch.full_like(pos, -1),
        )
        # gallery grouped by label, for the positives of each query
        g_lab = labels[g_items]
        self.g_by_label = torch.argsort(g_lab, stable=True)
        self.g_lab_sorted = g_lab[self.g_by_label]
        q_lab = labels[q_items]
        self.pos_start = torch.searchsorted(self.g_lab_sorted, q_lab, side="left")
        self.pos_end = torch.searchsorted(self.g_lab_sorted, q_lab, side="right")
        self.num_positives = self.pos_end - self.pos_start - (self.self_gpos >= 0).long()

    @property
    def num_blocks(self) -> int:
        return (self.q_items.numel() + self.query_block - 1) // self.query_block

    # ------------------------------------------------------------------ helpers
    def _approx_rows(self, rows: Tensor, c0: int, c1: int) -> Tensor:
        """Approximate scores of query rows ``rows`` against gallery positions [c0, c1), self pairs = -inf."""
        a = self.scorer.approx(self.q_items[rows], self.g_items[c0:c1])
        sg = self.self_gpos[rows]
        hit = (sg >= c0) & (sg < c1)
        if bool(hit.any()):
            r = hit.nonzero().squeeze(1)
            a[r, sg[r] - c0] = -math.inf
        return a

    def _positive_approx(self, rows: Tensor, owner: Tensor, gpos: Tensor, cnt: Tensor) -> Tensor:
        """Approximate scores of the (query row, positive) pairs: gathered dot products for small classes,
        one matrix product per class for large ones (memory traffic of a gather grows with D per pair)."""
        q_rows = self.q_items[rows]
        large = cnt[owner] > 16
        a = torch.empty(owner.numel(), dtype=torch.float64)
        small = ~large
        if bool(small.any()):
            a[small] = self.scorer.approx_pairs(q_rows[owner[small]], self.g_items[gpos[small]]).double()
        if bool(large.any()):
            li = large.nonzero().squeeze(1)
            lab = self.labels[q_rows[owner[li]]]
            for c in torch.unique(lab).tolist():
                sel = li[lab == c]
                o, gp = owner[sel], gpos[sel]
                uo, inv_o = torch.unique(o, return_inverse=True)
                ug, inv_g = torch.unique(gp, return_inverse=True)
                block = self.scorer.approx(q_rows[uo], self.g_items[ug])
                a[sel] = block[inv_o, inv_g].double()
        return a

    def _best_positive(self, rows: Tensor, w: Tensor) -> tuple[Tensor, Tensor]:
        """Exact best positive score and its gallery position for each query row (-inf / -1 if none).

        Positives are scored approximately; only those within ``2 w`` of the approximate maximum can be
        the exact best (or tie with it), and only those are re-scored exactly.
        """
        start = self.pos_start[rows]
        cnt = self.pos_end[rows] - start
        nr = rows.numel()
        best = torch.full((nr,), -math.inf, dtype=torch.float64)
        best_pos = torch.full((nr,), -1, dtype=torch.long)
        total = int(cnt.sum())
        if total == 0:
            return best, best_pos
        owner = torch.repeat_interleave(torch.arange(nr), cnt)
        offs = torch.arange(total) - torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt, cnt)
        gpos = self.g_by_label[start[owner] + offs]
        keep = gpos != self.self_gpos[rows][owner]
        owner, gpos = owner[keep], gpos[keep]
        if owner.numel() == 0:
            return best, best_pos
        q_rows = self.q_items[rows]
        a = self._positive_approx(rows, owner, gpos, cnt)
        m = torch.full((nr,), -math.inf, dtype=torch.float64).scatter_reduce_(0, owner, a, reduce="amax")
        near = a >= m[owner] - 2 * w[owner]
        owner, gpos = owner[near], gpos[near]
        s = self.scorer.exact(q_rows[owner], self.g_items[gpos])
        best.scatter_reduce_(0, owner, s, reduce="amax")
        is_best = s == best[owner]
        big = torch.full((nr,), self.g_items.numel(), dtype=torch.long)
        big.scatter_reduce_(0, owner[is_best], gpos[is_best], reduce="amin")
        best_pos = torch.where(torch.isfinite(best), big, best_pos)
        return best, best_pos

    def _rank_exact_rows(
        self, rows: Tensor, s_best: Tensor, p_best: Tensor, thr_lo: Tensor, thr_hi: Tensor
    ) -> Tensor:
        """Exact rank of the best positive for a few query rows, resolving the uncertainty band."""
        rank = torch.zeros(rows.numel(), dtype=torch.long)
        q_lab = self.labels[self.q_items[rows]]
        ng = self.g_items.numel()
        for c0 in range(0, ng, self.gallery_chunk):
            c1 = min(ng, c0 + self.gallery_chunk)
            a = self._approx_rows(rows, c0, c1)
            rank += torch.count_nonzero(a > thr_hi.unsqueeze(1), dim=1)
            band = (a >= thr_lo.unsqueeze(1)) & (a <= thr_hi.unsqueeze(1))
            r, c = band.nonzero(as_tuple=True)
            gpos = c + c0
            neg = self.labels[self.g_items[gpos]] != q_lab[r]
            r, gpos = r[neg], gpos[neg]
            if r.numel():
                s = self.scorer.exact(self.q_items[rows][r], self.g_items[gpos])
                beats = (s > s_best[r]) | ((s == s_best[r]) & (gpos < p_best[r]))
                rank.index_add_(0, r, beats.long())
        return rank

    def _topk_rows_full(self, rows: Tensor, k: int, w: Tensor) -> tuple[Tensor, Tensor]:
        """Candidates (approx value, gallery position) of rows whose buffer was too short: full re-scan."""
        ng = self.g_items.numel()
        full = torch.cat(
            [self._approx_rows(rows, c0, min(ng, c0 + self.gallery_chunk)) for c0 in range(0, ng, self.gallery_chunk)],
            dim=1,
        )
        kk = min(k, ng)
        t = full.topk(kk, dim=1).values[:, -1]
        cut = _down(t.double() - 2 * w)
        counts = torch.count_nonzero(full >= cut.unsqueeze(1), dim=1)
        width = max(int(counts.max()), kk)
        return full.topk(width, dim=1)

    # ------------------------------------------------------------------ main
    @staticmethod
    def _merge_candidates(
        buf_v: Tensor, buf_i: Tensor, a: Tensor, c0: int, kc: int, m: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Keep the kc largest approximate scores per row (values, gallery positions) across chunks.

        Once a row's buffer is full, only entries >= its current kc-th value can enter, so a comparison
        and a sparse extraction replace a full ``topk`` of the chunk.
        """
        if buf_v.shape[1] < kc:
            v, i = a.topk(min(kc, a.shape[1]), dim=1)
            buf_v = torch.cat([buf_v, v], dim=1)
            buf_i = torch.cat([buf_i, i + c0], dim=1)
        else:
            torch.ge(a, buf_v[:, kc - 1 :], out=m)
            r, c = _true_pairs(m, 1)
            if r.numel() == 0:
                return buf_v, buf_i
            nr = a.shape[0]
            counts = torch.bincount(r, minlength=nr)
            width = int(counts.max())
            pos = torch.arange(r.numel()) - (torch.cumsum(counts, 0) - counts)[r]
            v = torch.full((nr, width), -math.inf)
            i = torch.zeros((nr, width), dtype=torch.long)
            v[r, pos] = a[r, c]
            i[r, pos] = c + c0
            buf_v = torch.cat([buf_v, v], dim=1)
            buf_i = torch.cat([buf_i, i], dim=1)
        if buf_v.shape[1] > kc:
            buf_v, j = buf_v.topk(kc, dim=1)
            buf_i = buf_i.gather(1, j)
        return buf_v, buf_i

    def _order_candidates(
        self, rows: Tensor, cand_v: Tensor, cand_i: Tensor, cut: Tensor, w: Tensor, kk: int, exact_scores: bool
    ) -> tuple[Tensor, Tensor]:
        """Exact top-kk order of the candidates (approx values sorted descending per row).

        Consecutive candidates whose approximate scores differ by more than ``2 w`` are in their exact
        order already; runs of closer ones ("clusters") are re-scored exactly and sorted by (exact score
        desc, gallery position asc). With ``exact_scores`` every candidate is re-scored (exact neighbour
        ids and scores); without, only clusters that mix same-class and other-class items are re-scored,
        which makes the relevance sequence exact (all the metrics need) but leaves the order inside a
        same-relevance cluster to the approximate scores.
        """
        ng = self.g_items.numel()
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
            # only runs that mix same-class and other-class items change the relevance sequence
            q_lab = self.labels[self.q_items[rows]].unsqueeze(1)
            relv = (self.labels[self.g_items[cand_i.clamp(max=ng - 1)]] == q_lab).long()
            nclu = int(cid.max()) + 1
            pos_cnt = torch.zeros(cid.shape[0], nclu + 1, dtype=torch.long).scatter_add_(1, cid, relv * valid)
            tot_cnt = torch.zeros(cid.shape[0], nclu + 1, dtype=torch.long).scatter_add_(1, cid, valid.long())
            mixed = (pos_cnt > 0) & (pos_cnt < tot_cnt)
            need = valid & linked & mixed.gather(1, cid)
        score = torch.where(valid, v64, torch.full_like(v64, -math.inf))
        r, c = need.nonzero(as_tuple=True)
        if r.numel():
            score[r, c] = self.scorer.exact(self.q_items[rows][r], self.g_items[cand_i[r, c]])
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

    # ------------------------------------------------------------------ per-query state
    def prepare_state(self, rows: Tensor, k: int, rank_ks: tuple[int, ...]) -> PassState:
        """Bounds, exact best positive and its band thresholds, empty counters and buffers for ``rows``."""
        ng = self.g_items.numel()
        w = self.scorer.error_bound(self.q_items[rows], self.g_items)
        npos = self.num_positives[rows]
        has = npos > 0
        nr = rows.numel()
        if rank_ks:
            s_best = torch.full((nr,), -math.inf, dtype=torch.float64)
            p_best = torch.full((nr,), -1, dtype=torch.long)
            for s in range(0, nr, 8192):
                s_best[s : s + 8192], p_best[s : s + 8192] = self._best_positive(rows[s : s + 8192], w[s : s + 8192])
            inf = torch.full((nr,), math.inf, dtype=torch.float32)
            thr_hi = torch.where(has, _up(s_best + w), inf)
            thr_lo = torch.where(has, _down(s_best - w), inf)
        else:
            s_best = p_best = thr_hi = thr_lo = None
        kc = min(ng, k + max(8, k // 2)) if k > 0 else 0
        return PassState(
            rows=rows,
            w=w,
            has=has,
            s_best=s_best,
            p_best=p_best,
            thr_lo=thr_lo,
            thr_hi=thr_hi,
            lo=torch.zeros(nr, dtype=torch.long),
            hi=torch.zeros(nr, dtype=torch.long),
            kc=kc,
            buf_v=torch.empty(nr, 0),
            buf_i=torch.empty(nr, 0, dtype=torch.long),
            rank_ks=tuple(rank_ks),
        )

    def scan_rows(self, st: PassState) -> None:
        """Approximate pass of the state's rows against the whole gallery, chunk by chunk."""
        rows = st.rows
        ng = self.g_items.numel()
        need_rank = st.thr_lo is not None
        mask = torch.empty(rows.numel(), min(ng, self.gallery_chunk), dtype=torch.bool)
        for c0 in track(range(0, ng, self.gallery_chunk), "retrieval: gallery chunks"):
            c1 = min(ng, c0 + self.gallery_chunk)
            a = self._approx_rows(rows, c0, c1)
            m = mask[:, : c1 - c0]
            with _OneThread():
                if need_rank:
                    torch.gt(a, st.thr_hi.unsqueeze(1), out=m)
                    st.lo += _count(m, 1)
                    torch.ge(a, st.thr_lo.unsqueeze(1), out=m)
                    st.hi += _count(m, 1)
                if st.kc > 0:
                    st.buf_v, st.buf_i = self._merge_candidates(st.buf_v, st.buf_i, a, c0, st.kc, m)

    # ------------------------------------------------------------------ symmetric (all-vs-all) pass
    @property
    def symmetric(self) -> bool:
        """All-vs-all: the queries are the gallery, so one product serves both (q, g) and (g, q)."""
        return self.q_items.numel() == self.g_items.numel() and bool(torch.equal(self.q_items, self.g_items))

    def tiles(self) -> list[tuple[int, int]]:
        """Upper-triangular tiles (i <= j) of the global tile grid (tile size ``query_block``)."""
        nb = self.num_blocks
        return [(i, j) for i in range(nb) for j in range(i, nb)]

    def scan_symmetric(self, st: PassState, part: tuple[int, int] = (0, 1)) -> None:
        """Approximate pass over the tiles ``t`` with ``t % world == rank`` (``part = (rank, world)``).

        Each off-diagonal tile ``X_i X_j^T`` is used twice: rows are queries of block i against gallery
        block j, columns queries of block j against gallery block i, halving the products. Every diagonal
        tile is computed by every process to seed the candidate thresholds; only the owner counts it.
        ``st`` must cover all rows; counters and buffers hold this process's share (merge with
        :func:`merge_states`).
        """
        rank, world = part
        n = self.q_items.numel()
        bs = self.query_block
        nb = self.num_blocks
        need_rank = st.thr_lo is not None
        kc = st.kc
        tau = torch.full((n,), -math.inf)
        mask = torch.empty(min(n, bs), min(n, bs), dtype=torch.bool)
        tile_ids = {t: idx for idx, t in enumerate(self.tiles())}
        kmax = max(rank_ks_of(st)) if need_rank else 0

        def block(i: int) -> Tensor:
            return torch.arange(i * bs, min(n, (i + 1) * bs))

        # diagonal tiles: thresholds for everyone, counts and candidates for the owner
        for i in range(nb):
            r = block(i)
            a = self._approx_rows(r, int(r[0]), int(r[-1]) + 1)
            own = tile_ids[(i, i)] % world == rank
            if kc > 0:
                v, idx = a.topk(min(kc, a.shape[1]), dim=1)
                if v.shape[1] == kc:
                    tau[r] = v[:, -1]
                if own:
                    st.buf_v, st.buf_i = _insert_rows(st.buf_v, st.buf_i, r, v, idx + int(r[0]), kc)
            if own and need_rank:
                m = mask[: r.numel(), : r.numel()]
                torch.gt(a, st.thr_hi[r].unsqueeze(1), out=m)
                st.lo[r] += _count(m, 1)
                torch.ge(a, st.thr_lo[r].unsqueeze(1), out=m)
                st.hi[r] += _count(m, 1)
        for (i, j), idx_t in track(tile_ids.items(), "retrieval: tiles", total=len(tile_ids)):
            if i == j or idx_t % world != rank:
                continue
            ri, rj = block(i), block(j)
            a = self.scorer.approx(self.q_items[ri], self.g_items[rj])
            m = mask[: ri.numel(), : rj.numel()]
            with _OneThread():
                if need_rank:
                    self._count_side(a, m, st, ri, 1, kmax)
                    self._count_side(a, m, st, rj, 0, kmax)
                if kc > 0:
                    # rows: queries in block i; an entry can only matter if it reaches the row's threshold
                    torch.ge(a, tau[ri].unsqueeze(1), out=m)
                    r, c = _true_pairs(m, 1)
                    if r.numel():
                        st.buf_v, st.buf_i = _insert_pairs(st.buf_v, st.buf_i, ri[r], a[r, c], rj[c], kc)
                        upd = torch.unique(ri[r])
                        full = st.buf_v.shape[1] >= kc
                        if full:
                            tau[upd] = torch.maximum(tau[upd], st.buf_v[upd, kc - 1])
                    torch.ge(a, tau[rj].unsqueeze(0), out=m)
                    r, c = _true_pairs(m, 0)
                    if r.numel():
                        st.buf_v, st.buf_i = _insert_pairs(st.buf_v, st.buf_i, rj[c], a[r, c], ri[r], kc)
                        upd = torch.unique(rj[c])
                        if st.buf_v.shape[1] >= kc:
                            tau[upd] = torch.maximum(tau[upd], st.buf_v[upd, kc - 1])

    @staticmethod
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
            mm = torch.empty(part.shape, dtype=torch.bool)
        shape = (-1, 1) if dim == 1 else (1, -1)
        torch.gt(part, st.thr_hi[sub].view(shape), out=mm)
        st.lo[sub] += _count(mm, dim)
        torch.ge(part, st.thr_lo[sub].view(shape), out=mm)
        st.hi[sub] += _count(mm, dim)

    # ------------------------------------------------------------------ exact finish
    def finish(self, st: PassState, k: int, rank_ks: tuple[int, ...], exact_scores: bool = False) -> SearchResult:
        """Exact ranks and neighbour lists of the state's rows from its (complete) counters and buffers."""
        rows = st.rows
        ng = self.g_items.numel()
        w = st.w
        npos = self.num_positives[rows]
        has = st.has
        lo, hi, buf_v, buf_i = st.lo, st.hi, st.buf_v, st.buf_i
        if rank_ks:
            rank = lo.clone()
            ks = torch.tensor(rank_ks, dtype=torch.long)
            # rank lies in [lo, hi - 1]; resolve it exactly where that interval straddles a requested K
            amb = has & ((lo.unsqueeze(1) < ks) & (hi.unsqueeze(1) - 1 >= ks)).any(dim=1)
            if bool(amb.any()):
                ar = amb.nonzero().squeeze(1)
                for s in range(0, ar.numel(), 256):
                    sub = ar[s : s + 256]
                    rank[sub] = self._rank_exact_rows(
                        rows[sub], st.s_best[sub], st.p_best[sub], st.thr_lo[sub], st.thr_hi[sub]
                    )
            rank = torch.where(has, rank, torch.full_like(rank, -1))
        else:
            rank = torch.full((rows.numel(),), -1, dtype=torch.long)

        if k > 0:
            kk = min(k, ng)
            t = buf_v[:, kk - 1]
            cut = _down(t.double() - 2 * w)
            complete = buf_v.shape[1] >= ng
            # the buffer must reach below the cut, otherwise a needed candidate may be missing
            bad = (buf_v[:, -1] >= cut) & torch.isfinite(cut) & (not complete)
            cand_v, cand_i = buf_v, buf_i
            if bool(bad.any()):
                br = bad.nonzero().squeeze(1)
                extra = [self._topk_rows_full(rows[br[s : s + 64]], kk, w[br[s : s + 64]]) for s in range(0, br.numel(), 64)]
                width = max(cand_v.shape[1], max(v.shape[1] for v, _ in extra))
                cand_v = torch.nn.functional.pad(cand_v, (0, width - cand_v.shape[1]), value=-math.inf)
                cand_i = torch.nn.functional.pad(cand_i, (0, width - cand_i.shape[1]), value=0)
                for s, (v, i) in zip(range(0, br.numel(), 64), extra):
                    sub = br[s : s + 64]
                    cand_v[sub] = torch.nn.functional.pad(v, (0, width - v.shape[1]), value=-math.inf)
                    cand_i[sub] = torch.nn.functional.pad(i, (0, width - i.shape[1]), value=0)
                t = cand_v.topk(kk, dim=1).values[:, -1]
                cut = _down(t.double() - 2 * w)
            gidx, exact = self._order_candidates(rows, cand_v, cand_i, cut, w, kk, exact_scores)
            if kk < k:
                gidx = torch.nn.functional.pad(gidx, (0, k - kk), value=-1)
                exact = torch.nn.functional.pad(exact, (0, k - kk), value=-math.inf)
        else:
            gidx = torch.empty(rows.numel(), 0, dtype=torch.long)
            exact = torch.empty(rows.numel(), 0, dtype=torch.float64)
        return SearchResult(gidx, exact, rank, npos)

    def block_rows(self, b: int) -> Tensor:
        nq = self.q_items.numel()
        return torch.arange(b * self.query_block, min(nq, (b + 1) * self.query_block))

    def run_block(self, b: int, k: int, rank_ks: tuple[int, ...], exact_scores: bool = False) -> SearchResult:
        """Search query block ``b`` (rows ``[b * query_block, (b + 1) * query_block)``) against the gallery."""
        st = self.prepare_state(self.block_rows(b), k, rank_ks)
        self.scan_rows(st)
        return self.finish(st, k, rank_ks, exact_scores)

    def use_symmetric(self) -> bool:
        """Use the symmetric tile pass: all-vs-all with at least 4 tiles per side."""
        return self.symmetric and self.num_blocks >= 4

    def run(
        self, k: int, rank_ks: tuple[int, ...], blocks: list[int] | None = None, exact_scores: bool = False
    ) -> SearchResult:
        """Search (single process) and return the results of the given query blocks (default all).

        ``exact_scores=False`` re-scores only the candidates whose order is uncertain: the neighbour order
        is exact either way, but ``scores`` then holds approximate values where no re-scoring was needed.
        """
        with _Threads(1):
            return self._run(k, rank_ks, blocks, exact_scores)

    def _run(
        self, k: int, rank_ks: tuple[int, ...], blocks: list[int] | None = None, exact_scores: bool = False
    ) -> SearchResult:
        blocks = list(range(self.num_blocks)) if blocks is None else blocks
        if self.use_symmetric():
            st = self.prepare_state(torch.arange(self.q_items.numel()), k, rank_ks)
            self.scan_symmetric(st)
            parts = [self.finish(st.select(self.block_rows(b)), k, rank_ks, exact_scores) for b in blocks]
        else:
            parts = [self.run_block(b, k, rank_ks, exact_scores) for b in blocks]
        return concat_results(parts, k)


    def run_distributed(
        self,
        k: int,
        rank_ks: tuple[int, ...],
        rank: int,
        world: int,
        all_gather: Callable[[Any], list[Any]],
        exact_scores: bool = False,
    ) -> SearchResult:
        """Multi-process search: every process gets the result for all queries, identical everywhere.

        The work is split on the global grid: symmetric tiles ``t`` (or query blocks ``b``) go to process
        ``t % world`` (``b % world``). Partial counters/candidate buffers are merged with ``all_gather``
        (a function returning the list of every process's object, in rank order); each process then
        finishes its share of query blocks exactly and the per-query results are gathered in block order.
        Every per-query result is a function of exact scores only, hence independent of ``world``.
        """
        with _Threads(1):
            mine = list(range(rank, self.num_blocks, world))
            if self.use_symmetric():
                st = self.prepare_state(torch.arange(self.q_items.numel()), k, rank_ks)
                self.scan_symmetric(st, (rank, world))
                parts = all_gather((st.lo, st.hi, st.buf_v, st.buf_i))
                merged = merge_states(
                    [PassState(st.rows, st.w, st.has, st.s_best, st.p_best, st.thr_lo, st.thr_hi, lo, hi, st.kc, v, i,
                               st.rank_ks)
                     for lo, hi, v, i in parts]
                )
                res = [self.finish(merged.select(self.block_rows(b)), k, rank_ks, exact_scores) for b in mine]
            else:
                res = [self.run_block(b, k, rank_ks, exact_scores) for b in mine]
            gathered = all_gather(dict(zip(mine, res)))
        by_block: dict[int, SearchResult] = {}
        for part in gathered:
            by_block.update(part)
        return concat_results([by_block[b] for b in range(self.num_blocks)], k)


def rank_ks_of(st: PassState) -> tuple[int, ...]:
    return st.rank_ks


def concat_results(parts: list[SearchResult], k: int) -> SearchResult:
    """Concatenate per-block results in order."""
    if not parts:
        return SearchResult(
            torch.empty(0, k, dtype=torch.long),
            torch.empty(0, k, dtype=torch.float64),
            torch.empty(0, dtype=torch.long),
            torch.empty(0, dtype=torch.long),
        )
    return SearchResult(
        torch.cat([p.neighbors for p in parts]),
        torch.cat([p.scores for p in parts]),
        torch.cat([p.first_positive_rank for p in parts]),
        torch.cat([p.num_positives for p in parts]),
    )


def _insert_rows(buf_v: Tensor, buf_i: Tensor, rows: Tensor, v: Tensor, i: Tensor, kc: int) -> tuple[Tensor, Tensor]:
    """Merge dense candidate rows ``(v, i)`` into the buffers of ``rows`` keeping the kc largest."""
    return _insert_pairs(buf_v, buf_i, rows.repeat_interleave(v.shape[1]), v.reshape(-1), i.reshape(-1), kc)


def _insert_pairs(buf_v: Tensor, buf_i: Tensor, q: Tensor, v: Tensor, g: Tensor, kc: int) -> tuple[Tensor, Tensor]:
    """Merge candidate triples (query row q, value v, gallery position g) into the buffers (top kc)."""
    n = buf_v.shape[0]
    order = torch.argsort(q, stable=True)
    q, v, g = q[order], v[order], g[order]
    counts = torch.bincount(q, minlength=n)
    width = int(counts.max())
    pos = torch.arange(q.numel()) - (torch.cumsum(counts, 0) - counts)[q]
    rows = torch.unique(q)
    local = torch.full((n,), -1, dtype=torch.long)
    local[rows] = torch.arange(rows.numel())
    nv = torch.full((rows.numel(), width), -math.inf)
    ni = torch.zeros((rows.numel(), width), dtype=torch.long)
    nv[local[q], pos] = v
    ni[local[q], pos] = g
    cv = torch.cat([buf_v[rows], nv], dim=1)
    ci = torch.cat([buf_i[rows], ni], dim=1)
    width_new = min(kc, cv.shape[1])
    if cv.shape[1] > width_new:
        cv, j = cv.topk(width_new, dim=1)
        ci = ci.gather(1, j)
    if width_new > buf_v.shape[1]:
        buf_v = torch.nn.functional.pad(buf_v, (0, width_new - buf_v.shape[1]), value=-math.inf)
        buf_i = torch.nn.functional.pad(buf_i, (0, width_new - buf_i.shape[1]), value=0)
    cv = torch.nn.functional.pad(cv, (0, buf_v.shape[1] - cv.shape[1]), value=-math.inf)
    ci = torch.nn.functional.pad(ci, (0, buf_i.shape[1] - ci.shape[1]), value=0)
    buf_v[rows] = cv
    buf_i[rows] = ci
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
    return PassState(
        base.rows, base.w, base.has, base.s_best, base.p_best, base.thr_lo, base.thr_hi, lo, hi, kc, v, i, base.rank_ks
    )
