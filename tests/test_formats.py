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
from tests.test_cli_trust import glyph_renderings  # noqa: F401 - the cached Glyphs renderings (a fixture)
from tests.test_report_browser import browser  # noqa: F401 - headless chromium (a fixture), or a skip


def test_the_rule():
    assert format_metric("recall@1", 0.7875) == "78.75"
    assert format_metric("category/a/b/mrr", 1.0) == "100.00"
    assert format_metric("threshold@fmr=0.01", 0.71234) == "0.7123" and not is_rate("category/x/threshold@fmr=0.1")
    assert format_metric("fnmr@fmr=0.01", 0.3, 8) == "   30.00" and is_rate("fnmr@fmr=0.01")
    assert format_metric("map@r", math.nan) == "nan"
    assert format_metrics_line({"recall@1": 0.875, "map@r": 0.5}) == "recall@1 87.50, map@r 50.00"


def _row(table: str, name: str) -> list[str]:
    return next(line.replace("|", " ").split()[1:] for line in table.splitlines() if line.split()[:1] == [name])


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


def test_test_prints_its_metrics_in_the_format_without_categories_too(capsys):
    """``test`` (and ``validate``) print the metrics the one way also when the data have no categories; on main
    only Lightning's table of fractions (0.875) was printed then."""
    from types import SimpleNamespace

    from lightning_dml.callbacks import ValidationSummary

    trainer = SimpleNamespace(callback_metrics={"test/recall@1": torch.tensor(0.875), "val/recall@1": 0.5,
                                                "test/threshold@fmr=0.01": 0.71234}, is_global_zero=True)
    assert ValidationSummary().print_category_table(trainer, "test/", "test") is None  # no per-category table
    printed = capsys.readouterr().out
    assert "Test metrics, %:" in printed and "Per category" not in printed
    assert _row(printed.split("Test metrics, %:")[1], "recall@1") == ["87.50"] and "50.00" not in printed
    assert _row(printed.split("Test metrics, %:")[1], "threshold@fmr=0.01") == ["0.7123"]
    trainer.callback_metrics["test/category/a/recall@1"] = 1.0
    assert ValidationSummary().print_category_table(trainer, "test/", "test").split()[:2] == ["category", "recall@1"]
    assert "Per category (test, queries of each category), %:" in capsys.readouterr().out
    trainer.is_global_zero = False  # the other processes print nothing
    ValidationSummary().print_category_table(trainer, "test/", "test")
    assert capsys.readouterr().out == ""


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


# --------------------------------------------------------------------------------------------- serve's errors
def _error_app():
    """A FastAPI app answering ``/boom`` as LitServe's own code paths do (their shapes on main)."""
    from fastapi import FastAPI, HTTPException
    from fastapi.responses import PlainTextResponse

    app = FastAPI()

    @app.get("/validate")
    async def validate(k: int) -> dict:  # a k that is not an integer: FastAPI's 422, {"detail": [{...}]}
        return {"k": k}

    @app.get("/timeout")
    async def timeout() -> None:  # LitServe's answer to a request the model worker did not answer in time
        raise HTTPException(504, "Request timed out")

    @app.get("/text")
    async def text() -> PlainTextResponse:  # LitServe's /health before the worker is ready
        return PlainTextResponse("not ready", status_code=503, headers={"Retry-After": "1"})

    @app.get("/empty")
    async def empty() -> PlainTextResponse:
        return PlainTextResponse("", status_code=418)

    @app.get("/crash")
    async def crash() -> None:
        raise RuntimeError("secret detail")

    return app


