"""``lightning-dml index build|add|evaluate|status`` and ``lightning-dml search`` through ``lightning_dml.cli.main``
(issue 23's Contract) on a tiny fixture: the Glyphs config with a SmallConvNet of width 8 and a 16-d embedding, a
random-init checkpoint, and a gallery of 4 class folders x 5 grey PNGs."""

from __future__ import annotations

import csv
import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import yaml
from PIL import Image

from lightning_dml.checkpoints import checkpoint_record
from lightning_dml.cli import main
from lightning_dml.index import EmbeddingIndex

ROOT = Path(__file__).resolve().parents[1]
QUIET = ["--progress_bar", "false"]


def _write_gallery(folder: Path, classes: range, seed: int = 0, per_class: int = 5) -> None:
    rng = np.random.default_rng(seed)
    for c in classes:
        base = rng.integers(0, 255, (32, 32))
        for i in range(per_class):
            pixels = np.clip(base + rng.normal(0, 25, (32, 32)), 0, 255).astype(np.uint8)
            path = folder / f"class{c}" / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels, "L").save(path)


def _checkpoint(config: Path, path: Path, seed: int) -> Path:
    import warnings

    from lightning_dml.cli import build_cli

    torch.manual_seed(seed)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")  # sys.argv is pytest's
        cli = build_cli(["--config", str(config)], run=False)
    torch.save({"state_dict": cli.model.state_dict(), "pytorch-lightning_version": pl.__version__}, path)
    return path


