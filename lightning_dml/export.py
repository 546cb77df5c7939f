"""Export the embedding model alone (backbone + embedding head, no loss, no Lightning) for inference.

Four formats, written by :func:`export_embedding_model` (``python -m lightning_dml.export``: the first two by
default, the program formats when asked for with ``--formats``):

* ``embedding_model.safetensors`` (``safetensors``, the safe format): the weights as tensors only
  (`safetensors <https://huggingface.co/docs/safetensors>`_) and, in the file's metadata, a JSON record of the
  architecture: the backbone's and the head's ``class_path`` and ``init_args``
  (:mod:`lightning_dml.models.records`) and the fusion. :func:`load_embedding_model` rebuilds the module from that
  record, from the library's own classes only (timm models by name), and loads the tensors: nothing in the file is
  unpickled or imported, so a file from a stranger cannot run code. This is what an index folder stores. Needs
  lightning-dml (and timm for a timm backbone) to load.
* ``embedding_state_dict.pt`` (``state_dict``): ``{"state_dict", "embedding_dim", "input_shape"}``; rebuild the
  backbone and head classes (e.g. ``SmallConvNet`` + ``LinearEmbedding``), wrap them in :class:`EmbeddingModel` and
  call ``load_state_dict``. Loads with ``torch.load(..., weights_only=True)`` (tensors and plain data only).
* ``embedding_torchscript.pt`` (``torchscript``): a traced TorchScript module; ``torch.jit.load(path)`` needs only
  torch.
* ``embedding_exported.pt2`` (``torch_export``): a ``torch.export`` program with a dynamic batch dimension;
  ``torch.export.load(path).module()`` needs only torch.
* ``embedding_model.onnx`` (``onnx``): an ONNX model (dynamic batch axis; input ``images``, output ``embeddings``)
  for ONNX Runtime, verified at export against the module's embeddings, with ``onnx_export.json`` recording the
  difference; ``--quantize int8`` adds ``embedding_model.int8.onnx`` and its measured error
  (:mod:`lightning_dml.onnx.export`; the ``onnx`` extra). An ONNX file holds operators and tensors, no code.

**Loading a TorchScript or ``torch.export`` file runs code chosen by whoever wrote it** (TorchScript code, and
``torch.export`` archives may hold pickled weights): load only files you made yourself or got from someone you
trust. :func:`load_embedding_model` refuses them unless called with ``trust_code=True``, and no command of the
library that reads a shared folder (an index, a report) loads them.

Beside the weights, ``input_spec.json`` says how to preprocess an image for the model
(:func:`preprocessing_record`: the backbone's :class:`~lightning_dml.models.input_spec.InputSpec` (channel order,
value scale, mean, std), the evaluation transform's resize and crop sizes, the input shape, and that the outputs
are raw, not L2-normalised); docs/models.md shows the lines that use it in plain PyTorch.

The exported function maps images ``[B, C, H, W]`` (preprocessed as in training: the data module's
normalisation) to **raw** embeddings ``[B, D]``, as ``DMLModule.forward`` does; L2-normalise them for cosine
retrieval, as the metrics do. Every file is written under a temporary name and renamed when complete, so an
interrupted export never leaves a half-written file behind; the safe format is reloaded before the rename and its
embeddings of the example batch must equal the module's.

From the command line, with the config the run was trained with (``lightning-dml`` saves it as ``config.yaml``)::

    python -m lightning_dml.export --config config.yaml --ckpt_path checkpoints/last.ckpt --output exported/
"""

from __future__ import annotations

import copy
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from lightning_dml.cli_parsing import CommandParser
from lightning_dml.errors import CorruptFileError, UserInputError

SAFETENSORS = "embedding_model.safetensors"
STATE_DICT = "embedding_state_dict.pt"
TORCHSCRIPT = "embedding_torchscript.pt"
TORCH_EXPORT = "embedding_exported.pt2"
#: the preprocessing the model expects (JSON), written beside the weights: see :func:`preprocessing_record`
INPUT_SPEC = "input_spec.json"
FORMATS = ("safetensors", "state_dict", "torchscript", "torch_export", "onnx")
#: what ``python -m lightning_dml.export`` writes without ``--formats``: the formats that load without running code
DEFAULT_FORMATS = ("safetensors", "state_dict")
#: the safetensors metadata key holding the architecture record (JSON), and the record's format version
RECORD_KEY = "lightning_dml.embedding_model"
RECORD_FORMAT = 1