def test_serve_errors_have_one_json_shape_on_every_route():
    """Every error of the real LitServer app (not started: no model worker) and of the code paths LitServe answers
    with: ``{"error": "<one line>"}``, application/json, the status kept. On main 404/405/422/504 were FastAPI's
    ``{"detail": ...}`` and a 503 / 500 plain text."""
    pytest.importorskip("litserve")
    from starlette.testclient import TestClient

    from lightning_dml.index import server as S

    app = S.build_server("/nonexistent", accelerator="cpu", timeout=2).app
    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: the model worker is never started
    cases = [
        ("GET", "/nope", {}, 404, "Not Found"),
        ("GET", "/search", {}, 405, "Method Not Allowed"),
        ("PUT", "/health", {}, 405, "Method Not Allowed"),
        ("GET", "/openapi.json", {}, 404, "Not Found"),
        ("POST", "/search", {"content": b"x", "headers": {"Content-Type": "text/plain"}}, 415, "Content-Type text/"),
        ("POST", "/search", {"content": b"{", "headers": {"Content-Type": "application/json"}}, 400,
         "not valid JSON"),
        ("POST", "/search", {"content": b"", "headers": {"Content-Type": "image/png"}}, 400, "empty body"),
        ("GET", "/health", {}, 500, "internal server error"),  # no worker queues: LitServe raises
    ]
    for method, path, kwargs, status, text in cases:
        r = client.request(method, path, **kwargs)
        assert r.status_code == status, (method, path, r.text)
        assert r.headers["content-type"] == "application/json", (method, path)
        body = r.json()
        assert list(body) == ["error"] and text in body["error"] and "\n" not in body["error"], (method, path, body)
    assert client.request("GET", "/search").headers["allow"] == "POST"  # the other headers are kept
    assert client.get("/").status_code == 200 and client.get("/").text == "litserve running"  # successes unchanged
    assert client.get("/info").json()["server"]["timeout"] == 2

    inner = TestClient(S.JSONErrorMiddleware(_error_app()), raise_server_exceptions=False)
    for method, path, kwargs, status, text in [
        ("GET", "/validate?k=many", {}, 422, "query.k: Input should be a valid integer"),
        ("GET", "/validate", {}, 422, "query.k: Field required"),
        ("GET", "/timeout", {}, 504, "Request timed out"),
        ("GET", "/text", {}, 503, "not ready"),
        ("GET", "/empty", {}, 418, "I'm a Teapot"),
        ("GET", "/crash", {}, 500, "internal server error"),  # FastAPI's own plain text, rewritten
    ]:
        r = inner.request(method, path, **kwargs)
        assert r.status_code == status and r.headers["content-type"] == "application/json", (path, r.text)
        assert list(r.json()) == ["error"] and text.lower() in r.json()["error"].lower(), (path, r.json())
        assert "secret detail" not in r.text and int(r.headers["content-length"]) == len(r.content)
    assert inner.get("/text").headers["retry-after"] == "1"


def test_error_message_is_one_bounded_line():
    from lightning_dml.index import server as S

    assert S.error_message(400, "application/json", b'{"error": "bad k"}') == "bad k"
    assert S.error_message(404, "text/plain", b"") == "Not Found"
    assert S.error_message(500, "text/plain", b"line one\n  line two") == "line one line two"
    long = S.error_message(400, "text/plain", b"x" * 10_000)
    assert len(long) == S.MAX_MESSAGE and long.endswith("...")


# --------------------------------------------------------------------------------------------- the report
def _glyphs_predictions(tmp_path: Path) -> tuple[Path, dict]:
    """A predictions file of the Glyphs config's test split (random embeddings near each class's centre, two
    categories), as ``lightning-dml predict`` writes one for a data module with categories."""
    from lightning_dml.cli import build_cli
    from tests.test_cli import GLYPHS

    cli = build_cli(["--config", str(GLYPHS), "--trainer.logger=false", "--trainer.callbacks=[]"], run=False)
    cli.datamodule.setup("test")
    labels = cli.datamodule.test_dataset.labels
    n = len(labels)
    g = torch.Generator().manual_seed(0)
    embeddings = torch.randn(int(labels.max()) + 1, 8, generator=g)[labels] + 0.7 * torch.randn(n, 8, generator=g)
    data = {"embeddings": embeddings, "labels": labels, "indices": torch.arange(n), "paths": None,
            "checkpoint": {"path": str(tmp_path / "logs" / "glyphs" / "version_3" / "checkpoints" / "last.ckpt"),
                           "sha256": "0" * 64},
            "category": torch.arange(n) % 2, "category_names": ["even", "odd"]}
    path = tmp_path / "predictions.pt"
    torch.save(data, path)
    return path, data


def test_report_shows_every_metric_test_computes_and_names_the_run(tmp_path: Path, glyph_renderings, capsys):
    """``report --predictions P --config C`` shows what ``test`` computes with C's model settings (here the extra
    metrics mrr, ndcg@5, fnmr@fmr=0.1), overall and per category, equal to RetrievalMetrics; a rebuild from
    results.npz keeps them; the title names the run of the checkpoint. On main: only Recall@K, MAP@R, R-Precision,
    MAP, no category, and the title "Retrieval report: report"."""
    from lightning_dml.metrics import RetrievalMetrics
    from tests.test_cli import GLYPHS
    from tests.test_report import read_js

    predictions, data = _glyphs_predictions(tmp_path)
    extra = ["--model.metrics=[mrr, ndcg@5, fnmr@fmr=0.1]", "--model.clustering=false"]
    out = tmp_path / "report"
    report = report_main(["--out", str(out), "--predictions", str(predictions), "--config", str(GLYPHS),
                          "--queries", "5", *extra])
    m = RetrievalMetrics(recall_at=(1, 2, 4, 8), clustering=False, metrics=("mrr", "ndcg@5", "fnmr@fmr=0.1"),
                         category_names=["even", "odd"])
    m.update(data["embeddings"], data["labels"], indices=data["indices"], category=data["category"])
    expected = {k: float(v) for k, v in m.compute().items()}
    (summary,) = read_js(out / "data" / "summary.js")
    shown = dict(summary["metrics"])
    overall = {k: v for k, v in expected.items() if not k.startswith("category/")}
    assert {"mrr", "ndcg@5", "fnmr@fmr=0.1", "threshold@fmr=0.1"} <= set(overall)
    assert {k: shown[k] for k in overall} == overall
    categories = summary["categories"]
    for name, *values in categories["rows"]:
        assert dict(zip(categories["metrics"], values)) == {
            k.rsplit("/", 1)[1]: v for k, v in expected.items() if k.startswith(f"category/{name}/")}
    assert [row[0] for row in categories["rows"]] == ["even", "odd"] and "mrr" in categories["metrics"]
    assert summary["title"] == "glyphs/version_3: retrieval report"
    line = capsys.readouterr().out.splitlines()[-1]
    assert f"mrr {format_metric('mrr', overall['mrr'])}" in line and report.metrics["mrr"] == overall["mrr"]

    again = tmp_path / "again"
    report_main(["--out", str(again), "--results", str(out / "results.npz")])
    (rebuilt,) = read_js(again / "data" / "summary.js")
    assert rebuilt["metrics"] == summary["metrics"] and rebuilt["categories"] == categories
    assert rebuilt["title"] == "glyphs/version_3: retrieval report"


