"""A command line that starts at once (issue 27 s.5): ``--help``, a misspelt command and every command's help are
answered without importing torch (a command's help from the text shipped in ``lightning_dml/help_texts/``, which
must be what the command's parser prints), and ``search`` of an image imports neither Lightning's training stack
nor torchvision or ``torch._dynamo``. The import graph is measured (``sys.modules`` of a fresh interpreter,
``python -X importtime``), not the wall time."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_dml import entry

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "pytorch_lightning", "lightning_fabric", "jsonargparse", "wandb", "torchvision", "timm", "numpy")

# Runs lightning_dml.entry.main on each command line of argv[1] (JSON) in a fresh interpreter (with argv[3], the
# shipped help texts read from that folder); prints each exit code and output, and the top-level packages of HEAVY
# that were imported.
_PROBE = """
import contextlib, io, json, sys
from pathlib import Path
from lightning_dml import entry
from lightning_dml.entry import main
heavy = json.loads(sys.argv[2])
if len(sys.argv) > 3:
    entry.HELP_TEXTS = Path(sys.argv[3])
runs = []
for argv in json.loads(sys.argv[1]):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(argv)
            code = 0
        except SystemExit as done:
            code = done.code
    runs.append({"code": code, "out": out.getvalue(), "err": err.getvalue()})
imported = sorted({name.split(".")[0] for name in sys.modules} & set(heavy))
print(json.dumps({"runs": runs, "imported": imported}))
"""


def _probe(argvs: list[list[str]], cache: Path, heavy=HEAVY, help_texts: Path | None = None) -> dict:
    env = {**os.environ, "LIGHTNING_DML_CACHE": str(cache), "COLUMNS": "100"}
    extra = [] if help_texts is None else [str(help_texts)]
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argvs), json.dumps(heavy), *extra], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def test_help_and_a_misspelt_command_import_no_torch(tmp_path):
    result = _probe([["--help"], ["fitt", "--config", "x.yaml"], ["--offline", "serv"], []], tmp_path)
    assert result["imported"] == []
    help_run, fitt, serv, nothing = result["runs"]
    assert help_run["code"] == 0
    for name in entry.command_names():
        assert f"\n  {name} " in help_run["out"], name
    assert fitt["code"] == 2 and fitt["err"].count("\n") == 1
    assert "unknown command 'fitt' (did you mean fit?)" in fitt["err"]
    assert serv["code"] == 2 and "abbreviations are not accepted; did you mean serve?" in serv["err"]
    assert nothing["code"] == 2 and "usage: lightning-dml" in nothing["out"]


def test_every_commands_help_is_answered_without_torch_on_the_first_call(tmp_path):
    """A fresh install (an empty cache folder): ``<command> --help`` (and ``-h``) of every command prints the
    shipped text, whatever the terminal's width, importing none of HEAVY and writing nothing into the cache; the
    index subcommands' help needs no shipped text."""
    commands = entry.command_names()
    subcommands = [["index", name, "--help"] for name in ("build", "add", "evaluate", "status")]
    argvs = [[command, "--help"] for command in commands] + [["search", "-h"], *subcommands]
    result = _probe(argvs, tmp_path)
    assert result["imported"] == [], "a command's help imported " + ", ".join(result["imported"])
    for argv, run in zip(argvs, result["runs"]):
        assert run["code"] in (0, None) and run["out"].startswith("usage: lightning-dml"), (argv, run["err"][-500:])
        if len(argv) == 2:
            assert run["out"] == (entry.HELP_TEXTS / f"{argv[0]}.txt").read_text(encoding="utf-8"), argv
    assert not (tmp_path / "help").exists()


