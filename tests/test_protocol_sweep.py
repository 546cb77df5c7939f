"""``lightning-dml sweep`` (issue 15): search space and budget files, the pruning/divergence callback, and sweeps on
a small Glyphs subset through the real command: 2 trials, a killed worker's study resumed, two workers on one
journal study, a diverged trial recorded as failed, the best config accepted by ``fit --print_config``."""

from __future__ import annotations

import json
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import warnings
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
from tests.test_protocol_cv import check_class_lists, tiny_fit_args, wandb_runs
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
class _TwoProcesses:
    """The strategy of one process of a 2-process DDP fit, as the callback sees it: ``peer_finite`` is whether the
    other process saw only finite values; ``root_prunes`` is global rank 0's pruning decision (``None``: this
    process is rank 0, its own decision goes out)."""

    def __init__(self, peer_finite: bool = True, root_prunes: bool | None = None) -> None:
        self.peer_finite, self.root_prunes = peer_finite, root_prunes

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        assert all
        return bool(decision) and self.peer_finite

    def broadcast(self, obj, src: int = 0):
        assert src == 0
        return obj if self.root_prunes is None else self.root_prunes


def _trainer(value: float, step: int, strategy: _TwoProcesses | None = None) -> SimpleNamespace:
    return SimpleNamespace(callback_metrics={"val/map@r": torch.tensor(value)}, global_step=step, sanity_checking=False,
                           should_stop=False, strategy=strategy or _TwoProcesses())


def test_callback_reports_across_folds_and_stops_a_pruned_or_diverged_fit():
    """Regression (DDP sweeps): the callback stops the fit (``should_stop``) instead of raising inside it, which
    left the fit's other processes waiting for the one that raised; the sweep raises after the fit."""
    study = optuna.create_study(direction="maximize", pruner=optuna.pruners.ThresholdPruner(lower=0.5))
    trial = study.ask()
    callback = sweep.TrialCallback(trial, step_offset=1 * 100, heartbeat_interval=0.0)  # fold 1 of 100-step fits
    trainer = _trainer(0.75, 40)
    callback.on_validation_end(trainer, None)
    assert study.trials[0].intermediate_values == {140: 0.75}
    assert "heartbeat" in study.trials[0].user_attrs
    assert not trainer.should_stop and callback.pruned is None
    trainer = _trainer(0.25, 60)
    callback.on_validation_end(trainer, None)  # below the threshold: pruned, the fit stops, nothing raised
    assert trainer.should_stop and callback.pruned == "pruned at step 160 (val/map@r 0.2500)"
    assert callback.diverged is None

    callback = sweep.TrialCallback(trial, heartbeat_interval=0.0)
    trainer = _trainer(0.75, 3)
    callback.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, 0)
    assert not trainer.should_stop
    callback.on_train_batch_end(trainer, None, {"loss": torch.tensor(float("nan"))}, None, 0)
    assert trainer.should_stop and callback.diverged == "training loss nan at step 3"

    callback = sweep.TrialCallback(trial, heartbeat_interval=0.0)
    module = torch.nn.Linear(2, 2)
    trainer = _trainer(0.75, 5)
    callback.setup(trainer, module, "fit")
    module(torch.ones(1, 2))
    callback.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, 0)
    assert not trainer.should_stop
    out = module(torch.tensor([[float("inf"), 0.0], [1.0, 0.0]]))
    assert torch.equal(out[0], torch.ones(2)) and torch.equal(out[1], module.weight[:, 0] + module.bias)
    # the non-finite row is replaced (finite, with a direction), so that the rest of the fit runs through
    callback.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, 0)
    assert trainer.should_stop and callback.diverged.startswith("the model's embeddings are non-finite")
    callback.teardown(trainer, module, "fit")
    assert not torch.isfinite(module(torch.tensor([[float("inf"), 0.0]]))).all()  # the hook is gone after the fit

    callback = sweep.TrialCallback(trial, heartbeat_interval=0.0)
    trainer = _trainer(float("nan"), 7)
    callback.on_validation_end(trainer, None)
    assert trainer.should_stop and callback.diverged == "val/map@r is nan at step 7"


def test_callback_in_the_other_processes_of_a_ddp_fit_follows_the_decisions():
    """A callback given on the fit's command line (``trial_number``) holds the sweep's trial in the sweep's
    process and none in the fit's other processes, which take rank 0's pruning and any process's divergence."""
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    sweep.RUNNING_TRIALS[trial.number] = trial
    try:
        assert sweep.TrialCallback(trial_number=trial.number).trial is trial
    finally:
        sweep.RUNNING_TRIALS.pop(trial.number)
    follower = sweep.TrialCallback(trial_number=trial.number)
    assert follower.trial is None and follower.trial_number == trial.number
    trainer = _trainer(0.75, 10, _TwoProcesses(root_prunes=False))
    follower.on_validation_end(trainer, None)
    follower.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, 0)
    assert not trainer.should_stop
    trainer = _trainer(0.5, 20, _TwoProcesses(root_prunes=True))
    follower.on_validation_end(trainer, None)
    assert trainer.should_stop and follower.pruned.startswith("pruned at step 20")
    assert study.trials[0].intermediate_values == {}  # only the sweep's process reports

    follower = sweep.TrialCallback(trial_number=trial.number)
    trainer = _trainer(0.75, 30, _TwoProcesses(peer_finite=False))
    follower.on_train_batch_end(trainer, None, {"loss": torch.tensor(1.0)}, None, 0)  # finite here, not there
    assert trainer.should_stop and follower.diverged == "non-finite values in another process at step 30"


