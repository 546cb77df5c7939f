"""``lightning-dml sweep`` (issue 15): search space and budget files, the pruning/divergence callback, and sweeps on
a small Glyphs subset through the real command: 2 trials, a killed worker's study resumed, two workers on one
journal study, a diverged trial recorded as failed, the best config accepted by ``fit --print_config``."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
import torch
import yaml

from lightning_dml.cli import build_cli, main
from lightning_dml.protocol import sweep
from lightning_dml.protocol.budget import Budget, ProtocolError, load_budget
from tests import glyph_cache
from tests.test_protocol_cv import tiny_fit_args
from tests.test_protocol_folds import glyph_subset, glyph_subset_file  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[1]
SPACE = {
    "model.optimizer.init_args.lr": {"low": 1.0e-4, "high": 1.0e-2, "log": True},
    "model.embedding_dim": {"choices": [8, 16]},
}


def _write(path: Path, data: dict) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


# ------------------------------------------------------------------------------------------- files
def test_space_file_is_checked(tmp_path):
    good = {**SPACE, "model.loss.init_args.beta": {"low": 10, "high": 80, "step": 10, "type": "int"}}
    assert sweep.load_space(_write(tmp_path / "s.yaml", good)) == good
    bad = [
        ({"k": [1, 2]}, "expected"),
        ({"k": {"choices": []}}, "non-empty"),
        ({"k": {"low": 1}}, "low, high"),
        ({"k": {"low": 2, "high": 1}}, "low < high"),
        ({"k": {"low": 0, "high": 1, "log": True}}, "low > 0"),
        ({"k": {"low": 1, "high": 2, "type": "str"}}, "type"),
        ({"k": {"low": 1, "high": 2, "lo": 3}}, r"unknown: \['lo'\]"),
    ]
    for space, match in bad:
        with pytest.raises(ProtocolError, match=match):
            sweep.load_space(_write(tmp_path / "s.yaml", space))


def test_budget_file_is_checked(tmp_path):
    assert load_budget(_write(tmp_path / "b.yaml", {"trials": 3, "steps": 5, "folds": 2})) == Budget(3, 5, 2, 1)
    for data, match in [({"folds": 1}, "folds must be an integer >= 2"), ({"trails": 3}, "unknown keys"),
                        ({"steps": 0}, "steps")]:
        with pytest.raises(ProtocolError, match=match):
            load_budget(_write(tmp_path / "b.yaml", data))


def test_suggest_and_overrides_follow_the_space():
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    space = {**SPACE, "model.loss.init_args.beta": {"low": 10, "high": 80, "step": 10, "type": "int"}}
    for _ in range(10):
        params = sweep.suggest(study.ask(), space)
        assert 1e-4 <= params["model.optimizer.init_args.lr"] <= 1e-2
        assert params["model.embedding_dim"] in (8, 16)
        assert params["model.loss.init_args.beta"] in range(10, 81, 10)
    assert sweep.override_args({"a.b": 0.5, "c": True, "d": "x"}) == ["--a.b=0.5", "--c=true", "--d=x"]


# ------------------------------------------------------------------------------------------- callback
def test_callback_reports_across_folds_prunes_and_stops_on_nan():
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.ThresholdPruner(lower=0.5))
    trial = study.ask()
    callback = sweep.TrialCallback(trial, step_offset=1 * 100, heartbeat_interval=0.0)  # fold 1 of 100-step fits
    trainer = SimpleNamespace(callback_metrics={"val/map@r": torch.tensor(0.75)}, global_step=40, sanity_checking=False)
    callback.on_validation_end(trainer, None)
    assert study.trials[0].intermediate_values == {140: 0.75}
    assert "heartbeat" in study.trials[0].user_attrs
    trainer.global_step, trainer.callback_metrics = 60, {"val/map@r": torch.tensor(0.25)}
    with pytest.raises(optuna.TrialPruned):
        callback.on_validation_end(trainer, None)
    callback.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, 0)
    with pytest.raises(sweep.DivergedError, match="nan"):
        callback.on_train_batch_end(trainer, None, {"loss": torch.tensor(float("nan"))}, None, 0)
    module = torch.nn.Linear(2, 2)
    callback.setup(trainer, module, "fit")
    module(torch.ones(1, 2))
    with pytest.raises(sweep.DivergedError, match="embeddings are non-finite"):
        module(torch.tensor([[float("inf"), 0.0]]))
    callback.teardown(trainer, module, "fit")
    module(torch.tensor([[float("inf"), 0.0]]))  # the hook is gone after the fit


# ------------------------------------------------------------------------------------------- command
def _sweep_args(tmp_path: Path, budget: dict, run_dir: Path, *extra: str) -> list[str]:
    return [
        "sweep", "--space", str(_write(tmp_path / "space.yaml", SPACE)),
        "--budget", str(_write(tmp_path / "budget.yaml", budget)), "--run_dir", str(run_dir), *extra,
        *tiny_fit_args(tmp_path / "logs"), "--trainer.logger=false", "--trainer.enable_checkpointing=false",
    ]


def _worker(args: list[str], glyphs: Path, log: Path) -> subprocess.Popen:
    """The real ``lightning-dml`` entry point in a fresh process, serving the Glyphs subset."""
    code = "from tests import glyph_cache; glyph_cache.install_from_env(); from lightning_dml.cli import main; main()"
    env = {**os.environ, glyph_cache.ENV: str(glyphs), "PYTHONPATH": str(ROOT)}
    handle = open(log, "w")
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, cwd=log.parent, stdout=handle,
                            stderr=subprocess.STDOUT)


def _trials(run_dir: Path, storage: str | None = None) -> list:
    url = storage or f"sqlite:///{run_dir / 'study.db'}"
    if storage and storage.endswith(".log"):
        url = optuna.storages.JournalStorage(optuna.storages.journal.JournalFileBackend(storage))
    return optuna.load_study(study_name="sweep", storage=url).get_trials()


@pytest.mark.slow
def test_two_trial_sweep_resume_and_best_config(glyph_subset, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "sweep"
    args = _sweep_args(tmp_path, {"trials": 2, "steps": 2, "folds": 2}, run_dir)
    main(args)
    trials = _trials(run_dir)
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    for t in trials:  # the objective is the mean validation MAP@R over the two folds
        assert len(t.user_attrs["fold_map@r"]) == 2
        assert t.value == pytest.approx(sum(t.user_attrs["fold_map@r"]) / 2)
        assert sorted(t.intermediate_values) == sorted({2 * 0 + 2, 2 * 1 + 2})  # step = fold * steps + global step
    summary = json.loads((run_dir / "sweep.json").read_text())
    assert summary["budget"] == {"trials": 2, "steps": 2, "folds": 2, "repeats": 1}
    best = max(trials, key=lambda t: t.value)
    assert summary["best"] == {"number": best.number, "value": best.value, "params": best.params}
    # the same command again continues the study: nothing left to run, same trials and best value
    main(args)
    again = json.loads((run_dir / "sweep.json").read_text())
    assert again["best"] == summary["best"] and len(_trials(run_dir)) == 2
    # a different budget is refused for this study
    with pytest.raises(SystemExit):
        main(_sweep_args(tmp_path, {"trials": 3, "steps": 2, "folds": 2}, run_dir))
    assert "one budget and space" in capsys.readouterr().err
    # the best config is complete: fit --print_config accepts it and shows the best parameters and the budget
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        build_cli(["fit", "--config", str(run_dir / "best.yaml"), "--print_config"])
    assert exit_info.value.code == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    best_lr = best.params["model.optimizer.init_args.lr"]
    assert printed["model"]["optimizer"]["init_args"]["lr"] == pytest.approx(best_lr)
    assert printed["model"]["embedding_dim"] == best.params["model.embedding_dim"]
    assert printed["trainer"]["max_steps"] == 2 and printed["data"]["init_args"]["num_folds"] is None


@pytest.mark.slow
def test_a_diverged_trial_fails_and_the_sweep_goes_on(glyph_subset, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "sweep"
    storage = f"sqlite:///{tmp_path / 'nan.db'}"
    study = optuna.create_study(study_name="sweep", storage=storage, direction="maximize")
    study.enqueue_trial({"model.optimizer.init_args.lr": 1e30, "model.embedding_dim": 8})  # SGD step overflows
    space = {**SPACE, "model.optimizer.init_args.lr": {"low": 1e-4, "high": 1e31, "log": True}}
    args = _sweep_args(tmp_path, {"trials": 2, "steps": 2, "folds": 2}, run_dir, "--storage", storage)
    args[2] = str(_write(tmp_path / "space.yaml", space))
    main([*args, "--model.optimizer=torch.optim.SGD"])
    trials = _trials(run_dir, storage)
    assert trials[0].state.name == "FAIL" and "diverged" in trials[0].user_attrs
    assert trials[1].state.name == "COMPLETE"  # the sweep went on, and the diverged trial counted
    assert len(trials) == 2


def _states_read_only(path: Path) -> list[str]:
    """Trial states of the SQLite study at ``path``, read without creating anything (optuna's storage would create
    its tables, racing the worker that is creating them)."""
    if not path.exists():
        return []
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as connection:
            return [row[0] for row in connection.execute("SELECT state FROM trials ORDER BY number")]
    except sqlite3.OperationalError:  # tables not created yet, or locked
        return []


@pytest.mark.slow
def test_killed_worker_study_resumes_and_two_workers_share_a_journal(tmp_path, tmp_path_factory):
    glyphs = glyph_subset_file(tmp_path_factory.getbasetemp())
    run_dir = tmp_path / "sweep"
    args = _sweep_args(tmp_path, {"trials": 2, "steps": 2, "folds": 2}, run_dir)
    worker = _worker(args, glyphs, tmp_path / "first.log")
    deadline = time.time() + 240
    while time.time() < deadline:  # kill it while trial 1 runs, after trial 0 completed
        states = _states_read_only(run_dir / "study.db")
        if states == ["COMPLETE", "RUNNING"]:
            break
        assert worker.poll() is None, (tmp_path / "first.log").read_text()
        time.sleep(0.5)
    worker.send_signal(signal.SIGKILL)
    worker.wait()
    # the same command again: the killed worker's RUNNING trial is marked FAIL (its process is gone), the study
    # goes on until 2 trials finished
    rerun = _worker(args, glyphs, tmp_path / "rerun.log")
    assert rerun.wait(timeout=300) == 0, (tmp_path / "rerun.log").read_text()
    trials = _trials(run_dir)
    assert [t.state.name for t in trials] == ["COMPLETE", "FAIL", "COMPLETE"]
    assert "diverged" not in trials[1].user_attrs
    assert trials[2].user_attrs["worker"] != trials[0].user_attrs["worker"]

    # two workers on one journal-file study run distinct trials
    journal = str(tmp_path / "shared" / "study.log")
    runs = [
        _worker(_sweep_args(tmp_path, {"trials": 2, "steps": 2, "folds": 2}, tmp_path / f"w{i}", "--storage", journal,
                            "--seed", str(i)), glyphs, tmp_path / f"w{i}.log")
        for i in range(2)
    ]
    for i, run in enumerate(runs):
        assert run.wait(timeout=300) == 0, (tmp_path / f"w{i}.log").read_text()
    trials = _trials(run_dir, journal)
    complete = [t for t in trials if t.state.name == "COMPLETE"]
    assert len(complete) >= 2 and len({t.number for t in trials}) == len(trials)
    assert len({t.user_attrs["worker"] for t in complete}) == 2  # both workers ran trials of the one study


def test_bad_sweep_invocations_are_one_message(tmp_path, capsys):
    budget = _write(tmp_path / "budget.yaml", {"trials": 2, "steps": 2, "folds": 2})
    space = _write(tmp_path / "space.yaml", SPACE)
    cases = [
        (["--space", str(tmp_path / "missing.yaml"), "--budget", str(budget), "--config", "c.yaml"], "missing.yaml"),
        (["--space", str(space), "--budget", str(budget)], "needs the fit's config"),
        (["--space", str(space), "--budget", str(budget), "--storage", "study.txt", "--config", "c.yaml",
          "--run_dir", str(tmp_path / "r")], "journal file ending in .log"),
    ]
    for args, match in cases:
        with pytest.raises(SystemExit) as exit_info:
            main(["sweep", *args])
        err = capsys.readouterr().err
        assert exit_info.value.code == 1 and err.startswith("lightning-dml: error:") and match in err, err
