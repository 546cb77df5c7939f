"""An index from a checkpoint and an image gallery (:func:`build_index`), and adding a gallery to a saved index
(:func:`add_gallery`): what ``lightning-dml index build`` and ``index add`` run.

The gallery is embedded by :func:`~lightning_dml.index.embed.predict_embeddings` (``Trainer.predict``: devices,
DDP, workers, progress bar as ``lightning-dml predict``), with the evaluation transform of the config's data module
and the backbone's input spec, and the embedding model is exported (the safe format: tensors and a JSON record
of the architecture) into the index folder, so adding and searching later need neither the config nor the
checkpoint. Lightning's device and process lines ("GPU available: ...", "TPU available: ...") and a deprecation
warning torch raises inside Lightning on every batch are not shown (:func:`quiet_lightning`): a build prints its own
summary line only (and Lightning's progress bar).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from lightning_dml.index.embed import embedding_metric, load_checkpoint_model, predict_embeddings, preprocessing
from lightning_dml.index.folder import DEFAULT_LOCK_TIMEOUT, locked, settle
from lightning_dml.index.gallery import read_items
from lightning_dml.index.index import MODEL, EmbeddingIndex, IndexTable, _stat
from lightning_dml.index.manifest import IndexFolderError, Manifest
from lightning_dml.widths import cut

__all__ = ["QUIET_LOGGERS", "add_gallery", "build_index", "quiet_lightning"]

#: Lightning's loggers of its device and process information (``INFO`` records, dropped by :func:`quiet_lightning`):
#: ``rank_zero_info``'s ("GPU available: False, used: False", "TPU available: ...", DDP's "distributed_backend=...
#: All distributed processes registered"), the CUDA accelerator's "LOCAL_RANK: 0 - CUDA_VISIBLE_DEVICES: [0]" and
#: Fabric's "Initializing distributed: GLOBAL_RANK: ..."
QUIET_LOGGERS = ("pytorch_lightning.utilities.rank_zero", "lightning_fabric.utilities.rank_zero",
                 "pytorch_lightning.accelerators.cuda", "lightning_fabric.utilities.distributed")


@contextlib.contextmanager
def quiet_lightning() -> Iterator[None]:
    """Within the block, Lightning's device and process lines are not shown (the loggers :data:`QUIET_LOGGERS` at
    level ``WARNING`` at least: Python logging's public way; Lightning's warnings and errors still show) and
    neither is torch's "``isinstance(treespec, LeafSpec)`` is deprecated", which Lightning's own ``_pytree`` raises
    on every batch (:func:`lightning_dml.cli.quiet_dependency_warnings`: that message from that module only).
    Both are restored on exit. For a predict loop that is a step of a command (``index build``), not a run the
    user configured: ``fit``/``test``/``predict`` keep Lightning's lines."""
    from lightning_dml.cli import quiet_dependency_warnings

    loggers = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [log.level for log in loggers]
    with warnings.catch_warnings():
        quiet_dependency_warnings()
        for log in loggers:
            log.setLevel(max(log.getEffectiveLevel(), logging.WARNING))
        try:
            yield
        finally:
            for log, level in zip(loggers, levels):
                log.setLevel(level)


def build_index(
    config: str | os.PathLike,
    ckpt_path: str | os.PathLike,
    gallery: str | os.PathLike,
    kind: str = "flat",
    out: str | os.PathLike | None = None,
    *,
    split: str | None = None,
    shards: int = 1,
    accelerator: str = "auto",
    devices: int | str = 1,
    strategy: str = "auto",
    num_workers: int = 0,
    batch_size: int = 128,
    progress: bool = True,
    overwrite: bool = True,
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
    width: int | None = None,
    **kind_options: Any,
) -> EmbeddingIndex | None:
    """Embed ``gallery`` (a folder of class folders or a table, :mod:`lightning_dml.index.gallery`) with the
    model of ``config`` and ``ckpt_path``, index it (``kind``, ``kind_options``, ``shards``) and, with ``out``,
    save the folder with the exported model. Returns the index on rank 0, ``None`` on the other DDP ranks.

    The folder is written whole beside ``out`` and swapped in under ``out``'s lock (:meth:`EmbeddingIndex.save`,
    :mod:`lightning_dml.index.folder`; the lock is taken after the embedding, waiting at most ``lock_timeout``
    seconds): a build stopped at any point leaves an existing index whole. ``overwrite=False`` refuses to
    replace an index folder (also one another process wrote during the embedding).

    ``width``: keep the leading ``width`` dimensions of the embeddings (a Matryoshka model,
    :mod:`lightning_dml.widths`), re-normalised for ``cosine``; the manifest records it and the index's embedder
    cuts every query the same way. A width beyond the model's embedding is a
    :class:`~lightning_dml.widths.WidthError` (after the embedding: the model's width is known then).
    """
    items = read_items(gallery, split)
    with quiet_lightning():
        module, datamodule, record = load_checkpoint_model(config, ckpt_path)
        spec, preprocess = preprocessing(module, datamodule)
        metric = embedding_metric(module)
        embeddings = predict_embeddings(
            module, items.paths, spec, preprocess, accelerator=accelerator, devices=devices, strategy=strategy,
            num_workers=num_workers, batch_size=batch_size, progress=progress,
        )
    if embeddings is None:
        return None
    if width is not None:  # nested widths: the leading dimensions, normalised (cosine) by EmbeddingIndex.build
        embeddings = cut(embeddings, width, "index build --width")
    stats = [_stat(str(p)) for p in items.paths]
    table = IndexTable(range(len(items)), [str(p) for p in items.paths], items.labels,
                       [s for s, _ in stats], [m for _, m in stats])
    manifest = {
        "checkpoint": record,
        "input_spec": dataclasses.asdict(spec),
        "preprocess": preprocess,
        "model": MODEL,
        "gallery": [str(Path(gallery).expanduser().absolute())],
        "width": width,
    }
    index = EmbeddingIndex.build(embeddings, table, kind=kind, metric=metric, manifest=manifest, shards=shards,
                                 **kind_options)
    if out is not None:
        # the model is exported into the new folder, which replaces ``out`` as a whole only once complete
        index.save(out, replace=overwrite, lock_timeout=lock_timeout, add_files=lambda staged: _export(
            module, staged, spec, preprocess))
    return index


