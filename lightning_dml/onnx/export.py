"""The embedding model as an ONNX file, verified against PyTorch at export, optionally quantised to int8.

:func:`export_onnx` writes ``embedding_model.onnx``: the function of :mod:`lightning_dml.export`'s formats, images
``[B, C, H, W]`` preprocessed as the model's :class:`~lightning_dml.models.input_spec.InputSpec` says (the data
module's evaluation transform: ``input_spec.json`` beside it, or an index folder's manifest) -> raw embeddings
``[B, D]``, with a dynamic batch axis (input ``images``, output ``embeddings``). The exporter is torch's
TorchScript-based ``torch.onnx.export(..., dynamo=False)`` (opset :data:`OPSET`): it needs only the ``onnx``
package, where the ``torch.export``-based exporter (torch's default since 2.9) also needs ``onnxscript``; torch 2.14
marks the TorchScript-based one deprecated, so the export says which it used in its record.

**Verification.** The file is loaded by onnxruntime (CPU provider) and run on the sample inputs (the example batch,
and one more image so that a second batch size is checked); the export fails, in one line giving the difference,
unless every embedding ``e`` of the ONNX model is within the relative tolerance of the PyTorch model's ``r``:
:func:`embedding_error` ``= max over rows of ||e - r||_2 / ||r||_2 <= tolerance`` (default :data:`TOLERANCE`,
1e-4: float32 kernels of two engines differ in their summation order, about 1e-7 relative on the test models).

**int8** (``quantize="int8"``): onnxruntime's dynamic quantisation (``quantize_dynamic``, int8 weights, activations
quantised per batch at run time) of the verified file into ``embedding_model.int8.onnx``; its error against PyTorch
on the same samples is measured and recorded, not bounded (it is a lossy compression; docs/serving.md gives its
retrieval drop on the Glyphs test gallery).

Both files and the record ``onnx_export.json`` (the exporter, opset, versions, tolerance, the errors measured) are
written under temporary names and renamed when complete.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from lightning_dml.errors import UserInputError
from lightning_dml.onnx.runtime import ONNX_INT8_MODEL, ONNX_MODEL, ONNX_RECORD, onnxruntime_module

__all__ = ["OPSET", "QUANTIZE", "TOLERANCE", "OnnxExportError", "embedding_error", "export_onnx"]

#: the ONNX opset of the export
OPSET = 17
#: the largest relative error (:func:`embedding_error`) of the ONNX model's embeddings accepted at export
TOLERANCE = 1e-4
#: what ``quantize`` accepts
QUANTIZE = ("int8",)


class OnnxExportError(UserInputError, RuntimeError):
    """The ONNX model does not reproduce the PyTorch model's embeddings, or the export cannot run."""


def embedding_error(test: np.ndarray, reference: np.ndarray) -> float:
    """``max_i ||test_i - reference_i||_2 / ||reference_i||_2`` in float64 (a zero reference row counts its absolute
    error): the relative error of the worst embedding, which bounds the change of its cosine similarities."""
    test, reference = np.asarray(test, dtype=np.float64), np.asarray(reference, dtype=np.float64)
    if test.shape != reference.shape:
        return float("inf")
    norms = np.linalg.norm(reference, axis=1)
    errors = np.linalg.norm(test - reference, axis=1) / np.where(norms > 0, norms, 1.0)
    return float(errors.max()) if errors.size else 0.0


def _run(path: Path, inputs: np.ndarray) -> np.ndarray:
    ort = onnxruntime_module()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: inputs})[0]


def _onnx_export(model: nn.Module, example: torch.Tensor, path: Path) -> None:
    try:
        import onnx  # noqa: F401 - torch.onnx.export needs it
    except ImportError:
        raise OnnxExportError("the ONNX export needs onnx: pip install 'lightning-dml[onnx]'") from None
    with warnings.catch_warnings(), torch.no_grad():
        # torch 2.14 warns that the TorchScript-based exporter is deprecated (the module docstring says why it is used)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", message=".*legacy TorchScript-based ONNX export.*")
        torch.onnx.export(model, (example,), str(path), dynamo=False, input_names=["images"],
                          output_names=["embeddings"], opset_version=OPSET, do_constant_folding=True,
                          dynamic_axes={"images": {0: "batch"}, "embeddings": {0: "batch"}})


