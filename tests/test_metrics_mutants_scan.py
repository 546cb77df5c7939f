"""The approximate pass of the exact search (``lightning_dml/metrics/_scan.py``): cases the mutation check (issue 26,
docs/testing.md) found untested, each against a brute force.

On small integer coordinates in Euclidean mode the approximate (float32) scores are exact (the set is divided by a
power of two, every product and sum is a small dyadic number), so the pass's counters and pair windows can be
compared entry by entry with counts over the whole score matrix.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from lightning_dml.metrics import functional as F
from lightning_dml.metrics._candidates import SearchRequest
from lightning_dml.metrics._ranks import pair_bound, pairs_pass
from lightning_dml.metrics._scan import initial_state, make_windows, scan_rows, scan_symmetric
from lightning_dml.metrics._scores import score_tile
from tests.metrics_reference import brute_scores, brute_task_metrics, brute_task_rankings


def _integer_set(n: int = 40, d: int = 3, classes: int = 5, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (n, d), generator=g).float(), torch.randint(0, classes, (n,), generator=g)


def _search(x: torch.Tensor, y: torch.Tensor, query_block: int, gallery_chunk: int):
    task, scorer, grid = F.build_search(
        F.prepare(x, y), metric="euclidean", precision="fp32", query_block=query_block, gallery_chunk=gallery_chunk
    )
    full = score_tile(scorer, task, torch.arange(task.q_items.numel()), 0, task.g_items.numel())
    # the premise of the brute force: approximate scores exact (so symmetric, tile by tile alike)
    exact = brute_scores(x, "euclidean") * scorer.score_scale
    finite = torch.isfinite(full)
    assert torch.equal(full.double()[finite], exact[finite]) and torch.equal(full, full.T)
    return task, scorer, grid, full


# grids: query blocks of 16 (3 blocks: query blocks against gallery chunks) and of 8 (5 blocks: the symmetric pass,
# off-diagonal tiles standing for two pairs)
GRIDS = [pytest.param(16, 12, False, id="rows"), pytest.param(8, 8, True, id="symmetric")]


@pytest.mark.parametrize("query_block,gallery_chunk,symmetric", GRIDS)
@pytest.mark.parametrize("sparse", [True, False], ids=["sparse", "dense"])
def test_pair_windows_count_and_collect_every_pair(query_block: int, gallery_chunk: int, symmetric: bool,
                                                   sparse: bool) -> None:
    """Each window counts the pairs above its top cut and collects those between its cuts, once per (query,
    gallery) pair, whichever way it is served: a sparse extraction (the far upper tail) or two comparisons."""
    x, y = _integer_set()
    task, scorer, grid, full = _search(x, y, query_block, gallery_chunk)
    assert grid.symmetric(task) == symmetric
    values = torch.unique(full[torch.isfinite(full)].double(), sorted=True).flip(0)
    low, high = [float(values[3]), float(values[8])], [float(values[1]), float(values[5])]
    windows = make_windows(low, high, pair_bound(task, scorer), task.device, [sparse, sparse])
    pairs_pass(task, scorer, grid, windows)
    got: list[Counter] = [Counter(), Counter()]
    for q, g, packed in zip(torch.cat(windows.q_rows).tolist(), torch.cat(windows.gpos).tolist(),
                            torch.cat(windows.window).tolist()):
        window, weight = divmod(packed, 2)
        got[window][(q, g)] += 1
        if weight:  # an off-diagonal entry of the symmetric pass: (q, g) and (g, q)
            got[window][(g, q)] += 1
    for i in range(2):
        above = full > windows.cut_above[i]
        inside = (full >= windows.cut_below[i]) & ~above
        assert int(windows.above[i]) == int(above.sum()) > 0
        want = Counter(map(tuple, inside.nonzero().tolist()))
        assert got[i] == want and len(want) > 0


@pytest.mark.parametrize("query_block,gallery_chunk,symmetric", GRIDS)
def test_best_positive_bands_count_the_whole_gallery(query_block: int, gallery_chunk: int, symmetric: bool) -> None:
    """``lo`` counts the items above a query's band and ``hi`` those at or above its bottom, over every tile; a
    query drops out of the counting once ``lo`` reaches the largest K (its counts are then partial, ``lo`` at least
    K: a miss for every K)."""
    x, y = _integer_set(seed=1)
    task, scorer, grid, full = _search(x, y, query_block, gallery_chunk)
    request = SearchRequest(k=0, rank_ks=(2, 6))
    n = task.q_items.numel()
    if symmetric:
        st = initial_state(task, scorer, torch.arange(n), request)
        scan_symmetric(task, scorer, grid, st)
        states = [st]
    else:
        states = [initial_state(task, scorer, grid.block_rows(task, b), request) for b in range(grid.num_blocks(task))]
        for st in states:
            scan_rows(task, scorer, grid, st)
    lo = torch.cat([st.lo for st in states])
    hi = torch.cat([st.hi for st in states])
    has = torch.cat([st.has for st in states])
    lo_ref = (full > torch.cat([st.thr_hi for st in states]).unsqueeze(1)).sum(1)
    hi_ref = (full >= torch.cat([st.thr_lo for st in states]).unsqueeze(1)).sum(1)
    full_count = has & (lo < 6)
    assert torch.equal(lo[full_count], lo_ref[full_count]) and torch.equal(hi[full_count], hi_ref[full_count])
    assert bool((lo[full_count] > 0).any())  # items certainly ahead are counted, not only the band
    dropped = has & ~full_count
    assert bool(dropped.any()) and bool((lo[dropped] <= lo_ref[dropped]).all()) and bool((hi[dropped] <= hi_ref[dropped]).all())
    assert not bool((lo[~has] | hi[~has]).any())


def test_a_split_with_a_single_positive_pair() -> None:
    """One relevant (query, gallery) pair in the whole split: its exact score and rank are kept (MAP, FNMR@FMR, the
    rank matrix of one column) as in the brute force."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(12, 4, generator=g)
    qm = torch.arange(12) < 4
    s = brute_scores(x)[:4, 4:]
    q, g = divmod(int(s.flatten().argsort(descending=True)[6]), 8)  # the 7th best of the 32 pairs
    y = torch.arange(12)
    y[4 + g] = q  # the only positive pair: (q, 4 + g)
    names = ["map", "fnmr@fmr=0.1", "fnmr@fmr=0.5"]
    stats = F.retrieval_stats(x, y, query_mask=qm, gallery_mask=~qm, metrics=names)
    rankings = brute_task_rankings(x, y, query_mask=qm, gallery_mask=~qm)
    want = torch.tensor([[rel.index(True) if any(rel) else -1] for _, _, rel, _, _ in rankings])
    assert torch.equal(stats.positive_ranks, want) and int((want >= 0).sum()) == 1
    got = F.retrieval_metrics(x, y, recall_at=(1,), query_mask=qm, gallery_mask=~qm, metrics=names)
    ref = brute_task_metrics(x, y, (1,), query_mask=qm, gallery_mask=~qm, fmrs=("0.1", "0.5"))
    for key in names:
        assert got[key] == pytest.approx(ref[key], abs=1e-12), key
    assert {ref["fnmr@fmr=0.1"], ref["fnmr@fmr=0.5"]} == {0.0, 1.0}  # the positive lies between the two thresholds


