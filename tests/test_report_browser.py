"""The report in a real browser (issue 22): headless Chromium (Debian's ``chromium``) driven by Playwright opens
``index.html`` from disk and checks the page: the query rows, the border colour of every hit and miss, every
thumbnail decoded, the pager and the sortable table, no console error; it saves a screenshot (into the test's
folder, and to ``$LIGHTNING_DML_REPORT_SCREENSHOT`` when set). Without a browser the test is skipped with the
reason (``.ci/run`` installs Chromium where it can)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_dml.data import TensorImageDataset
from lightning_dml.report import image_source, write_report
from lightning_dml.report.writer import IGNORED, IRRELEVANT, RELEVANT
from lightning_dml.retrieval import RetrievalResults
from tests.test_report import make_items, read_js

#: the border colours of report.css (--rel, --irr, --ign, --query) as the browser computes them
COLOURS = {RELEVANT: "rgb(22, 163, 74)", IRRELEVANT: "rgb(220, 38, 38)", IGNORED: "rgb(156, 163, 175)"}
QUERY = "rgb(31, 41, 55)"
CHROMIUM_FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """Headless Chromium (a fresh profile in a temporary folder), or a skip naming why there is none."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (the dev extra)")
    executable = (os.environ.get("LIGHTNING_DML_CHROMIUM") or shutil.which("chromium")
                  or shutil.which("chromium-browser"))
    if executable is None:
        pytest.skip("no chromium executable on PATH (Debian: apt-get install chromium; .ci/run does it as root)")
    manager = sync_api.sync_playwright().start()
    profile = tmp_path_factory.mktemp("chromium-profile")
    try:
        context = manager.chromium.launch_persistent_context(
            str(profile), executable_path=executable, headless=True, args=CHROMIUM_FLAGS,
            viewport={"width": 1280, "height": 900},
        )
    except Exception as error:  # noqa: BLE001 - any launch failure is the skip's reason
        manager.stop()
        pytest.skip(f"chromium ({executable}) did not start: {' '.join(str(error).split())[:300]}")
    yield context
    context.close()
    manager.stop()


def _report(tmp_path: Path, kind: str) -> tuple[Path, RetrievalResults]:
    data = make_items(tmp_path / "images")
    res = RetrievalResults.compute(data["embeddings"], data["labels"], sequence=data["sequence"], top_k=6,
                                   paths=data["paths"], pair_histogram_bins=20,
                                   class_names=[f"class {c}" for c in range(6)])
    if kind == "files":
        images = image_source(paths=data["paths"], indices=range(30))
    else:  # an in-memory dataset (as Glyphs): uint8 pixels, no file
        pixels = torch.stack([torch.from_numpy(np.array(Image.open(p))).permute(2, 0, 1) for p in data["paths"]])
        images = image_source(dataset=TensorImageDataset(pixels, data["labels"]))
    write_report(res, tmp_path / "report", images=images, queries=None, per_page=7, embeddings=data["embeddings"])
    return tmp_path / "report", res


@pytest.mark.parametrize("kind", ["files", "in-memory"])
def test_report_page_in_chromium(browser, tmp_path: Path, kind: str) -> None:
    folder, res = _report(tmp_path, kind)
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"console {m.type}: {m.text}")
            if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    page.goto((folder / "index.html").as_uri())
    page.wait_for_selector(".qrow")
    page.wait_for_function("Array.from(document.images).every(i => i.complete)")

    rows = page.locator("#query-rows .qrow")
    assert rows.count() == 7
    pages = [read_js(folder / "data" / f"queries-{n:05d}.js")[1] for n in range(5)]
    expected_rows = pages[0]["rows"]
    assert [int(rows.nth(i).get_attribute("data-query")) for i in range(7)] == [r["q"] for r in expected_rows]
    tiles = page.evaluate("""() => Array.from(document.querySelectorAll('#query-rows .qrow')).map(row =>
        Array.from(row.querySelectorAll('.tile')).map(t => [Number(t.dataset.index), t.dataset.flag ?? null,
            getComputedStyle(t).borderTopColor, t.title]))""")
    flags = set()
    for row, shown in zip(expected_rows, tiles):
        query, hits = shown[0], shown[1:]
        assert query[0] == row["q"] and query[2] == QUERY
        position = list(res.query).index(row["q"])
        ranked = [h for h in hits if h[1] != str(IGNORED)]
        assert [h[0] for h in ranked] == res.neighbors[position].tolist()  # the engine's top-k, in order
        for (index, flag, colour, title), rel in zip(ranked, res.relevant[position]):
            assert int(flag) == (RELEVANT if rel else IRRELEVANT) and colour == COLOURS[int(flag)], (row["q"], index)
            assert f"img_{index:03d}.png" in title or kind == "in-memory"
            assert f"class {index // 5}" in title
        for index, flag, colour, _ in hits:
            flags.add(int(flag))
            if int(flag) == IGNORED:
                assert colour == COLOURS[IGNORED] and index == row["q"] ^ 1  # its sequence's other item
    assert flags == {RELEVANT, IRRELEVANT, IGNORED}, flags

    images = page.evaluate("() => Array.from(document.images).map(i => [i.getAttribute('src'), i.naturalWidth])")
    assert len(images) > 7 * 7 and all(width > 0 for _, width in images), [i for i in images if i[1] <= 0]

    metrics = dict(page.evaluate("""() => Array.from(document.querySelectorAll('#metrics-values tr[data-metric]'))
        .map(tr => [tr.dataset.metric, tr.children[1].title])"""))  # the full value on hover
    assert float(metrics["recall@1"]) == res.recall_at(1) and float(metrics["map@r"]) == res.map_at_r()
    assert page.locator("#recall-curve circle").count() == len(read_js(folder / "data" / "summary.js")[0]["curve"])
    assert page.locator("#histogram rect.pos").count() > 0

    page.screenshot(path=str(tmp_path / "report.png"))
    target = os.environ.get("LIGHTNING_DML_REPORT_SCREENSHOT")
    if target and kind == "files":
        Path(target).parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=target)

    page.locator("#query-pager button", has_text="\u203a").click()  # the next page, loaded on demand
    page.wait_for_function("(row => row !== null && row.dataset.query == %d)(document.querySelector('#query-rows .qrow'))"
                           % pages[1]["rows"][0]["q"])  # "loading page 2" first, then the rows
    assert rows.count() == 7
    page.locator("#query-pager button", has_text="\u00bb").click()
    page.wait_for_function("document.querySelectorAll('#query-rows .qrow').length == 2")  # 30 = 4 x 7 + 2

    header = page.locator("#class-table th", has_text="recall@1")
    header.click()  # ascending on the first click (the worst classes first), descending on the second
    values = [float(v) for v in page.locator("#class-table tr td:nth-child(5)").all_text_contents()]
    assert values == sorted(values) and len(values) == 6
    header.click()
    values = [float(v) for v in page.locator("#class-table tr td:nth-child(5)").all_text_contents()]
    assert values == sorted(values, reverse=True)
    assert problems == []
    page.close()
