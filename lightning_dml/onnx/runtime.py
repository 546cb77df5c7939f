"""Embedding images with an exported ONNX model through ONNX Runtime, without PyTorch.

:class:`OnnxEmbedder` is the ONNX counterpart of :class:`~lightning_dml.index.embed.ImageEmbedder`: the same
preprocessing (the index's ``input_spec`` and ``preprocess`` records: the image read by
:func:`~lightning_dml.data.image_decode.load_image`, resized and centre-cropped by PIL as
:class:`~lightning_dml.data.pil_eval.PILEvalTransform` does, then ``(x * scale / 255 - mean) / std`` in float32 in
the spec's channel order, :class:`~lightning_dml.data.transforms.ToInputSpec`), then the ONNX model, which takes the
**preprocessed** float32 pixel tensor ``images [B, C, H, W]`` (dynamic ``B``) and returns the raw embeddings
``embeddings [B, D]`` (not L2-normalised), as every format of :mod:`lightning_dml.export` does.

The pixels equal ``PILEvalTransform``'s bit for bit (``tests/test_onnx.py`` compares them); the embeddings equal the
PyTorch model's within the tolerance checked at export (:mod:`lightning_dml.onnx.export`). This module imports
numpy, PIL and onnxruntime only: ``lightning-dml search --runtime onnx`` runs where torch is not installed.

An ONNX file is a protobuf of operators and tensors: loading it runs no code of its author's choosing (no custom
operator library is registered here).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from lightning_dml.errors import UserInputError

__all__ = ["ONNX_MODEL", "ONNX_INT8_MODEL", "ONNX_RECORD", "OnnxEmbedder", "OnnxRuntimeError", "PixelTransform",
           "onnxruntime_module", "providers_for"]

#: the float32 ONNX model, the int8 (dynamically quantised) one, and the export's record (JSON), as written into an
#: export folder or an index folder
ONNX_MODEL = "embedding_model.onnx"
ONNX_INT8_MODEL = "embedding_model.int8.onnx"
ONNX_RECORD = "onnx_export.json"

#: PIL's filter for each interpolation name of an input spec (as :data:`lightning_dml.data.pil_eval.PIL_FILTERS`)
_FILTERS = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC,
            "nearest": Image.Resampling.NEAREST}


class OnnxRuntimeError(UserInputError, RuntimeError):
    """onnxruntime missing, a provider asked for that it does not have, or an ONNX model that cannot be loaded."""


def onnxruntime_module() -> Any:
    """The ``onnxruntime`` module, or one line saying how to install it."""
    try:
        import onnxruntime
    except ImportError:
        raise OnnxRuntimeError("the ONNX runtime needs onnxruntime: pip install 'lightning-dml[onnx]' "
                               "(onnxruntime-gpu for the CUDA provider)") from None
    return onnxruntime


def providers_for(device: str) -> list[str]:
    """onnxruntime's execution providers for ``device``: ``cpu`` -> the CPU provider; ``auto`` -> CUDA first where
    this onnxruntime has it; ``cuda`` (or ``cuda:N``) -> CUDA, refused in one line where it is missing."""
    ort = onnxruntime_module()
    available = ort.get_available_providers()
    name = str(device).split(":")[0]
    if name == "cpu":
        return ["CPUExecutionProvider"]
    if name not in ("auto", "cuda"):
        raise OnnxRuntimeError(f"--device {device}: the ONNX runtime runs on cpu, cuda or auto")
    if "CUDAExecutionProvider" in available:
        return ["CUDAExecutionProvider", "CPUExecutionProvider"]
    if name == "cuda":
        raise OnnxRuntimeError(f"--device {device}: this onnxruntime has no CUDAExecutionProvider (it has "
                               f"{', '.join(available)}): pip install onnxruntime-gpu, or use --device cpu")
    return ["CPUExecutionProvider"]


def _resized_size(width: int, height: int, shorter: int) -> tuple[int, int]:
    # torchvision's Resize(shorter) on a PIL image: the longer side truncated (lightning_dml.data.pil_eval)
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shorter * long / short)
    return (shorter, new_long) if width <= height else (new_long, shorter)


class PixelTransform:
    """A PIL image -> the float32 ``[C, crop, crop]`` model input of an index's ``input_spec`` and ``preprocess``
    records, with PIL and NumPy only: what :class:`~lightning_dml.data.pil_eval.PILEvalTransform` computes."""

    def __init__(self, input_spec: dict[str, Any], preprocess: dict[str, Any]) -> None:
        try:
            self.crop = int(preprocess["crop_size"])
            self.resize = int(preprocess["resize_size"])
            self.mode = str(preprocess["mode"])
            self.color = str(input_spec["color"])
            self.scale = float(input_spec["scale"])
            self.filter = _FILTERS[input_spec.get("interpolation", "bilinear")]
            channels = 1 if self.color == "L" else 3
            self.mean = np.asarray(input_spec["mean"], dtype=np.float32).reshape(channels, 1, 1)
            self.std = np.asarray(input_spec["std"], dtype=np.float32).reshape(channels, 1, 1)
        except (KeyError, TypeError, ValueError) as error:
            raise OnnxRuntimeError(f"the index's input_spec/preprocess records are incomplete ({error!r})") from None
        self.channels = channels

    def __call__(self, image: Image.Image) -> np.ndarray:
        if image.mode != self.mode:
            image = image.convert(self.mode)
        size = _resized_size(image.width, image.height, self.resize)
        if size != image.size:
            image = image.resize(size, self.filter)
        top = int(round((image.height - self.crop) / 2.0))
        left = int(round((image.width - self.crop) / 2.0))
        image = image.crop((left, top, left + self.crop, top + self.crop))
        pixels = np.array(image, copy=True).reshape(image.height, image.width, -1).transpose(2, 0, 1)
        if self.color == "BGR":
            pixels = pixels[::-1]
        out = pixels.astype(np.float32)  # the float32 operations of ToInputSpec.into, in its order
        out *= np.float32(self.scale / 255.0)
        out -= self.mean
        out /= self.std
        return out

    def read(self, image: str | os.PathLike | Image.Image) -> np.ndarray:
        """The model input of an image file (read by :func:`~lightning_dml.data.image_decode.load_image`, as the
        data sets read it) or a PIL image; an unreadable file is one line naming it."""
        from lightning_dml.data.image_decode import load_image

        if isinstance(image, Image.Image):
            return self(image)
        try:
            return self(load_image(Path(image), self.mode))
        except FileNotFoundError:
            raise UserInputError(f"query image {image} does not exist") from None
        except Exception as error:  # noqa: BLE001 - any decoder failure names the file
            detail = " ".join(f"{type(error).__name__}: {error}".split())
            raise UserInputError(f"query image {image} cannot be read as an image ({detail})") from None


class OnnxEmbedder:
    """Embeds images (paths or PIL images) with an ONNX model: ``embedder(images)`` -> raw embeddings ``[N, D]``
    float32 (NumPy), in batches of ``batch_size``; ``embed_pixels`` embeds model inputs (``PixelTransform``'s).

    ``device``: ``cpu``, ``cuda`` or ``auto`` (:func:`providers_for`). ``width``: keep the leading ``width``
    dimensions of each embedding (an index built with ``index build --width``, as the torch embedder's
    :class:`~lightning_dml.widths.LeadingDims`; the search normalises them for ``cosine``). An unreadable query is
    one :class:`~lightning_dml.errors.UserInputError` naming it, as with the PyTorch embedder."""

    def __init__(self, model_path: str | os.PathLike, input_spec: dict[str, Any], preprocess: dict[str, Any],
                 device: str = "cpu", batch_size: int = 64, width: int | None = None) -> None:
        ort = onnxruntime_module()
        model_path = Path(model_path)
        if not model_path.is_file():
            raise OnnxRuntimeError(f"no ONNX model at {model_path}")
        self.providers = providers_for(device)
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: no provider notices on stderr
        try:
            self.session = ort.InferenceSession(str(model_path), options, providers=self.providers)
        except Exception as error:  # noqa: BLE001 - onnxruntime's load errors (not ONNX, truncated) name no file
            detail = " ".join(str(error).split())[:300]
            raise OnnxRuntimeError(f"ONNX model {model_path} cannot be loaded ({detail})") from None
        self.input_name = self.session.get_inputs()[0].name
        self.transform = PixelTransform(input_spec, preprocess)
        self.mode = self.transform.mode
        self.batch_size = int(batch_size)
        self.width = None if width is None else int(width)
        self.device = "cuda" if self.providers[0] == "CUDAExecutionProvider" else "cpu"

    def pixels(self, image: str | os.PathLike | Image.Image) -> np.ndarray:
        """The model input ``[C, H, W]`` of one image (a path or a PIL image): :meth:`PixelTransform.read`."""
        return self.transform.read(image)

    def embed_pixels(self, pixels: Sequence[np.ndarray] | np.ndarray) -> np.ndarray:
        """Raw embeddings ``[N, D]`` (float32) of model inputs ``[N, C, H, W]``, in batches of ``batch_size``."""
        batch = np.ascontiguousarray(np.stack(list(pixels)) if not isinstance(pixels, np.ndarray) else pixels,
                                     dtype=np.float32)
        out = [self.session.run(None, {self.input_name: batch[s : s + self.batch_size]})[0]
               for s in range(0, len(batch), self.batch_size)]
        out = np.concatenate(out).astype(np.float32, copy=False)
        if self.width is None:
            return out
        if self.width > out.shape[1]:
            raise OnnxRuntimeError(f"width {self.width} exceeds the ONNX model's embedding width D = {out.shape[1]}")
        return out[:, : self.width]

    def __call__(self, images: Sequence[str | os.PathLike | Image.Image]) -> np.ndarray:
        images = list(images)
        if not images:
            raise ValueError("OnnxEmbedder: no image given")
        out = [self.embed_pixels([self.pixels(image) for image in images[s : s + self.batch_size]])
               for s in range(0, len(images), self.batch_size)]
        return np.concatenate(out)
