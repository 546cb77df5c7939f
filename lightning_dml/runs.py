"""A run's folders: a ``fit`` never replaces the checkpoints of another run, and where a run's outputs go.

* :func:`check_checkpoint_folders`: a ``fit`` that would save checkpoints into a folder already holding checkpoints
  (``last.ckpt``, ``best-*.ckpt``: another run's, as ``<default_root_dir>/checkpoints`` is shared by every fit
  given the same ``--trainer.default_root_dir``) is refused with one :class:`RunFolderError` naming the folder, its
  files and the three ways on, unless the fit resumes from that folder (``--ckpt_path last``, ``hpc``, or a file in
  it, or a SLURM job requeued without ``--ckpt_path``, which Lightning resumes from the newest
  ``<default_root_dir>/hpc_ckpt_*.ckpt``: :func:`slurm_requeue_resumes`) or ``--overwrite_checkpoints true`` says
  to replace them (:func:`remove_checkpoints`, before the first step).
  Refusing rather than versioning keeps the documented layout (``<default_root_dir>/checkpoints/last.ckpt``), so
  the folder holds one run and ``--ckpt_path last`` (Lightning: the newest ``last.ckpt`` of the run's checkpoint
  folders) always means that run.
* :func:`run_folder`: the folder of a run's own outputs (``predictions.pt``): ``--trainer.default_root_dir`` when it
  names another folder than the working directory, else the logger's folder of this run (the W&B run's folder,
  the version folder of a CSV or TensorBoard logger), never the logger's ``save_dir`` shared by every run.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import datetime, timezone
from pathlib import Path

import pytorch_lightning as pl
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger, WandbLogger

from lightning_dml.errors import UserInputError

__all__ = [
    "RunFolderError",
    "check_checkpoint_folders",
    "existing_checkpoints",
    "remove_checkpoints",
    "run_folder",
    "slurm_requeue_resumes",
]

#: ``ckpt_path`` values that resume the run of the trainer's own checkpoint folders (Lightning resolves them)
RESUMING_CKPT_PATHS = ("last", "hpc")


class RunFolderError(UserInputError, FileExistsError):
    """A command would replace what another run made (its checkpoints)."""


def existing_checkpoints(folders: Iterable[str | os.PathLike]) -> list[Path]:
    """The checkpoint files (``*.ckpt``, files or sharded folders) directly in ``folders``, sorted."""
    found: set[Path] = set()
    for folder in folders:
        folder = Path(folder)
        if folder.is_dir():
            found.update(p for p in folder.glob("*.ckpt"))
    return sorted(found)


def slurm_requeue_resumes(default_root_dir: str | os.PathLike) -> bool:
    """Whether a fit without ``ckpt_path`` resumes a requeued SLURM job: Lightning then restores the newest
    ``hpc_ckpt_<n>.ckpt`` of ``default_root_dir`` when it runs under SLURM (its checkpoint connector's rule)."""
    from lightning_fabric.plugins.environments import SLURMEnvironment

    return SLURMEnvironment.detect() and any(Path(default_root_dir).expanduser().glob("hpc_ckpt_*.ckpt"))


def _inside(path: Path, folders: Iterable[Path]) -> bool:
    resolved = path.expanduser().resolve()
    return any(resolved.parent == folder.expanduser().resolve() for folder in folders)


def _describe(files: list[Path]) -> str:
    newest = max(files, key=lambda p: p.stat().st_mtime)
    when = datetime.fromtimestamp(newest.stat().st_mtime, tz=timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    names = ", ".join(p.name for p in files[:4]) + (f" and {len(files) - 4} more" if len(files) > 4 else "")
    return f"{names} (newest written {when})"


def check_checkpoint_folders(
    folders: Iterable[str | os.PathLike], ckpt_path: str | os.PathLike | None, overwrite: bool
) -> list[Path]:
    """The checkpoints of ``folders`` that a new ``fit`` would replace (to remove when ``overwrite``), or raise
    :class:`RunFolderError` when there are some and the fit neither resumes from one of ``folders`` nor was told
    to overwrite them (see the module docstring). Returns ``[]`` when the fit resumes or the folders hold none."""
    folders = [Path(f) for f in folders]
    files = existing_checkpoints(folders)
    if not files:
        return []
    if ckpt_path is not None:
        text = str(ckpt_path)
        if text in RESUMING_CKPT_PATHS or ("://" not in text and _inside(Path(text), folders)):
            return []  # resuming this run: its checkpoints are its own
    if overwrite:
        return files
    where = ", ".join(str(f) for f in dict.fromkeys(p.parent for p in files))
    started = "from another checkpoint" if ckpt_path is not None else "as a new run"
    raise RunFolderError(
        f"{where} already holds the checkpoints of a run: {_describe(files)}; this fit, started {started}, would "
        "replace them. Resume that run with --ckpt_path last, give this run its own folder "
        "(--trainer.default_root_dir DIR), or replace them with --overwrite_checkpoints true"
    )


def remove_checkpoints(files: Iterable[Path]) -> None:
    """Delete the checkpoint files (and sharded checkpoint folders) ``files``: what ``--overwrite_checkpoints true``
    replaces, so that ``last``/``best`` of the folder are the new run's."""
    import shutil

    for path in files:
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def run_folder(trainer: pl.Trainer) -> Path:
    """The folder of this run's own outputs (see the module docstring). Call it on global rank 0 only: with W&B it
    starts the logger's run, as Lightning does before ``setup``."""
    root = Path(os.path.abspath(os.path.expanduser(str(trainer.default_root_dir))))
    if root != Path(os.getcwd()):
        return root
    for logger in trainer.loggers:
        if isinstance(logger, (CSVLogger, TensorBoardLogger)):
            return Path(os.path.abspath(logger.log_dir))
        if isinstance(logger, WandbLogger):
            directory = getattr(logger.experiment, "dir", None)
            if isinstance(directory, str) and directory:
                return Path(os.path.abspath(os.path.dirname(os.path.normpath(directory))))
    return root
