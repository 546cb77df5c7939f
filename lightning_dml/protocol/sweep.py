"""``lightning-dml sweep``: hyper-parameter search over any config key by class-disjoint cross-validation.

The search of Musgrave, Belongie and Lim (ECCV 2020, section 4.2) with optuna: every trial samples the keys of
the search space (TPE sampler), fits the config on each of the budget's ``folds`` folds of the training classes
(``--data.init_args.num_folds``/``fold``, ``--trainer.max_steps`` the budget's ``steps``) and scores the trial by
the **mean validation MAP@R over the folds** (``val/map@r`` of the model at the end of each fit). The test classes
are never used.

* **Space** (``--space``, YAML; keys in the CLI's dotted form)::

      model.loss.init_args.beta: {low: 10, high: 80}                    # float, uniform
      model.optimizer.init_args.lr: {low: 1.0e-4, high: 1.0e-2, log: true}
      model.embedding_dim: {low: 32, high: 128, step: 32, type: int}
      model.loss.init_args.lam: {choices: [0.5, 1.0]}

* **Pruning**: :class:`TrialCallback` reports every validation to the trial (``trial.report``) and stops the fit
  when ``trial.should_prune()`` says so (a PRUNED trial). The reported step runs on across the folds: the
  validation after training step ``s`` of fold ``i`` (folds in order 0..k-1) is step ``i * steps + s``, so every
  trial's fold ``i`` reports at the same steps and the pruner compares like with like.
* **Divergence**: non-finite embeddings (checked on the model's output before the loss sees them), a non-finite
  training loss or a non-finite ``val/map@r`` end the trial as FAIL (user attribute ``diverged``, the reason); the
  sweep goes on and a diverged trial counts against the budget.
* **Several devices per fit** (``--trainer.devices N``): each fit runs in processes of its own
  (:mod:`lightning_dml.protocol.launch`), and the callback is on the fit's command line, so every process has it;
  the processes agree on pruning and divergence (global rank 0 decides pruning, any process's non-finite value
  counts) and stop the fit together (``trainer.should_stop``), never one process alone. The study, the
  tables and the files are this process's (global rank 0).
* **Storage** (``--storage``): default ``sqlite:///<run_dir>/study.db``; any database URL optuna supports
  (``postgresql://...`` for many nodes); a file path ending in ``.log`` or ``.journal``: optuna's journal file
  storage (a shared file system, e.g. SLURM array jobs).
* **Resume and many workers**: rerunning the same command continues the study until it holds ``trials`` finished
  trials (COMPLETE, PRUNED or diverged); several workers can run it on one study at once (give each its own
  ``--seed``; they may overshoot the budget by one trial each). A trial left RUNNING by a killed worker is marked
  FAIL (the study's user attribute ``stale_trial_<n>`` names the worker) by the next worker that starts: at once
  when that worker runs on the same host and the trial's process is gone, otherwise once the trial's heartbeat
  (written every ``--heartbeat_interval`` seconds during training) is older than ``--grace_period`` seconds. The
  worker prints each trial it marks so, and ``sweep.json`` gives the reason (``fail_reason``).
* **Output** (``<run_dir>``): ``best.yaml``, the complete config of the best trial (the fit arguments, the best
  parameters and ``trainer.max_steps``; accepted by ``lightning-dml fit`` and ``lightning-dml cv``), and
  ``sweep.json`` (budget, study, storage, best value and parameters, every trial's state, value and parameters,
  and why a failed trial failed). Each fit's folder ``<run_dir>/trial_<n>/fold_<i>`` holds its ``config.yaml``,
  ``classes.json`` (the fit's training, validation and test class ids) and its logs and checkpoints. With a W&B
  logger every fit is a run of its own: group ``sweep <study> <storage>`` (the same for every worker of the
  study), job type ``trial <n>``, name ``trial <n> fold <i>``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytorch_lightning as pl
import torch
import yaml

from lightning_dml.cli_parsing import CommandParser
from lightning_dml.metrics_format import format_metric
from lightning_dml.protocol.budget import Budget, ProtocolError, load_budget
from lightning_dml.protocol.launch import class_lists, finish_runs, fit_command, started_externally, wandb_group

try:
    import optuna
    from optuna.trial import TrialState
except ImportError:  # pragma: no cover - optuna is the `protocol` extra
    optuna = None

#: the metric the sweep maximises (mean over folds)
OBJECTIVE = "val/map@r"
#: the optuna trials this process runs, by number: where a :class:`TrialCallback` built from the fit's command line
#: finds its trial (in the other processes of a DDP fit there is none)
RUNNING_TRIALS: dict[int, Any] = {}


class DivergedError(RuntimeError):
    """The training loss became NaN or infinite."""


# ------------------------------------------------------------------------------------------- space
def load_space(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """The search space of a YAML file (see the module docstring), checked: ``{key: spec}``."""
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as error:
        raise ProtocolError(f"space file {path}: {error.strerror or error}") from None
    if not isinstance(data, dict) or not data:
        raise ProtocolError(f"space file {path}: expected a mapping of config keys to ranges or choices")
    for key, spec in data.items():
        where = f"space file {path}, key {key}"
        if not isinstance(spec, dict):
            raise ProtocolError(f"{where}: expected {{low, high[, log, step, type]}} or {{choices: [...]}}")
        if "choices" in spec:
            if set(spec) != {"choices"} or not isinstance(spec["choices"], list) or not spec["choices"]:
                raise ProtocolError(f"{where}: a categorical key has only 'choices', a non-empty list")
            continue
        unknown = sorted(set(spec) - {"low", "high", "log", "step", "type"})
        if unknown or not {"low", "high"} <= set(spec):
            raise ProtocolError(f"{where}: a range has low, high and optionally log, step, type (unknown: {unknown})")
        if spec.get("type", "float") not in ("float", "int"):
            raise ProtocolError(f"{where}: type is 'float' or 'int', got {spec['type']!r}")
        low, high = spec["low"], spec["high"]
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (low, high)) or not low < high:
            raise ProtocolError(f"{where}: need numbers low < high, got low={low!r}, high={high!r}")
        if spec.get("log") and low <= 0:
            raise ProtocolError(f"{where}: a log-scale range needs low > 0, got {low}")
        if spec.get("log") and spec.get("step") is not None:
            raise ProtocolError(f"{where}: log and step exclude each other")
    return data


def suggest(trial: Any, space: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One value per key of ``space`` from ``trial`` (``suggest_categorical``/``suggest_int``/``suggest_float``)."""
    params = {}
    for key, spec in space.items():
        if "choices" in spec:
            params[key] = trial.suggest_categorical(key, spec["choices"])
        elif spec.get("type") == "int":
            params[key] = trial.suggest_int(key, int(spec["low"]), int(spec["high"]), step=int(spec.get("step") or 1),
                                            log=bool(spec.get("log", False)))
        else:
            params[key] = trial.suggest_float(key, float(spec["low"]), float(spec["high"]), step=spec.get("step"),
                                              log=bool(spec.get("log", False)))
    return params