def test_report_page_title_and_figures_in_chromium(browser, tmp_path: Path):
    """In a real browser: the page's title (the tab's, and its heading) names the run, not the folder "report";
    every figure on the page follows the rule (the metrics, per category, threshold@fmr a score)."""
    from tests.test_report import make_items
    data = make_items(tmp_path / "images")
    n = data["labels"].shape[0]
    data.update(checkpoint={"path": str(tmp_path / "logs" / "shoes" / "checkpoints" / "last.ckpt"), "sha256": "0"},
                category=torch.arange(n) % 3, category_names=["a", "b", "c"])
    torch.save(data, tmp_path / "predictions.pt")
    out = tmp_path / "report"
    report_main(["--out", str(out), "--predictions", str(tmp_path / "predictions.pt"), "--queries", "3"])
    # a threshold (a score) shown beside the rates: a results file holding test's metrics
    results = RetrievalResults.load(out / "results.npz")
    results.extra["metrics"] = {**results.extra["metrics"], "fnmr@fmr=0.1": 0.25, "threshold@fmr=0.1": 0.61234}
    results.save(out / "results.npz")
    report_main(["--out", str(out), "--results", str(out / "results.npz"), "--queries", "3"])
    page = browser.new_page()
    page.goto((out / "index.html").as_uri())
    page.wait_for_selector("#metrics-values tr[data-metric]")
    assert page.title() == "shoes: retrieval report" and page.inner_text("#title") == page.title()
    shown = dict(page.evaluate("""() => Array.from(document.querySelectorAll('#metrics-values tr[data-metric]'))
        .map(tr => [tr.dataset.metric, tr.children[1].textContent])"""))
    metrics = results.extra["metrics"]
    assert shown["recall@1"] == format_metric("recall@1", metrics["recall@1"])
    assert shown["threshold@fmr=0.1"] == "0.6123" and shown["fnmr@fmr=0.1"] == "25.00"
    cells = page.evaluate("""() => Array.from(document.querySelectorAll('#category-values tr[data-category]'))
        .map(tr => [tr.dataset.category, tr.children[1].textContent])""")
    first = next(k for k in metrics if k.startswith("category/a/"))
    assert [c[0] for c in cells] == ["a", "b", "c"] and cells[0][1] == format_metric(first, metrics[first])
    header = page.evaluate("() => Array.from(document.querySelectorAll('#class-table th')).map(th => th.textContent)")
    assert any(h.startswith("map@r (%)") for h in header), header  # the metric's name, as everywhere
    per_class = {row["class"]: row for row in results.per_class()}
    first_row = page.evaluate("""() => Array.from(document.querySelectorAll('#class-table tr')).slice(1, 2)
        .map(tr => Array.from(tr.children).map(td => td.textContent))[0]""")
    assert first_row[4:6] == [format_metric("recall@1", per_class[int(first_row[0])]["recall@1"]),
                              format_metric("map@r", per_class[int(first_row[0])]["map@r"])]
    page.close()


def test_the_demo_table_prints_in_the_one_format():
    """``make demo``'s comparison table (``RetrievalComparison``) follows the rule: 0.7875 is ``78.75``, not 78.8."""
    from lightning_dml.callbacks import format_table
    from lightning_dml.metrics_format import format_metric

    table = format_table({"trained network": {"recall@1": 0.7875, "map@r": 0.41204}}, columns=("recall@1", "map@r"))
    row = table.splitlines()[1].split()
    assert row[-2:] == [format_metric("recall@1", 0.7875), format_metric("map@r", 0.41204)] == ["78.75", "41.20"]
