"""Exact nearest-neighbour search in chunks: a fast approximate pass, then exact fp64 re-scoring.

Every result this module returns is a function of *exact* scores only (``_precision``), so it equals an fp64
brute force with the **tie rule**: a gallery item ranks ahead of another when its exact score is larger, or
when the scores are equal and its position in the split (``indices``) is smaller.

The approximate pass (``_scan``) multiplies blocks of the embedding matrix in the precision of
``_device.resolve_precision`` and never allocates an N x N matrix. Each approximate score ``a`` carries a
rigorous bound ``|a - s| <= w_q`` on its distance to the exact score ``s`` (``_precision.Scorer.error_bound``).
With that bound

* an item whose approximate score is below ``t_k - 2 w_q`` (``t_k`` = the k-th largest approximate score)
  cannot be among the exact top k, so only the survivors are re-scored exactly;
* the rank of the best positive (what Recall@K needs, for any K) is the number of items with approximate
  score ``> s* + w_q`` plus the exact count inside the band ``[s* - w_q, s* + w_q]``; the band is only
  resolved when it decides whether ``rank < K`` for a requested K.

Everything runs on the device of the scorer's embeddings (CPU or CUDA), through the same code.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from lightning_dml.metrics._candidates import PassState, SearchResult, concat_results, round_down, round_up
from lightning_dml.metrics._device import _Threads
from lightning_dml.metrics._precision import Scorer
from lightning_dml.metrics._scan import scan_rows, scan_symmetric


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
        self.device = scorer.device
        self.labels = labels
        self.q_items = q_items
        self.g_items = g_items
        self.query_block = int(query_block)
        self.gallery_chunk = int(gallery_chunk)
        ng = g_items.numel()
        # position of each query's own row in the gallery (or -1)
        pos = torch.searchsorted(g_items, q_items).clamp_(max=max(ng - 1, 0))
        self.self_gpos = torch.where(
            (g_items[pos] == q_items) if ng > 0 else torch.zeros_like(q_items, dtype=torch.bool),
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

    def _arange(self, *args: int) -> Tensor:
        return torch.arange(*args, device=self.device)

    # ------------------------------------------------------------------ helpers
    def approx_rows(self, rows: Tensor, c0: int, c1: int) -> Tensor:
        """Approximate scores of query rows ``rows`` against gallery positions [c0, c1), self pairs = -inf."""
        a = self.scorer.approx(self.q_items[rows], self.g_items[c0:c1])
        sg = self.self_gpos[rows]
        hit = (sg >= c0) & (sg < c1)
        r = hit.nonzero().squeeze(1)
        if r.numel():
            a[r, sg[r] - c0] = -math.inf
        return a

    def _positive_approx(self, rows: Tensor, owner: Tensor, gpos: Tensor, cnt: Tensor) -> Tensor:
        """Approximate scores of the (query row, positive) pairs: gathered dot products for small classes,
        one matrix product per class for large ones (memory traffic of a gather grows with D per pair)."""
        q_rows = self.q_items[rows]
        large = cnt[owner] > 16
        a = torch.empty(owner.numel(), dtype=torch.float64, device=self.device)
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
        best = torch.full((nr,), -math.inf, dtype=torch.float64, device=self.device)
        best_pos = torch.full((nr,), -1, dtype=torch.long, device=self.device)
        total = int(cnt.sum())
        if total == 0:
            return best, best_pos
        owner = torch.repeat_interleave(self._arange(nr), cnt)
        offs = self._arange(total) - torch.repeat_interleave(torch.cumsum(cnt, 0) - cnt, cnt)
        gpos = self.g_by_label[start[owner] + offs]
        keep = gpos != self.self_gpos[rows][owner]
        owner, gpos = owner[keep], gpos[keep]
        if owner.numel() == 0:
            return best, best_pos
        q_rows = self.q_items[rows]
        a = self._positive_approx(rows, owner, gpos, cnt)
        m = torch.full((nr,), -math.inf, dtype=torch.float64, device=self.device).scatter_reduce_(
            0, owner, a, reduce="amax"
        )
        near = a >= m[owner] - 2 * w[owner]
        owner, gpos = owner[near], gpos[near]
        s = self.scorer.exact(q_rows[owner], self.g_items[gpos])
        best.scatter_reduce_(0, owner, s, reduce="amax")
        is_best = s == best[owner]
        big = torch.full((nr,), self.g_items.numel(), dtype=torch.long, device=self.device)
        big.scatter_reduce_(0, owner[is_best], gpos[is_best], reduce="amin")
        best_pos = torch.where(torch.isfinite(best), big, best_pos)
        return best, best_pos

    def _rank_exact_rows(self, rows: Tensor, st: PassState) -> Tensor:
        """Exact rank of the best positive for a few query rows (``st`` selected to them): resolve the band."""
        rank = torch.zeros(rows.numel(), dtype=torch.long, device=self.device)
        q_lab = self.labels[self.q_items[rows]]
        ng = self.g_items.numel()
        for c0 in range(0, ng, self.gallery_chunk):
            c1 = min(ng, c0 + self.gallery_chunk)
            a = self.approx_rows(rows, c0, c1)
            rank += torch.count_nonzero(a > st.thr_hi.unsqueeze(1), dim=1)
            band = (a >= st.thr_lo.unsqueeze(1)) & (a <= st.thr_hi.unsqueeze(1))
            r, c = band.nonzero(as_tuple=True)
            gpos = c + c0
            neg = self.labels[self.g_items[gpos]] != q_lab[r]
            r, gpos = r[neg], gpos[neg]
            if r.numel():
                s = self.scorer.exact(self.q_items[rows][r], self.g_items[gpos])
                beats = (s > st.s_best[r]) | ((s == st.s_best[r]) & (gpos < st.p_best[r]))
                rank.index_add_(0, r, beats.long())
        return rank

    def _topk_rows_full(self, rows: Tensor, k: int, w: Tensor) -> tuple[Tensor, Tensor]:
        """Candidates (approx value, gallery position) of rows whose buffer was too short: full re-scan."""
        ng = self.g_items.numel()
        full = torch.cat(
            [self.approx_rows(rows, c0, min(ng, c0 + self.gallery_chunk)) for c0 in range(0, ng, self.gallery_chunk)],
            dim=1,
        )
        kk = min(k, ng)
        t = full.topk(kk, dim=1).values[:, -1]
        cut = round_down(t.double() - 2 * w)
        counts = torch.count_nonzero(full >= cut.unsqueeze(1), dim=1)
        width = max(int(counts.max()), kk)
        return full.topk(width, dim=1)

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
            zeros = torch.zeros(cid.shape[0], nclu + 1, dtype=torch.long, device=self.device)
            pos_cnt = zeros.scatter_add(1, cid, relv * valid)
            tot_cnt = zeros.scatter_add(1, cid, valid.long())
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
        dev = self.device
        w = self.scorer.error_bound(self.q_items[rows], self.g_items)
        npos = self.num_positives[rows]
        has = npos > 0
        nr = rows.numel()
        if rank_ks:
            s_best = torch.full((nr,), -math.inf, dtype=torch.float64, device=dev)
            p_best = torch.full((nr,), -1, dtype=torch.long, device=dev)
            for s in range(0, nr, 8192):
                s_best[s : s + 8192], p_best[s : s + 8192] = self._best_positive(rows[s : s + 8192], w[s : s + 8192])
            inf = torch.full((nr,), math.inf, dtype=torch.float32, device=dev)
            thr_hi = torch.where(has, round_up(s_best + w), inf)
            thr_lo = torch.where(has, round_down(s_best - w), inf)
        else:
            s_best = p_best = thr_hi = thr_lo = None
        kc = min(ng, k + max(8, k // 2)) if k > 0 else 0
        zeros = torch.zeros(nr, dtype=torch.long, device=dev)
        return PassState(
            rows=rows, w=w, has=has, s_best=s_best, p_best=p_best, thr_lo=thr_lo, thr_hi=thr_hi, lo=zeros,
            hi=zeros.clone(), kc=kc, buf_v=torch.empty(nr, 0, device=dev),
            buf_i=torch.empty(nr, 0, dtype=torch.long, device=dev), rank_ks=tuple(rank_ks),
        )

    # ------------------------------------------------------------------ exact finish
    def _exact_ranks(self, st: PassState) -> Tensor:
        """Rank of the best positive: exact where ``[lo, hi - 1]`` straddles a requested K, else ``lo``."""
        lo, hi, has = st.lo, st.hi, st.has
        if not st.rank_ks:
            return torch.full((st.rows.numel(),), -1, dtype=torch.long, device=self.device)
        rank = lo.clone()
        ks = torch.tensor(st.rank_ks, dtype=torch.long, device=self.device)
        amb = has & ((lo.unsqueeze(1) < ks) & (hi.unsqueeze(1) - 1 >= ks)).any(dim=1)
        ar = amb.nonzero().squeeze(1)
        for s in range(0, ar.numel(), 256):
            sub = ar[s : s + 256]
            rank[sub] = self._rank_exact_rows(st.rows[sub], st.select(sub))
        return torch.where(has, rank, torch.full_like(rank, -1))

    def finish(self, st: PassState, k: int, exact_scores: bool = False) -> SearchResult:
        """Exact ranks and neighbour lists of the state's rows from its (complete) counters and buffers."""
        rows, w = st.rows, st.w
        ng = self.g_items.numel()
        rank = self._exact_ranks(st)
        if k <= 0:
            empty = torch.empty(rows.numel(), 0, device=self.device)
            return SearchResult(empty.long(), empty.double(), rank, self.num_positives[rows])
        kk = min(k, ng)
        cand_v, cand_i = st.buf_v, st.buf_i
        cut = round_down(cand_v[:, kk - 1].double() - 2 * w)
        # the buffer must reach below the cut, otherwise a needed candidate may be missing
        bad = (cand_v[:, -1] >= cut) & torch.isfinite(cut) & (cand_v.shape[1] < ng)
        br = bad.nonzero().squeeze(1)
        if br.numel():
            steps = range(0, br.numel(), 64)
            extra = [self._topk_rows_full(rows[br[s : s + 64]], kk, w[br[s : s + 64]]) for s in steps]
            width = max(cand_v.shape[1], max(v.shape[1] for v, _ in extra))
            cand_v = torch.nn.functional.pad(cand_v, (0, width - cand_v.shape[1]), value=-math.inf)
            cand_i = torch.nn.functional.pad(cand_i, (0, width - cand_i.shape[1]), value=0)
            for s, (v, i) in zip(steps, extra):
                sub = br[s : s + 64]
                cand_v[sub] = torch.nn.functional.pad(v, (0, width - v.shape[1]), value=-math.inf)
                cand_i[sub] = torch.nn.functional.pad(i, (0, width - i.shape[1]), value=0)
            cut = round_down(cand_v.topk(kk, dim=1).values[:, -1].double() - 2 * w)
        gidx, exact = self._order_candidates(rows, cand_v, cand_i, cut, w, kk, exact_scores)
        if kk < k:
            gidx = torch.nn.functional.pad(gidx, (0, k - kk), value=-1)
            exact = torch.nn.functional.pad(exact, (0, k - kk), value=-math.inf)
        return SearchResult(gidx, exact, rank, self.num_positives[rows])

    # ------------------------------------------------------------------ driver
    def block_rows(self, b: int) -> Tensor:
        nq = self.q_items.numel()
        return self._arange(b * self.query_block, min(nq, (b + 1) * self.query_block))

    def run_block(self, b: int, k: int, rank_ks: tuple[int, ...], exact_scores: bool = False) -> SearchResult:
        """Search query block ``b`` (rows ``[b * query_block, (b + 1) * query_block)``) against the gallery."""
        st = self.prepare_state(self.block_rows(b), k, rank_ks)
        scan_rows(self, st)
        return self.finish(st, k, exact_scores)

    def use_symmetric(self) -> bool:
        """Use the symmetric tile pass: all-vs-all with at least 4 tiles per side."""
        return self.symmetric and self.num_blocks >= 4

    @property
    def symmetric(self) -> bool:
        """All-vs-all: the queries are the gallery, so one product serves both (q, g) and (g, q)."""
        return self.q_items.numel() == self.g_items.numel() and bool(torch.equal(self.q_items, self.g_items))

    def run(self, k: int, rank_ks: tuple[int, ...], exact_scores: bool = False) -> SearchResult:
        """Search all queries in one process.

        ``exact_scores=False`` re-scores only the candidates whose order is uncertain: the neighbour order
        is exact either way, but ``scores`` then holds approximate values where no re-scoring was needed.
        """
        with _Threads(1):
            if self.use_symmetric():
                st = self.prepare_state(self._arange(self.q_items.numel()), k, rank_ks)
                scan_symmetric(self, st)
                parts = [self.finish(st.select(self.block_rows(b)), k, exact_scores) for b in range(self.num_blocks)]
            else:
                parts = [self.run_block(b, k, rank_ks, exact_scores) for b in range(self.num_blocks)]
        return concat_results(parts, k, self.device)