def override_args(params: dict[str, Any]) -> list[str]:
    """``--key=value`` command-line overrides (strings as they are, everything else as JSON)."""
    return [f"--{key}={value if isinstance(value, str) else json.dumps(value)}" for key, value in params.items()]


# ------------------------------------------------------------------------------------------- callback
class TrialCallback(pl.Callback):
    """Reports each validation's ``val/map@r`` to an optuna trial and stops the fit when the trial is pruned or
    diverged (non-finite embeddings, seen through a forward hook on the module, a non-finite training loss or a
    non-finite ``val/map@r``); keeps the trial's heartbeat.

    The fit is stopped, never interrupted by an exception: every process of a DDP fit takes the same decision at the
    same point (global rank 0 decides pruning, ``trainer.strategy.broadcast``; a non-finite value in any process
    counts, ``trainer.strategy.reduce_boolean_decision``) and sets ``trainer.should_stop``, so that no process is
    left waiting for the others. An embedding with a non-finite value is replaced by ones, so that the rest of the
    fit (a last validation) runs through; the trial fails anyway. After the fit, :attr:`pruned` or
    :attr:`diverged` says why it stopped (the sweep then raises ``optuna.TrialPruned`` or :class:`DivergedError`).

    Args:
        trial: the running ``optuna.Trial``; ``None``: the one the sweep registered in :data:`RUNNING_TRIALS` for
            ``trial_number`` in this process, and in the other processes of a DDP fit none (the callback then takes
            part in the decisions only).
        step_offset: added to the trainer's ``global_step`` for the reported step (``fold * steps``).
        heartbeat_interval: seconds between heartbeats (user attribute ``heartbeat``, a Unix time).
        trial_number: the trial's number, how the sweep gives the callback on a fit's command line.

    The checks read one flag per forward and per training step (a host synchronisation each, and under DDP one
    all-reduce per training step; only in sweeps).
    """

    def __init__(self, trial: Any = None, step_offset: int = 0, heartbeat_interval: float = 60.0,
                 trial_number: int | None = None) -> None:
        if trial is None and trial_number is not None:
            trial = RUNNING_TRIALS.get(int(trial_number))
        self.trial = trial
        self.trial_number = trial_number if trial is None else trial.number
        self.step_offset = int(step_offset)
        self.heartbeat_interval = float(heartbeat_interval)
        self.last_beat = time.time()
        self.last_reported: int | None = None
        self.pruned: str | None = None
        self.diverged: str | None = None
        self._nonfinite: str | None = None
        self._hook: Any = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._hook is None:
            self._hook = pl_module.register_forward_hook(self._check_embeddings)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _check_embeddings(self, module: torch.nn.Module, inputs: Any, output: Any) -> Any:
        if isinstance(output, torch.Tensor):
            finite = torch.isfinite(output.detach())
            if not bool(finite.all()):
                if self._nonfinite is None:
                    self._nonfinite = f"the model's embeddings are non-finite ({type(module).__name__} output)"
                # a row with a non-finite value becomes all ones (finite, with a direction for the cosine metric)
                rows = finite.reshape(len(output), -1).all(dim=1).reshape(-1, *([1] * (output.dim() - 1)))
                return torch.where(rows, output, torch.ones((), dtype=output.dtype, device=output.device))
        return None

    def _agree_finite(self, trainer: pl.Trainer, step: int) -> None:
        """Every process: stop the fit when any process saw a non-finite value."""
        if trainer.strategy.reduce_boolean_decision(self._nonfinite is None, all=True):
            return
        self.diverged = self.diverged or self._nonfinite or f"non-finite values in another process at step {step}"
        trainer.should_stop = True

    def beat(self, force: bool = False) -> None:
        now = time.time()
        if self.trial is not None and (force or now - self.last_beat >= self.heartbeat_interval):
            self.trial.set_user_attr("heartbeat", now)
            self.last_beat = now

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if isinstance(loss, torch.Tensor) and not bool(torch.isfinite(loss.detach()).all()) and self._nonfinite is None:
            self._nonfinite = f"training loss {float(loss)} at step {trainer.global_step}"
        self._agree_finite(trainer, trainer.global_step)
        self.beat()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.beat()
        step = self.step_offset + trainer.global_step
        self._agree_finite(trainer, trainer.global_step)
        value = trainer.callback_metrics.get(OBJECTIVE)  # the same in every process (synchronised metric)
        if trainer.sanity_checking or value is None or step == self.last_reported or self.diverged or self.pruned:
            return
        self.last_reported = step
        if not math.isfinite(float(value)):
            self.diverged = f"{OBJECTIVE} is {float(value)} at step {step}"
            trainer.should_stop = True
            return
        prune = False
        if self.trial is not None:
            self.trial.report(float(value), step)
            prune = self.trial.should_prune()
        if trainer.strategy.broadcast(prune, src=0) and not self.pruned:
            self.pruned = f"pruned at step {step} ({OBJECTIVE} {float(value):.4f})"
            trainer.should_stop = True


