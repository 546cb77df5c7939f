"""The ``lightning-dml`` command: a ``LightningCLI`` with ``fit``, ``validate``, ``test`` and ``predict``.

Configs name every class by ``class_path``/``init_args`` (backbone, loss, data module, logger), so jsonargparse
validates every key, including the loss's own arguments::

    lightning-dml fit --config configs/glyphs.yaml
    lightning-dml fit --config configs/glyphs.yaml --model.loss.init_args.beta 40
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from pytorch_lightning.cli import LightningCLI

from lightning_dml.data.base import DMLDataModule
from lightning_dml.data.input_spec import backbone_input_spec
from lightning_dml.module import DMLModule


class DMLCLI(LightningCLI):
    """LightningCLI with the library's defaults: W&B logging offline, no sanity validation on partial data."""

    def add_arguments_to_parser(self, parser) -> None:
        # the backbone's input convention (colour order, value scale, mean/std) sets the data module's preprocessing
        parser.link_arguments(
            "model", "data.init_args.input_spec", compute_fn=backbone_input_spec, apply_on="instantiate"
        )
        parser.set_defaults(
            {
                "trainer.logger": {
                    "class_path": "pytorch_lightning.loggers.WandbLogger",
                    "init_args": {"project": "lightning-dml", "offline": True, "save_dir": "logs"},
                },
                "trainer.num_sanity_val_steps": 0,
            }
        )


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
