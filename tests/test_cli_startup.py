"""A command line that starts at once (issue 27 s.5): ``--help``, a misspelt command and every command's help are
answered without importing torch, and ``search`` does not import Lightning's training stack. The import graph is
measured (``sys.modules`` of a fresh interpreter), not the wall time."""

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
TRAINING_STACK = ("pytorch_lightning", "lightning_fabric", "jsonargparse", "wandb", "torchmetrics", "timm")

# Runs lightning_dml.entry.main on each command line of argv[1] (JSON) in a fresh interpreter; prints each exit
# code and output, and the top-level packages of HEAVY that were imported.
_PROBE = """
import contextlib, io, json, sys
from lightning_dml.entry import main
heavy = json.loads(sys.argv[2])
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


def _probe(argvs: list[list[str]], cache: Path, heavy=HEAVY) -> dict:
    env = {**os.environ, "LIGHTNING_DML_CACHE": str(cache), "COLUMNS": "100"}
    proc = subprocess.run([sys.executable, "-c", _PROBE, json.dumps(argvs), json.dumps(heavy)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
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


@pytest.mark.filterwarnings("ignore:LightningCLI.s args parameter")
def test_every_commands_help_is_answered_without_torch_once_it_was_printed(tmp_path, monkeypatch, capsys):
    """The first ``<command> --help`` runs the command (here in this process) and keeps its help in the cache; a
    fresh interpreter then prints the same text without importing torch."""
    monkeypatch.setenv("LIGHTNING_DML_CACHE", str(tmp_path))
    monkeypatch.setenv("COLUMNS", "100")
    commands = ["fit", *entry.COMMANDS]
    first = {}
    for command in commands:
        with pytest.raises(SystemExit) as done:
            entry.main([command, "--help"])
        assert done.value.code in (0, None), command
        first[command] = capsys.readouterr().out
        assert f"lightning-dml {command}" in first[command] or "usage:" in first[command], command
    result = _probe([[command, "--help"] for command in commands], tmp_path)
    assert result["imported"] == [], "a cached help imported " + ", ".join(result["imported"])
    for command, run in zip(commands, result["runs"]):
        assert run["code"] == 0 and run["out"] == first[command], command


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
    with pytest.raises(SystemExit):
        entry.main(["search", "--help"])
    assert "--index" in capsys.readouterr().out
    assert not (tmp_path / "help").exists()


def test_search_imports_no_training_stack():
    """What ``lightning-dml search`` imports to read an index, embed the query images with the exported model and
    search: torch, faiss and torchvision, never Lightning, jsonargparse or W&B (seconds of start-up)."""
    modules = ["lightning_dml.entry", "lightning_dml.index.search", "lightning_dml.index.index",
               "lightning_dml.index.gallery", "lightning_dml.index.embed", "lightning_dml.index.cut",
               "lightning_dml.index.rerank"]
    code = f"import sys, importlib\nfor m in {modules!r}: importlib.import_module(m)\n" \
           f"print(sorted({{n.split('.')[0] for n in sys.modules}} & set({list(TRAINING_STACK)!r})))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout
