"""Stage 3 of the exact search (lightning_dml/metrics/_ranks.py): cases the mutation check (issue 26,
docs/testing.md) found untested, each against a float64 brute force with the tie rule."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dml.metrics import _ranks
from lightning_dml.metrics import functional as F
from tests.metrics_reference import brute_scores


def _exact_ranks(x: torch.Tensor, y: torch.Tensor) -> list[list[int]]:
    """Per query (every item, itself excluded): the rank (items ahead, tie rule) of each of its positives."""
    s = brute_scores(x)
    n = x.shape[0]
    idx = torch.arange(n)
    out: list[list[int]] = [[] for _ in range(n)]
    with_pos = [q for q in range(n) if int(((y == y[q]) & (idx != q)).sum())]
    for c in range(0, len(with_pos), 32):
        qs = torch.tensor(with_pos[c : c + 32])
        sq = s[qs].unsqueeze(1)  # [b, 1, n]: ahead[b, p, g] = g ranks ahead of p for query qs[b]
        sp = sq.transpose(1, 2)
        ahead = (sq > sp) | ((sq == sp) & (idx < idx.unsqueeze(1)))
        ahead[torch.arange(qs.numel()), :, qs] = False
        count = ahead.sum(dim=2)
        for b, q in enumerate(qs.tolist()):
            out[q] = sorted(count[b, (y == y[q]) & (idx != q)].tolist())
    return out


def _twins(pairs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``pairs`` pairs of identical integer rows: the first of each pair its own class (a negative for everyone),
    the second of class 0. Every positive of a class-0 query ties with its twin, which wins the tie (smaller
    position): every such band holds another item, and the exact rank is one more than the certain count."""
    g = torch.Generator().manual_seed(5)
    e = torch.randint(-4, 5, (pairs, 8), generator=g).float()
    e[:, 0] = 9.0  # no zero row
    x = e.repeat_interleave(2, dim=0)
    y = torch.zeros(2 * pairs, dtype=torch.long)
    y[0::2] = torch.arange(1, pairs + 1)
    return x, y


@pytest.fixture(scope="module")
def twins() -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
    x, y = _twins(260)
    return x, y, _exact_ranks(x, y)


def test_more_than_256_ambiguous_best_positive_ranks(twins) -> None:
    """``mrr`` needs the exact best-positive rank of all 260 class-0 queries, each band ambiguous: the rows are
    resolved 256 at a time, and the 257th (and later) must be resolved as well."""
    x, y, want = twins
    stats = F.retrieval_stats(x, y, metrics=["mrr"], query_block=1024, gallery_chunk=128)
    got = stats.first_positive_rank.tolist()
    assert got == [r[0] if r else -1 for r in want]


def test_more_than_256_rows_of_ambiguous_positive_ranks(twins) -> None:
    """``map`` needs the exact rank of every positive; 260 query rows hold ambiguous bands, resolved 256 rows at a
    time: the rows past the first 256 must be resolved too."""
    x, y, want = twins
    stats = F.retrieval_stats(x, y, metrics=["map"], query_block=1024, gallery_chunk=128)
    pr = stats.positive_ranks
    got = [sorted(v for v in row if v >= 0) for row in pr.tolist()]
    assert got == want


def test_a_clear_first_positive_is_not_rescanned(monkeypatch) -> None:
    """Recall@1 of queries whose best positive is far ahead of every other item: the band ``[lo, hi - 1]`` is
    ``[0, 0]`` and decides ``rank < 1`` already, so no row is re-scanned (the module's promise: the band is
    resolved only where it decides ``rank < K``), and the ranks are the exact ones."""
    g = torch.Generator().manual_seed(6)
    centres = torch.eye(6)
    y = torch.arange(6).repeat_interleave(4)
    x = centres[y] + 0.01 * torch.randn(24, 6, generator=g)
    calls: list[int] = []
    real = _ranks._rank_best_rows

    def counting(task, scorer, grid, st):
        calls.append(st.rows.numel())
        return real(task, scorer, grid, st)

    monkeypatch.setattr(_ranks, "_rank_best_rows", counting)
    stats = F.retrieval_stats(x, y, rank_ks=(1,))
    want = _exact_ranks(x, y)
    assert [r[0] for r in want] == [0] * 24  # the data is what the test says
    assert stats.first_positive_rank.tolist() == [0] * 24
    assert calls == []


