"""Embedding images for an index: a checkpoint through Lightning's predict loop (gallery), the exported model
(queries).

* :func:`load_checkpoint_model`: the ``DMLModule`` of a run's config with a checkpoint's weights (read safely,
  :func:`~lightning_dml.checkpoints.read_checkpoint`; another architecture or width is one
  :class:`~lightning_dml.checkpoints.CheckpointMismatchError`), and the evaluation preprocessing of the config's
  data module (:func:`preprocessing`: the backbone's :class:`~lightning_dml.models.input_spec.InputSpec`, the crop
  and resize sizes).
* :func:`predict_embeddings`: the raw embeddings of image files by ``Trainer.predict`` (devices, DDP, workers and
  the progress bar as ``lightning-dml predict`` has them), gathered by
  :class:`~lightning_dml.callbacks.PredictionWriter` (rank 0 returns them, the other ranks ``None``).
* :class:`ImageEmbedder`: the index folder's model (the safe format of :mod:`lightning_dml.export`: tensors only
  and a JSON record of the architecture, rebuilt from the library's own classes: nothing in the folder is
  unpickled) and the same preprocessing, batched, on a device: what search uses, with no training config.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import Tensor
from torch.utils.data import DataLoader

from lightning_dml.data.image_list import ImageListDataset, collate_skipping, load_image
from lightning_dml.data.pil_eval import PILEvalTransform
from lightning_dml.errors import UserInputError
from lightning_dml.models.input_spec import InputSpec
from lightning_dml.run_model import preprocessing

__all__ = [
    "ImageEmbedder",
    "embedding_metric",
    "load_checkpoint_model",
    "predict_embeddings",
    "preprocessing",
]


def embedding_metric(module: Any) -> str:
    """The metric the model is evaluated with (its test metrics' ``metric``: ``cosine`` or ``euclidean``)."""
    metrics = getattr(module, "test_metrics", None)
    return str(getattr(metrics, "metric", "cosine"))


def load_checkpoint_model(config: str | os.PathLike, ckpt_path: str | os.PathLike) -> tuple[Any, Any, dict | None]:
    """``(module, datamodule, checkpoint record)``: the config's model (in eval mode) with the checkpoint's weights,
    and its data module with the backbone's input spec adopted (not set up: no dataset is read). The config is the
    one ``fit`` saves or the one given to ``fit`` (:func:`lightning_dml.run_model.load_run_model`)."""
    from lightning_dml.run_model import load_run_model

    return load_run_model(config, ckpt_path)


def predict_embeddings(
    module: Any,
    paths: Sequence[Path],
    spec: InputSpec,
    preprocess: dict[str, Any],
    *,
    accelerator: str = "auto",
    devices: int | str = 1,
    strategy: str = "auto",
    num_workers: int = 0,
    batch_size: int = 128,
    progress: bool = True,
    callbacks: Sequence[Any] = (),
) -> Tensor | None:
    """Raw embeddings ``[N, D]`` (float32, CPU) of ``paths`` in order, computed by ``Trainer.predict``.

    Under DDP every process embeds its share; rank 0 returns all of them, the other ranks ``None``. A file that
    cannot be decoded is one :class:`~lightning_dml.data.image_list.CorruptImageError` naming it. ``callbacks``:
    more Lightning callbacks of the predict run (e.g. a timer).
    """
    import pytorch_lightning as pl

    from lightning_dml.callbacks.predictions import PredictionWriter
    from lightning_dml.cli import quiet_lightning_tips

    from lightning_dml.data.transforms import eval_transform

    quiet_lightning_tips()
    transform = eval_transform(spec, preprocess["crop_size"], preprocess["resize_size"])
    dataset = ImageListDataset(
        list(paths), torch.arange(len(paths)), transform, mode=preprocess["mode"], split="gallery", evaluation=True
    )
    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers, collate_fn=collate_skipping,
        persistent_workers=False,
    )
    with tempfile.TemporaryDirectory(prefix="lightning-dml-index-") as tmp:
        writer = PredictionWriter(str(Path(tmp) / "gallery.pt"), announce=False)  # a temporary file: no "wrote" line
        trainer = pl.Trainer(
            accelerator=accelerator, devices=devices, strategy=strategy, logger=False, enable_checkpointing=False,
            enable_model_summary=False, enable_progress_bar=progress, callbacks=[writer, *callbacks],
            inference_mode=True, default_root_dir=tmp,
        )
        trainer.predict(module, dataloaders=loader, return_predictions=False)
        if not trainer.is_global_zero:
            return None
        data = torch.load(writer.written_path, map_location="cpu", weights_only=True)
    if data["indices"].numel() != len(paths) or not torch.equal(data["indices"], torch.arange(len(paths))):
        raise RuntimeError(f"predict returned {data['indices'].numel()} of {len(paths)} gallery items")
    return data["embeddings"].float()


