"""``fnmr@fmr=F`` counts ``floor(F x negatives)`` in exact rational arithmetic (issue 26 s.4).

float64 gave ``floor(0.29 x 100) = 28``: 28 negative pairs accepted instead of 29, and another threshold and FNMR.
F is the decimal number written in the name (``fractions.Fraction`` of the string: "0.29" is 29/100); a float
stands for its shortest ``repr``. The brute force of ``tests/metrics_reference.py`` counts in integers.
"""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.metrics import functional as F
from tests.metrics_reference import brute_task_metrics


def _verification_set(queries: int, negatives: int = 100, positives: int = 10, seed: int = 0):
    """``queries`` queries of class 0 against a gallery of ``positives`` items of class 0 and ``negatives`` of
    class 1 (query/gallery mode): ``queries x negatives`` negative pairs, ``queries x positives`` positive ones."""
    g = torch.Generator().manual_seed(seed)
    n = queries + negatives + positives
    x = torch.randn(n, 6, generator=g)
    y = torch.zeros(n, dtype=torch.long)
    y[queries : queries + negatives] = 1
    qm = torch.zeros(n, dtype=torch.bool)
    qm[:queries] = True
    return x, y, qm, ~qm


def test_fmr_0_29_with_100_negatives_accepts_29_pairs() -> None:
    """The issue's figures: one query on a line (Euclidean), 100 negatives at distances 1..100, 10 positives: 4
    near, 1 between the 29th and 30th negative, 5 far. At FMR 0.29 the 29 nearest negatives are accepted, the
    threshold is the 30th (-900), so the positive at 29.5 is accepted: FNMR 5/10 (float64 gave 6/10)."""
    dist = torch.cat([torch.arange(1, 101).float(), torch.tensor([0.5] * 4 + [29.5] + [200.0] * 5)])
    x = torch.cat([torch.zeros(1, 1), dist.unsqueeze(1)])
    y = torch.cat([torch.tensor([0]), torch.ones(100, dtype=torch.long), torch.zeros(10, dtype=torch.long)])
    qm = torch.zeros(111, dtype=torch.bool)
    qm[0] = True
    got = F.retrieval_metrics(x, y, query_mask=qm, gallery_mask=~qm, recall_at=(1,), metric="euclidean",
                              metrics=["fnmr@fmr=0.29"])
    assert got["threshold@fmr=0.29"] == -900.0
    assert got["fnmr@fmr=0.29"] == 0.5
    stats = F.retrieval_stats(x, y, query_mask=qm, gallery_mask=~qm, metric="euclidean", metrics=["fnmr@fmr=0.29"])
    assert stats.pairs.negatives == 100 and stats.pairs.fmr == [0.29]


@pytest.mark.parametrize("queries, denominator", [(1, 100), (2, 1000)])
def test_every_rate_with_an_integral_product_equals_the_fraction_brute_force(queries: int, denominator: int) -> None:
    """F = j / denominator for every j with F x negatives an integer (100 negative pairs with F in hundredths; 200
    with F in thousandths), which float64 often floors to one less (0.29, 0.57, 0.58 of 100; 0.145, 0.285, ... of
    200). Every figure equals the brute force counting in integers, and exactly floor(F x negatives) negative
    pairs lie above the threshold."""
    x, y, qm, gm = _verification_set(queries, negatives=100, positives=4)
    n_neg = queries * 100
    rates = [repr(j / denominator) for j in range(1, denominator + 1) if j * n_neg % denominator == 0]
    floored = [r for r in rates if math.floor(float(r) * n_neg) != Fraction(r) * n_neg]
    assert len(floored) >= 3  # the float64 floor is wrong for some of them: the test can tell
    ref = brute_task_metrics(x, y, (1,), query_mask=qm, gallery_mask=gm, fmrs=rates)
    stats = F.retrieval_stats(x, y, query_mask=qm, gallery_mask=gm, metrics=[f"fnmr@fmr={r}" for r in rates],
                              query_block=4, gallery_chunk=64)
    got = F.retrieval_metrics(x, y, query_mask=qm, gallery_mask=gm, recall_at=(1,),
                              metrics=[f"fnmr@fmr={r}" for r in rates])
    negatives = stats.pairs.negatives
    assert negatives == n_neg
    for r in rates:
        key = F.parse_metric(f"fnmr@fmr={r}").key
        assert key == f"fnmr@fmr={float(r):g}"
        assert got[key] == ref[f"fnmr@fmr={r}"], r
        # the threshold is a score: the brute force sums the coordinates in another order (last bit)
        assert got[f"threshold@fmr={float(r):g}"] == pytest.approx(ref[f"threshold@fmr={r}"], rel=0, abs=1e-15), r
    for rate, fmr in zip(stats.pairs.fmrs, stats.pairs.fmr):
        accepted = round(fmr * negatives)
        assert accepted == (rate.numerator * negatives) // rate.denominator


