"""``lightning-dml cv`` and ``sweep`` with fits on two processes (DDP, gloo, CPU), through the command as the
console script runs it (issue 19).

Lightning's DDP launcher starts a fit's other processes by running the command line again; before the fix that was
the whole ``cv`` (or ``sweep``) command, which ran every fold (or trials of its own) in every process and failed at
the table. Now each fit's second process runs that ``fit`` alone, and the command's own work (test embeddings,
tables, the study, the files) happens once, in global rank 0.
"""

from __future__ import annotations

import csv
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
import torch
import yaml

from lightning_dml.protocol import cv
from tests import glyph_cache
from tests.test_protocol_cv import check_class_lists, tiny_fit_args
from tests.test_protocol_folds import glyph_subset_file

HERE = Path(__file__).resolve().parent
SCRIPT = HERE / "distributed" / "run_protocol_ddp.py"
#: two processes, with the strategy Lightning picks for them (DDP through its script launcher), and named
TWO_PROCESSES = ["--trainer.devices=2"]
DDP = [*TWO_PROCESSES, "--trainer.strategy=ddp"]
pytestmark = [pytest.mark.skipif(sys.platform == "win32", reason="gloo"), pytest.mark.slow]


def _run(args: list[str], cwd: Path, glyphs: Path, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", PYTHONWARNINGS="ignore",
               **{glyph_cache.ENV: str(glyphs)})
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK"):
        env.pop(key, None)
    # generous: each fit starts a second Python process; a loaded 2-core machine takes minutes
    return subprocess.run([sys.executable, *launcher, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=900)


def _processes(stdout: str) -> list[tuple[str, str]]:
    return re.findall(r"^PROTOCOL-PROCESS (\S+) LOCAL_RANK=(\S+)$", stdout, flags=re.M)


def test_cv_with_two_process_fits(tmp_path, tmp_path_factory):
    glyphs = glyph_subset_file(tmp_path_factory.getbasetemp())
    run_dir, logs = tmp_path / "cv", tmp_path / "logs"
    proc = _run(["cv", "--num_folds", "2", "--run_dir", str(run_dir), *tiny_fit_args(logs), *TWO_PROCESSES],
                tmp_path, glyphs)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-8000:]
    assert "Traceback" not in output, output[-8000:]
    # the cv command ran once; each fit's second process ran that fit alone
    assert _processes(proc.stdout) == [("cv", "None"), ("fit", "1"), ("fit", "1")], proc.stdout[-4000:]
    assert proc.stdout.count("| evaluation |") == 1  # the table, printed once
    folders = [cv.fold_dir(run_dir, 0, i) for i in range(2)]
    saved = [torch.load(folder / cv.EMBEDDINGS, weights_only=False) for folder in folders]
    for i, (folder, fold) in enumerate(zip(folders, saved)):
        assert fold["world_size"] == 2 and fold["checkpoint"].endswith(".ckpt")
        assert "val/map@r" in fold["val"] and fold["embeddings"].shape[1] == 16
        assert yaml.safe_load((folder / "config.yaml").read_text())["data"]["init_args"]["fold"] == i
    check_class_lists(folders, 2)
    expected = cv.evaluate_repeat(saved, (1, 2))
    with open(run_dir / "results.csv") as handle:
        rows = list(csv.DictReader(handle))
    got = {(r["evaluation"], r["metric"]): float(r["mean"]) for r in rows}
    for evaluation in ("separate", "concatenated"):
        assert got[(evaluation, "map@r")] == pytest.approx(expected[evaluation]["map@r"])
    # the table was logged once (CSVLogger: one metrics.csv holds it)
    logged = [p for p in logs.rglob("metrics.csv") if "cv/concatenated/map@r/mean" in p.read_text()]
    assert len(logged) == 1


