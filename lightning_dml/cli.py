"""The ``lightning-dml`` command: a ``LightningCLI`` with ``fit``, ``validate``, ``test`` and ``predict``.

Configs name every class by ``class_path``/``init_args`` (backbone, loss, data module, logger), so jsonargparse
validates every key, including the loss's own arguments::

    lightning-dml fit --config configs/glyphs.yaml
    lightning-dml fit --config configs/glyphs.yaml --model.loss.init_args.beta 40
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from pytorch_lightning import Callback, Trainer
from pytorch_lightning.callbacks import BasePredictionWriter, ModelCheckpoint
from pytorch_lightning.cli import LightningCLI

from lightning_dml.callbacks import PeriodicCheckpoint, PredictionWriter, ValidationSummary
from lightning_dml.data.base import DMLDataModule
from lightning_dml.download import env_flag, set_offline
from lightning_dml.errors import UserInputError, user_error_message
from lightning_dml.module import DMLModule
from lightning_dml.run_config import SaveRunConfig

#: Trainer defaults of the ``lightning-dml`` command (a user's ``trainer_defaults`` to :class:`DMLCLI` adds to them)
TRAINER_DEFAULTS: dict[str, Any] = {
    "logger": {
        "class_path": "pytorch_lightning.loggers.WandbLogger",
        "init_args": {"project": "lightning-dml", "offline": True, "save_dir": "logs"},
    },
    "num_sanity_val_steps": 0,
    # P x K batches come from BalancedClassSampler, which shards them by rank itself; Lightning's
    # DistributedSampler replacement would deal each process every world-size-th index instead.
    "use_distributed_sampler": False,
}


def _as_list(callbacks: Any) -> list[Callback]:
    if callbacks is None:
        return []
    return list(callbacks) if isinstance(callbacks, (list, tuple)) else [callbacks]


class DMLCLI(LightningCLI):
    """LightningCLI with the library's defaults: W&B logging offline, no sanity validation on partial data,
    checkpoints a preempted run can resume from, and the last validation metrics printed when ``fit`` ends.

    Checkpoints (both in ``<trainer.default_root_dir>/checkpoints`` unless ``--checkpoint.dirpath`` is given, so
    the same command plus ``--ckpt_path last`` resumes a run; give each run its own ``default_root_dir``):

    * ``--checkpoint.*``: a ``ModelCheckpoint`` keeping the best validation by ``val/recall@1``
      (``best-epoch=..-step=...ckpt``); ``ckpt_path="best"`` after ``fit`` uses it.
    * ``--periodic_checkpoint.*``: :class:`~lightning_dml.callbacks.PeriodicCheckpoint`, ``last.ckpt`` every
      ``every_n_train_steps`` training steps (mid-epoch) and at every epoch end.

    ``--trainer.enable_checkpointing false`` turns both off.

    ``predict`` writes ``<log_dir>/predictions.pt`` (embeddings, labels, indices, image paths) with a
    :class:`~lightning_dml.callbacks.PredictionWriter`, unless ``--trainer.callbacks`` already has a prediction
    writer. Every run has a :class:`~lightning_dml.callbacks.ValidationSummary` (given through Lightning's
    ``trainer_defaults``), which prints the last validation metrics at the end of ``fit``.

    Customised through LightningCLI's public hooks only: ``trainer_defaults``, ``add_arguments_to_parser`` (the
    two checkpoint groups are parsed but not instantiated by jsonargparse) and ``instantiate_trainer``, which
    builds the checkpoint callbacks from the parsed groups and hands them to ``LightningCLI.instantiate_trainer``
    as ``callbacks`` with the user's. The saved ``config.yaml`` stays what the user gave.
    """

    def __init__(self, *args: Any, trainer_defaults: dict[str, Any] | None = None, **kwargs: Any) -> None:
        defaults = {**TRAINER_DEFAULTS, **(trainer_defaults or {})}
        defaults["callbacks"] = [*_as_list(defaults.get("callbacks")), ValidationSummary()]
        super().__init__(*args, trainer_defaults=defaults, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        # No link for data.init_args.input_spec: the data module reads the backbone's input convention at set-up
        # (DMLDataModule.adopt_input_spec), and a link would silently replace an input_spec set in the config.
        # parsed and validated, instantiated by instantiate_trainer (only when checkpointing is on)
        parser.add_class_arguments(ModelCheckpoint, "checkpoint", instantiate=False, fail_untyped=False)
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/recall@1",
                "checkpoint.mode": "max",
                "checkpoint.save_top_k": 1,
                "checkpoint.save_last": False,  # last.ckpt is the periodic checkpoint's
                "checkpoint.filename": "best-{epoch}-{step}",
            }
        )
        parser.add_class_arguments(PeriodicCheckpoint, "periodic_checkpoint", instantiate=False, fail_untyped=False)

    def checkpoint_callbacks(self, trainer_config: dict[str, Any]) -> list[ModelCheckpoint]:
        """The ``--checkpoint`` and ``--periodic_checkpoint`` callbacks, both saving to one folder (none when
        ``enable_checkpointing`` is false)."""
        if trainer_config.get("enable_checkpointing") is False:
            return []
        config = self.config_init.get(str(self.subcommand), self.config_init)
        groups = {"checkpoint": ModelCheckpoint, "periodic_checkpoint": PeriodicCheckpoint}
        init = {key: {**config[key]} for key in groups}
        given = next((args["dirpath"] for args in init.values() if args.get("dirpath") is not None), None)
        root = trainer_config.get("default_root_dir") or os.getcwd()
        folder = given or os.path.realpath(os.path.join(os.path.expanduser(str(root)), "checkpoints"))
        return [cls(**{**init[key], "dirpath": init[key].get("dirpath") or folder}) for key, cls in groups.items()]

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """The trainer with the user's callbacks, the checkpoint callbacks and, for ``predict``, a
        :class:`~lightning_dml.callbacks.PredictionWriter` unless the user gave a prediction writer."""
        config = self.config_init.get(str(self.subcommand), self.config_init)
        trainer_config = {**config.get("trainer", {}), **kwargs}
        callbacks = [*_as_list(trainer_config.get("callbacks")), *self.checkpoint_callbacks(trainer_config)]
        if self.subcommand == "predict" and not any(isinstance(cb, BasePredictionWriter) for cb in callbacks):
            callbacks.append(PredictionWriter())
        return super().instantiate_trainer(**{**kwargs, "callbacks": callbacks})


def build_cli(args: Sequence[str] | None = None, run: bool = True) -> DMLCLI:
    """Build (and with ``run=True`` execute) the CLI; ``args`` replaces ``sys.argv[1:]`` (used by tests)."""
    os.environ.setdefault("WANDB_SILENT", "true")
    return DMLCLI(
        DMLModule,
        DMLDataModule,
        subclass_mode_data=True,
        save_config_callback=SaveRunConfig,  # config.yaml in the run's own folders (lightning_dml/run_config.py)
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of the ``lightning-dml`` console script (``args`` replaces ``sys.argv[1:]``).

    Two switches of its own, anywhere on the command line: ``--offline`` forbids every download (as
    ``LIGHTNING_DML_OFFLINE=1`` does; DDP processes inherit it), ``--debug`` shows the traceback of a user error.
    A user error (:class:`~lightning_dml.errors.UserInputError`: a missing dataset or weights file, a failed or
    refused download, a checksum mismatch, a corrupt file) prints ``lightning-dml: error: <message>`` on stderr
    and exits with status 1, without traceback unless ``--debug`` or ``LIGHTNING_DML_DEBUG=1``. Every other
    exception is a bug and keeps its traceback.

    ``lightning-dml cv ...`` (:mod:`lightning_dml.protocol.cv`) and ``lightning-dml sweep ...``
    (:mod:`lightning_dml.protocol.sweep`) are dispatched here, beside the LightningCLI subcommands (which are
    Trainer methods); their user errors are printed the same way.
    """
    argv = list(sys.argv[1:] if args is None else args)
    if "--offline" in argv:
        set_offline(True)
    if "--debug" in argv:
        os.environ["LIGHTNING_DML_DEBUG"] = "1"  # inherited by the DDP processes Lightning starts
    debug = env_flag("LIGHTNING_DML_DEBUG")
    argv = [a for a in argv if a not in ("--offline", "--debug")]
    if args is None:
        sys.argv[1:] = argv  # Lightning's DDP launcher restarts the command from sys.argv
    try:
        if argv[:1] in (["cv"], ["sweep"]):
            # imported on use: the protocol commands import this module
            importlib.import_module(f"lightning_dml.protocol.{argv[0]}").main(argv[1:])
        else:
            build_cli(None if args is None else argv)
    except UserInputError as error:
        if debug:
            raise
        print(f"lightning-dml: error: {user_error_message(error)}", file=sys.stderr)
        raise SystemExit(1) from None


__all__ = ["DMLCLI", "build_cli", "main"]
