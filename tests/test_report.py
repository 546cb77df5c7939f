"""The retrieval report (issue 22): `lightning-dml report` from a predictions file, a results file or a checkpoint;
what the page's data hold (the metrics equal RetrievalMetrics', the rows and flags equal RetrievalResults'), the
thumbnails (written once, reused, in-memory images), and the command's user errors."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_dml.cli import COMMANDS, main
from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.report import ThumbnailWriter, image_source, write_report
from lightning_dml.report.command import main as report_main
from lightning_dml.report.writer import IGNORED, IRRELEVANT, RELEVANT
from lightning_dml.retrieval import RetrievalResults
from tests.test_cli_trust import glyph_renderings  # noqa: F401 - the cached Glyphs renderings (a fixture)

CLASSES, PER_CLASS = 6, 5


def make_items(folder: Path, seed: int = 0) -> dict:
    """30 items of 6 classes: a PNG file each (the class's colour, a white mark at the item's place), embeddings
    near their class's centre (noisy enough for misses), a sequence per pair of items; a predictions dict."""
    g = torch.Generator().manual_seed(seed)
    n = CLASSES * PER_CLASS
    labels = torch.arange(n) // PER_CLASS
    centres = torch.randn(CLASSES, 8, generator=g)
    embeddings = centres[labels] + 0.9 * torch.randn(n, 8, generator=g)
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        rng = np.random.default_rng(int(labels[i]))
        pixels = np.empty((40, 50, 3), dtype=np.uint8)
        pixels[...] = rng.integers(0, 200, 3)
        pixels[(i * 3) % 34 : (i * 3) % 34 + 6, 10:20] = 255
        path = folder / f"img_{i:03d}.png"
        Image.fromarray(pixels).save(path)
        paths.append(str(path))
    return {"embeddings": embeddings, "labels": labels, "indices": torch.arange(n), "paths": paths,
            "checkpoint": None, "sequence": torch.arange(n) // 2}


def read_js(path: Path) -> list:
    """The arguments of the one call a data file makes (``DMLReport.summary({...});``)."""
    text = path.read_text(encoding="utf-8").strip()
    match = re.fullmatch(r"DMLReport\.(summary|page)\((.*)\);", text, flags=re.S)
    assert match, text[:80]
    return json.loads("[" + match.group(2).replace("<\\/", "</") + "]")


@pytest.fixture
def predictions(tmp_path: Path) -> Path:
    data = make_items(tmp_path / "images")
    data.pop("sequence")
    path = tmp_path / "predictions.pt"
    torch.save(data, path)
    return path


def test_report_is_one_command_of_the_registry() -> None:
    assert COMMANDS["report"][0] == "lightning_dml.report.command"


def test_report_from_predictions_matches_the_metrics_and_the_results(predictions: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "report"
    main(["report", "--out", str(out), "--predictions", str(predictions), "--top_k", "4", "--per_page", "7",
          "--queries", "all", "--bins", "10"])
    assert "30 queries on 5 pages" in capsys.readouterr().out
    for name in ("index.html", "report.js", "report.css", "data/summary.js", "results.npz"):
        assert (out / name).is_file(), name
    html = (out / "index.html").read_text()
    assert "http" not in html.replace("http://www.w3.org", "")  # nothing fetched from elsewhere
    (summary,) = read_js(out / "data" / "summary.js")
    data = torch.load(predictions, weights_only=True)
    m = RetrievalMetrics(clustering=False, recall_at=(1, 2, 4, 8))
    m.update(data["embeddings"], data["labels"], indices=data["indices"])
    expected = m.compute()
    shown = dict(summary["metrics"])
    for name in ("recall@1", "recall@2", "recall@4", "recall@8", "map@r", "r_precision"):
        assert shown[name] == expected[name], name
    assert summary["pages"] == 5 and summary["counts"]["shown"] == 30
    assert sum(summary["histogram"]["positive"]) == 30 * (PER_CLASS - 1)
    assert sum(summary["histogram"]["negative"]) == 30 * 29 - 30 * (PER_CLASS - 1)
    assert [k for k, _ in summary["curve"]][:4] == [1, 2, 3, 4] and summary["curve"][-1] == [29, 1.0]
    res = RetrievalResults.load(out / "results.npz")
    worst = res.worst(30)
    rows = [row for n in range(5) for row in read_js(out / "data" / f"queries-{n:05d}.js")[1]["rows"]]
    assert [r["q"] for r in rows] == res.query[worst].tolist()
    for r, w in zip(rows, worst):
        assert [h[0] for h in r["hits"]] == res.neighbors[w].tolist()
        assert [h[2] for h in r["hits"]] == [RELEVANT if f else IRRELEVANT for f in res.relevant[w]]
        assert [h[3] for h in r["hits"]] == [1, 2, 3, 4]
    page = read_js(out / "data" / "queries-00000.js")[1]
    for index, (label, name, thumb) in page["items"].items():
        assert name == f"img_{int(index):03d}.png" and label == str(int(index) // PER_CLASS)
        with Image.open(out / thumb) as image:
            assert image.format == "WEBP" and max(image.size) == 50  # smaller than 96: its own size
    per_class = {row[0]: row for row in summary["per_class"]}
    assert sorted(per_class) == list(range(CLASSES)) and all(row[2] == PER_CLASS for row in per_class.values())


def test_thumbnails_are_written_once_and_follow_the_file(tmp_path: Path) -> None:
    data = make_items(tmp_path / "images")
    source = image_source(paths=data["paths"], indices=range(30))
    writer = ThumbnailWriter(tmp_path / "thumbs", size=24, fmt="jpeg")
    first = writer.write(source, range(30))
    assert (writer.written, writer.reused) == (30, 0)
    assert len({p.name for p in first.values()}) == 30  # one file per image (distinct contents)
    with Image.open(first[0]) as image:
        assert max(image.size) == 24 and image.format == "JPEG"
    again = writer.write(source, range(30))
    assert (writer.written, writer.reused) == (0, 30) and again == first
    Image.new("RGB", (10, 10), (1, 2, 3)).save(data["paths"][5])  # the file changes: a new thumbnail
    os.utime(data["paths"][5], ns=(1, 1))
    third = writer.write(source, range(30))
    assert (writer.written, writer.reused) == (1, 29) and third[5] != first[5]
    Path(data["paths"][7]).write_bytes(b"not an image")
    with pytest.warns(RuntimeWarning, match=r"1 image\(s\) could not be read.*img_007.png"):
        fourth = writer.write(source, range(30))
    assert fourth[7] is None and writer.failed[0][0] == 7


class _TensorDataset:
    """A dataset without files: float images in [-1, 1] from ``__getitem__`` (no ``images`` attribute)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.rand(n, 3, 12, 12, generator=g) * 2 - 1

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        return self.x[i], 0, i


def test_in_memory_images_and_sequences_shown_as_ignored(tmp_path: Path) -> None:
    data = make_items(tmp_path / "images")
    res = RetrievalResults.compute(data["embeddings"], data["labels"], sequence=data["sequence"], top_k=5)
    report = write_report(res, tmp_path / "r", images=image_source(dataset=_TensorDataset(30)),
                          embeddings=data["embeddings"], queries=None, per_page=100)
    assert report.thumbnails_written > 0 and not report.unreadable
    (page_no, page) = read_js(tmp_path / "r" / "data" / "queries-00000.js")
    grey = 0
    x = torch.nn.functional.normalize(data["embeddings"].double(), dim=1)
    for r in page["rows"]:
        q = r["q"]
        partner = q ^ 1  # the other item of its sequence: never ranked, shown grey where it would rank
        hits = {h[0]: h for h in r["hits"]}
        ranked = res.neighbors[list(res.query).index(q)]
        assert partner not in ranked
        score = float(x[q] @ x[partner])
        if score >= float(res.scores[list(res.query).index(q)][-1]):
            assert hits[partner][2] == IGNORED and hits[partner][3] is None
            assert hits[partner][1] == pytest.approx(score, abs=1e-12)
            grey += 1
        else:
            assert partner not in hits
    assert grey > 0
    for label, name, thumb in page["items"].values():
        assert name.startswith("item ") and thumb.endswith(".webp")
        with Image.open(tmp_path / "r" / thumb) as image:
            assert image.size == (12, 12) and image.mode == "RGB"


def test_report_from_results_file_rebuilds_without_the_model(predictions: Path, tmp_path: Path) -> None:
    first = report_main(["--out", str(tmp_path / "a"), "--predictions", str(predictions), "--queries", "10"])
    second = report_main(["--out", str(tmp_path / "b"), "--results", str(tmp_path / "a" / "results.npz"),
                          "--queries", "10"])
    assert first.metrics == second.metrics and second.queries == 10
    first_page = [read_js(tmp_path / name / "data" / "queries-00000.js") for name in ("a", "b")]
    assert first_page[0] == first_page[1]
    rerun = report_main(["--out", str(tmp_path / "a"), "--predictions", str(predictions), "--queries", "10"])
    assert rerun.thumbnails_written == 0 and rerun.thumbnails_reused == first.thumbnails_written > 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "give one source"),
        (["--predictions", "{tmp}/missing.pt"], "--predictions .*missing.pt: no such file"),
        (["--predictions", "{bad}"], "--predictions .*: not a predictions file"),
        (["--results", "{tmp}/none.npz"], "--results .*none.npz: no such file"),
        (["--results", "{bad}"], "--results .*bad.pt: not a results file"),
        (["--results", "{pred}"], "--results .*predictions.pt: not a results file"),
        (["--predictions", "{pred}", "--results", "{tmp}/x.npz"], "give one source.*--predictions, --results"),
        (["--ckpt_path", "{tmp}/m.ckpt"], "--ckpt_path needs the run's --config"),
        (["--predictions", "{pred}", "--queries", "many"], "--queries must be a number or 'all', got 'many'"),
        (["--predictions", "{pred}", "--model.x", "1"], "unknown arguments --model.x 1"),
        (["--predictions", "{pred}", "--out", "{bad}"], "--out .* is a file, not a folder"),
    ],
)
def test_user_errors_are_one_line(args: list[str], message: str, predictions: Path, tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"garbage")
    args = [a.format(tmp=tmp_path, bad=bad, pred=predictions) for a in args]
    if "--out" not in args:
        args = ["--out", str(tmp_path / "out"), *args]
    with pytest.raises(SystemExit) as exit_info:
        main(["report", *args])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("lightning-dml: error: ") and "\n" not in err and "Traceback" not in err
    assert re.search(message, err), err


@pytest.mark.slow
def test_report_of_a_glyphs_checkpoint_shows_the_in_memory_images(tmp_path: Path, glyph_renderings, capsys) -> None:
    """The command from --config and --ckpt_path: predict's own loop embeds the test split (DIR/predictions.pt),
    the Glyphs images (no files) become thumbnails and the labels their characters; then from the predictions
    file with the config for the images, every thumbnail reused."""
    from lightning_dml.cli import build_cli
    from tests.test_cli import FAST, GLYPHS

    quiet = ["--trainer.callbacks=[]", "--trainer.logger=false"]
    root = tmp_path / "run"
    build_cli(["fit", "--config", str(GLYPHS), *FAST, *quiet, "--trainer.enable_checkpointing=true",
               f"--trainer.default_root_dir={root}"])
    out = tmp_path / "report"
    predict_args = [a for a in FAST if not a.startswith("--trainer.")] + ["--trainer.enable_progress_bar=false"]
    main(["report", "--out", str(out), "--config", str(GLYPHS), "--ckpt_path", str(root / "checkpoints" / "last.ckpt"),
          "--queries", "20", *predict_args])
    assert (out / "predictions.pt").is_file() and (out / "index.html").is_file()
    first = read_js(out / "data" / "queries-00000.js")[1]
    labels = {item[0] for item in first["items"].values()}
    assert all(len(label) == 1 for label in labels)  # one character per class, not class ids
    assert all(item[1].startswith("item ") and (out / item[2]).is_file() for item in first["items"].values())
    data = torch.load(out / "predictions.pt", weights_only=True)
    m = RetrievalMetrics(clustering=False, recall_at=(1, 2, 4, 8))
    m.update(data["embeddings"], data["labels"], indices=data["indices"])
    (summary,) = read_js(out / "data" / "summary.js")
    assert dict(summary["metrics"])["recall@1"] == m.compute()["recall@1"]
    capsys.readouterr()
    again = main(["report", "--out", str(out), "--predictions", str(out / "predictions.pt"), "--config", str(GLYPHS),
                  "--queries", "20", *[a for a in predict_args if a.startswith("--data.")]])
    assert again is None  # cli.main returns nothing; the summary line says what was reused
    assert re.search(r", 0 thumbnails written, \d+ reused", capsys.readouterr().out)
    assert read_js(out / "data" / "queries-00000.js")[1] == first