# ------------------------------------------------------------------------------------------- trials
def callback_argument(trial_number: int, step_offset: int, heartbeat_interval: float) -> str:
    """The ``--trainer.callbacks+=`` argument that gives a fit its :class:`TrialCallback`."""
    spec = {"class_path": f"{TrialCallback.__module__}.{TrialCallback.__qualname__}",
            "init_args": {"trial_number": trial_number, "step_offset": step_offset,
                          "heartbeat_interval": heartbeat_interval}}
    return f"--trainer.callbacks+={json.dumps(spec)}"


def validate_alone(cli: Any, callback: TrialCallback) -> float:
    """Validate the fitted model of ``cli`` once more in this process alone (after a fit on several devices, whose
    other processes have ended), on the fit's first device and with its precision; ``callback`` reports it at the
    fit's last step. Returns the new ``val/map@r``."""
    device = cli.trainer.strategy.root_device
    callback.step_offset += cli.trainer.global_step  # the new trainer counts no step: report at the fit's last one
    trainer = pl.Trainer(
        accelerator=device.type, devices=[device.index or 0] if device.type == "cuda" else 1,
        precision=cli.trainer.precision, limit_val_batches=cli.trainer.limit_val_batches, logger=False,
        callbacks=[callback], enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, use_distributed_sampler=False,
    )
    trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
    return float(trainer.callback_metrics[OBJECTIVE])


