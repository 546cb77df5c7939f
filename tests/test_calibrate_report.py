"""The report's operating point and DET curve (issue 30 s.2): ``lightning-dml report --fmr F`` marks the exact
threshold at F on the pair-score histograms and on a DET curve (FNMR against FMR, log axes), checked against a
float64 brute force over every pair, and in headless Chromium (skipped without it)."""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_dml.cli import main
from tests.test_calibrate import brute_pairs
from tests.test_report import make_items, read_js
from tests.test_report_browser import browser  # noqa: F401 (fixture)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("calibrate_report")
    data = make_items(root / "images")
    data.pop("sequence")
    data["embeddings"][7] = data["embeddings"][3]  # a duplicate of another class's item: tied pair scores
    torch.save(data, root / "predictions.pt")
    main(["report", "--out", str(root / "report"), "--predictions", str(root / "predictions.pt"), "--bins", "20",
          "--fmr", "0.05", "--queries", "5"])
    (summary,) = read_js(root / "report" / "data" / "summary.js")
    return {"root": root, "data": data, "summary": summary}


def test_operating_point_and_det_curve_equal_brute_force(report):
    summary, data = report["summary"], report["data"]
    pos, neg = brute_pairs(data["embeddings"].numpy(), data["labels"].numpy(), "cosine")
    op = summary["operating_point"]
    theta = op["threshold"]
    allowed = math.floor(Fraction("0.05") * len(neg))
    assert op["target"] == "0.05" and (op["positives"], op["negatives"]) == (len(pos), len(neg))
    assert int((neg > theta + 1e-12).sum()) <= allowed < int((neg >= theta - 1e-12).sum())
    assert op["fmr"] == int((neg > theta + 1e-12).sum()) / len(neg) <= 0.05
    assert op["fnmr"] == int((pos <= theta + 1e-12).sum()) / len(pos)
    # the DET curve at each bin edge: the pairs whose bin is at or above the edge accepted
    h = summary["histogram"]
    low, width, bins = h["edges"][0], h["edges"][1] - h["edges"][0], len(h["positive"])

    def bin_of(s: np.ndarray) -> np.ndarray:
        return np.clip(np.floor((s - low) / width), 0, bins - 1)

    det = summary["det"]
    assert len(det) == bins + 1 and det[0] == [1.0, 0.0] and det[-1] == [0.0, 1.0]
    for i, (fmr, fnmr) in enumerate(det):
        assert fmr == (bin_of(neg) >= i).sum() / len(neg) and fnmr == (bin_of(pos) < i).sum() / len(pos), i


def test_fmr_option_errors_are_one_line(report, capsys):
    root = report["root"]
    for args, message in ((["--predictions", str(root / "predictions.pt"), "--fmr", "1"], "must be a number in"),
                          (["--results", str(root / "report" / "results.npz"), "--fmr", "0.1"], "--fmr needs the")):
        with pytest.raises(SystemExit):
            main(["report", "--out", str(root / "other"), *args])
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err


def test_det_and_operating_point_in_chromium(report, browser, tmp_path: Path):  # noqa: F811
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(f"{m.type}: {m.text}") if m.type in ("error", "warning") else None)
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.goto((report["root"] / "report" / "index.html").as_uri())
    page.wait_for_selector("#det svg")
    assert page.locator("#det polyline.curve").count() == 1 and page.locator("#det circle.opdot").count() == 1
    assert page.locator("#histogram line.op").count() == 1
    caption = page.locator("#histogram figcaption.muted").inner_text()
    assert f"threshold {report['summary']['operating_point']['threshold']}" in caption.replace("\n", " ")
    points = page.locator("#det polyline.curve").get_attribute("points").split()
    assert len(points) == sum(1 for f, n in report["summary"]["det"] if f > 0 and n > 0)
    assert problems == []
    page.locator("#metrics").screenshot(path=str(tmp_path / "det.png"))
    import os
    import shutil

    if os.environ.get("LIGHTNING_DML_DET_SCREENSHOT"):
        shutil.copy(tmp_path / "det.png", os.environ["LIGHTNING_DML_DET_SCREENSHOT"])
