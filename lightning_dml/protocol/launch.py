"""How ``cv`` and ``sweep`` run their fits: one after another in the command's process, each fit with DDP
processes of its own, one W&B run per fit.

Lightning's DDP launcher (``strategy="ddp"``, what it picks for several devices) starts the other processes of a
fit by running the command line again, ``sys.argv``, with ``LOCAL_RANK=1 ...`` set. Were that the ``cv`` or
``sweep`` command, each further process would run the whole protocol again (every fold, the table, every trial of
its own). So :func:`fit_command` makes the command line of each fit its own: during the fit ``sys.argv[1:]`` is
``fit <the fit's arguments>``, and LightningCLI reads it from there (``build_cli()`` without ``args``: one source
of arguments). The further processes run that ``lightning-dml fit`` alone and end with it; then the process group
is destroyed and the variables Lightning's launcher set (``MASTER_PORT``, ``LOCAL_RANK``, ...) are restored, so
the next fit starts processes of its own. The command's own work (the test embeddings, the tables, the optuna
study) happens in this process only, global rank 0.

When an external launcher (``torchrun``, ``srun`` with several tasks) started the command, every process runs it
whole and the fits run in lockstep: :func:`started_externally` tells, :func:`is_global_zero` says who writes.

W&B: a run in progress is reused by every later ``WandbLogger`` of the process, so each fit's run is finished
after the fit, and W&B torn down so that it reads its environment again (:func:`finish_runs`); ``WANDB_RUN_GROUP``,
``WANDB_JOB_TYPE`` and ``WANDB_NAME`` (W&B's environment variables, used where the config's logger does not set
``group``, ``job_type`` or ``name``) group the runs of one ``cv`` or study and name each fit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from pytorch_lightning.utilities import rank_zero_only

#: variables Lightning's DDP launcher sets in the launching process (and ``OMP_NUM_THREADS``, which it sets when
#: unset), restored after each fit
LAUNCH_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE", "OMP_NUM_THREADS")
#: W&B's environment variables for a run's group, job type and name
WANDB_ENV = {"group": "WANDB_RUN_GROUP", "job_type": "WANDB_JOB_TYPE", "name": "WANDB_NAME"}
#: W&B's longest group name
WANDB_GROUP_LENGTH = 128


def started_externally() -> bool:
    """Whether this process is one of several that an external launcher started (``torchrun``, ``srun`` with
    several tasks, or Lightning's launcher itself): each of them runs the whole command."""
    env = os.environ
    return ("LOCAL_RANK" in env or "RANK" in env or int(env.get("WORLD_SIZE", "1") or 1) > 1
            or int(env.get("SLURM_NTASKS", "1") or 1) > 1)


def is_global_zero() -> bool:
    """Whether this process is global rank 0 (the only one when no external launcher started the command)."""
    return getattr(rank_zero_only, "rank", 0) == 0


def wandb_group(text: str) -> str:
    """``text`` cut to W&B's longest group name, keeping its end (the distinctive part of a path)."""
    return text if len(text) <= WANDB_GROUP_LENGTH else "..." + text[-(WANDB_GROUP_LENGTH - 3):]


@contextmanager
def fit_command(args: Sequence[str], wandb: dict[str, str] | None = None) -> Iterator[None]:
    """During the block, ``sys.argv[1:]`` is ``args`` (``["fit", ...]``: the command line LightningCLI parses when
    ``build_cli()`` gets no ``args``, and the one Lightning's DDP launcher runs in the fit's other processes) and
    W&B's group/job type/name variables are ``wandb`` (keys ``group``, ``job_type``, ``name``). Afterwards: the
    command line and those variables are restored; unless an external launcher started the command, the process
    group of the fit's processes is destroyed and the variables Lightning's launcher set are restored, so that the
    next fit starts its own processes. (After an exception the process group is left alone: the command is failing,
    and the fit's other processes end when this one does.)"""
    external = started_externally()
    saved_argv = sys.argv[1:]
    saved_env = {key: os.environ.get(key) for key in (*LAUNCH_ENV, *WANDB_ENV.values())}
    threads = torch.get_num_threads()
    sys.argv[1:] = list(args)
    for key, value in (wandb or {}).items():
        os.environ[WANDB_ENV[key]] = str(value)
    finished = False
    try:
        yield
        finished = True
    finally:
        sys.argv[1:] = saved_argv
        restore = list(WANDB_ENV.values())
        if not external:
            if finished and torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
            restore += LAUNCH_ENV
            torch.set_num_threads(threads)
        for key in restore:
            if saved_env[key] is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = saved_env[key]


def finish_runs(trainer: Any, exit_code: int = 0) -> None:
    """Finish the W&B run of each ``WandbLogger`` of ``trainer`` (global rank 0), so that the next fit's logger
    starts a run of its own instead of reusing this one, then ``wandb.teardown()``: W&B reads its environment
    variables (the next run's group and name) once per set-up. Other loggers keep nothing open between fits."""
    if trainer is None or not trainer.is_global_zero:
        return
    from pytorch_lightning.loggers import WandbLogger

    loggers = [logger for logger in trainer.loggers if isinstance(logger, WandbLogger)]
    for logger in loggers:
        logger.experiment.finish(exit_code=exit_code)
    if loggers:
        import wandb

        wandb.teardown()


def run_name(trainer: Any) -> dict[str, str] | None:
    """The W&B run of ``trainer``'s first ``WandbLogger`` (global rank 0): id, name, group, job type and folder;
    ``None`` without one."""
    if trainer is None or not trainer.is_global_zero:
        return None
    from pytorch_lightning.loggers import WandbLogger

    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            run = logger.experiment
            return {"id": run.id, "name": run.name, "group": run.group, "job_type": run.job_type,
                    "dir": os.path.dirname(os.path.abspath(run.dir))}
    return None


def class_lists(datamodule: Any) -> dict[str, Any]:
    """The class ids (the data set's labels) of a fit's training, validation and test splits, with the fold
    arguments of the data module."""
    def ids(dataset: Any) -> list[int] | None:
        labels = getattr(dataset, "labels", None)
        return None if labels is None else torch.unique(torch.as_tensor(labels)).tolist()

    return {
        "num_folds": getattr(datamodule, "num_folds", None), "fold": getattr(datamodule, "fold", None),
        "fold_seed": getattr(datamodule, "fold_seed", None),
        "train": ids(getattr(datamodule, "train_dataset", None)),
        "validation": ids(getattr(datamodule, "val_dataset", None)),
        "test": ids(getattr(datamodule, "test_dataset", None)),
    }


__all__ = ["class_lists", "finish_runs", "fit_command", "is_global_zero", "run_name", "started_externally",
           "wandb_group"]