def test_symmetric_pass_takes_each_candidate_once() -> None:
    """A query whose candidate threshold is still unset (a last block shorter than the buffer) takes its entries
    from its own column of a tile; an entry equal to the tile's shared threshold is taken once, not once from the
    shared extraction and again from the column (the neighbour list would hold that item twice).

    Points on a line: block 0 (13 items at 0..12), blocks 1 and 2 far away; each full block seeds its thresholds
    from its diagonal tile (12 candidates for k = 4), the lowest of block 0 is -(12^2) (item 0's 12th neighbour).
    Item 39 (in the short last block) lies at -12: its best pair, with item 0, scores exactly that."""
    pos = torch.cat([torch.arange(13.0), 1000 + torch.arange(13.0), 2000 + torch.arange(13.0),
                     torch.tensor([-12.0, 5000.0, 5001.0, 5002.0])])
    x = torch.stack([pos, torch.zeros_like(pos)], 1)
    y = torch.arange(43) % 3
    stats = F.retrieval_stats(x, y, metric="euclidean", precision="fp32", k=4, exact_scores=True, query_block=13)
    assert stats.neighbors[39].tolist() == [0, 1, 2, 3]
    for q, cand, _, _, _ in brute_task_rankings(x, y, metric="euclidean"):
        assert stats.neighbors[q].tolist() == cand[:4], q
