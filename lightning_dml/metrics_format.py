"""How every command prints a metric: one rule for ``test``/``validate``/``fit``'s tables (``test`` and ``validate``
print only the library's table: the CLI turns Lightning's table of the logged fractions off), ``report`` (its line
and its page), ``index evaluate`` and ``sweep``'s best trial (``docs/metrics.md``, "Printed values").

* A rate (Recall@K, MAP@R, R-Precision, MAP, Precision@K, MRR, NDCG@K, FNMR@FMR, NMI, F1, neighbour recall@k...)
  is printed in **percent with two decimals**: ``0.7875`` -> ``78.75``. Two decimals keep two Recall@K of up to
  10,000 queries apart (one query more or less moves it by at least 0.01 %).
* A score is printed as the score it is, with four decimals: ``threshold@fmr=F`` (a similarity, not a rate).
* A value that is not finite (NaN: no query to average) is printed as ``nan`` / ``inf``, never as a number.
* The name is the metric's key without any stage prefix: ``recall@1``, ``map@r``, ``fnmr@fmr=0.01``,
  ``category/<name>/<metric>`` (the same keys as the logged ``test/...`` metrics and ``RetrievalMetrics``).

Files keep the fraction (``index evaluate --format json``, ``results.npz``, ``sweep.json``, the logged metrics): only
text meant for a person goes through :func:`format_metric`.
"""

from __future__ import annotations

import math

__all__ = ["PERCENT_DIGITS", "SCORE_DIGITS", "format_metric", "format_metrics_line", "is_rate"]

#: decimals of a rate in percent
PERCENT_DIGITS = 2
#: decimals of a score (``threshold@fmr=F``)
SCORE_DIGITS = 4
#: metric names (last part of a key) that are scores, not rates
SCORE_PREFIXES = ("threshold@",)


def is_rate(name: str) -> bool:
    """Whether the metric ``name`` (a key, possibly ``category/<name>/<metric>`` or ``test/...``) is a rate, printed
    in percent; ``threshold@fmr=F`` is a score."""
    return not name.rpartition("/")[2].startswith(SCORE_PREFIXES)


def format_metric(name: str, value: float, width: int = 0) -> str:
    """``value`` of the metric ``name`` as printed by every command (module docstring), right-aligned to
    ``width``: ``format_metric("recall@1", 0.7875) == "78.75"``, ``format_metric("threshold@fmr=0.01", 0.71234)
    == "0.7123"``."""
    value = float(value)
    if not math.isfinite(value):
        return f"{value!s:>{width}}"
    if is_rate(name):
        return f"{100 * value:>{width}.{PERCENT_DIGITS}f}"
    return f"{value:>{width}.{SCORE_DIGITS}f}"


def format_metrics_line(values: dict[str, float]) -> str:
    """``"recall@1 78.75, map@r 41.20"``: the metrics on one line, in their order."""
    return ", ".join(f"{name} {format_metric(name, value)}" for name, value in values.items())