class ImageEmbedder:
    """Embeds images with an index folder's model (``embedding_model.safetensors``, the safe format of
    :mod:`lightning_dml.export`) and the index's preprocessing.

    The model is rebuilt from the file's architecture record and its tensors
    (:func:`~lightning_dml.export.load_safe_embedding_model`): nothing the folder's author chose is unpickled or
    imported. A model in the old ``torch.export`` format (``embedding_exported.pt2``, written by lightning-dml
    before the safe format) is refused, not loaded (loading it can run code from the file): one
    :class:`~lightning_dml.index.manifest.IndexFolderError` saying to rebuild the index.

    ``embedder(images)`` takes image paths or PIL images and returns raw embeddings ``[N, D]`` on ``device``,
    computed in batches of ``batch_size`` (eval-mode models embed each image independently of its batch). An
    unreadable file is a :class:`~lightning_dml.errors.UserInputError` naming it.
    """

    def __init__(self, model_path: str | os.PathLike, spec: InputSpec, preprocess: dict[str, Any],
                 device: str | torch.device = "cpu", batch_size: int = 64, width: int | None = None) -> None:
        from lightning_dml.export import load_safe_embedding_model
        from lightning_dml.index.manifest import IndexFolderError

        model_path = Path(model_path)
        if model_path.suffix != ".safetensors":
            raise IndexFolderError(
                f"index folder {model_path.parent}: its model {model_path.name} is not in the safe format and is not "
                "loaded (a torch.export or TorchScript file runs code chosen by whoever wrote it): rebuild the index "
                "with this version of lightning-dml index build, which stores embedding_model.safetensors (tensors "
                "and a JSON record only)"
            )
        self.device = torch.device(device)
        self.model = load_safe_embedding_model(model_path)
        if width is not None:  # index build --width: the leading dimensions only (lightning_dml.widths)
            from lightning_dml.widths import LeadingDims

            self.model = LeadingDims(self.model, width)
        if self.device.type != "cpu":
            self.model = self.model.to(self.device)
        self.spec = spec
        self.mode = preprocess["mode"]
        # eval_transform's result without importing torchvision (seconds of search's start-up)
        self.transform = PILEvalTransform(spec, preprocess["crop_size"], preprocess["resize_size"])
        self.batch_size = int(batch_size)

    def _pixels(self, image: str | os.PathLike | Image.Image) -> Tensor:
        if isinstance(image, Image.Image):
            return self.transform(image.convert(self.mode) if image.mode != self.mode else image)
        try:
            return self.transform(load_image(Path(image), self.mode))
        except FileNotFoundError:
            raise UserInputError(f"query image {image} does not exist") from None
        except Exception as error:  # noqa: BLE001 - any decoder failure names the file
            detail = " ".join(f"{type(error).__name__}: {error}".split())
            raise UserInputError(f"query image {image} cannot be read as an image ({detail})") from None

    @torch.no_grad()
    def __call__(self, images: Sequence[str | os.PathLike | Image.Image]) -> Tensor:
        images = list(images)
        if not images:
            raise ValueError("embed_images: no image given")
        out = []
        for start in range(0, len(images), self.batch_size):
            batch = torch.stack([self._pixels(image) for image in images[start : start + self.batch_size]])
            out.append(self.model(batch.to(self.device, non_blocking=True)).float())
        return torch.cat(out)
