"""``lightning-dml index build --runtime onnx``: an index whose gallery is embedded by the ONNX export of the model.

:func:`build_index_onnx` does what :func:`~lightning_dml.index.build.build_index` does, with ONNX Runtime in place
of Lightning's predict loop: the checkpoint's embedding model is exported to ONNX and verified against PyTorch on
the gallery's first images (:func:`~lightning_dml.onnx.export.export_onnx`: the export fails beyond its tolerance),
the gallery is embedded by :class:`~lightning_dml.onnx.runtime.OnnxEmbedder` (one process; ``device``: cpu, cuda or
auto), and the folder gets, beside the files of every index (the safe-format model included, so ``index add`` and
``search --runtime torch`` work on it), ``embedding_model.onnx`` and ``onnx_export.json``. ``width`` (``index build
--width``) keeps the leading dimensions of the embeddings as :func:`~lightning_dml.index.build.build_index` does
(recorded in the manifest: the ONNX and torch embedders of the folder cut every query the same way); the kind's
options include the compressed vectors of :mod:`lightning_dml.index.vectors` (``vectors``, ``rescore``).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_dml.onnx.runtime import ONNX_MODEL, ONNX_RECORD, OnnxEmbedder, PixelTransform

__all__ = ["build_index_onnx"]


def build_index_onnx(
    config: str | os.PathLike,
    ckpt_path: str | os.PathLike,
    gallery: str | os.PathLike,
    kind: str = "flat",
    out: str | os.PathLike | None = None,
    *,
    split: str | None = None,
    shards: int = 1,
    device: str = "cpu",
    batch_size: int = 128,
    overwrite: bool = True,
    lock_timeout: float = 600.0,
    width: int | None = None,
    **kind_options: Any,
) -> Any:
    """The :class:`~lightning_dml.index.EmbeddingIndex` of ``gallery`` embedded by ONNX Runtime (module docstring),
    saved to ``out`` when given (as a whole, under its lock, as ``build_index`` saves)."""
    from lightning_dml.export import embedding_model, export_embedding_model
    from lightning_dml.index.embed import embedding_metric, load_checkpoint_model, preprocessing
    from lightning_dml.index.gallery import read_items
    from lightning_dml.index.index import MODEL, EmbeddingIndex, IndexTable, _stat
    from lightning_dml.onnx.export import export_onnx
    from lightning_dml.widths import cut

    items = read_items(gallery, split)
    module, datamodule, record = load_checkpoint_model(config, ckpt_path)
    spec, preprocess = preprocessing(module, datamodule)
    spec_record = dataclasses.asdict(spec)
    model = embedding_model(module)
    with tempfile.TemporaryDirectory(prefix="lightning-dml-onnx-") as tmp:
        staging = Path(tmp)
        transform = PixelTransform(spec_record, preprocess)  # the verification's samples: the gallery's first images
        samples = torch.from_numpy(np.stack([transform.read(p) for p in items.paths[:2]]))
        export_onnx(model, samples, staging)
        embedder = OnnxEmbedder(staging / ONNX_MODEL, spec_record, preprocess, device=device, batch_size=batch_size)
        embeddings = cut(torch.from_numpy(embedder(items.paths)), width, "index build --width")
        stats = [_stat(str(p)) for p in items.paths]
        table = IndexTable(range(len(items)), [str(p) for p in items.paths], items.labels,
                           [s for s, _ in stats], [m for _, m in stats])
        manifest = {"checkpoint": record, "input_spec": spec_record, "preprocess": preprocess, "model": MODEL,
                    "gallery": [str(Path(gallery).expanduser().absolute())], "width": width}
        index = EmbeddingIndex.build(embeddings, table, kind=kind, metric=embedding_metric(module),
                                     manifest=manifest, shards=shards, **kind_options)
        if out is None:
            return index

        def add_files(folder: Path) -> None:
            export_embedding_model(module, staging / "safe", samples, formats=("safetensors",))
            os.replace(staging / "safe" / MODEL, folder / MODEL)
            for name in (ONNX_MODEL, ONNX_RECORD):
                shutil.copy2(staging / name, folder / name)

        index.save(out, replace=overwrite, lock_timeout=lock_timeout, add_files=add_files)
    return index