def fit_fold(fit_args: Sequence[str], budget: Budget, fold: int, root: Path, trial_number: int,
             heartbeat_interval: float = 60.0, wandb: dict[str, str] | None = None) -> float:
    """Fit one fold of trial ``trial_number`` through :func:`~lightning_dml.cli.build_cli` with its
    :class:`TrialCallback` (:func:`~lightning_dml.protocol.launch.fit_command`: the fit's processes its own, one W&B
    run) and return the final ``val/map@r`` (validated once more when the fit did not end with a validation).
    Raises ``optuna.TrialPruned`` or :class:`DivergedError` when the callback stopped the fit."""
    from lightning_dml.cli import build_cli

    step_offset = fold * budget.steps
    args = ["fit", *fit_args, f"--data.init_args.num_folds={budget.folds}", f"--data.init_args.fold={fold}",
            f"--trainer.max_steps={budget.steps}", f"--trainer.default_root_dir={root}",
            callback_argument(trial_number, step_offset, heartbeat_interval)]
    with fit_command(args, wandb):
        cli = build_cli()
    trainer = cli.trainer
    failed = True
    try:
        if trainer.is_global_zero:
            path = Path(root) / "classes.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(class_lists(cli.datamodule), indent=2))
        callback = next(cb for cb in trainer.callbacks
                        if isinstance(cb, TrialCallback) and cb.trial_number == trial_number)
        stale = callback.last_reported != step_offset + trainer.global_step
        value = None
        if callback.diverged is None and callback.pruned is None and stale:
            # the fit's last steps were not validated (`--validate_at_end false`, or a stopped fit)
            if trainer.world_size > 1:
                value = validate_alone(cli, callback)
            else:
                trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False)
        if callback.diverged is not None:
            raise DivergedError(callback.diverged)
        if callback.pruned is not None:
            raise optuna.TrialPruned(callback.pruned)
        value = float(trainer.callback_metrics[OBJECTIVE] if value is None else value)
        if not math.isfinite(value):
            raise DivergedError(f"{OBJECTIVE} is {value}")
        failed = False
        return value
    finally:
        finish_runs(trainer, exit_code=int(failed))


