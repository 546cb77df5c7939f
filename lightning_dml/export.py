"""Export the embedding model alone (backbone + embedding head, no loss, no Lightning) for inference.

Three formats, written by :func:`export_embedding_model`:

* ``embedding_state_dict.pt``: ``{"state_dict", "embedding_dim", "input_shape"}``; rebuild the backbone and
  head classes (e.g. ``SmallConvNet`` + ``LinearEmbedding``), wrap them in :class:`EmbeddingModel` and call
  ``load_state_dict``. Loads with ``torch.load(..., weights_only=True)``.
* ``embedding_torchscript.pt``: a traced TorchScript module; ``torch.jit.load(path)`` needs only torch.
* ``embedding_exported.pt2``: a ``torch.export`` program with a dynamic batch dimension;
  ``torch.export.load(path).module()`` needs only torch.

The exported function maps images ``[B, C, H, W]`` (preprocessed as in training: the data module's
normalisation) to **raw** embeddings ``[B, D]``, as ``DMLModule.forward`` does; L2-normalise them for cosine
retrieval, as the metrics do. Every file is written under a temporary name and renamed when complete, so an
interrupted export never leaves a half-written file behind. :func:`load_embedding_model` loads any of the last two
by file name.

From the command line, with the config the run was trained with (``lightning-dml`` saves it as ``config.yaml``)::

    python -m lightning_dml.export --config config.yaml --ckpt_path checkpoints/last.ckpt --output exported/
"""

from __future__ import annotations

import argparse
import copy
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

STATE_DICT = "embedding_state_dict.pt"
TORCHSCRIPT = "embedding_torchscript.pt"
TORCH_EXPORT = "embedding_exported.pt2"
FORMATS = ("state_dict", "torchscript", "torch_export")


class EmbeddingModel(nn.Module):
    """``head(backbone(images))``: the inference part of a ``DMLModule``, as a plain ``nn.Module``."""

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images))


def embedding_model(module: nn.Module) -> EmbeddingModel:
    """A CPU copy of ``module``'s backbone and head, in eval mode, without gradients.

    ``module`` is a ``DMLModule`` (or anything with ``backbone`` and ``head``). Multi-level fusion modules, whose
    backbone returns several levels, are exported through ``forward_levels``.
    """
    if not (hasattr(module, "backbone") and hasattr(module, "head")):
        raise ValueError(f"{type(module).__name__} has no `backbone` and `head` to export")
    if getattr(module, "fusion", "none") != "none":
        model: nn.Module = _FusionEmbeddingModel(copy.deepcopy(module.backbone), copy.deepcopy(module.head))
    else:
        model = EmbeddingModel(copy.deepcopy(module.backbone), copy.deepcopy(module.head))
    model = model.cpu().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class _FusionEmbeddingModel(EmbeddingModel):
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone.forward_levels(images))


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def export_embedding_model(
    module: nn.Module,
    directory: str | os.PathLike,
    example_input: torch.Tensor,
    formats: Sequence[str] = FORMATS,
) -> dict[str, Path]:
    """Write the embedding model of ``module`` to ``directory`` in each of ``formats``.

    Args:
        module: a trained ``DMLModule``.
        directory: output folder (created if needed).
        example_input: a batch of preprocessed images ``[B, C, H, W]`` with the size the model will see; traced by
            TorchScript and ``torch.export`` (whose batch dimension is dynamic).
        formats: any of ``"state_dict"``, ``"torchscript"``, ``"torch_export"``.

    Returns:
        ``{format: path}`` of the files written.
    """
    unknown = [f for f in formats if f not in FORMATS]
    if unknown or not formats:
        raise ValueError(f"unknown export format(s) {unknown or list(formats)}; valid formats: {', '.join(FORMATS)}")
    if not isinstance(example_input, torch.Tensor) or example_input.ndim != 4:
        shape = tuple(example_input.shape) if isinstance(example_input, torch.Tensor) else type(example_input)
        raise ValueError(f"example_input must be an image batch [B, C, H, W], got {shape}")
    model = embedding_model(module)
    example = example_input.detach().float().cpu()
    if example.shape[0] < 2:  # a batch of one would let torch.export specialise the batch size to 1
        example = example.expand(2, *example.shape[1:]).contiguous()
    with torch.no_grad():
        reference = model(example)
    if reference.ndim != 2 or not torch.isfinite(reference).all():
        raise ValueError(f"the model must map images to finite embeddings [B, D], got {tuple(reference.shape)}")

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    if "state_dict" in formats:
        payload = {
            "state_dict": model.state_dict(),
            "embedding_dim": int(reference.shape[1]),
            "input_shape": list(example.shape[1:]),
        }
        _atomic_write(out / STATE_DICT, lambda p: torch.save(payload, p))
        written["state_dict"] = out / STATE_DICT
    if "torchscript" in formats:
        with torch.no_grad():
            traced = torch.jit.trace(model, example, check_trace=True)
        _atomic_write(out / TORCHSCRIPT, lambda p: torch.jit.save(traced, str(p)))
        written["torchscript"] = out / TORCHSCRIPT
    if "torch_export" in formats:
        batch = torch.export.Dim("batch", min=1)
        program = torch.export.export(model, (example,), dynamic_shapes={"images": {0: batch}})
        _atomic_write(out / TORCH_EXPORT, lambda p: torch.export.save(program, str(p)))
        written["torch_export"] = out / TORCH_EXPORT
    return written