def test_rate_spellings_are_read_as_the_decimal_written() -> None:
    for text, rate in (("0.29", Fraction(29, 100)), ("2.9e-1", Fraction(29, 100)), ("1e-3", Fraction(1, 1000)),
                       (" 0.001 ", Fraction(1, 1000)), ("1.0", Fraction(1)), ("1", Fraction(1))):
        m = F.parse_metric(f"fnmr@fmr={text}")
        assert m.rate == rate and m.fmr == float(rate), text
    assert F.exact_rate(0.29) == Fraction(29, 100)  # a float: its shortest repr, not the binary value
    assert F.exact_rate("0.1") == Fraction(1, 10) != Fraction(0.1)
    # two rates that share their %g spelling are two metrics, each keyed by a text that reads back exactly
    a, b = F.parse_metric("fnmr@fmr=0.12345671"), F.parse_metric("fnmr@fmr=0.12345672")
    assert a.key != b.key
    for m in (a, b, F.parse_metric("fnmr@fmr=0.1000000000000000000001")):
        assert Fraction(m.key.split("=")[1]) == m.rate
    for bad in ("fnmr@fmr=0", "fnmr@fmr=1.0000000000000000001", "fnmr@fmr=-0.1", "fnmr@fmr=nan", "fnmr@fmr=1/3"):
        with pytest.raises(ValueError, match=r"false match rate must be a number in \(0, 1\]"):
            F.parse_metric(bad)


def test_fmr_one_accepts_every_pair() -> None:
    """``fnmr@fmr=1`` (documented): every negative pair may be accepted, the threshold is ``-inf``, every positive
    pair is accepted: FNMR 0.0; the key writes the rate in its shortest form."""
    x, y, qm, gm = _verification_set(2, negatives=20, positives=4)
    got = F.retrieval_metrics(x, y, query_mask=qm, gallery_mask=gm, recall_at=(1,), metrics=["fnmr@fmr=1.0"])
    assert got["fnmr@fmr=1"] == 0.0 and got["threshold@fmr=1"] == -math.inf
    ref = brute_task_metrics(x, y, (1,), query_mask=qm, gallery_mask=gm, fmrs=[1.0])
    assert ref["fnmr@fmr=1"] == 0.0 and ref["threshold@fmr=1"] == -math.inf
    m = RetrievalMetrics(metrics=("fnmr@fmr=1.0",), clustering=False)
    m.update(x, y, query_mask=qm, gallery_mask=gm)
    assert m.compute()["fnmr@fmr=1"] == 0.0


def test_no_positive_pair_gives_fnmr_zero() -> None:
    """Documented: without a positive pair (every label distinct) FNMR is 0.0 (nothing is falsely rejected), the
    threshold is still the order statistic of the negatives."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(21, 5, generator=g)
    y = torch.arange(21)
    for f in ("0.1", "0.5"):
        got = F.retrieval_metrics(x, y, recall_at=(1,), metrics=[f"fnmr@fmr={f}"])
        ref = brute_task_metrics(x, y, (1,), fmrs=[f])
        assert got[f"fnmr@fmr={f}"] == 0.0 == ref[f"fnmr@fmr={f}"]
        assert got[f"threshold@fmr={f}"] == pytest.approx(ref[f"threshold@fmr={f}"], rel=0, abs=1e-15)
        assert math.isfinite(got[f"threshold@fmr={f}"])