def make_objective(
    fit_args: Sequence[str], space: dict[str, dict[str, Any]], budget: Budget, run_dir: Path, heartbeat_interval: float,
    group: str | None = None,
) -> Callable[[Any], float]:
    """The optuna objective: sample the space, fit every fold, return the mean final ``val/map@r``. With a W&B
    logger each fit is a run of ``group``, job type ``trial <n>``, name ``trial <n> fold <i>``."""
    def objective(trial: Any) -> float:
        trial.set_user_attr("worker", f"{socket.gethostname()}:{os.getpid()}")
        params = suggest(trial, space)
        values = []
        RUNNING_TRIALS[trial.number] = trial
        try:
            for fold in range(budget.folds):
                trial.set_user_attr("heartbeat", time.time())
                root = run_dir / f"trial_{trial.number}" / f"fold_{fold}"
                wandb = {"job_type": f"trial {trial.number}", "name": f"trial {trial.number} fold {fold}"}
                if group:
                    wandb["group"] = group
                values.append(fit_fold([*fit_args, *override_args(params)], budget, fold, root, trial.number,
                                       heartbeat_interval, wandb))
                trial.set_user_attr("fold_map@r", values)
        except DivergedError as error:
            trial.set_user_attr("diverged", str(error))
            raise
        finally:
            RUNNING_TRIALS.pop(trial.number, None)
        return sum(values) / len(values)

    return objective


def fail_stale_trials(study: Any, grace_period: float) -> list[int]:
    """Mark FAIL the RUNNING trials of dead workers: on this host, a trial whose process is gone; anywhere, a trial
    whose heartbeat is older than ``grace_period`` seconds. Each is printed, and the study's user attribute
    ``stale_trial_<n>`` gives the reason (naming the worker). Returns their numbers."""
    host, now, failed = socket.gethostname(), time.time(), []
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        worker = str(trial.user_attrs.get("worker", "")) or "unknown"
        beat = trial.user_attrs.get("heartbeat", trial.datetime_start.timestamp() if trial.datetime_start else now)
        worker_host, _, pid = worker.rpartition(":")
        dead = worker_host == host and pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid))
        age = now - float(beat)
        if dead or age > grace_period:
            reason = (f"its worker {worker} is gone (no such process on this host)" if dead else
                      f"no heartbeat from its worker {worker} for {age:.0f} s (--grace_period {grace_period:g} s)")
            study.set_user_attr(f"stale_trial_{trial.number}", reason)
            study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)  # another worker may be first
            print(f"sweep {study.study_name}: trial {trial.number} was left RUNNING, marked FAIL: {reason}", flush=True)
            failed.append(trial.number)
    return failed


def fail_reason(study: Any, trial: Any) -> str | None:
    """Why a FAIL trial failed: diverged (the trial's ``diverged``), left by a dead worker (the study's
    ``stale_trial_<n>``), or ``None`` when nothing was recorded."""
    if trial.state != TrialState.FAIL:
        return None
    if "diverged" in trial.user_attrs:
        return f"diverged: {trial.user_attrs['diverged']}"
    stale = study.user_attrs.get(f"stale_trial_{trial.number}")
    return None if stale is None else f"left RUNNING by a dead worker: {stale}"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def finished_trials(study: Any) -> int:
    """Trials that count against the budget: COMPLETE, PRUNED, and FAIL by divergence."""
    return sum(
        t.state in (TrialState.COMPLETE, TrialState.PRUNED)
        or (t.state == TrialState.FAIL and "diverged" in t.user_attrs)
        for t in study.get_trials(deepcopy=False)
    )


def open_storage(storage: str | None, run_dir: Path) -> Any:
    """An optuna storage: ``None`` -> SQLite ``<run_dir>/study.db``; a URL -> as optuna reads it; a path ending in
    ``.log``/``.journal`` -> journal file storage."""
    if storage is None:
        run_dir.mkdir(parents=True, exist_ok=True)
        return f"sqlite:///{(run_dir / 'study.db').resolve()}"
    if "://" in storage:
        return storage
    if storage.endswith((".log", ".journal")):
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        Path(storage).parent.mkdir(parents=True, exist_ok=True)
        return JournalStorage(JournalFileBackend(storage))
    raise ProtocolError(f"--storage {storage!r}: give a database URL (sqlite:///..., postgresql://...) or a journal "
                        "file ending in .log or .journal")