def test_neighbour_scores_past_the_gallery_are_exact_then_minus_inf() -> None:
    """k larger than the gallery: the exact scores of the real neighbours in place, then ``-inf`` padding."""
    g = torch.Generator().manual_seed(7)
    q, gal = torch.randn(3, 5, generator=g), torch.randn(4, 5, generator=g)
    scores, ids = F.knn(q, gal, k=6)
    s = brute_scores(torch.cat([q, gal]))[:3, 3:]
    for row in range(3):
        want = sorted(range(4), key=lambda j: (-float(s[row, j]), j))
        assert ids[row].tolist() == want + [-1, -1]
        assert scores[row, :4].tolist() == pytest.approx([float(s[row, j]) for j in want], abs=1e-12)
        assert scores[row, 4:].tolist() == [-math.inf, -math.inf]


def test_full_rescans_of_several_row_chunks_keep_every_candidate() -> None:
    """Queries whose candidate buffer is too short are re-scanned 64 rows at a time; chunks of different widths
    (10 near-duplicates per query in the first 64 rows, 20 in the last 4) are padded to the widest, never cut to the
    narrowest: bf16 scores tie the near-duplicates, the exact order decides the first neighbour."""
    g = torch.Generator().manual_seed(8)
    nq = 68
    q = torch.nn.functional.normalize(torch.randn(nq, 32, generator=g), dim=1)
    counts = [10] * 64 + [20] * 4
    gal = torch.cat([q[i] + 3e-4 * torch.randn(c, 32, generator=g) for i, c in enumerate(counts)])
    scores, ids = F.knn(q, gal, k=1, precision="bf16")
    qn = torch.nn.functional.normalize(q.double(), dim=1)
    gn = torch.nn.functional.normalize(gal.double(), dim=1)
    s = qn @ gn.T
    best = s.max(dim=1)
    assert ids[:, 0].tolist() == best.indices.tolist()
    assert scores[:, 0].tolist() == pytest.approx(best.values.tolist(), abs=1e-12)


def test_no_rank_asked_for_a_query_without_positive_is_minus_one() -> None:
    """``rank_ks=()`` and no metric needing a rank: the rank of a query without a relevant item is still -1."""
    g = torch.Generator().manual_seed(9)
    y = torch.tensor([0, 0, 1, 1, 2, 3, 3, 4])
    x = torch.randn(8, 4, generator=g)
    stats = F.retrieval_stats(x, y, rank_ks=(), k=2)
    assert stats.num_relevant.tolist() == [1, 1, 1, 1, 0, 1, 1, 0]
    none = stats.num_relevant == 0
    assert (stats.first_positive_rank[none] == -1).all()


def test_a_repaired_window_tops_out_near_the_largest_score(monkeypatch) -> None:
    """The histogram repair of a missed ``fnmr@fmr`` window takes the *lowest* bin whose count bounds the
    threshold as the window's top: within a bin of the largest score (cosine <= 1), not the top of the float range
    (which would collect every pair above the threshold), and the figures are the brute force's."""
    from tests.metrics_reference import brute_task_metrics

    g = torch.Generator().manual_seed(10)
    y = torch.randint(0, 4, (40,), generator=g)
    x = torch.randn(4, 6, generator=g)[y] + 0.8 * torch.randn(40, 6, generator=g)
    planned, guaranteed, tops = _ranks.plan_windows, _ranks.guaranteed_windows, []

    def wrong(task, scorer, grid, fmrs, neg_total, bound, **kw):  # every window far above its threshold
        w = planned(task, scorer, grid, fmrs, neg_total, bound, **kw)
        return _ranks.make_windows([2.0] * len(fmrs), [3.0] * len(fmrs), bound, w.low.device)

    def recorded(*a, **k):
        w = guaranteed(*a, **k)
        tops.extend(w.high.tolist())
        return w

    monkeypatch.setattr(_ranks, "plan_windows", wrong)
    monkeypatch.setattr(_ranks, "guaranteed_windows", recorded)
    got = F.retrieval_metrics(x, y, recall_at=(1,), metrics=["fnmr@fmr=0.1", "fnmr@fmr=0.25"])
    want = brute_task_metrics(x, y, (1,), fmrs=("0.1", "0.25"))
    for key in ("fnmr@fmr=0.1", "fnmr@fmr=0.25"):
        assert got[key] == pytest.approx(want[key], abs=1e-12)
    assert len(tops) == 2 and all(t < 1.1 for t in tops), tops