@pytest.fixture(scope="module")
def fixture(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("index_cli")
    cfg = yaml.safe_load((ROOT / "configs" / "glyphs.yaml").read_text())
    cfg["trainer"] = {"logger": False, "enable_checkpointing": False, "accelerator": "cpu", "devices": 1}
    cfg["model"]["backbone"]["init_args"]["width"] = 8
    cfg["model"]["embedding_dim"] = 16
    cfg["model"]["clustering"] = False
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    _write_gallery(root / "gallery", range(4))
    out = {"root": root, "config": config, "gallery": root / "gallery",
           "ckpt": _checkpoint(config, root / "model.ckpt", 0), "other_ckpt": _checkpoint(config, root / "b.ckpt", 1)}
    code, _, err = _main_capture(["index", "build", "--config", str(config), "--ckpt_path", str(out["ckpt"]),
                                  "--gallery", str(out["gallery"]), "--kind", "flat", "--out", str(root / "flat"),
                                  *QUIET])
    assert code == 0, err[-3000:]
    out["flat"] = root / "flat"
    return out


def _main_capture(args: list[str]) -> tuple[int, str, str]:
    import contextlib
    import sys

    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
    sys.stdout.flush()
    return code, out.getvalue(), err.getvalue()


def _one_error(args: list[str]) -> str:
    code, _, err = _main_capture(args)
    lines = [line for line in err.splitlines() if line.startswith("lightning-dml: error: ")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_build_writes_the_folder_and_search_finds_each_gallery_image_first(fixture):
    index = EmbeddingIndex.load(fixture["flat"])
    manifest = index.manifest
    assert len(index) == 20 and index.kind == "flat" and index.dim == 16 and index.metric == "cosine"
    assert manifest.checkpoint == checkpoint_record(fixture["ckpt"])
    assert manifest.input_spec["color"] == "L" and manifest.preprocess == {"crop_size": 32, "resize_size": 32,
                                                                           "mode": "L"}
    assert (fixture["flat"] / "embedding_model.safetensors").is_file()
    # the exported model + preprocessing embed as the build's predict loop did
    torch.testing.assert_close(
        torch.nn.functional.normalize(index.embed_images(index.table.paths), dim=1), index.embeddings,
        atol=1e-5, rtol=0,
    )
    queries = [str(fixture["gallery"] / "class1" / "0.png"), str(fixture["gallery"] / "class3")]
    code, out, err = _main_capture(["search", "--index", str(fixture["flat"]), "--k", "3", *queries])
    assert code == 0, err
    lines = [json.loads(line) for line in out.splitlines()]
    assert len(lines) == 1 + 5
    assert lines[0]["query"] == queries[0]
    for line in lines:
        results = line["results"]
        assert len(results) == 3 and set(results[0]) == {"id", "path", "label", "score"}
        assert Path(results[0]["path"]) == Path(line["query"]).absolute()
        assert results[0]["score"] == pytest.approx(1.0, abs=1e-5)
        assert [r["score"] for r in results] == sorted((r["score"] for r in results), reverse=True)
    assert lines[0]["results"][0]["label"] == "class1"
    # CSV: one row per result, the same answer
    code, out, _ = _main_capture(["search", "--index", str(fixture["flat"]), "--k", "3", "--format", "csv",
                                  queries[0]])
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [int(r["id"]) for r in rows] == [r["id"] for r in lines[0]["results"]]
    assert [r["rank"] for r in rows] == ["1", "2", "3"]


def test_evaluate_reports_exact_and_index_in_one_table(fixture, tmp_path):
    code, out, err = _main_capture(["index", "evaluate", "--index", str(fixture["flat"]), "--k", "4"])
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split(" | ")[0].strip() == "ranking" and "map@r" in lines[0] and "neighbour_recall@4" in lines[0]
    exact = lines[2].split("|")
    flat = lines[3].split("|")
    assert exact[0].strip() == "exact" and flat[0].strip() == "index (flat)"
    assert [v.strip() for v in exact[1:-1]] == [v.strip() for v in flat[1:-1]] and flat[-1].strip() == "100.00"
    shutil.copytree(fixture["gallery"] / "class2", tmp_path / "queries" / "class2")  # labelled: class folders
    code, out, err = _main_capture(["index", "evaluate", "--index", str(fixture["flat"]), "--format", "json",
                                    "--queries", str(tmp_path / "queries")])
    assert code == 0, err
    result = json.loads(out)
    assert result["queries"] == 5 and result["rows"]["index (flat)"]["recall@1"] == 1.0


@pytest.mark.slow
def test_ivf_pq_build_and_evaluate(fixture, tmp_path):
    out = tmp_path / "pq"
    code, _, err = _main_capture(["index", "build", "--config", str(fixture["config"]), "--ckpt_path",
                                  str(fixture["ckpt"]), "--gallery", str(fixture["gallery"]), "--kind", "ivf_pq",
                                  "--nlist", "2", "--m", "4", "--nbits", "3", "--out", str(out), *QUIET])
    assert code == 0, err[-3000:]
    index = EmbeddingIndex.load(out)
    assert index.kind == "ivf_pq" and index.options == {"nlist": 2, "nprobe": 2, "m": 4, "nbits": 3}
    again = EmbeddingIndex.from_checkpoint(fixture["config"], fixture["ckpt"], fixture["gallery"], "ivf_pq",
                                           nlist=2, m=4, nbits=3, progress=False)  # the Python API, not saved
    torch.testing.assert_close(again.embeddings, index.embeddings)
    code, text, err = _main_capture(["index", "evaluate", "--index", str(out), "--format", "json"])
    assert code == 0, err
    assert set(json.loads(text)["rows"]) == {"exact", "index (ivf_pq)"}


@pytest.mark.slow
def test_a_csv_gallery_and_add_with_changed_files(fixture, tmp_path):
    gallery = tmp_path / "g"
    shutil.copytree(fixture["gallery"], gallery)
    table = tmp_path / "gallery.csv"
    table.write_text("path,label\n" + "".join(f"g/{p.parent.name}/{p.name},{p.parent.name}\n"
                                             for p in sorted(gallery.rglob("*.png"))))
    out = tmp_path / "idx"
    code, _, err = _main_capture(["index", "build", "--config", str(fixture["config"]), "--ckpt_path",
                                  str(fixture["ckpt"]), "--gallery", str(table), "--out", str(out), *QUIET])
    assert code == 0, err[-3000:]
    assert len(EmbeddingIndex.load(out)) == 20
    _write_gallery(gallery, range(4, 6), seed=5)  # two new classes
    Image.new("L", (32, 32), 7).save(gallery / "class0" / "0.png")  # a changed file
    code, text, _ = _main_capture(["index", "status", "--index", str(out)])
    assert "changed gallery files: 1" in text and "modified" in text
    code, text, err = _main_capture(["index", "add", "--index", str(out), "--gallery", str(gallery)])
    assert code == 0, err
    assert "10 added, 1 re-embedded (changed files), 19 unchanged" in text
    index = EmbeddingIndex.load(out)
    assert len(index) == 30 and index.changed_files() == [] and index.manifest.next_id == 31
    code, text, _ = _main_capture(["search", "--index", str(out), "--k", "1", str(gallery / "class5" / "2.png")])
    found = json.loads(text)["results"][0]
    assert found["label"] == "class5" and found["path"].endswith("class5/2.png")


def test_search_and_evaluate_pass_the_cut_and_rerank_options(fixture):
    query = str(fixture["gallery"] / "class0" / "1.png")
    code, out, err = _main_capture(["search", "--index", str(fixture["flat"]), "--k", "3", "--threshold", "1.5", query])
    assert code == 0, err
    assert json.loads(out) == {"query": query, "results": []}  # no cosine similarity reaches 1.5: no match
    code, out, err = _main_capture(["search", "--index", str(fixture["flat"]), "--k", "3", "--rerank",
                                    "kreciprocal:k1=3,k2=1,candidates=10", query])
    assert code == 0, err
    results = json.loads(out)["results"]
    assert len(results) == 3 and [r["score"] for r in results] == sorted((r["score"] for r in results), reverse=True)
    code, out, err = _main_capture(["index", "evaluate", "--index", str(fixture["flat"]), "--format", "json",
                                    "--rerank", "aqe:alpha=3,n=2"])
    assert code == 0, err
    assert set(json.loads(out)["rows"]) == {"exact", "index (flat)", "exact + aqe:alpha=3,n=2"}
    line = _one_error(["search", "--index", str(fixture["flat"]), "--k", "3", "--rerank", "magic", query])
    assert "unknown method 'magic'" in line


def test_user_errors_are_one_line(fixture, tmp_path):
    line = _one_error(["index", "build", "--config", str(fixture["config"]), "--ckpt_path", str(fixture["ckpt"]),
                       "--gallery", str(fixture["gallery"]), "--kind", "ivf", "--out", str(tmp_path / "x")])
    assert "unknown index kind 'ivf'" in line
    line = _one_error(["index", "build", "--config", str(fixture["config"]), "--ckpt_path", str(fixture["ckpt"]),
                       "--gallery", str(fixture["gallery"]), "--out", str(fixture["flat"])])
    assert "is an index" in line and "--overwrite" in line
    line = _one_error(["search", "--index", str(tmp_path), "--k", "2", str(fixture["gallery"])])
    assert "no manifest.json" in line
    line = _one_error(["search", "--index", str(fixture["flat"]), "--k", "2", str(tmp_path / "missing.png")])
    assert "missing.png does not exist" in line
    (tmp_path / "broken.png").write_bytes(b"not a png")
    line = _one_error(["search", "--index", str(fixture["flat"]), "--k", "2", str(tmp_path / "broken.png")])
    assert "broken.png cannot be read as an image" in line
    line = _one_error(["search", "--index", str(fixture["flat"]), "--k", "0", str(fixture["gallery"])])
    assert "--k 0 outside" in line


def test_queries_of_another_checkpoint_are_an_error_naming_both_digests(fixture, tmp_path):
    other = checkpoint_record(fixture["other_ckpt"])
    predictions = tmp_path / "predictions.pt"
    torch.save({"embeddings": torch.randn(4, 16), "labels": torch.tensor([0, 0, 1, 1]), "indices": torch.arange(4),
                "paths": None, "checkpoint": other, "class_names": ["class0", "class1"]}, predictions)
    line = _one_error(["index", "evaluate", "--index", str(fixture["flat"]), "--queries", str(predictions)])
    mine = checkpoint_record(fixture["ckpt"])["sha256"]
    assert other["sha256"] in line and mine in line
    torch.save({"embeddings": torch.randn(4, 8), "labels": torch.tensor([0, 0, 1, 1]), "indices": torch.arange(4),
                "paths": None, "checkpoint": None}, predictions)
    line = _one_error(["index", "evaluate", "--index", str(fixture["flat"]), "--queries", str(predictions)])
    assert "embedding size 8" in line and "size 16" in line


def test_a_config_of_another_width_is_one_error(fixture, tmp_path):
    cfg = yaml.safe_load(fixture["config"].read_text())
    cfg["model"]["embedding_dim"] = 32
    wide = tmp_path / "wide.yaml"
    wide.write_text(yaml.safe_dump(cfg))
    line = _one_error(["index", "build", "--config", str(wide), "--ckpt_path", str(fixture["ckpt"]),
                       "--gallery", str(fixture["gallery"]), "--out", str(tmp_path / "o"), *QUIET])
    assert "does not fit the model" in line and "head" in line


@pytest.mark.slow
def test_build_under_two_process_ddp_equals_one_process(fixture, tmp_path):
    """``--devices 2 --strategy ddp``: Lightning restarts the command in a second process, each embeds its share,
    rank 0 gathers and writes the folder, with the embeddings of the one-process build."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, "-m", "lightning_dml", "index", "build", "--config", str(fixture["config"]),
               "--ckpt_path", str(fixture["ckpt"]), "--gallery", str(fixture["gallery"]), "--out", str(tmp_path / "d"),
               "--accelerator", "cpu", "--devices", "2", "--strategy", "ddp", "--batch_size", "4", *QUIET]
    proc = subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("20 items indexed") == 1  # printed by rank 0 only
    ddp, single = EmbeddingIndex.load(tmp_path / "d"), EmbeddingIndex.load(fixture["flat"])
    assert ddp.table.paths == single.table.paths
    torch.testing.assert_close(ddp.embeddings, single.embeddings, atol=1e-6, rtol=0)


def _score_of_itself(index_dir: Path, image: Path) -> tuple[str, float]:
    code, text, err = _main_capture(["search", "--index", str(index_dir), "--k", "1", str(image)])
    assert code == 0, err[-3000:]
    found = json.loads(text)["results"][0]
    return found["path"], found["score"]


def test_a_build_overwrite_interrupted_after_its_export_leaves_the_old_index(fixture, tmp_path, monkeypatch):
    """Issue 26 s.2: Ctrl-C right after the export step of ``index build --overwrite`` (with another checkpoint)
    left the new model beside the old vectors: the index loaded and a gallery image's own score was 0.156, not 1.
    The new folder is written beside the old one and swapped in whole, so the old index is untouched."""
    import lightning_dml.index.build as B

    index_dir = tmp_path / "idx"
    shutil.copytree(fixture["flat"], index_dir)
    checkpoint = torch.load(fixture["ckpt"], weights_only=True)  # another model (the fixture's two are equal)
    torch.manual_seed(3)
    checkpoint["state_dict"] = {k: v + 0.3 * torch.randn_like(v) if v.is_floating_point() else v
                                for k, v in checkpoint["state_dict"].items()}
    other = tmp_path / "other.ckpt"
    torch.save(checkpoint, other)
    before = {p.name: p.read_bytes() for p in index_dir.iterdir()}
    image = fixture["gallery"] / "class2" / "3.png"
    assert _score_of_itself(index_dir, image) == (str(image), pytest.approx(1.0, abs=1e-5))
    real_export = B._export

    def export_then_ctrl_c(*args, **kwargs):
        real_export(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(B, "_export", export_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        main(["index", "build", "--config", str(fixture["config"]), "--ckpt_path", str(other),
              "--gallery", str(fixture["gallery"]), "--out", str(index_dir), "--overwrite", *QUIET])
    assert _score_of_itself(index_dir, image) == (str(image), pytest.approx(1.0, abs=1e-5))
    assert {p.name: p.read_bytes() for p in index_dir.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == [".idx.lock", "idx", "other.ckpt"]
    monkeypatch.setattr(B, "_export", real_export)
    code, _, err = _main_capture(["index", "build", "--config", str(fixture["config"]), "--ckpt_path", str(other),
                                  "--gallery", str(fixture["gallery"]), "--out", str(index_dir), "--overwrite",
                                  *QUIET])
    assert code == 0, err[-3000:]
    index = EmbeddingIndex.load(index_dir)
    assert index.manifest.checkpoint == checkpoint_record(other)
    assert not torch.allclose(index.embeddings, EmbeddingIndex.load(fixture["flat"]).embeddings, atol=1e-3)
    assert _score_of_itself(index_dir, image) == (str(image), pytest.approx(1.0, abs=1e-5))


def test_build_and_add_wait_for_the_lock_and_stop_naming_its_holder(fixture, tmp_path):
    """``index build --overwrite`` and ``index add`` of one folder exclude each other: while another process holds
    the folder's lock, each waits ``--lock_timeout`` seconds and stops with one line naming the holder."""
    import os
    import time

    from lightning_dml.index import folder as F

    index_dir = tmp_path / "idx"
    shutil.copytree(fixture["flat"], index_dir)
    ready, release = tmp_path / "ready", tmp_path / "release"
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child holds the lock until told to stop
        try:
            with F.locked(index_dir, what="the test's holder"):
                ready.touch()
                end = time.monotonic() + 60
                while not release.exists() and time.monotonic() < end:
                    time.sleep(0.02)
        finally:
            os._exit(0)
    try:
        while not ready.exists():
            time.sleep(0.02)
        for command in (["index", "add", "--index", str(index_dir), "--gallery", str(fixture["gallery"])],
                        ["index", "build", "--config", str(fixture["config"]), "--ckpt_path", str(fixture["ckpt"]),
                         "--gallery", str(fixture["gallery"]), "--out", str(index_dir), "--overwrite", *QUIET]):
            code, _, err = _main_capture([*command, "--lock_timeout", "0.2"])
            lines = err.splitlines()
            assert code == 1 and "Traceback" not in err and lines[-1].startswith("lightning-dml: error: "), err
            waiting = [line for line in lines if "waiting up to 0.2 s" in line]
            assert len(waiting) == 1 and f"is locked by pid {pid}" in waiting[0], err
            assert f"is locked by pid {pid}" in lines[-1] and "the test's holder" in lines[-1], err
            assert "--lock_timeout" in lines[-1]
    finally:
        release.touch()
        os.waitpid(pid, 0)
    code, text, err = _main_capture(["index", "add", "--index", str(index_dir), "--gallery", str(fixture["gallery"])])
    assert code == 0 and "0 added" in text, err[-3000:]
    line = _one_error(["index", "add", "--index", str(index_dir), "--gallery", str(fixture["gallery"]),
                       "--lock_timeout", "nan"])
    assert "--lock_timeout must be" in line


# A child process of the next test: ``lightning-dml ...`` whose ``index add`` waits, after loading the index and
# before embedding, until both adds got there (at most 3 s): without the folder's lock both loaded the same index.
_ADD_WITH_A_MEETING = """
import os, sys, time
from pathlib import Path
from lightning_dml.index.index import EmbeddingIndex
real = EmbeddingIndex.embed_images
def embed_images(self, images):
    meeting = Path(os.environ["MEETING"])
    (meeting / str(os.getpid())).touch()
    end = time.monotonic() + 3
    while len(list(meeting.iterdir())) < 2 and time.monotonic() < end:
        time.sleep(0.05)
    return real(self, images)
EmbeddingIndex.embed_images = embed_images
from lightning_dml.cli import main
main(sys.argv[1:])
"""


@pytest.mark.slow
def test_two_concurrent_index_adds_keep_every_item(fixture, tmp_path):
    """Issue 26 s.2: two concurrent ``index add`` runs of different images both reported "3 added", and the index
    ended with 18 items instead of 21 (both loaded the same index, the same new ids handed out twice). Two real
    processes: the end count is the sum, the ids are distinct, each run's images are found."""
    import os
    import subprocess
    import sys

    index_dir = tmp_path / "idx"
    shutil.copytree(fixture["flat"], index_dir)
    for name, seed in (("g1", 11), ("g2", 12)):
        _write_gallery(tmp_path / name, range(10 * seed, 10 * seed + 1), seed=seed, per_class=3)
    (tmp_path / "meeting").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MEETING": str(tmp_path / "meeting")}
    procs = [subprocess.Popen([sys.executable, "-c", _ADD_WITH_A_MEETING, "index", "add", "--index", str(index_dir),
                               "--gallery", str(tmp_path / name)], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for name in ("g1", "g2")]
    outputs = [p.communicate(timeout=300) for p in procs]
    for proc, (out, err) in zip(procs, outputs):
        assert proc.returncode == 0 and "3 added, 0 re-embedded (changed files), 0 unchanged" in out, err[-3000:]
    index = EmbeddingIndex.load(index_dir)
    assert len(index) == 26 and sorted(index.table.ids.tolist()) == list(range(26))
    images = sorted(str(p) for p in tmp_path.glob("g?/*/*.png"))
    scores, ids = index.search(index.embed_images(images), 1)
    assert [index.table.paths[r] for r in index.table.rows_of(ids[:, 0].numpy())] == images
    torch.testing.assert_close(scores[:, 0], torch.ones(6), atol=1e-5, rtol=0)