def _create_study(name: str, storage: Any, attempts: int = 5) -> Any:
    """Create or load the study. Workers that start together on a new SQLite file race to create its tables (one
    of them fails with "table ... already exists"): such a worker tries again."""
    for attempt in range(attempts - 1):
        try:
            return optuna.create_study(study_name=name, storage=storage, direction="maximize", load_if_exists=True)
        except Exception as error:  # sqlalchemy's OperationalError (sqlalchemy is optuna's dependency, not ours)
            if "already exists" not in str(error):
                raise
            time.sleep(0.5 * (attempt + 1))
    return optuna.create_study(study_name=name, storage=storage, direction="maximize", load_if_exists=True)


def write_best_config(fit_args: Sequence[str], params: dict[str, Any], budget: Budget, path: Path) -> None:
    """The complete config (every key, as ``fit --print_config`` shows it) of ``fit_args`` with ``params`` and the
    budget's ``trainer.max_steps``, without folds: the config to train or cross-validate the winner."""
    from lightning_dml.cli import build_cli

    with fit_command([*fit_args, *override_args(params), f"--trainer.max_steps={budget.steps}"]):
        cli = build_cli(run=False)
    path.write_text(cli.parser.dump(cli.config, skip_none=False))


def storage_label(storage: str | None, run_dir: Path) -> str:
    """Where the study of ``--storage`` lives, for the W&B group (the same for every worker of the study): a file's
    absolute path (the default SQLite file, a journal file, a ``sqlite:///`` URL), or a database URL without user
    and password."""
    if storage is None:
        return str((run_dir / "study.db").resolve())
    if "://" not in storage:
        return str(Path(storage).resolve())
    parts = urlsplit(storage)
    if parts.scheme == "sqlite":
        return str(Path(parts.path[1:]).resolve())  # sqlite:///relative, sqlite:////absolute
    return f"{parts.scheme}://{parts.hostname or ''}{f':{parts.port}' if parts.port else ''}{parts.path}"


# ------------------------------------------------------------------------------------------- command
def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="lightning-dml sweep",
        allow_abbrev=False,
        description=(
            "Hyper-parameter search (optuna, TPE) over the keys of --space by class-disjoint cross-validation: a "
            "trial's value is the mean validation MAP@R over the budget's folds. The study lives in --storage and "
            "resumes when the command is run again; several workers can share it. Writes <run_dir>/best.yaml and "
            "<run_dir>/sweep.json. Every other argument (--config ..., overrides) goes to `lightning-dml fit`."
        ),
    )
    parser.add_argument("--space", type=Path, required=True, help="search space YAML (dotted config keys)")
    parser.add_argument("--budget", type=Path, required=True, help="budget YAML: trials, steps, folds (shared with cv)")
    parser.add_argument("--run_dir", type=Path, default=Path("logs/sweep"), help="folder of the fits and results")
    parser.add_argument("--storage", help="database URL or journal file (.log/.journal); default <run_dir>/study.db")
    parser.add_argument("--study_name", default="sweep", help="study name in the storage (default 'sweep')")
    parser.add_argument("--seed", type=int, default=0, help="TPE sampler seed (give each concurrent worker its own)")
    parser.add_argument("--heartbeat_interval", type=float, default=60.0, help="seconds between trial heartbeats")
    parser.add_argument("--grace_period", type=float, default=600.0,
                        help="seconds without heartbeat after which a RUNNING trial is marked FAIL (default 600)")
    return parser


def summary(study: Any, budget: Budget, storage: Any) -> dict[str, Any]:
    """The results of the study: budget, best trial, every trial (number, state, value, parameters, attributes)."""
    trials = study.get_trials(deepcopy=False)
    complete = [t for t in trials if t.state == TrialState.COMPLETE]
    best = max(complete, key=lambda t: t.value) if complete else None
    return {
        "study_name": study.study_name,
        "storage": storage if isinstance(storage, str) else type(storage).__name__,
        "objective": f"mean {OBJECTIVE} over {budget.folds} folds (maximised)",
        "budget": budget.as_dict(),
        "finished_trials": finished_trials(study),
        "best": None if best is None else {"number": best.number, "value": best.value, "params": best.params},
        "trials": [
            {"number": t.number, "state": t.state.name, "value": t.value, "params": t.params,
             **({"fail_reason": fail_reason(study, t)} if t.state == TrialState.FAIL else {}),
             "user_attrs": {k: v for k, v in t.user_attrs.items() if k != "heartbeat"}}
            for t in trials
        ],
    }