def load_embedding_model(path: str | os.PathLike) -> Callable[[torch.Tensor], torch.Tensor]:
    """Load an exported TorchScript (``.pt``) or ``torch.export`` (``.pt2``) embedding model; needs only torch."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no exported model at {path}")
    if path.suffix == ".pt2":
        return torch.export.load(str(path)).module()
    if path.name == STATE_DICT:
        raise ValueError(
            f"{path} holds weights only: rebuild the backbone and head, wrap them in EmbeddingModel and call "
            "load_state_dict(torch.load(path, weights_only=True)['state_dict'])"
        )
    return torch.jit.load(str(path), map_location="cpu")


def export_checkpoint(
    config: str | os.PathLike,
    ckpt_path: str | os.PathLike,
    directory: str | os.PathLike,
    formats: Sequence[str] = FORMATS,
    batch_size: int = 2,
) -> dict[str, Path]:
    """Export the embedding model of a ``lightning-dml`` checkpoint, rebuilt from the run's config.

    The example input is a batch of ``batch_size`` images from the data module's test split (so the shapes and
    preprocessing are the real ones).
    """
    import yaml

    from lightning_dml.cli import build_cli

    with open(config) as f:
        cfg: dict[str, Any] = yaml.safe_load(f)
    if not isinstance(cfg, dict) or "model" not in cfg or "data" not in cfg:
        raise ValueError(f"{config} is not a lightning-dml config (it needs `model` and `data` sections)")
    cfg.pop("ckpt_path", None)  # a `fit` option, not a model setting
    backbone_args = (cfg["model"].get("backbone") or {}).get("init_args") if isinstance(cfg["model"], dict) else None
    if isinstance(backbone_args, dict) and "pretrained" in backbone_args:
        backbone_args["pretrained"] = False  # the checkpoint holds the weights: no download, no cache needed
    cfg["trainer"] = {"logger": False, "enable_checkpointing": False, "accelerator": "cpu", "devices": 1}
    cli = build_cli(["--config", yaml.safe_dump(cfg)], run=False)
    checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=False)
    if "state_dict" not in checkpoint:
        raise ValueError(f"{ckpt_path} is not a Lightning checkpoint (no `state_dict`)")
    cli.model.load_state_dict(checkpoint["state_dict"])
    datamodule = cli.datamodule
    datamodule.adopt_input_spec(cli.model)  # no trainer sets it up here: feed the backbone's input convention
    datamodule.setup("test")
    images = next(iter(datamodule.test_dataloader()))[0][:batch_size]
    return export_embedding_model(cli.model, directory, images, formats)


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Export the embedding model of a lightning-dml checkpoint.")
    parser.add_argument("--config", required=True, help="the run's config (lightning-dml saves config.yaml)")
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written by the run")
    parser.add_argument("--output", required=True, help="output folder")
    parser.add_argument("--formats", nargs="+", default=list(FORMATS), choices=FORMATS)
    args = parser.parse_args(argv)
    for name, path in export_checkpoint(args.config, args.ckpt_path, args.output, args.formats).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()


__all__ = [
    "EmbeddingModel",
    "embedding_model",
    "export_checkpoint",
    "export_embedding_model",
    "load_embedding_model",
]
