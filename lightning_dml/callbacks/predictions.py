"""``PredictionWriter``: the one predictions file ``lightning-dml predict`` writes, and :func:`load_predictions`."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import os
import sys
import tempfile

import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BasePredictionWriter

from lightning_dml.checkpoints import checkpoint_record, read_torch_file
from lightning_dml.distributed import all_gather_object
from lightning_dml.errors import CorruptFileError, UserInputError
from lightning_dml.runs import run_folder

__all__ = ["PredictionWriter", "check_output_path", "describe_predictions", "load_predictions"]


def _merge_predictions(outputs: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate ``predict_step`` outputs (CPU) into one ``embeddings``/``labels``/``indices`` dict."""
    merged: dict[str, list[torch.Tensor]] = {"embeddings": [], "labels": [], "indices": []}
    for out in outputs:
        if "indices" not in out:
            raise ValueError(
                "PredictionWriter needs the dataset index of every item: predict_step must return 'indices' "
                "(DMLModule does when the batch is (image, label, index, ...), as every data module yields)"
            )
        for key in merged:
            merged[key].append(torch.as_tensor(out[key]).detach().cpu())
    if not merged["indices"]:
        empty = torch.empty(0, dtype=torch.long)
        return {"embeddings": torch.empty(0, 0), "labels": empty, "indices": empty}
    return {k: torch.cat(v) for k, v in merged.items()}


def _sorted_unique(merged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The items sorted by index, each index once (the first occurrence)."""
    indices = merged["indices"].long()
    order = torch.sort(indices, stable=True).indices
    sorted_indices = indices[order]
    keep = torch.ones_like(sorted_indices, dtype=torch.bool)
    keep[1:] = sorted_indices[1:] != sorted_indices[:-1]
    order = order[keep]
    return {
        "embeddings": merged["embeddings"][order].float(),
        "labels": merged["labels"][order].long(),
        "indices": indices[order],
    }


def _item_fields(dataset: Any, indices: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """The dataset's query/gallery masks, sequence and category ids of the items ``indices`` (``None`` where the
    dataset has no such field)."""
    out: dict[str, torch.Tensor | None] = {}
    for name, dtype in (("query_mask", torch.bool), ("gallery_mask", torch.bool), ("sequence", torch.long),
                        ("category", torch.long)):
        values = getattr(dataset, name, None)
        out[name] = None if values is None else torch.as_tensor(values).to("cpu", dtype)[indices]
    return out


def _names(datamodule: Any) -> dict[str, list[str] | None]:
    """The data module's ``class_names`` and ``category_names`` as lists of text (``None`` where it has none)."""
    out: dict[str, list[str] | None] = {}
    for name in ("class_names", "category_names"):
        values = getattr(datamodule, name, None)
        out[name] = [str(v) for v in values] if isinstance(values, (list, tuple)) and len(values) else None
    return out


