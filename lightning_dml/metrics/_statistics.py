"""Stage 4 of the exact search: per-query statistics, and the metrics they reduce to.

:class:`RetrievalStats` holds, per query, what the exact search established (the rank of its first relevant item,
R, the relevance of its k nearest neighbours, the rank of each of its positives when ``map`` is asked for, its
category) and, for ``fnmr@fmr``, the exact pair thresholds. :func:`per_query` turns one metric name into a value per
query with the set of queries it averages over; :func:`reduce_metrics` averages them, over all queries and per
category. Definitions: ``docs/metrics.md``.

Queries without a relevant item (R = 0): the metrics of the first relevant item (Recall@K, Precision@K, MRR) count
them as 0; the metrics normalised by R (MAP@R, R-Precision, NDCG@K, MAP) leave them out, and are 0.0 when no
query has a relevant item.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction

import numpy as np
import torch
from torch import Tensor

from lightning_dml.metrics._candidates import exact_rate
from lightning_dml.metrics._ranks import PairThresholds

__all__ = ["MetricName", "RetrievalStats", "exact_mean", "exact_rate", "parse_metric", "per_query", "reduce_metrics"]


@dataclass
class RetrievalStats:
    """Per-query exact retrieval statistics (queries in increasing split-index order).

    Attributes:
        first_positive_rank: number of gallery items ranked ahead of the best relevant item; -1 if none. Exact
            for every query when ``mrr`` or ``map`` was asked for; else exact where a requested K needs it and on
            the same side of every requested K elsewhere.
        num_relevant: R, the number of relevant gallery items (excluded items left out).
        relevance: ``[Q, k]`` bool, whether each of the k nearest neighbours is relevant.
        neighbors: ``[Q, k]`` row positions (into the prepared set) of the neighbours, -1 for padding.
        scores: ``[Q, k]`` float64 scores of the neighbours (exact where their order needed it).
        query_rows: ``[Q]`` row positions of the queries in the prepared set.
        positive_ranks: ``[Q, T]`` exact rank (items ahead) of every relevant item, ascending rank order from the
            right (``-1`` padding on the left); None unless ``map`` was asked for.
        category: ``[Q]`` category id of each query (-1: none); None without categories.
        pairs: the exact thresholds and error rates of ``fnmr@fmr`` (in the search's units); None unless asked for.
        score_scale: the search's scores are the raw scores times this (Euclidean mode scales the set by a power
            of two); thresholds are reported divided by it.
    """

    first_positive_rank: Tensor
    num_relevant: Tensor
    relevance: Tensor
    neighbors: Tensor
    scores: Tensor
    query_rows: Tensor
    positive_ranks: Tensor | None = None
    category: Tensor | None = None
    pairs: PairThresholds | None = None
    score_scale: float = 1.0


@dataclass(frozen=True)
class MetricName:
    """A parsed metric name: ``kind`` (``recall``, ``precision``, ``ndcg``, ``mrr``, ``map``, ``map@r``,
    ``r_precision``, ``fnmr@fmr``) with its cut-off ``k`` or rate ``fmr``; ``key`` is the canonical name.

    ``rate`` is the false match rate as an exact rational: the decimal number written in the name
    (``fnmr@fmr=0.29`` is 29/100, not the float nearest to it); built from a float ``fmr`` alone it is the decimal
    ``repr(fmr)`` (the shortest one that reads back as that float: 0.29 again).
    """

    kind: str
    key: str
    k: int = 0
    fmr: float = 0.0
    rate: Fraction | None = None

    def __post_init__(self) -> None:
        if self.kind == "fnmr@fmr" and self.rate is None:
            object.__setattr__(self, "rate", exact_rate(self.fmr))


def _rate_text(rate: Fraction) -> str:
    """The shortest text of a rate in ``(0, 1]`` that reads back as exactly it: ``f"{F:g}"`` where that is exact
    (``0.001``, ``1e-05``), else every decimal digit (a rate written with more digits than a float keeps)."""
    for text in (f"{float(rate):g}", repr(float(rate))):
        if Fraction(text) == rate:
            return text
    rest = rate.denominator
    for p in (2, 5):
        while rest % p == 0:
            rest //= p
    if rest != 1:  # not a finite decimal (a Fraction given directly, e.g. 1/3): numerator/denominator
        return str(rate)
    digits = 0
    while (rate * 10**digits).denominator != 1:
        digits += 1
    whole, frac = divmod(int(rate * 10**digits), 10**digits)
    return f"{whole}.{frac:0{digits}d}".rstrip("0").rstrip(".")


_AT_K = re.compile(r"^(recall|precision|ndcg)@(\d+)$")
_FMR = re.compile(r"^fnmr@fmr=(.+)$")


def parse_metric(name: str) -> MetricName:
    """Parse ``recall@K``, ``precision@K``, ``ndcg@K``, ``mrr``, ``map``, ``map@r``, ``r_precision`` or
    ``fnmr@fmr=F`` (``0 < F <= 1``, read exactly as the decimal number written: :func:`exact_rate`; its key
    writes F in the shortest form that reads back exactly, ``fnmr@fmr=1.0`` -> ``fnmr@fmr=1``); a ``ValueError``
    names the accepted forms otherwise."""
    text = str(name).strip()
    at_k = _AT_K.match(text)
    if at_k:
        k = int(at_k.group(2))
        if k < 1:
            raise ValueError(f"metric {name!r}: K must be >= 1")
        return MetricName(at_k.group(1), f"{at_k.group(1)}@{k}", k=k)
    if text in ("mrr", "map", "map@r", "r_precision"):
        return MetricName(text, text)
    fmr = _FMR.match(text)
    if fmr:
        try:
            value = float(fmr.group(1))
        except ValueError:
            value = math.nan
        if not 0.0 < value <= 1.0:
            raise ValueError(f"metric {name!r}: the false match rate must be a number in (0, 1], e.g. fnmr@fmr=0.001")
        rate = exact_rate(fmr.group(1))
        if not 0 < rate <= 1:  # a rate just above 0 or 1 that rounds into the range as a float
            raise ValueError(f"metric {name!r}: the false match rate must be a number in (0, 1], e.g. fnmr@fmr=0.001")
        return MetricName("fnmr@fmr", f"fnmr@fmr={_rate_text(rate)}", fmr=float(rate), rate=rate)
    raise ValueError(
        f"unknown metric {name!r}: expected recall@K, precision@K, ndcg@K, mrr, map, map@r, r_precision or "
        "fnmr@fmr=F (K an integer >= 1, F in (0, 1])"
    )


def _needs_k(stats: RetrievalStats, k: int, name: str) -> None:
    if stats.relevance.shape[1] < k:
        raise ValueError(f"{name}: neighbour lists of length {stats.relevance.shape[1]} are shorter than {k}")


def per_query(stats: RetrievalStats, metric: MetricName) -> tuple[Tensor, Tensor]:
    """``(values, included)``: the metric's float64 value per query and the queries it averages over.

    Every query has a finite value: one left out of the mean (R = 0 for R-Precision, MAP@R, MAP and NDCG@K) gets 0.0.
    """
    fpr, r = stats.first_positive_rank, stats.num_relevant
    everyone = torch.ones_like(r, dtype=torch.bool)
    with_r = r > 0
    kind = metric.kind
    if kind == "recall":
        return ((fpr >= 0) & (fpr < metric.k)).double(), everyone
    if kind == "precision":
        if metric.k == 1:  # Precision@1 = Recall@1, from the exact rank (no neighbour list needed)
            return ((fpr >= 0) & (fpr < 1)).double(), everyone
        _needs_k(stats, metric.k, metric.key)
        return stats.relevance[:, : metric.k].sum(dim=1).double() / metric.k, everyone
    if kind == "mrr":
        return torch.where(fpr >= 0, 1.0 / (fpr.double() + 1.0), torch.zeros_like(fpr, dtype=torch.float64)), everyone
    if kind in ("map@r", "r_precision"):
        if r.numel() and stats.relevance.shape[1] < int(r.max()):
            raise ValueError(f"neighbour lists of length {stats.relevance.shape[1]} are shorter than the largest R")
        in_r = torch.arange(stats.relevance.shape[1], device=r.device).unsqueeze(0) < r.unsqueeze(1)
        rel = stats.relevance & in_r
        denom = r.clamp(min=1).double()
        if kind == "r_precision":
            return rel.sum(dim=1).double() / denom, with_r
        relf = rel.double()
        prec = torch.cumsum(relf, dim=1) / torch.arange(1, rel.shape[1] + 1, dtype=torch.float64, device=r.device)
        return (prec * relf).sum(dim=1) / denom, with_r
    if kind == "ndcg":
        _needs_k(stats, metric.k, metric.key)
        disc = 1.0 / torch.log2(torch.arange(metric.k, dtype=torch.float64, device=r.device) + 2.0)
        dcg = (stats.relevance[:, : metric.k].double() * disc).sum(dim=1)
        ideal = torch.cumsum(disc, 0)[(r.clamp(min=1, max=metric.k) - 1)]
        return dcg / ideal, with_r
    if kind == "map":
        if stats.positive_ranks is None:
            raise ValueError("map: the search did not compute the ranks of every positive")
        ranks = stats.positive_ranks  # ascending score order: the best (lowest rank) last; -1 padding first
        valid = ranks >= 0
        order = torch.sort(torch.where(valid, ranks, torch.full_like(ranks, torch.iinfo(torch.long).max)), dim=1)
        sorted_ranks = order.values
        hits = torch.arange(1, ranks.shape[1] + 1, dtype=torch.float64, device=r.device).unsqueeze(0)
        ok = sorted_ranks != torch.iinfo(torch.long).max
        prec = torch.where(ok, hits / (sorted_ranks.double() + 1.0), torch.zeros_like(hits))
        return prec.sum(dim=1) / r.clamp(min=1).double(), with_r
    raise ValueError(f"{metric.key} is not a per-query metric")


def exact_mean(values: Tensor | np.ndarray, included: Tensor | np.ndarray) -> float:
    """Mean of ``values[included]`` (0.0 when none): the sum is exactly rounded (``math.fsum``), so the figure
    depends on neither the thread count (a parallel sum's order does) nor the device nor the order of the queries."""
    n = int(included.sum())
    return math.fsum(values[included].tolist()) / n if n else 0.0


def _category_name(c: int, names: Sequence[str] | dict[int, str] | None) -> str:
    if isinstance(names, dict):
        return str(names.get(c, c))
    if names is not None and 0 <= c < len(names):
        return str(names[c])
    return str(c)


def reduce_metrics(
    stats: RetrievalStats, metrics: Sequence[MetricName], category_names: Sequence[str] | dict[int, str] | None = None,
) -> dict[str, float]:
    """The metric dictionary: each metric averaged over its queries; with categories, also
    ``category/<name>/<metric>`` over the queries of each category (``<name>``: ``category_names[id]`` or the id);
    ``fnmr@fmr=F`` with ``threshold@fmr=F`` (in the scores' raw units) over all pairs."""
    out: dict[str, float] = {}
    values = {}
    for m in metrics:
        if m.kind == "fnmr@fmr":
            continue
        values[m.key] = per_query(stats, m)
        out[m.key] = exact_mean(*values[m.key])
    if stats.pairs is not None:
        for f, theta, fnmr in zip(stats.pairs.fmrs, stats.pairs.thresholds, stats.pairs.fnmr):
            key = _rate_text(exact_rate(f))
            out[f"fnmr@fmr={key}"] = fnmr
            out[f"threshold@fmr={key}"] = theta / stats.score_scale if math.isfinite(theta) else theta
    if stats.category is not None:
        for c in torch.unique(stats.category).tolist():
            if c < 0:
                continue
            name = _category_name(c, category_names)
            mine = stats.category == c
            for key, (v, inc) in values.items():
                out[f"category/{name}/{key}"] = exact_mean(v, inc & mine)
    return out