def _export(module: Any, out: Path, spec: Any, preprocess: dict[str, Any]) -> None:
    """The embedding model as ``out/embedding_model.safetensors`` (:data:`~lightning_dml.index.index.MODEL`): the
    safe format of :mod:`lightning_dml.export`, weights as tensors and a JSON record of the architecture, so that
    loading the folder never unpickles anything its author chose; written elsewhere, then moved (never
    half-written). A model the safe format cannot rebuild (a backbone class of the user's own) is one
    :class:`~lightning_dml.models.records.UnsupportedModelError`."""
    from lightning_dml.export import export_embedding_model

    out.mkdir(parents=True, exist_ok=True)
    example = torch.zeros(2, spec.channels, preprocess["crop_size"], preprocess["crop_size"])
    with tempfile.TemporaryDirectory(dir=out, prefix=".export-") as tmp:
        written = export_embedding_model(module, tmp, example, formats=("safetensors",))
        os.replace(written["safetensors"], out / MODEL)


def add_gallery(
    index_dir: str | os.PathLike,
    gallery: str | os.PathLike,
    *,
    split: str | None = None,
    batch_size: int = 64,
    device: str = "cpu",
    lock_timeout: float = DEFAULT_LOCK_TIMEOUT,
) -> dict[str, int]:
    """Bring a saved index up to date with ``gallery``: its images not yet indexed are embedded (the exported
    model) and added; indexed images of it whose file changed (size, modification time) are re-embedded under a
    new id; the others are kept. Saves the folder and returns ``{"added", "updated", "unchanged"}``.

    The folder's lock (:func:`~lightning_dml.index.folder.locked`) is held from loading the index to saving it, so
    concurrent adds (and builds into the same folder) run one after the other and never hand out an id twice; a
    second one waits at most ``lock_timeout`` seconds, then stops with an
    :class:`~lightning_dml.index.folder.IndexBusyError` naming the holder."""
    settle(index_dir)
    Manifest.read(index_dir)  # a missing or foreign folder is reported before anything is locked
    with locked(index_dir, lock_timeout, f"lightning-dml index add --gallery {gallery}"):
        return _add_gallery(index_dir, gallery, split, batch_size, device)


def _add_gallery(index_dir: str | os.PathLike, gallery: str | os.PathLike, split: str | None, batch_size: int,
                 device: str) -> dict[str, int]:
    index = EmbeddingIndex.load(index_dir, device=device)
    if index.manifest.model is None:
        raise IndexFolderError(f"index {index_dir} has no exported model (built from tensors): use "
                               "EmbeddingIndex.add with embeddings")
    items = read_items(gallery, split)
    known = {p: r for r, p in enumerate(index.table.paths)}
    new_rows, stale_ids = [], []
    unchanged = 0
    for i, path in enumerate(items.paths):
        row = known.get(str(path))
        if row is None:
            new_rows.append(i)
        elif _stat(str(path)) != (index.table.sizes[row], index.table.mtimes[row]) or \
                items.labels[i] != index.table.labels[row]:
            stale_ids.append(int(index.table.ids[row]))
            new_rows.append(i)
        else:
            unchanged += 1
    if stale_ids:
        index.remove(stale_ids)
    if new_rows:
        embeddings = torch.cat([
            index.embed_images([items.paths[i] for i in new_rows[s : s + batch_size]])
            for s in range(0, len(new_rows), batch_size)
        ])
        index.add(embeddings, [str(items.paths[i]) for i in new_rows], [items.labels[i] for i in new_rows])
    source = str(Path(gallery).expanduser().absolute())
    if source not in index.manifest.gallery:
        index.manifest.gallery.append(source)
    index.save(index_dir)
    return {"added": len(new_rows) - len(stale_ids), "updated": len(stale_ids), "unchanged": unchanged}
