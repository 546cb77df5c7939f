"""The model of a run, rebuilt outside a ``lightning-dml`` command from the config the run saved and a checkpoint.

What ``python -m lightning_dml.export`` and ``lightning-dml index build`` read: the ``config.yaml`` that ``fit``
saves (or the config file given to ``fit``) and one of its checkpoints.

* :func:`read_run_config`: the config file as a dict, one :class:`~lightning_dml.errors.UserInputError` naming
  the file when it is missing, not YAML or not a lightning-dml config;
* :func:`run_config_cli`: the CLI of that config without a subcommand (model and data module instantiated, no
  trainer run). The options of a command rather than of the run, which ``fit`` saves beside the model
  (``ckpt_path``, ``weights_only``, and ``verbose``, ``return_predictions`` in a ``test`` or ``predict`` config:
  the arguments of the ``Trainer`` methods, :data:`COMMAND_OPTIONS`), are dropped, and so is the trainer: CPU, no
  logger, no checkpointing;
* :func:`load_run_model`: the config's model in eval mode with the checkpoint's weights (read safely,
  :func:`~lightning_dml.checkpoints.read_checkpoint`; another architecture or width is one
  :class:`~lightning_dml.checkpoints.CheckpointMismatchError`), and its data module with the backbone's input
  spec adopted (not set up: no dataset is read);
* :func:`preprocessing`: the evaluation preprocessing of the model and its data module (the backbone's
  :class:`~lightning_dml.models.input_spec.InputSpec`, the crop and resize sizes), what an export folder's
  ``input_spec.json`` and an index folder's manifest record.
"""

from __future__ import annotations

import copy
import functools
import inspect
import os
import warnings
from pathlib import Path
from typing import Any

from lightning_dml.errors import UserInputError

__all__ = ["COMMAND_OPTIONS", "command_options", "load_run_model", "preprocessing", "read_run_config", "run_config_cli"]


@functools.cache
def command_options() -> frozenset[str]:
    """:data:`COMMAND_OPTIONS`, computed on first use: importing Lightning's ``Trainer`` takes seconds, and
    ``lightning-dml search`` imports this module (through :mod:`lightning_dml.index.embed`) without training."""
    from pytorch_lightning import Trainer

    objects = {"self", "model", "datamodule", "dataloaders", "train_dataloaders", "val_dataloaders"}
    return frozenset(
        name
        for method in (Trainer.fit, Trainer.validate, Trainer.test, Trainer.predict)
        for name in inspect.signature(method).parameters
        if name not in objects
    )


def __getattr__(name: str) -> Any:
    #: ``COMMAND_OPTIONS``: top-level keys of a saved config that are options of the command (``Trainer.fit``/
    #: ``validate``/``test``/``predict`` arguments such as ``ckpt_path`` and ``weights_only``), not of the run's
    #: model and data (:func:`command_options`)
    if name == "COMMAND_OPTIONS":
        return command_options()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def read_run_config(config: str | os.PathLike) -> dict[str, Any]:
    """The run config at ``config`` (``fit``'s saved ``config.yaml`` or the file given to ``fit``)."""
    import yaml

    path = Path(config)
    if not path.is_file():
        raise UserInputError(f"--config {path} does not exist")
    try:
        cfg = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        raise UserInputError(f"--config {path} is not YAML: {error}") from None
    if not isinstance(cfg, dict) or "model" not in cfg or "data" not in cfg:
        raise UserInputError(f"--config {path} is not a lightning-dml config (it needs `model` and `data` sections)")
    return cfg


def run_config_cli(cfg: dict[str, Any]) -> Any:
    """The :class:`~lightning_dml.cli.DMLCLI` of run config ``cfg`` without a subcommand: model and data module
    instantiated, on the CPU, no logger, no checkpointing, no seed set; a pretrained backbone is not downloaded
    (the checkpoint holds its weights), unless it has an adapter (its checkpoint holds the adapter alone)."""
    import yaml

    from lightning_dml.cli import build_cli

    cfg = {k: v for k, v in copy.deepcopy(cfg).items() if k not in command_options()}
    backbone_args = (cfg["model"].get("backbone") or {}).get("init_args") if isinstance(cfg["model"], dict) else None
    if isinstance(backbone_args, dict) and "pretrained" in backbone_args and not backbone_args.get("adapter"):
        # the checkpoint holds the weights: no download, no cache needed (an adapter's holds the adapter alone:
        # it loads on top of the pretrained weights, models/adapters.py)
        backbone_args["pretrained"] = False
    cfg["trainer"] = {"logger": False, "enable_checkpointing": False, "accelerator": "cpu", "devices": 1}
    cfg["seed_everything"] = False  # nothing random: no "seed set" lines
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")  # argv is another command's
        return build_cli(["--config", yaml.safe_dump(cfg)], run=False)


