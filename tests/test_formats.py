"""Issue 27 s.3: one answer in one format. The same Recall@1 is printed alike by ``test``'s table
(``ValidationSummary``), ``report`` and ``index evaluate`` (:mod:`lightning_dml.metrics_format`: rates in percent,
two decimals; ``threshold@fmr`` a score, four decimals), under the same metric names."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from lightning_dml.callbacks.summary import format_metrics
from lightning_dml.index.evaluate import format_table
from lightning_dml.metrics_format import format_metric, format_metrics_line, is_rate
from lightning_dml.report.command import main as report_main
from lightning_dml.retrieval import RetrievalResults


def test_the_rule():
    assert format_metric("recall@1", 0.7875) == "78.75"
    assert format_metric("category/a/b/mrr", 1.0) == "100.00"
    assert format_metric("threshold@fmr=0.01", 0.71234) == "0.7123" and not is_rate("category/x/threshold@fmr=0.1")
    assert format_metric("fnmr@fmr=0.01", 0.3, 8) == "   30.00" and is_rate("fnmr@fmr=0.01")
    assert format_metric("map@r", math.nan) == "nan"
    assert format_metrics_line({"recall@1": 0.875, "map@r": 0.5}) == "recall@1 87.50, map@r 50.00"


def _row(table: str, name: str) -> list[str]:
    return next(line.replace("|", " ").split()[1:] for line in table.splitlines() if line.split()[0] == name)


def test_test_table_and_index_evaluate_print_one_recall_alike():
    """Recall@1 = 0.875 (7 of 8 queries): 87.50 in both tables (on main: 87.5 and 0.8750), and MAP@R under the
    same name."""
    values = {"recall@1": 0.875, "map@r": 0.40625}
    table, _ = format_metrics(values)
    assert _row(table, "recall@1") == ["87.50"] and _row(table, "map@r") == ["40.62"]
    result = {"rows": {"exact": dict(values), "index (flat)": dict(values)}, "neighbour_recall@k": 1.0, "k": 4,
              "queries": 8, "search_seconds": 0.001, "kind": "flat", "options": {}}
    evaluated = format_table(result)
    header = evaluated.splitlines()[0].replace("|", " ").split()
    assert header == ["ranking", "recall@1", "map@r", "neighbour_recall@4"]
    assert _row(evaluated, "exact") == ["87.50", "40.62"]
    assert evaluated.splitlines()[3].replace("|", " ").split()[-1] == "100.00"


def test_report_prints_the_same_figures(tmp_path: Path, capsys):
    """``report``'s summary line: the same rule, the values of its page."""
    g = torch.Generator().manual_seed(3)
    labels = torch.arange(24) // 3
    embeddings = torch.randn(8, 6, generator=g)[labels] + 0.8 * torch.randn(24, 6, generator=g)
    results = RetrievalResults.compute(embeddings, labels, top_k=3)
    path = results.save(tmp_path / "results.npz") or tmp_path / "results.npz"
    report = report_main(["--out", str(tmp_path / "report"), "--results", str(path)])
    line = capsys.readouterr().out.splitlines()[-1]
    printed = dict(re.findall(r"(\S+) (-?[\d.]+|nan)(?:,|$)", line.strip()))
    assert printed and printed == {k: format_metric(k, v) for k, v in report.metrics.items()}
    assert printed["recall@1"] == f"{100 * results.recall_at(1):.2f}"
