"""The ``lightning-dml`` command: a ``LightningCLI`` with ``fit``, ``validate``, ``test`` and ``predict``.

Configs name every class by ``class_path``/``init_args`` (backbone, loss, data module, logger), so jsonargparse
validates every key, including the loss's own arguments::

    lightning-dml fit --config configs/glyphs.yaml
    lightning-dml fit --config configs/glyphs.yaml --model.loss.init_args.beta 40
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from pytorch_lightning import Trainer
from pytorch_lightning.callbacks import BasePredictionWriter, ModelCheckpoint
from pytorch_lightning.cli import LightningCLI

from lightning_dml.callbacks import PeriodicCheckpoint, PredictionWriter
from lightning_dml.data.base import DMLDataModule
from lightning_dml.data.input_spec import backbone_input_spec
from lightning_dml.module import DMLModule


class DMLCLI(LightningCLI):
    """LightningCLI with the library's defaults: W&B logging offline, no sanity validation on partial data, and
    checkpoints a preempted run can resume from.

    Checkpoints (both in ``<trainer.default_root_dir>/checkpoints`` unless ``--checkpoint.dirpath`` is given, so
    the same command plus ``--ckpt_path last`` resumes a run; give each run its own ``default_root_dir``):

    * ``--checkpoint.*``: a ``ModelCheckpoint`` keeping the best validation by ``val/recall@1``
      (``best-epoch=..-step=...ckpt``); ``ckpt_path="best"`` after ``fit`` uses it.
    * ``--periodic_checkpoint.*``: :class:`~lightning_dml.callbacks.PeriodicCheckpoint`, ``last.ckpt`` every
      ``every_n_train_steps`` training steps (mid-epoch) and at every epoch end.

    ``--trainer.enable_checkpointing false`` turns both off.

    ``predict`` writes ``<log_dir>/predictions.pt`` (embeddings, labels, indices, image paths) with a
    :class:`~lightning_dml.callbacks.PredictionWriter`, unless ``--trainer.callbacks`` already has a prediction
    writer.
    """

    def add_arguments_to_parser(self, parser) -> None:
        # the backbone's input convention (colour order, value scale, mean/std) sets the data module's preprocessing
        parser.link_arguments(
            "model", "data.init_args.input_spec", compute_fn=backbone_input_spec, apply_on="instantiate"
        )
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        parser.set_defaults(
            {
                "checkpoint.monitor": "val/recall@1",
                "checkpoint.mode": "max",
                "checkpoint.save_top_k": 1,
                "checkpoint.save_last": False,  # last.ckpt is the periodic checkpoint's
                "checkpoint.filename": "best-{epoch}-{step}",
            }
        )
        parser.add_lightning_class_args(PeriodicCheckpoint, "periodic_checkpoint")
        parser.set_defaults(
            {
                "trainer.logger": {
                    "class_path": "pytorch_lightning.loggers.WandbLogger",
                    "init_args": {"project": "lightning-dml", "offline": True, "save_dir": "logs"},
                },
                "trainer.num_sanity_val_steps": 0,
                # P x K batches come from BalancedClassSampler, which shards them by rank itself; Lightning's
                # DistributedSampler replacement would deal each process every world-size-th index instead.
                "trainer.use_distributed_sampler": False,
            }
        )

    def instantiate_trainer(self, **kwargs: Any) -> Trainer:
        """Add the checkpoint callbacks (unless checkpointing is off), saving to one predictable folder, and for
        ``predict`` a :class:`~lightning_dml.callbacks.PredictionWriter` unless the user gave a prediction writer."""
        trainer_config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        callbacks = [self._get(self.config_init, key) for key in self._parser(self.subcommand).callback_keys]
        ours = [cb for cb in callbacks if isinstance(cb, ModelCheckpoint)]
        if trainer_config.get("enable_checkpointing") is False:
            callbacks = [cb for cb in callbacks if not any(cb is o for o in ours)]
        else:
            given = next((cb.dirpath for cb in ours if cb.dirpath is not None), None)
            root = trainer_config.get("default_root_dir") or os.getcwd()
            folder = given or os.path.realpath(os.path.join(os.path.expanduser(str(root)), "checkpoints"))
            for cb in ours:
                if cb.dirpath is None:
                    cb.dirpath = folder
        if self.subcommand == "predict":
            given_callbacks = trainer_config.get("callbacks") or []
            if not isinstance(given_callbacks, list):
                given_callbacks = [given_callbacks]
            if not any(isinstance(cb, BasePredictionWriter) for cb in [*given_callbacks, *callbacks]):
                callbacks = [*callbacks, PredictionWriter()]
        return self._instantiate_trainer(trainer_config, callbacks)


def build_cli(args: Sequence[str] | None = None, run: bool = True) -> DMLCLI:
    """Build (and with ``run=True`` execute) the CLI; ``args`` replaces ``sys.argv[1:]`` (used by tests)."""
    os.environ.setdefault("WANDB_SILENT", "true")
    return DMLCLI(
        DMLModule,
        DMLDataModule,
        subclass_mode_data=True,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of the ``lightning-dml`` console script."""
    build_cli(args)


__all__ = ["DMLCLI", "build_cli", "main"]