@pytest.mark.slow
def test_the_shipped_help_texts_are_what_the_parsers_print():
    """``tools/help_texts.py --check`` prints every command's help with its parser (at the shipped width) and fails
    when a shipped text differs, so that a changed option cannot ship stale help (rerun ``python
    tools/help_texts.py`` after changing one)."""
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "help_texts.py"), "--check"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def test_the_help_check_names_a_changed_or_missing_text(tmp_path):
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import help_texts
    finally:
        sys.path.remove(str(ROOT / "tools"))
    files = {"search.txt": "usage: lightning-dml search ...\n", "versions.json": "{}\n"}
    help_texts.write(tmp_path, files)
    (tmp_path / "gone.txt").write_text("usage: an old command\n")
    assert help_texts.out_of_date(tmp_path, files) == ["gone.txt"]
    (tmp_path / "search.txt").write_text("usage: lightning-dml search --old_option\n")
    assert help_texts.out_of_date(tmp_path, files) == ["search.txt", "gone.txt"]
    help_texts.write(tmp_path, files)
    assert help_texts.out_of_date(tmp_path, files) == [] and not (tmp_path / "gone.txt").exists()


def test_shipped_texts_of_other_versions_are_not_printed(tmp_path, monkeypatch):
    """Texts written with another Python, jsonargparse, Lightning or torch version (their options or layout may
    differ) are not printed: the command prints its help itself (and the cache keeps it)."""
    monkeypatch.setattr(entry, "HELP_TEXTS", tmp_path)
    (tmp_path / "search.txt").write_text("usage: lightning-dml search (shipped)\n")
    versions = entry.help_versions()
    (tmp_path / "versions.json").write_text(json.dumps(versions))
    assert entry.shipped_help("search") == "usage: lightning-dml search (shipped)\n"
    assert entry.shipped_help("fit") is None  # no text shipped
    assert entry.shipped_help("../search") is None  # not a command
    (tmp_path / "versions.json").write_text(json.dumps({**versions, "pytorch-lightning": "0.0.1"}))
    assert entry.shipped_help("search") is None
    (tmp_path / "versions.json").write_text("{not json")
    assert entry.shipped_help("search") is None


def test_without_a_valid_shipped_text_the_help_is_kept_in_the_cache(tmp_path, monkeypatch, capsys):
    """The fallback for other versions: the first ``search --help`` runs the command (here in this process) and
    keeps its help in the cache; a fresh interpreter then prints the same text without importing torch."""
    monkeypatch.setenv("LIGHTNING_DML_CACHE", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "100")
    monkeypatch.setattr(entry, "HELP_TEXTS", tmp_path / "none")
    with pytest.raises(SystemExit) as done:
        entry.main(["search", "--help"])
    assert done.value.code in (0, None)
    first = capsys.readouterr().out
    assert first.startswith("usage: lightning-dml search") and len(list((tmp_path / "help").iterdir())) == 1
    result = _probe([["search", "--help"]], tmp_path, help_texts=tmp_path / "none")
    assert result["imported"] == [], "a cached help imported " + ", ".join(result["imported"])
    assert result["runs"][0]["code"] == 0 and result["runs"][0]["out"] == first


def test_the_help_cache_key_follows_the_command_and_the_terminal_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    key = entry.help_cache_key(["fit", "--help"])
    assert key == entry.help_cache_key(["fit", "--help"])
    assert key != entry.help_cache_key(["test", "--help"])
    monkeypatch.setenv("COLUMNS", "140")  # argparse wraps the help to the terminal's width
    assert key != entry.help_cache_key(["fit", "--help"])