class UnsafeFormatError(UserInputError, ValueError):
    """A model file whose loading would run code from the file (TorchScript, ``torch.export``), not asked for."""


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
    backbone returns several levels, are exported through ``forward_levels``. A backbone's LoRA adapter is merged
    into the copy's weights (:func:`~lightning_dml.models.adapters.merge_adapter`: ``W0 + (alpha / r) B A``, the
    plain ``nn.Linear`` back), so every format loads without ``peft``; VPT's prompts stay part of the model.
    """
    if not (hasattr(module, "backbone") and hasattr(module, "head")):
        raise ValueError(f"{type(module).__name__} has no `backbone` and `head` to export")
    if getattr(module, "fusion", "none") != "none":
        model: nn.Module = _FusionEmbeddingModel(copy.deepcopy(module.backbone), copy.deepcopy(module.head))
    else:
        model = EmbeddingModel(copy.deepcopy(module.backbone), copy.deepcopy(module.head))
    from lightning_dml.models.adapters import merge_adapter

    merge_adapter(model.backbone)  # LoRA folded into the weights (the copy's): the export needs no peft
    model = model.cpu().eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


class _FusionEmbeddingModel(EmbeddingModel):
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone.forward_levels(images))


def architecture_record(model: EmbeddingModel, example: torch.Tensor, embedding_dim: int) -> dict[str, Any]:
    """The JSON record of the safe format: ``{"format", "backbone", "head", "levels", "embedding_dim",
    "input_shape"}`` (``backbone``/``head``: :func:`~lightning_dml.models.records.module_record`; ``levels``: the
    head takes the backbone's multi-level features, fusion). A class the safe format cannot rebuild is an
    :class:`~lightning_dml.models.records.UnsupportedModelError`."""
    from lightning_dml.models.records import module_record

    return {
        "format": RECORD_FORMAT,
        "backbone": module_record(model.backbone, "backbone"),
        "head": module_record(model.head, "embedding head"),
        "levels": isinstance(model, _FusionEmbeddingModel),
        "embedding_dim": int(embedding_dim),
        "input_shape": [int(v) for v in example.shape[1:]],
    }


def build_embedding_model(record: Any, where: str) -> EmbeddingModel:
    """The (randomly initialised) :class:`EmbeddingModel` of an architecture record, built from the library's
    allow-listed classes only (:func:`~lightning_dml.models.records.build_module`); a record that is not one is a
    :class:`~lightning_dml.errors.CorruptFileError` naming ``where``."""
    from lightning_dml.models.records import build_module

    if not isinstance(record, dict) or record.get("format") != RECORD_FORMAT:
        found = record.get("format") if isinstance(record, dict) else type(record).__name__
        raise CorruptFileError(
            f"{where}: architecture record of format {found!r}, this version of lightning-dml reads format "
            f"{RECORD_FORMAT} (export the model again)"
        )
    if not isinstance(record.get("levels"), bool):
        raise CorruptFileError(f"{where}: the architecture record's 'levels' must be true or false")
    backbone = build_module(record.get("backbone"), "backbone", where)
    head = build_module(record.get("head"), "embedding head", where)
    wrapper = _FusionEmbeddingModel if record["levels"] else EmbeddingModel
    return wrapper(backbone, head)


def _write_safetensors(model: EmbeddingModel, record: dict[str, Any], path: Path) -> None:
    from safetensors.torch import save_model

    save_model(model, str(path), metadata={RECORD_KEY: json.dumps(record, sort_keys=True)})


class _NoInitOnMeta(torch.overrides.TorchFunctionMode):
    """Leaves the random initialisers (``torch.nn.init.*_``, ``Tensor.normal_``) of ``meta`` tensors undone: they
    hold no values, and torch's meta ``normal_`` is a Python reference whose first call imports ``torch._dynamo``
    (about 2 s of ``lightning-dml search``'s start-up)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        initialiser = getattr(func, "__module__", None) == "torch.nn.init" and func.__name__.endswith("_")
        if func is torch.Tensor.normal_ or initialiser:
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def load_safe_embedding_model(path: str | os.PathLike) -> EmbeddingModel:
    """The model of a safe-format file (``embedding_model.safetensors``) on the CPU, in eval mode, without
    gradients: rebuilt from its architecture record (:func:`build_embedding_model`), then its tensors loaded
    (``safetensors``: no pickle). The record's model is first built on the ``meta`` device (no memory) and must
    have exactly the file's tensor names and shapes, so a record cannot make the loader allocate more than the
    file holds. Every problem is one :class:`~lightning_dml.errors.CorruptFileError` naming the file: truncated
    or not a safetensors file, no record, a record of classes the library does not rebuild, tensors that do not
    fit the rebuilt model."""
    from safetensors import safe_open
    from safetensors.torch import load_model

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no exported model at {path}")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = handle.metadata() or {}
            shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}
    except Exception as error:  # noqa: BLE001 - safetensors' header errors (truncated, not safetensors) name no file
        detail = " ".join(str(error).split())[:200]
        raise CorruptFileError(
            f"exported model {path} is truncated or not a safetensors file ({path.stat().st_size} bytes: {detail})"
        ) from None
    if RECORD_KEY not in metadata:
        raise CorruptFileError(
            f"exported model {path} has no lightning-dml architecture record (metadata key {RECORD_KEY!r}): it was "
            "not written by lightning_dml.export"
        )
    try:
        record = json.loads(metadata[RECORD_KEY])
    except ValueError as error:
        raise CorruptFileError(f"exported model {path}: its architecture record is not JSON ({error})") from None
    where = f"exported model {path}"
    with torch.device("meta"), _NoInitOnMeta():  # no memory yet: the record's model must have the file's tensors
        skeleton = build_embedding_model(record, where)
    expected = {name: tuple(t.shape) for name, t in skeleton.state_dict().items()}
    if expected != shapes:
        missing = sorted(set(expected) - set(shapes))
        unexpected = sorted(set(shapes) - set(expected))
        reshaped = [f"{k} {list(shapes[k])} (the record's model: {list(expected[k])})"
                    for k in sorted(set(shapes) & set(expected)) if shapes[k] != expected[k]]
        raise CorruptFileError(
            f"{where}: its tensors do not fit the recorded architecture (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}, other shapes {reshaped[:2]})"
        )
    model = build_embedding_model(record, where)
    try:
        load_model(model, str(path), strict=True)
    except Exception as error:  # noqa: BLE001 - missing/unexpected/mis-shaped tensors, a truncated data section
        detail = " ".join(str(error).split())[:300]
        raise CorruptFileError(
            f"exported model {path}: its tensors do not fit the recorded architecture or cannot be read ({detail})"
        ) from None
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    return model


def preprocessing_record(
    spec: Any, preprocess: dict[str, Any], input_shape: Sequence[int], embedding_dim: int, metric: str
) -> dict[str, Any]:
    """The content of ``input_spec.json``: how an image becomes the model's input, and what comes out.

    ``{"format": 1, "input_spec": {color, scale, mean, std, crop_size, resize_size, interpolation, crop_pct},
    "mode": "L"|"RGB", "resize_size", "crop_size", "input_shape": [C, H, W], "embedding_dim", "normalized": false,
    "metric"}``: open the image in ``mode``, resize its shorter side to ``resize_size`` (``interpolation``,
    antialiased), centre-crop ``crop_size``, scale pixels to ``[0, scale]``, put the channels in ``color`` order,
    subtract ``mean`` and divide by ``std`` (:func:`~lightning_dml.data.transforms.eval_transform` does exactly
    this). The outputs are raw embeddings (``normalized`` false): L2-normalise them when ``metric`` is cosine.
    ``input_spec.crop_size``/``resize_size`` are the backbone's nominal sizes; the top-level ones are what the
    model was evaluated with."""
    import dataclasses

    return {
        "format": 1,
        "input_spec": dataclasses.asdict(spec),
        "mode": str(preprocess["mode"]),
        "resize_size": int(preprocess["resize_size"]),
        "crop_size": int(preprocess["crop_size"]),
        "input_shape": [int(v) for v in input_shape],
        "embedding_dim": int(embedding_dim),
        "normalized": False,
        "metric": str(metric),
    }


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")  # the suffix torch.export expects
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
    formats: Sequence[str] = DEFAULT_FORMATS,
    preprocess: tuple[Any, dict[str, Any]] | None = None,
    quantize: str | None = None,
) -> dict[str, Path]:
    """Write the embedding model of ``module`` to ``directory`` in each of ``formats``, and with ``preprocess``
    its preprocessing (``input_spec.json``, :func:`preprocessing_record`).

    Args:
        module: a trained ``DMLModule``.
        directory: output folder (created if needed).
        example_input: a batch of preprocessed images ``[B, C, H, W]`` with the size the model will see; traced by
            TorchScript and ``torch.export`` (whose batch dimension is dynamic).
        formats: any of ``"safetensors"``, ``"state_dict"``, ``"torchscript"``, ``"torch_export"`` (the last two
            run code when loaded: see the module docstring).
        preprocess: ``(InputSpec, {"crop_size", "resize_size", "mode"})`` of the evaluation transform
            (:func:`lightning_dml.run_model.preprocessing`; :func:`export_checkpoint` passes the run's), written
            as ``input_spec.json``. ``None``: no ``input_spec.json``.
        quantize: ``"int8"``: with ``"onnx"``, also the int8 ONNX model (:func:`lightning_dml.onnx.export.export_onnx`).

    Returns:
        ``{format: path}`` of the files written (and ``"input_spec"``: the preprocessing, with ``preprocess``).
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

    record = architecture_record(model, example, int(reference.shape[1])) if "safetensors" in formats else None
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    written: dict[str, Path] = {}
    if record is not None:

        def write_checked(path: Path) -> None:
            _write_safetensors(model, record, path)
            with torch.no_grad():
                rebuilt = load_safe_embedding_model(path)(example)
            if not torch.equal(rebuilt, reference):
                raise RuntimeError(f"the model rebuilt from {path.name} does not reproduce the module's embeddings")

        _atomic_write(out / SAFETENSORS, write_checked)
        written["safetensors"] = out / SAFETENSORS
    if "state_dict" in formats:
        payload = {
            "state_dict": model.state_dict(),
            "embedding_dim": int(reference.shape[1]),
            "input_shape": list(example.shape[1:]),
        }
        _atomic_write(out / STATE_DICT, lambda p: torch.save(payload, p))
        written["state_dict"] = out / STATE_DICT
    if "torchscript" in formats:
        with warnings.catch_warnings(), torch.no_grad():
            # torch deprecates torch.jit (a FutureWarning per call, torch 2.14): the format is the user's choice, and
            # its readers (torch.jit.load, C++ libtorch) are what it is kept for
            warnings.filterwarnings("ignore", message=r"`torch\.jit\.\w+` is deprecated", category=FutureWarning)
            traced = torch.jit.trace(model, example, check_trace=True)
            _atomic_write(out / TORCHSCRIPT, lambda p: torch.jit.save(traced, str(p)))
        written["torchscript"] = out / TORCHSCRIPT
    if "torch_export" in formats:
        batch = torch.export.Dim("batch", min=1)
        program = torch.export.export(model, (example,), dynamic_shapes={"images": {0: batch}})
        _atomic_write(out / TORCH_EXPORT, lambda p: torch.export.save(program, str(p)))
        written["torch_export"] = out / TORCH_EXPORT
    if "onnx" in formats:  # verified against `reference`'s model on the example: fails with the difference
        from lightning_dml.onnx.export import export_onnx
        from lightning_dml.onnx.runtime import ONNX_INT8_MODEL, ONNX_MODEL, ONNX_RECORD

        onnx_record = export_onnx(model, example, out, quantize=quantize)
        written["onnx"] = out / ONNX_MODEL
        if onnx_record["int8"] is not None:
            written["onnx_int8"] = out / ONNX_INT8_MODEL
        written["onnx_record"] = out / ONNX_RECORD
    if preprocess is not None:
        metric = str(getattr(getattr(module, "test_metrics", None), "metric", "cosine"))
        spec_record = preprocessing_record(preprocess[0], preprocess[1], example.shape[1:], reference.shape[1], metric)
        text = json.dumps(spec_record, indent=2) + "\n"
        _atomic_write(out / INPUT_SPEC, lambda p: p.write_text(text))
        written["input_spec"] = out / INPUT_SPEC
    return written


def load_embedding_model(
    path: str | os.PathLike, *, trust_code: bool = False
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Load an exported embedding model by file name, or the safe format of an export folder.

    * a folder (what ``python -m lightning_dml.export --output`` wrote): its ``embedding_model.safetensors``;
    * ``*.safetensors`` (the safe format): rebuilt from its architecture record, tensors only
      (:func:`load_safe_embedding_model`); safe for files from anyone.
    * TorchScript (``.pt``) or ``torch.export`` (``.pt2``): **loading runs code chosen by whoever wrote the file**;
      refused (:class:`UnsafeFormatError`) unless ``trust_code=True``, for files you made yourself.
    """
    path = Path(path)
    if path.is_dir():
        if not (path / SAFETENSORS).is_file():
            found = ", ".join(sorted(p.name for p in path.iterdir())[:6]) or "nothing"
            raise FileNotFoundError(
                f"export folder {path} has no {SAFETENSORS} (it holds {found}): export with the default formats, or "
                "give the file to load"
            )
        path = path / SAFETENSORS
    if not path.is_file():
        raise FileNotFoundError(f"no exported model at {path}")
    if path.suffix == ".safetensors":
        return load_safe_embedding_model(path)
    if path.name == STATE_DICT:
        raise ValueError(
            f"{path} holds weights only: rebuild the backbone and head, wrap them in EmbeddingModel and call "
            "load_state_dict(torch.load(path, weights_only=True)['state_dict']), or export the safe format "
            f"({SAFETENSORS}), which load_embedding_model rebuilds"
        )
    kind = "torch.export" if path.suffix == ".pt2" else "TorchScript"
    if not trust_code:
        raise UnsafeFormatError(
            f"{path} is a {kind} file, which is not loaded: loading it runs code chosen by whoever wrote it. Load the "
            f"safe format ({SAFETENSORS}, python -m lightning_dml.export writes it), or pass trust_code=True for a "
            "file you made yourself"
        )
    if path.suffix == ".pt2":
        return torch.export.load(str(path)).module()  # trusted by the caller (trust_code=True)
    return torch.jit.load(str(path), map_location="cpu")  # trusted by the caller (trust_code=True)