def main(argv: Sequence[str]) -> dict[str, Any]:
    """``lightning-dml sweep ...``; returns the summary written to ``<run_dir>/sweep.json``."""
    if optuna is None:
        raise ProtocolError("lightning-dml sweep needs optuna: pip install 'lightning-dml[protocol]'")
    options, fit_args = build_parser().parse_known_args(list(argv))
    if not fit_args:
        raise ProtocolError(
            "sweep needs the fit's config: lightning-dml sweep --space S.yaml --budget B.yaml --config C.yaml"
        )
    if started_externally():
        raise ProtocolError(
            "lightning-dml sweep starts the processes of its fits itself (--trainer.devices N on one machine): run it "
            "as one process, not under torchrun or srun with several tasks (several sweep workers can share one "
            "study: --storage)"
        )
    space, budget = load_space(options.space), load_budget(options.budget)
    run_dir = options.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    storage = open_storage(options.storage, run_dir)
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = _create_study(options.study_name, storage)
    recorded = study.user_attrs.get("budget")
    if recorded is None:
        study.set_user_attr("budget", budget.as_dict())
        study.set_user_attr("space", space)
    elif recorded != budget.as_dict() or study.user_attrs.get("space") != space:
        raise ProtocolError(f"study {options.study_name!r} was started with budget {recorded} and space "
                            f"{study.user_attrs.get('space')}: a study keeps one budget and space (new --study_name?)")
    fail_stale_trials(study, options.grace_period)
    # seeded by the seed and the study's size: a resumed single worker samples as an uninterrupted one would
    sampler = optuna.samplers.TPESampler(seed=options.seed + len(study.trials))
    study = optuna.load_study(study_name=options.study_name, storage=storage, sampler=sampler)

    def stop_at_budget(study: Any, trial: Any) -> None:
        if finished_trials(study) >= budget.trials:
            study.stop()

    if finished_trials(study) < budget.trials:
        group = wandb_group(f"sweep {options.study_name} {storage_label(options.storage, run_dir)}")
        study.optimize(
            make_objective(fit_args, space, budget, run_dir, options.heartbeat_interval, group),
            catch=(DivergedError,), callbacks=[stop_at_budget], gc_after_trial=True,
        )
    result = summary(study, budget, storage)
    if result["best"] is not None:
        write_best_config(fit_args, result["best"]["params"], budget, run_dir / "best.yaml")
    tmp = run_dir / f"sweep.json.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(result, indent=2, default=str))
    tmp.replace(run_dir / "sweep.json")
    print(result_line(result, budget, run_dir / "best.yaml"))
    return result


def result_line(result: dict[str, Any], budget: Budget, best_path: Path) -> str:
    """The line ``sweep`` ends with: the finished trials and the best trial, its objective printed as every command
    prints a metric (:func:`lightning_dml.metrics_format.format_metric`: MAP@R in percent, two decimals;
    ``sweep.json`` keeps the fraction)."""
    best = result["best"]
    name = OBJECTIVE.split("/", 1)[1]
    return (f"sweep {result['study_name']}: {result['finished_trials']} finished trials (budget {budget.as_dict()}); "
            + ("no complete trial" if best is None else
               f"best trial {best['number']}: {name} {format_metric(name, best['value'])} (%, mean over "
               f"{budget.folds} folds) {best['params']} -> {best_path}"))


__all__ = ["DivergedError", "TrialCallback", "fail_stale_trials", "finished_trials", "load_space", "main",
           "override_args", "suggest", "write_best_config"]
