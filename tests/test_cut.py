"""The search cut (lightning_dml/index/cut.py): constant threshold and OML's adaptive cut on hand-built lists."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dml.index import cut as C

NEG = float("-inf")


def rows(*lists: list[float], k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Score lists (best first) padded to k with -inf / -1; ids 10, 11, ... per row."""
    k = k or max(len(x) for x in lists)
    s = torch.full((len(lists), k), NEG, dtype=torch.float64)
    i = torch.full((len(lists), k), -1, dtype=torch.int64)
    for r, x in enumerate(lists):
        s[r, : len(x)] = torch.tensor(x, dtype=torch.float64)
        i[r, : len(x)] = torch.arange(10, 10 + len(x))
    return s, i


def kept(mask: torch.Tensor) -> list[int]:
    return mask.sum(1).tolist()


def oml_adaptive(dists: list[float], n_std: float) -> int:
    """OML's AdaptiveThresholding for one query (distances ascending), its mean gap over this query's own gaps:
    how many results are kept."""
    diffs = [b - a for a, b in zip(dists[:-1], dists[1:])]
    if not diffs:
        return len(dists)
    avg = sum(diffs) / len(diffs)
    big = [i for i, d in enumerate(diffs) if d > n_std * avg]
    return big[0] + 1 if big else len(dists)


@pytest.mark.parametrize(
    "scores,n,want",
    [
        ([0.9, 0.88, 0.86, 0.3, 0.28], 2.0, 3),  # one big gap after the third result
        ([0.9, 0.5, 0.49, 0.48], 2.0, 1),  # gap right after the best
        ([0.875, 0.75, 0.625, 0.5], 1.0, 4),  # equal gaps (exact in binary): none larger than the mean
        ([0.875, 0.75, 0.625, 0.5], 0.5, 1),  # every gap > 0.5 mean: cut after the first
        ([0.7, 0.7, 0.7], 1.0, 3),  # all equal: mean 0, no gap larger
        ([0.7, 0.7, 0.7], 0.0, 3),  # n = 0: still no gap > 0
        ([0.9], 3.0, 1),  # a single result: no gap
        ([0.9, 0.9, 0.2, 0.2], 1.5, 2),  # ties before and after the gap
        ([0.5, 0.5, 0.5, 0.125], 2.0, 3),  # gap 0.375 vs mean 0.125
        ([0.5, 0.5, 0.5, 0.125], 3.0, 4),  # exactly 3 x mean is not larger (strict >, as OML)
    ],
)
def test_adaptive_cut_hand_built(scores, n, want):
    s, i = rows(scores)
    assert kept(C.adaptive_mask(s, i, n)) == [want]
    assert oml_adaptive([-x for x in scores], n) == want  # the hand-built answers are OML's


def test_adaptive_cut_ignores_padding_and_other_queries():
    """Each query's mean gap is its own (batched, padded rows give the one-query answers)."""
    lists = [[0.9, 0.88, 0.86, 0.3], [0.9, 0.1], [0.5], [0.8, 0.79, 0.78, 0.77, 0.2, 0.19]]
    s, i = rows(*lists, k=8)
    got = kept(C.adaptive_mask(s, i, 2.0))
    assert got == [kept(C.adaptive_mask(*rows(x), 2.0))[0] for x in lists] == [3, 2, 1, 4]
    assert not C.adaptive_mask(s, i, 2.0)[i < 0].any()


def test_adaptive_cut_matches_oml_loop_on_random_lists():
    gen = torch.Generator().manual_seed(0)
    for _ in range(50):
        k = int(torch.randint(1, 12, (1,), generator=gen))
        x = torch.rand(k, generator=gen).double()
        x = torch.round(x * 8) / 8  # ties
        scores = sorted(x.tolist(), reverse=True)
        n = float(torch.rand(1, generator=gen)) * 3
        s, i = rows(scores)
        assert kept(C.adaptive_mask(s, i, n)) == [oml_adaptive([-v for v in scores], n)], (scores, n)


@pytest.mark.parametrize(
    "scores,t,want",
    [
        ([0.9, 0.6, 0.5, 0.2], 0.5, 3),  # at the threshold is kept
        ([0.9, 0.6, 0.5, 0.2], 0.95, 0),  # no match
        ([0.4, 0.4, 0.4], 0.4, 3),  # ties at the threshold
        ([0.3], -1.0, 1),
    ],
)
def test_threshold_hand_built(scores, t, want):
    s, i = rows(scores)
    assert kept(C.threshold_mask(s, i, t)) == [want]


def test_search_cut_applies_adaptive_then_threshold_and_pads():
    s, i = rows([0.9, 0.88, 0.86, 0.3, 0.28], [0.2, 0.1], k=6)
    cs, ci = C.SearchCut(threshold=0.87, adaptive=2.0).apply(s, i)
    assert ci.tolist() == [[10, 11, -1, -1, -1, -1], [-1] * 6]
    assert cs[0, :2].tolist() == [0.9, 0.88] and math.isinf(cs[0, 2]) and cs[0, 2] < 0
    cs, ci = C.SearchCut(adaptive=2.0).apply(s, i)
    assert ci[0].tolist() == [10, 11, 12, -1, -1, -1]
    cs, ci = C.SearchCut().apply(s, i)
    assert torch.equal(ci, i) and not C.SearchCut() and C.SearchCut(threshold=0.1)


@pytest.mark.parametrize(
    "threshold,adaptive,match",
    [("x", None, "--threshold 'x' is not a number"), ("nan", None, "not a finite number"),
     (None, "-1", "--adaptive '-1' must be >= 0"), (None, "inf", "not a finite number")],
)
def test_cut_options_errors(threshold, adaptive, match):
    with pytest.raises(C.CutOptionError, match=match):
        C.SearchCut.parse(threshold, adaptive)


def test_cut_options_parse():
    assert C.SearchCut.parse("0.5", "2") == C.SearchCut(0.5, 2.0)
    assert C.SearchCut.parse(None, None) == C.SearchCut()