def export_checkpoint(
    config: str | os.PathLike,
    ckpt_path: str | os.PathLike,
    directory: str | os.PathLike,
    formats: Sequence[str] = DEFAULT_FORMATS,
    batch_size: int = 2,
    quantize: str | None = None,
) -> dict[str, Path]:
    """Export the embedding model of a ``lightning-dml`` checkpoint, rebuilt from the run's config (the
    ``config.yaml`` that ``fit`` saves, or the config given to ``fit``: :func:`lightning_dml.run_model.load_run_model`).

    The example input is a batch of ``batch_size`` images from the data module's test split (so the shapes and
    preprocessing are the real ones).
    """
    from lightning_dml.run_model import load_run_model, preprocessing

    module, datamodule, _ = load_run_model(config, ckpt_path)
    datamodule.setup("test")
    images = next(iter(datamodule.test_dataloader()))[0][:batch_size]
    return export_embedding_model(module, directory, images, formats, preprocessing(module, datamodule), quantize)


def main(argv: Sequence[str] | None = None) -> None:
    parser = CommandParser(prog="python -m lightning_dml.export",
                           description="Export the embedding model of a lightning-dml checkpoint.")
    parser.add_argument("--config", required=True, help="the run's config (lightning-dml saves config.yaml)")
    parser.add_argument("--ckpt_path", required=True, help="a checkpoint written by the run (a file or an http(s) URL)")
    parser.add_argument("--output", required=True, help="output folder")
    parser.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS), choices=FORMATS,
                        help="safetensors and state_dict (default) load without running code; torchscript and "
                        "torch_export run code when loaded: share them only with people who trust you; onnx "
                        "(ONNX Runtime, verified at export) needs the onnx extra")
    parser.add_argument("--quantize", choices=("int8",), default=None,
                        help="with --formats onnx: also embedding_model.int8.onnx (dynamic int8 quantisation), its "
                        "embedding error recorded in onnx_export.json")
    args = parser.parse_args(argv)
    try:
        if args.quantize and "onnx" not in args.formats:
            raise UserInputError("--quantize int8 quantises the ONNX model: add onnx to --formats")
        written = export_checkpoint(args.config, args.ckpt_path, args.output, args.formats, quantize=args.quantize)
    except UserInputError as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    for name, path in written.items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()


__all__ = [
    "DEFAULT_FORMATS",
    "FORMATS",
    "INPUT_SPEC",
    "EmbeddingModel",
    "UnsafeFormatError",
    "architecture_record",
    "build_embedding_model",
    "embedding_model",
    "export_checkpoint",
    "export_embedding_model",
    "load_embedding_model",
    "load_safe_embedding_model",
    "preprocessing_record",
]