def test_the_callback_goes_on_the_fits_command_line():
    argument = sweep.callback_argument(trial_number=3, step_offset=40, heartbeat_interval=5.0)
    prefix, _, spec = argument.partition("=")
    assert prefix == "--trainer.callbacks+"
    assert json.loads(spec) == {"class_path": "lightning_dml.protocol.sweep.TrialCallback",
                                "init_args": {"trial_number": 3, "step_offset": 40, "heartbeat_interval": 5.0}}


# ------------------------------------------------------------------------------------------- command
def _sweep_args(tmp_path: Path, budget: dict, run_dir: Path, *extra: str, wandb: Path | None = None) -> list[str]:
    """The sweep command on the Glyphs subset; no logger, or offline W&B runs in ``wandb``."""
    logger = tiny_fit_args(wandb, "wandb") if wandb else [*tiny_fit_args(tmp_path / "logs"), "--trainer.logger=false"]
    return [
        "sweep", "--space", str(_write(tmp_path / "space.yaml", SPACE)),
        "--budget", str(_write(tmp_path / "budget.yaml", budget)), "--run_dir", str(run_dir), *extra,
        *logger, "--trainer.enable_checkpointing=false",
    ]


def _worker(args: list[str], glyphs: Path, log: Path) -> subprocess.Popen:
    """The real ``lightning-dml`` entry point in a fresh process, serving the Glyphs subset."""
    code = "from tests import glyph_cache; glyph_cache.install_from_env(); from lightning_dml.cli import main; main()"
    # one thread, as the DDP tests' processes: two of these workers run at once, beside another pytest worker
    env = {**os.environ, glyph_cache.ENV: str(glyphs), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
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
    """Also (issue 19): every fit is a W&B run of its own (they all went into the first one), grouped by the study,
    named by trial and fold; every fit's folder holds its config and class lists."""
    monkeypatch.chdir(tmp_path)
    run_dir, save_dir = tmp_path / "sweep", tmp_path / "wb"
    args = _sweep_args(tmp_path, {"trials": 2, "steps": 2, "folds": 2}, run_dir, wandb=save_dir)
    main(args)
    trials = _trials(run_dir)
    assert [t.state.name for t in trials] == ["COMPLETE", "COMPLETE"]
    for t in trials:  # the objective is the mean validation MAP@R over the two folds
        assert len(t.user_attrs["fold_map@r"]) == 2
        assert t.value == pytest.approx(sum(t.user_attrs["fold_map@r"]) / 2)
        assert sorted(t.intermediate_values) == sorted({2 * 0 + 2, 2 * 1 + 2})  # step = fold * steps + global step
    runs = list(wandb_runs(save_dir).values())
    assert len(runs) == 4  # 2 trials x 2 folds
    group = f"sweep sweep {(run_dir / 'study.db').resolve()}".encode()
    for t in trials:
        folders = [run_dir / f"trial_{t.number}" / f"fold_{i}" for i in range(2)]
        for i, folder in enumerate(folders):
            (run,) = [r for r in runs if f"trial {t.number} fold {i}".encode() in r["record"]]
            assert group in run["record"] and f"trial {t.number}".encode() in run["record"]
            for config in (folder / "config.yaml", run["dir"] / "config.yaml"):
                data = yaml.safe_load(config.read_text())
                assert data["data"]["init_args"]["fold"] == i
                assert data["model"]["embedding_dim"] == t.params["model.embedding_dim"]
        check_class_lists(folders, 2)
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
    assert json.loads((run_dir / "sweep.json").read_text())["trials"][0]["fail_reason"].startswith("diverged: ")
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


def _has_worker(path: Path, number: int) -> bool:
    """Whether trial ``number`` of the SQLite study at ``path`` has its ``worker`` user attribute yet (optuna makes a
    trial RUNNING first and the sweep writes the attribute right after: a kill between the two leaves a trial only
    the heartbeat's grace period fails, so the test waits for the attribute; on a loaded machine the gap is wide)."""
    try:
        with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as connection:
            row = connection.execute(
                "SELECT COUNT(*) FROM trial_user_attributes a JOIN trials t ON a.trial_id = t.trial_id "
                "WHERE t.number = ? AND a.key = 'worker'", (number,)
            ).fetchone()
            return bool(row and row[0])
    except sqlite3.OperationalError:
        return False


@pytest.mark.slow
def test_killed_worker_study_resumes_and_two_workers_share_a_journal(tmp_path, tmp_path_factory):
    glyphs = glyph_subset_file(tmp_path_factory.getbasetemp())
    run_dir = tmp_path / "sweep"
    args = _sweep_args(tmp_path, {"trials": 2, "steps": 2, "folds": 2}, run_dir)
    worker = _worker(args, glyphs, tmp_path / "first.log")
    deadline = time.time() + 240
    while time.time() < deadline:  # kill it while trial 1 runs, after trial 0 completed
        states = _states_read_only(run_dir / "study.db")
        if states == ["COMPLETE", "RUNNING"] and _has_worker(run_dir / "study.db", 1):
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
    # the worker says so, and sweep.json gives the reason (issue 19)
    assert "trial 1 was left RUNNING, marked FAIL: its worker" in (tmp_path / "rerun.log").read_text()
    failed = json.loads((run_dir / "sweep.json").read_text())["trials"][1]
    assert failed["state"] == "FAIL" and failed["fail_reason"].startswith("left RUNNING by a dead worker: its worker")
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


def test_a_trial_left_by_a_dead_worker_is_failed_with_its_reason(tmp_path, capsys):
    """Regression: a worker that marked a killed worker's trial FAIL said nothing, and sweep.json had no reason."""
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    study = optuna.create_study(study_name="s", direction="maximize")
    dead, silent, alive = study.ask(), study.ask(), study.ask()
    dead.set_user_attr("worker", f"{socket.gethostname()}:{gone.pid}")
    silent.set_user_attr("worker", "elsewhere:1")
    silent.set_user_attr("heartbeat", time.time() - 1000)
    alive.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
    assert sweep.fail_stale_trials(study, grace_period=600) == [dead.number, silent.number]
    out = capsys.readouterr().out
    assert f"trial {dead.number} was left RUNNING, marked FAIL: its worker {socket.gethostname()}:{gone.pid} is gone" in out
    assert f"trial {silent.number} was left RUNNING, marked FAIL: no heartbeat from its worker elsewhere:1 for" in out
    result = sweep.summary(study, Budget(3, 2, 2), "memory")
    reasons = {t["number"]: t.get("fail_reason") for t in result["trials"]}
    assert reasons[dead.number].startswith("left RUNNING by a dead worker: its worker") and "is gone" in reasons[dead.number]
    assert "--grace_period 600 s" in reasons[silent.number]
    assert alive.number not in reasons or reasons[alive.number] is None
    assert [t.state.name for t in study.trials] == ["FAIL", "FAIL", "RUNNING"]


def test_building_a_config_from_the_protocol_does_not_warn_about_args(glyph_subset, tmp_path, monkeypatch):
    """Regression (issue 19): every fit and config of cv and sweep warned "LightningCLI's args parameter is intended
    to run from within Python ...": LightningCLI got ``args`` while ``sys.argv`` held the cv/sweep command. The fit's
    arguments are now the command line LightningCLI reads, restored afterwards."""
    argv = ["lightning-dml", "sweep", "--space", "space.yaml", "--budget", "budget.yaml"]
    monkeypatch.setattr("sys.argv", list(argv))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sweep.write_best_config(tiny_fit_args(tmp_path / "logs"), {"model.embedding_dim": 8}, Budget(2, 3, 2),
                                tmp_path / "best.yaml")
    assert not [str(w.message) for w in caught if "args parameter" in str(w.message)]
    best = yaml.safe_load((tmp_path / "best.yaml").read_text())
    assert best["model"]["embedding_dim"] == 8 and best["trainer"]["max_steps"] == 3
    assert sys.argv == argv


@pytest.mark.slow  # a tiny fit and two validations, about 8 s
def test_a_fit_is_validated_alone_at_its_last_step(glyph_subset, tmp_path, monkeypatch):
    """After a fit on several devices whose last steps no validation saw (``--validate_at_end false``), the sweep
    validates the model in its own process; the value is the fit trainer's own validation's (exact metrics), and it
    is reported at the fit's last step. (Under DDP, equal to every digit to the fit's own final validation: checked
    by hand, 2026-11-24, 2 processes, 2 folds.)"""
    monkeypatch.chdir(tmp_path)
    cli = build_cli(["fit", *tiny_fit_args(tmp_path / "logs"), "--trainer.logger=false", "--validate_at_end=false",
                     "--trainer.enable_checkpointing=false", f"--trainer.default_root_dir={tmp_path}"])
    study = optuna.create_study(direction="maximize")
    trial = study.ask()
    value = sweep.validate_alone(cli, sweep.TrialCallback(trial, step_offset=100))
    assert study.trials[0].intermediate_values == {100 + cli.trainer.global_step: value}
    cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    assert value == float(cli.trainer.callback_metrics["val/map@r"])


def test_sweep_under_an_external_launcher_is_refused(tmp_path, monkeypatch, capsys):
    """Under torchrun or srun with several tasks every process would run trials of its own: one clear error."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    budget = _write(tmp_path / "budget.yaml", {"trials": 2, "steps": 2, "folds": 2})
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--space", str(_write(tmp_path / "space.yaml", SPACE)), "--budget", str(budget),
              "--run_dir", str(tmp_path / "r"), "--config", "c.yaml"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 1 and "not under torchrun or srun" in err and "Traceback" not in err


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