def test_sweep_with_two_process_fits_and_a_diverged_trial(tmp_path, tmp_path_factory):
    """Trial 0 diverges (SGD with lr 1e30): the two processes of its fit stop together and the trial fails as
    diverged; trial 1 runs both folds. No process is left waiting, nothing runs twice."""
    glyphs = glyph_subset_file(tmp_path_factory.getbasetemp())
    run_dir, storage = tmp_path / "sweep", f"sqlite:///{tmp_path / 'study.db'}"
    study = optuna.create_study(study_name="sweep", storage=storage, direction="maximize")
    study.enqueue_trial({"model.optimizer.init_args.lr": 1e30, "model.embedding_dim": 8})
    study.enqueue_trial({"model.optimizer.init_args.lr": 1e-3, "model.embedding_dim": 8})
    space = tmp_path / "space.yaml"
    space.write_text(yaml.safe_dump({"model.optimizer.init_args.lr": {"low": 1e-4, "high": 1e31, "log": True},
                                     "model.embedding_dim": {"choices": [8, 16]}}))
    budget = tmp_path / "budget.yaml"
    budget.write_text(yaml.safe_dump({"trials": 2, "steps": 2, "folds": 2}))
    args = ["sweep", "--space", str(space), "--budget", str(budget), "--run_dir", str(run_dir), "--storage", storage,
            *tiny_fit_args(tmp_path / "logs"), "--trainer.logger=false", "--trainer.enable_checkpointing=false",
            "--model.optimizer=torch.optim.SGD", *DDP]
    proc = _run(args, tmp_path, glyphs)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-8000:]
    # the sweep ran once; each fit's second process ran that fit alone: trial 0 stopped in its first fold
    assert _processes(proc.stdout) == [("sweep", "None"), ("fit", "1"), ("fit", "1"), ("fit", "1")], proc.stdout
    assert proc.stdout.count("sweep sweep: 2 finished trials") == 1
    summary = json.loads((run_dir / "sweep.json").read_text())
    first, second = summary["trials"]
    assert first["state"] == "FAIL" and first["fail_reason"].startswith("diverged: ")
    assert second["state"] == "COMPLETE" and len(second["user_attrs"]["fold_map@r"]) == 2
    assert second["value"] == pytest.approx(sum(second["user_attrs"]["fold_map@r"]) / 2)
    assert summary["best"]["number"] == 1 and (run_dir / "best.yaml").exists()
    check_class_lists([run_dir / "trial_1" / f"fold_{i}" for i in range(2)], 2)
    reported = optuna.load_study(study_name="sweep", storage=storage).trials[1].intermediate_values
    assert sorted(reported) == [2, 4]  # step = fold * steps + global step, reported by rank 0 only


def test_cv_under_an_external_launcher(tmp_path, tmp_path_factory):
    """``torchrun`` (as ``srun`` with two tasks) starts the command in two processes: each runs every fit in
    lockstep, global rank 0 alone writes the files and the table."""
    glyphs = glyph_subset_file(tmp_path_factory.getbasetemp())
    run_dir = tmp_path / "cv"
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2")
    proc = _run(["cv", "--num_folds", "2", "--run_dir", str(run_dir), *tiny_fit_args(tmp_path / "logs"),
                 *TWO_PROCESSES], tmp_path, glyphs, launcher)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-8000:]
    assert "Traceback" not in output, output[-8000:]
    assert sorted(_processes(proc.stdout)) == [("cv", "0"), ("cv", "1")], proc.stdout[-4000:]
    assert proc.stdout.count("| evaluation |") == 1
    saved = [torch.load(cv.fold_dir(run_dir, 0, i) / cv.EMBEDDINGS, weights_only=False) for i in range(2)]
    assert [fold["world_size"] for fold in saved] == [2, 2]
    check_class_lists([cv.fold_dir(run_dir, 0, i) for i in range(2)], 2)
    with open(run_dir / "results.csv") as handle:
        got = {(r["evaluation"], r["metric"]): float(r["mean"]) for r in csv.DictReader(handle)}
    assert got[("concatenated", "map@r")] == pytest.approx(cv.evaluate_repeat(saved, (1, 2))["concatenated"]["map@r"])
