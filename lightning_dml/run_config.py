"""Where a run's resolved config goes: ``config.yaml`` in the run's own folders.

LightningCLI's :class:`~pytorch_lightning.cli.SaveConfigCallback` writes ``config.yaml`` to ``trainer.log_dir``,
which for a logger without version folders (W&B) is the logger's ``save_dir``: ``logs/`` of the working directory
for the ``lightning-dml`` default logger, shared (and overwritten) by every run started there, whatever its
``--trainer.default_root_dir``. :class:`SaveRunConfig` writes it instead (on global rank 0, through Lightning's
``save_config`` hook) to:

* the logger's own folder of the run, where it has one: the version folder of a CSV or TensorBoard logger
  (``<save_dir>/<name>/version_<n>``), the W&B run's folder (``<save_dir>/wandb/<run>``, beside W&B's ``files/``);
* ``<trainer.default_root_dir>/config.yaml``, the run folder that also holds its ``checkpoints/``, when
  ``--trainer.default_root_dir`` names another folder than the working directory, or when the logger has no folder
  of the run (no logger: Lightning's own choice).

Another subcommand than ``fit`` writes ``config_<subcommand>.yaml`` (in both places), so that ``test`` or
``predict`` in a fit's folder keeps the fit's config: in its ``default_root_dir``, and in a logger folder it
shares with the fit (a CSV or TensorBoard logger given a fixed ``version``, a W&B run resumed by its ``id``).

So ``lightning-dml fit --config C`` in a working directory writes the config into its W&B run's folder only (not
into the working directory, shared by every run started there), and ``--trainer.default_root_dir runs/a`` puts it
into ``runs/a`` as well.
"""

from __future__ import annotations

import os
from typing import Any

import pytorch_lightning as pl
from pytorch_lightning.cli import SaveConfigCallback
from pytorch_lightning.loggers import CSVLogger, TensorBoardLogger, WandbLogger


def config_paths(trainer: pl.Trainer, stage: str, filename: str = "config.yaml") -> list[str]:
    """The files a run's config is written to (see the module docstring); call it on global rank 0 only (it may
    start the W&B run there, as Lightning does before ``setup``)."""
    stage = str(getattr(stage, "value", stage))  # Lightning passes its TrainerFn enum ("fit", "validate", ...)
    stem, suffix = os.path.splitext(filename)
    name = filename if stage == "fit" else f"{stem}_{stage}{suffix}"
    files = []
    for logger in trainer.loggers:
        if isinstance(logger, (CSVLogger, TensorBoardLogger)):
            files.append(os.path.join(logger.log_dir, name))
        elif isinstance(logger, WandbLogger):
            # the run's folder (W&B keeps its own config.yaml, the run's config, in the run's files/ folder)
            files.append(os.path.join(os.path.dirname(os.path.normpath(logger.experiment.dir)), name))
    root = os.path.abspath(os.path.expanduser(str(trainer.default_root_dir)))
    if not files or root != os.getcwd():
        files.insert(0, os.path.join(root, name))
    return list(dict.fromkeys(os.path.normpath(f) for f in files))


class SaveRunConfig(SaveConfigCallback):
    """``SaveConfigCallback`` that writes the config to the run's own folders (:func:`config_paths`) rather than
    the logger's shared ``save_dir``. Same arguments as Lightning's; ``save_to_log_dir`` is ignored (the files of
    :func:`config_paths` replace ``<log_dir>/config.yaml``)."""

    def __init__(self, parser: Any, config: Any, config_filename: str = "config.yaml", overwrite: bool = False,
                 multifile: bool = False, save_to_log_dir: bool = True) -> None:
        super().__init__(parser, config, config_filename, overwrite, multifile, save_to_log_dir=False)

    def save_config(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        for path in config_paths(trainer, stage, self.config_filename):
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self.parser.save(self.config, path, skip_none=False, overwrite=self.overwrite, multifile=self.multifile)


__all__ = ["SaveRunConfig", "config_paths"]
