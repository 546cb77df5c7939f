"""``lightning-dml serve --runtime onnx``: the server's model on ONNX Runtime, its search unchanged.

:class:`ServedOnnxModel` gives the index folder's ONNX model (:func:`~lightning_dml.onnx.folder_search.onnx_embedder`)
the shape of the :class:`~lightning_dml.index.embed.ImageEmbedder` the server's worker uses (``mode``, ``transform``
of a PIL image to the model input, ``model`` of a batch, ``device``, ``batch_size``): the pixels are
:class:`~lightning_dml.onnx.runtime.PixelTransform`'s (equal to the torch runtime's), the embeddings ONNX Runtime's,
handed to the same search, re-ranking, cuts and calibrated ``match`` flags as tensors; an index built with
``--width`` gets its queries cut to that width (the embedder's ``width``, from the manifest).
"""

from __future__ import annotations

from typing import Any

import torch
from PIL import Image

from lightning_dml.errors import UserInputError
from lightning_dml.onnx.folder_search import onnx_embedder

__all__ = ["ServedOnnxModel"]


class ServedOnnxModel:
    """The ONNX model of ``index`` (an :class:`~lightning_dml.index.EmbeddingIndex` loaded from a folder) on
    ``device`` (LitServe's: ``cpu``, or ``cuda:<i>``: onnxruntime's CUDA provider where it has one, on its first
    GPU), as the server's embedder."""

    def __init__(self, index: Any, device: str = "cpu") -> None:
        if getattr(index, "folder", None) is None:
            raise UserInputError("--runtime onnx serves an index folder (its embedding_model.onnx), not this store")
        # a GPU worker: CUDA where this onnxruntime has it, else its CPU provider (onnxruntime without CUDA)
        self.onnx = onnx_embedder(index.folder, index.manifest, "cpu" if str(device) == "cpu" else "auto")
        self.mode = self.onnx.mode
        self.batch_size = self.onnx.batch_size
        self.device = torch.device("cpu")  # inputs stay on the host: onnxruntime copies them to its device

    def transform(self, image: Image.Image) -> torch.Tensor:
        return torch.from_numpy(self.onnx.transform(image))

    def model(self, pixels: torch.Tensor) -> torch.Tensor:
        return torch.from_numpy(self.onnx.embed_pixels(pixels.numpy()))
