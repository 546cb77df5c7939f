"""Stage 0 of the exact search: the retrieval task, i.e. what is asked of the search.

A :class:`RetrievalTask` says which rows of the evaluated set are queries and which are gallery items, which
(query, gallery) pairs are **relevant** and which are **excluded** (ignored: neither relevant nor irrelevant, as if
the gallery item were absent for that query). Every later stage (scores, candidates, ranks, statistics) asks it
these questions and nothing else about labels:

* **relevance**: single labels ``[N]``: equal labels; label sets ``[N, L]`` (padded with ``-1``): the sets
  intersect;
* **exclusion**: a query never matches itself (its own row in the gallery, by position, never by value); with
  ``sequence`` ids, gallery items sharing the query's sequence id are excluded too (frames of one video, shots of
  one camera). A negative sequence id means "no sequence" (only the item itself is excluded);
* **positives** of a query: its relevant gallery items that are not excluded, ``num_relevant`` = R.

Pairs are kept as compressed rows (CSR: ``ptr[q] .. ptr[q + 1]`` into a flat array of gallery positions, sorted
within each query), so no Q x G matrix is ever built; the work is proportional to the number of positives and
excluded pairs. Everything stays on the device of the labels.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.metrics._device import _Threads

__all__ = ["RetrievalTask"]


def _csr(owner: Tensor, values: Tensor, rows: int) -> tuple[Tensor, Tensor]:
    """(ptr, values) of pairs (owner, value) sorted by owner then value, duplicates removed."""
    if owner.numel():
        span = int(values.max()) + 1
        key = torch.unique(owner * span + values)  # sorted, deduplicated
        owner, values = key // span, key % span
    counts = torch.bincount(owner, minlength=rows)
    ptr = torch.zeros(rows + 1, dtype=torch.long, device=owner.device)
    torch.cumsum(counts, 0, out=ptr[1:])
    return ptr, values


def _expand(ptr_start: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """For ranges ``[start, start + count)``, the flat (owner, position) pairs of their entries."""
    total = int(counts.sum())
    owner = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    offs = torch.arange(total, device=counts.device) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return owner, ptr_start[owner] + offs


class RetrievalTask:
    """Queries, gallery, relevance and exclusions of one evaluation (positions into the prepared set).

    Args:
        labels: ``[N]`` class ids, or ``[N, L]`` label sets padded with ``-1`` (a pair is relevant when the sets
            share a label; an item whose row is all ``-1`` is relevant to nothing).
        q_items: ``[Q]`` row positions of the queries.
        g_items: ``[G]`` row positions of the gallery, sorted ascending (gallery position order is the tie-break
            order of the search).
        sequence: ``[N]`` sequence ids or ``None``; a gallery item with the query's (non-negative) id is excluded.

    Attributes:
        self_gpos: ``[Q]`` gallery position of the query's own row, ``-1`` where it is not in the gallery.
        excl_ptr, excl_gpos: CSR of each query's excluded gallery positions (itself and its sequence).
        pos_ptr, pos_gpos: CSR of each query's positives (relevant, not excluded), gallery positions ascending.
        num_relevant: ``[Q]`` R, the number of positives.
    """

    def __init__(self, labels: Tensor, q_items: Tensor, g_items: Tensor, sequence: Tensor | None = None) -> None:
        ng = g_items.numel()
        if ng > 1 and bool((g_items[1:] <= g_items[:-1]).any()):
            raise ValueError("gallery items must be sorted and unique")
        self.device = labels.device
        self.multilabel = labels.ndim == 2
        self.labels = labels
        self.q_items = q_items
        self.g_items = g_items
        self.sequence = sequence
        nq = q_items.numel()
        with _Threads(1):  # sorts and gathers of ~1e5 entries: one thread (see _device._Threads)
            pos = torch.searchsorted(g_items, q_items).clamp_(max=max(ng - 1, 0))
            hit = (g_items[pos] == q_items) if ng > 0 else torch.zeros_like(q_items, dtype=torch.bool)
            self.self_gpos = torch.where(hit, pos, torch.full_like(pos, -1))
            self.excl_ptr, self.excl_gpos = self._exclusions(nq)
            self.pos_ptr, self.pos_gpos = self._positives(nq)
        self.num_relevant = self.pos_ptr[1:] - self.pos_ptr[:-1]

    # ------------------------------------------------------------------ set-up
    def _exclusions(self, nq: int) -> tuple[Tensor, Tensor]:
        """Each query's own row and, with sequences, the gallery items of its sequence."""
        own = self.self_gpos >= 0
        owners = [own.nonzero().squeeze(1)]
        values = [self.self_gpos[own]]
        if self.sequence is not None:
            g_seq = self.sequence[self.g_items]
            order = torch.argsort(g_seq, stable=True)
            sorted_seq = g_seq[order]
            q_seq = self.sequence[self.q_items]
            start = torch.searchsorted(sorted_seq, q_seq, side="left")
            end = torch.searchsorted(sorted_seq, q_seq, side="right")
            counts = torch.where(q_seq >= 0, end - start, torch.zeros_like(start))
            owner, at = _expand(start, counts)
            owners.append(owner)
            values.append(order[at])
        return _csr(torch.cat(owners), torch.cat(values), nq)

    def _positives(self, nq: int) -> tuple[Tensor, Tensor]:
        """Relevant gallery items of each query, without the excluded ones."""
        g_lab = self.labels[self.g_items]
        q_lab = self.labels[self.q_items]
        if self.multilabel:
            # inverted index over (label, gallery position) of every non-padding entry
            gl = g_lab.reshape(-1)
            gpos = torch.arange(self.g_items.numel(), device=self.device).repeat_interleave(g_lab.shape[1])
            keep = gl >= 0
            gl, gpos = gl[keep], gpos[keep]
            ql = q_lab.reshape(-1)
            qown = torch.arange(nq, device=self.device).repeat_interleave(q_lab.shape[1])
            keep = ql >= 0
            ql, qown = ql[keep], qown[keep]
        else:
            gl, gpos, ql, qown = g_lab, torch.arange(self.g_items.numel(), device=self.device), q_lab, None
        order = torch.argsort(gl, stable=True)
        sorted_lab, sorted_pos = gl[order], gpos[order]
        start = torch.searchsorted(sorted_lab, ql, side="left")
        counts = torch.searchsorted(sorted_lab, ql, side="right") - start
        owner, at = _expand(start, counts)
        if qown is not None:
            owner = qown[owner]
        values = sorted_pos[at]
        ptr, values = _csr(owner, values, nq)  # sorted and deduplicated (label sets may share several labels)
        if self.excl_gpos.numel() == 0 or values.numel() == 0:
            return ptr, values
        owner = torch.repeat_interleave(torch.arange(nq, device=self.device), ptr[1:] - ptr[:-1])
        span = self.g_items.numel() + 1
        e_owner = torch.repeat_interleave(torch.arange(nq, device=self.device), self.excl_ptr[1:] - self.excl_ptr[:-1])
        keep = ~torch.isin(owner * span + values, e_owner * span + self.excl_gpos)
        return _csr(owner[keep], values[keep], nq)

    # ------------------------------------------------------------------ questions
    def relevant(self, q_rows: Tensor, gpos: Tensor) -> Tensor:
        """Whether gallery positions ``gpos`` are relevant to query rows ``q_rows`` (element-wise, any equal shapes;
        exclusion is not considered here). ``gpos`` entries ``< 0`` (padding) are irrelevant."""
        valid = gpos >= 0
        g = self.g_items[gpos.clamp(min=0)]
        q = self.q_items[q_rows]
        if not self.multilabel:
            return valid & (self.labels[g] == self.labels[q])
        lq, lg = self.labels[q], self.labels[g]  # [..., L]
        same = (lq.unsqueeze(-1) == lg.unsqueeze(-2)) & (lq >= 0).unsqueeze(-1)
        return valid & same.flatten(-2).any(dim=-1)

    def positives(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        """Positives of query rows ``rows`` as pairs (index into ``rows``, gallery position), grouped by row."""
        owner, at = _expand(self.pos_ptr[rows], self.pos_ptr[rows + 1] - self.pos_ptr[rows])
        return owner, self.pos_gpos[at]

    def excluded_in(self, rows: Tensor, c0: int, c1: int) -> tuple[Tensor, Tensor]:
        """Excluded pairs of query rows ``rows`` with gallery positions in ``[c0, c1)``: (index into ``rows``,
        gallery position - c0)."""
        owner, at = _expand(self.excl_ptr[rows], self.excl_ptr[rows + 1] - self.excl_ptr[rows])
        g = self.excl_gpos[at]
        keep = (g >= c0) & (g < c1)
        return owner[keep], g[keep] - c0

    def num_excluded(self) -> Tensor:
        """``[Q]`` number of excluded gallery items of each query (itself and its sequence)."""
        return self.excl_ptr[1:] - self.excl_ptr[:-1]

    @property
    def symmetric(self) -> bool:
        """All-vs-all: the queries are the gallery (relevance and exclusion are then symmetric relations)."""
        return self.q_items.numel() == self.g_items.numel() and bool(torch.equal(self.q_items, self.g_items))