def _quantize_int8(source: Path, target: Path) -> None:
    import logging

    onnxruntime_module()
    from onnxruntime.quantization import QuantType, quantize_dynamic

    logger = logging.getLogger()  # quantize_dynamic logs a pre-processing hint on the root logger
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        quantize_dynamic(str(source), str(target), weight_type=QuantType.QInt8)
    finally:
        logger.setLevel(level)


def _staged(path: Path) -> Path:
    return path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")


def export_onnx(model: nn.Module, example: torch.Tensor, directory: str | os.PathLike, *,
                tolerance: float = TOLERANCE, quantize: str | None = None) -> dict[str, Any]:
    """Write ``model`` (an :class:`~lightning_dml.export.EmbeddingModel`: CPU, eval mode) to ``directory`` as
    ``embedding_model.onnx`` (and ``embedding_model.int8.onnx`` with ``quantize="int8"``), verified on ``example``
    (preprocessed images ``[B, C, H, W]``, B >= 1) and one more image (module docstring), and write the record
    ``onnx_export.json``. Returns the record; a difference over ``tolerance`` is an :class:`OnnxExportError` and
    leaves no file behind."""
    if quantize is not None and quantize not in QUANTIZE:
        raise OnnxExportError(f"--quantize {quantize}: expected one of {', '.join(QUANTIZE)}")
    if not tolerance > 0:
        raise OnnxExportError(f"the ONNX tolerance must be > 0, got {tolerance}")
    onnxruntime_module()
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    example = example.detach().float().cpu()
    samples = torch.cat([example, example[:1].flip(-1)])  # one more image: a second batch size is checked too
    with torch.no_grad():
        reference = model(samples).float().numpy()
    target = out / ONNX_MODEL
    staged = _staged(target)
    staged_int8 = _staged(out / ONNX_INT8_MODEL)
    try:
        _onnx_export(model, example, staged)
        error = embedding_error(_run(staged, samples.numpy()), reference)
        if not error <= tolerance:  # also NaN
            raise OnnxExportError(
                f"the ONNX model does not reproduce the PyTorch embeddings: max relative error {error:.3g} > tolerance "
                f"{tolerance:g} on {len(samples)} sample images (an operator exported differently; nothing written)"
            )
        record: dict[str, Any] = {
            "format": 1, "file": ONNX_MODEL, "exporter": "torch.onnx.export (TorchScript-based, dynamo=False)",
            "opset": OPSET, "torch": torch.__version__, "onnxruntime": onnxruntime_module().__version__,
            "input": "images", "output": "embeddings", "input_shape": [int(v) for v in example.shape[1:]],
            "embedding_dim": int(reference.shape[1]), "normalized": False, "tolerance": float(tolerance),
            "samples": int(len(samples)), "max_relative_error": error, "int8": None,
        }
        if quantize == "int8":
            _quantize_int8(staged, staged_int8)
            quantised = _run(staged_int8, samples.numpy())
            cosines = np.sum(_unit(quantised) * _unit(reference), axis=1)
            record["int8"] = {"file": ONNX_INT8_MODEL, "method": "onnxruntime quantize_dynamic (QInt8 weights)",
                              "max_relative_error": embedding_error(quantised, reference),
                              "min_cosine_to_torch": float(cosines.min())}
            os.replace(staged_int8, out / ONNX_INT8_MODEL)
        os.replace(staged, target)
        record_path = out / ONNX_RECORD
        staged_record = _staged(record_path)
        staged_record.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(staged_record, record_path)
    finally:
        for leftover in (staged, staged_int8):
            leftover.unlink(missing_ok=True)
    return record


def _unit(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)