def load_run_model(config: str | os.PathLike, ckpt_path: str | os.PathLike) -> tuple[Any, Any, dict | None]:
    """``(module, datamodule, checkpoint record)``: the model of run config ``config`` (in eval mode) with the
    weights of ``ckpt_path`` (a file or an http(s) URL), and its data module with the backbone's input spec
    adopted (not set up: no dataset is read). A LoRA adapter is merged into the weights
    (:func:`~lightning_dml.models.adapters.merge_adapter`), so the module embeds exactly as its export."""
    from lightning_dml.checkpoints import (
        CheckpointMismatchError,
        checkpoint_record,
        local_checkpoint,
        read_checkpoint,
    )

    cfg = read_run_config(config)
    ckpt_path = local_checkpoint(ckpt_path, what="--ckpt_path")  # an http(s) URL: its downloaded copy
    checkpoint = read_checkpoint(ckpt_path, what="--ckpt_path")
    cli = run_config_cli(cfg)
    module = cli.model
    hparams = checkpoint.get("hyper_parameters") or {}
    if hparams.get("loss_sizes"):
        module._apply_loss_sizes(hparams["loss_sizes"])  # noqa: SLF001 - the library's own module
    from lightning_dml.models.adapters import merge_adapter, restore_frozen_weights

    restore_frozen_weights(module.backbone, checkpoint, f"--ckpt_path {ckpt_path}")  # an adapter-only checkpoint
    missing, unexpected = [], []
    try:
        result = module.load_state_dict(checkpoint["state_dict"], strict=False)
        missing, unexpected = list(result.missing_keys), list(result.unexpected_keys)
    except RuntimeError as error:
        first = str(error).split("\n\t", 2)[1] if "\n\t" in str(error) else str(error)
        raise CheckpointMismatchError(
            f"--ckpt_path {ckpt_path} does not fit the model of --config {config}: {first.strip()} (give the config "
            "the run was trained with: lightning-dml saves it as config.yaml beside the logs)"
        ) from None
    model_keys = [k for k in missing if k.startswith(("backbone.", "head."))]
    if model_keys or [k for k in unexpected if k.startswith(("backbone.", "head."))]:
        raise CheckpointMismatchError(
            f"--ckpt_path {ckpt_path} does not fit the model of --config {config}: missing weights "
            f"{model_keys[:3]}, unexpected weights {unexpected[:3]}"
        )
    module.eval()
    merge_adapter(module.backbone)  # LoRA folded into the weights, as the exported model an index folder holds
    datamodule = cli.datamodule
    datamodule.adopt_input_spec(module)
    return module, datamodule, checkpoint_record(ckpt_path)


def preprocessing(module: Any, datamodule: Any) -> tuple[Any, dict[str, Any]]:
    """The input spec (the backbone's, else the data module's) and ``{"crop_size", "resize_size", "mode"}`` of the
    data module's evaluation transform (resize the shorter side, centre crop, convert to the spec)."""
    from lightning_dml.data.transforms import default_resize_size
    from lightning_dml.models.input_spec import TORCHVISION_IMAGENET, backbone_input_spec

    spec = backbone_input_spec(module) or getattr(datamodule, "input_spec", None) or TORCHVISION_IMAGENET
    crop = int(getattr(datamodule, "image_size", None) or spec.crop_size)
    resize = getattr(datamodule, "resize_size", None)
    resize = int(resize) if isinstance(resize, int) else default_resize_size(crop, spec)
    return spec, {"crop_size": crop, "resize_size": resize, "mode": "L" if spec.color == "L" else "RGB"}