class PredictionWriter(BasePredictionWriter):
    """Write everything ``predict`` computed into ONE file, loadable with :func:`load_predictions`.

    The file (``torch.save``) holds a dict:

    * ``embeddings``: float32 ``[N, D]`` raw embeddings (``DMLModule.forward``; L2-normalise for cosine search),
    * ``labels``: int64 ``[N]``, ``indices``: int64 ``[N]`` (position of the item in the predicted dataset; sorted,
      each once),
    * ``paths``: ``list[str]`` of the image file of each item when the predicted dataset has ``paths`` (the file
      data modules: CUB-200, Cars196, SOP, In-Shop, image folders and lists), else ``None`` (in-memory datasets such
      as Glyphs, whose ``labels`` index ``GlyphsDataModule.class_names``, one character per class),
    * ``query_mask``, ``gallery_mask``: bool ``[N]``, and ``sequence``, ``category``: int64 ``[N]`` (-1: none), in
      the order of ``indices``, when the predicted dataset has them (query/gallery benchmarks such as In-Shop, and
      the tables of :class:`~lightning_dml.data.CSVDataModule`), else ``None``;
    * ``class_names``, ``category_names``: ``list[str]``, the name of each label id and category id, when the data
      module has them (``class_names`` of Glyphs, image folders and tables, ``category_names`` of tables and SOP),
      else ``None``. :meth:`~lightning_dml.retrieval.RetrievalResults.from_predictions` reads all of these, so the
      results of a ``predict`` rank queries against the gallery, ignore the query's sequence and name classes and
      categories as the test metrics do (files written before these keys existed lack them);
    * ``checkpoint``: the checkpoint the trainer restored the weights from for this ``predict``
      (``trainer.ckpt_path``) as ``{"path": absolute path, "sha256": hex digest}``
      (:func:`~lightning_dml.checkpoints.checkpoint_record`), or ``None`` when it restored none: the module's
      weights as they were, which through ``lightning-dml predict`` without ``--ckpt_path`` are the
      configuration's initial weights. (Files written before this key existed lack it.)

    Under DDP every process sends its items (on CPU) to the others
    (:func:`lightning_dml.distributed.all_gather_object`); rank 0 drops duplicate indices and writes the single
    file (written to a temporary file renamed into place: a reader never sees half of it) and prints one line: the
    path, the number of rows, the embedding width, the kind of labels and the checkpoint. ``lightning-dml predict``
    adds one writing ``predictions.pt`` into the run's own folder (:func:`~lightning_dml.runs.run_folder`:
    ``--trainer.default_root_dir`` when given, else the logger's folder of this run, such as
    ``logs/wandb/offline-run-<time>-<id>/``), never into the logger's ``save_dir`` shared by every run. Only one
    predict dataloader is supported.

    ``lightning-dml predict --output PATH`` writes the file to ``PATH`` instead (checked before the model runs:
    :func:`check_output_path`).

    Args:
        output_path: the file; ``<run folder>/predictions.pt`` (:func:`~lightning_dml.runs.run_folder`) when ``None``.
        announce: print the line saying what was written (``False`` for a caller's temporary file, such as the
            gallery embeddings of ``lightning-dml index build``).
    """

    def __init__(self, output_path: str | None = None, announce: bool = True) -> None:
        super().__init__(write_interval="epoch")
        self.output_path = output_path
        self.announce = announce
        self.written_path: Path | None = None

    def resolve_path(self, trainer: pl.Trainer) -> Path:
        """Where the file goes for this trainer (call it on every process: ``trainer.log_dir`` is a collective; only
        global rank 0's answer is the file's)."""
        if self.output_path is not None:
            return Path(self.output_path)
        log_dir = trainer.log_dir  # every process takes part in this collective
        if not trainer.is_global_zero:
            return Path(log_dir or trainer.default_root_dir) / "predictions.pt"
        return run_folder(trainer) / "predictions.pt"

    @staticmethod
    def _dataset(trainer: pl.Trainer) -> Any:
        loaders = trainer.predict_dataloaders
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0] if len(loaders) == 1 else None
        return getattr(loaders, "dataset", None)

    def write_on_epoch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Sequence[Any], batch_indices: Sequence[Any]
    ) -> None:
        if predictions and isinstance(predictions[0], list):  # one list per dataloader
            if len(predictions) != 1:
                raise ValueError(f"PredictionWriter supports one predict dataloader, got {len(predictions)}")
            predictions = predictions[0]
        merged = _merge_predictions(predictions)  # an empty shard (more processes than items) still gathers
        parts = [p for p in all_gather_object(merged) if p["indices"].numel() > 0]
        merged = {k: torch.cat([p[k] for p in parts]) for k in merged} if parts else merged
        path = self.resolve_path(trainer)  # on every process
        if not trainer.is_global_zero:
            return
        result: dict[str, Any] = _sorted_unique(merged)
        dataset = self._dataset(trainer)
        paths = getattr(dataset, "paths", None)
        result["paths"] = None if paths is None else [str(paths[i]) for i in result["indices"].tolist()]
        result.update(_item_fields(dataset, result["indices"]))
        result.update(_names(getattr(trainer, "datamodule", None)))
        result["checkpoint"] = checkpoint_record(trainer.ckpt_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        try:
            torch.save(result, temporary)
            os.replace(temporary, path)
        finally:
            temporary.unlink(missing_ok=True)
        self.written_path = path
        if self.announce:
            print(f"lightning-dml predict: wrote {path}: {describe_predictions(result)}", file=sys.stdout, flush=True)


def check_output_path(path: str | os.PathLike, option: str = "--output") -> Path:
    """``path`` as an absolute file path that a :class:`PredictionWriter` can write, checked before any work:
    one :class:`~lightning_dml.errors.UserInputError` naming ``option`` when it is a folder (or ends with a path
    separator), when a part of its folder is a file, or when its nearest existing folder cannot be written
    (probed by creating and removing a temporary file there, which also holds for root and read-only file
    systems). Missing folders are created when the file is written."""
    text = os.fspath(path)
    target = Path(os.path.abspath(os.path.expanduser(text)))
    if not text or text.endswith((os.sep, "/")) or target.is_dir():
        raise UserInputError(f"{option} {text}: is a folder, give the file to write (e.g. {target / 'predictions.pt'})")
    folder = target.parent
    while not folder.exists():
        folder = folder.parent
    if not folder.is_dir():
        raise UserInputError(f"{option} {text}: {folder} is a file, not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".lightning-dml-probe-"):
            pass
    except OSError as error:
        raise UserInputError(f"{option} {text}: cannot write into {folder} ({error.strerror or error})") from None
    return target


def describe_predictions(data: dict[str, Any]) -> str:
    """One line on what a predictions file holds: rows, embedding width, labels, query/gallery split, checkpoint."""
    embeddings, labels = data["embeddings"], data["labels"]
    rows, width = len(data["indices"]), (int(embeddings.shape[1]) if embeddings.ndim == 2 else 0)
    if labels.ndim == 2:
        kind = f"label sets (multi-hot over {labels.shape[1]} labels)"
    else:
        distinct = int(torch.unique(labels).numel()) if labels.numel() else 0
        names = " with names" if data.get("class_names") else ""
        kind = f"one class label per row ({distinct} classes{names})"
    split = ""
    if data.get("query_mask") is not None:
        split = f", {int(data['query_mask'].sum())} queries / {int(data['gallery_mask'].sum())} gallery items"
    checkpoint = data.get("checkpoint")
    source = f"checkpoint {checkpoint['path']}" if checkpoint else "no checkpoint (initial weights)"
    return f"{rows} rows, embeddings of width {width} (raw, not normalised), {kind}{split}; {source}"


def load_predictions(path: str | Path) -> dict[str, Any]:
    """Load a :class:`PredictionWriter` file: ``{"embeddings", "labels", "indices", "paths", "checkpoint",
    "query_mask", "gallery_mask", "sequence", "category", "class_names", "category_names"}`` (see there; the keys
    after ``paths`` are absent from files written before they were recorded)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no predictions file at {path} (lightning-dml predict writes predictions.pt into the run's "
                         "folder and prints its path)")
    # tensors and plain data only; anything else (pickled objects, a truncated file) is one CorruptFileError
    data = read_torch_file(path, "predictions file", "predictions file")
    missing = {"embeddings", "labels", "indices", "paths"} - set(data if isinstance(data, dict) else ())
    if missing:
        raise CorruptFileError(f"{path} is not a predictions file: missing {sorted(missing)}")
    return data