def test_a_failed_or_refused_help_is_not_kept(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LIGHTNING_DML_CACHE", str(tmp_path))
    monkeypatch.setenv("LIGHTNING_DML_HELP_CACHE", "0")
    monkeypatch.setattr(entry, "HELP_TEXTS", tmp_path / "none")  # no shipped text: the command prints its help
    with pytest.raises(SystemExit):
        entry.main(["search", "--help"])
    assert "--index" in capsys.readouterr().out
    assert not (tmp_path / "help").exists()


#: what ``search`` of an image must not import (seconds of start-up): Lightning's training stack, torchvision
#: (whose ops import torch._dynamo; the query transform is lightning_dml.data.pil_eval), torch._dynamo itself (torch's
#: meta-device ``normal_`` imports it: lightning_dml.export skips initialising meta tensors), the models of timm,
#: and the science and plotting packages other commands use
SEARCH_MUST_NOT_IMPORT = ("torchvision", "torch._dynamo", "timm", "pytorch_lightning", "lightning_fabric",
                          "jsonargparse", "wandb", "torchmetrics", "scipy", "sklearn", "matplotlib", "sympy", "pandas",
                          "pyarrow", "litserve", "optuna")


@pytest.fixture(scope="module")
def small_index(tmp_path_factory) -> Path:
    """A flat index folder of 2 class folders x 3 grey PNGs under a random-init SmallConvNet (width 8, 16-d), with
    its exported model, written without Lightning (``index build`` embeds the gallery through Lightning's predict
    loop, seconds here): the model exported in the safe format, the gallery embedded by the folder's own
    :class:`~lightning_dml.index.embed.ImageEmbedder`, the index saved with the model beside it."""
    pytest.importorskip("faiss")
    import dataclasses
    import shutil

    import numpy as np
    import torch
    from PIL import Image

    from lightning_dml.export import EmbeddingModel, export_embedding_model
    from lightning_dml.index import EmbeddingIndex
    from lightning_dml.index.embed import ImageEmbedder
    from lightning_dml.index.index import MODEL
    from lightning_dml.models import LinearEmbedding, SmallConvNet

    root = tmp_path_factory.mktemp("startup_index")
    torch.manual_seed(0)
    backbone = SmallConvNet(in_channels=1, width=8)
    model = EmbeddingModel(backbone, LinearEmbedding(backbone.out_features, 16)).eval()
    spec = backbone.input_spec
    preprocess = {"crop_size": 32, "resize_size": 36, "mode": "L"}
    exported = export_embedding_model(model, root / "export", torch.zeros(2, 1, 32, 32), formats=("safetensors",))
    rng = np.random.default_rng(0)
    paths, labels = [], []
    for c in range(2):
        (root / "gallery" / f"class{c}").mkdir(parents=True)
        for i in range(3):
            pixels = (rng.random((30, 34)) * 120 + 100 * c).astype("uint8")
            paths.append(root / "gallery" / f"class{c}" / f"{i}.png")
            labels.append(f"class{c}")
            Image.fromarray(pixels, "L").save(paths[-1])
    embeddings = ImageEmbedder(exported["safetensors"], spec, preprocess)(paths)
    manifest = {"input_spec": dataclasses.asdict(spec), "preprocess": preprocess, "model": MODEL}
    index = EmbeddingIndex.build(embeddings, {"paths": [str(p) for p in paths], "labels": labels}, manifest=manifest)
    index.save(root / "index", add_files=lambda staged: shutil.copy(exported["safetensors"], staged / MODEL))
    return root


def test_search_of_an_image_imports_only_what_it_needs(small_index):
    """``python -X importtime -m lightning_dml search`` of one gallery image: every module it imports is listed;
    none of :data:`SEARCH_MUST_NOT_IMPORT` is, and the answer is still right (the image itself first, score 1)."""
    query = small_index / "gallery" / "class1" / "2.png"
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "lightning_dml", "search", "--index",
                           str(small_index / "index"), "--k", "2", str(query)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert {"torch", "faiss", "lightning_dml.index.index", "lightning_dml.data.pil_eval"} <= imported
    unwanted = [bad for bad in SEARCH_MUST_NOT_IMPORT
                if any(name == bad or name.startswith(bad + ".") for name in imported)]
    assert unwanted == [], "search imported " + ", ".join(unwanted)
    (line,) = proc.stdout.splitlines()
    best = json.loads(line)["results"][0]
    assert best["path"] == str(query) and best["label"] == "class1" and abs(best["score"] - 1) < 1e-5
