"""The manifest of an index folder (``manifest.json``): what the index holds and which model made it.

Written by :meth:`~lightning_dml.index.EmbeddingIndex.save`, read by :meth:`~lightning_dml.index.EmbeddingIndex.load`
(every problem one :class:`IndexFolderError` naming the file and the key). Keys:

* ``format``: the folder layout version (:data:`FORMAT`); ``library``, ``faiss``, ``torch``: the versions that wrote it;
* ``kind`` (``flat``, ``ivf_flat``, ``ivf_pq``, ``hnsw``), ``options`` (the kind's settings, e.g. ``nlist``,
  ``nprobe``), ``shards`` (number of faiss files), ``metric`` (``cosine``: vectors L2-normalised, inner product;
  ``euclidean``: raw vectors, squared L2 distance), ``embedding_dim``, ``count``, ``next_id``;
* ``checkpoint``: ``{"path", "sha256"}`` of the checkpoint the gallery was embedded with (``None``: built from
  tensors without one), ``input_spec`` (the backbone's :class:`~lightning_dml.models.input_spec.InputSpec` as a
  dict) and ``preprocess`` (``crop_size``, ``resize_size``, ``mode``: the evaluation transform of the run's data
  module), ``model`` (file name of the exported model beside it: ``embedding_model.safetensors``, tensors and a JSON
  architecture record, :mod:`lightning_dml.export`; ``None`` without one; a folder naming the old
  ``embedding_exported.pt2`` is refused when its model is needed: rebuild it);
* ``gallery``: the gallery sources added (paths as given, absolute); each file's size and modification time are in
  the table (``size``, ``mtime_ns`` columns), which :meth:`~lightning_dml.index.EmbeddingIndex.changed_files` compares;
* ``calibration``: the match threshold of ``lightning-dml index calibrate`` (:mod:`lightning_dml.index.calibrate`:
  threshold, target, achieved FMR/FNMR, pair counts, the labelled data and the checkpoint sha256 it was computed
  with), ``None`` when the index was not calibrated; a rebuild (``index build --overwrite``) writes none;
* ``width``: ``lightning-dml index build --width d`` kept the leading ``d`` dimensions of the model's embedding
  (nested widths, :mod:`lightning_dml.widths`; re-normalised for ``cosine``; ``embedding_dim`` is then ``d``): the
  index's embedder cuts every query the same way; ``None``: the full embedding;
* ``uid``: a random id written by each save (:func:`folder_uid`): a reader that finds another ``uid`` after reading
  the other files knows the folder was replaced meanwhile (:mod:`lightning_dml.index.folder`); ``""`` in folders
  written before it existed.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lightning_dml.errors import CorruptFileError, MissingFileError, UserInputError

__all__ = ["FORMAT", "MANIFEST", "IndexFolderError", "IndexMismatchError", "Manifest", "folder_uid", "versions"]

#: The layout version of an index folder this code reads and writes
FORMAT = 1
MANIFEST = "manifest.json"


class IndexFolderError(CorruptFileError):
    """An index folder that cannot be used: missing, not an index, a file missing or inconsistent with the manifest."""


class IndexMismatchError(UserInputError, ValueError):
    """Embeddings of another model than the index's (another checkpoint sha256 or embedding size)."""


def versions() -> dict[str, str]:
    """``{"library", "faiss", "torch"}`` versions of this process."""
    import torch

    from lightning_dml import __version__
    from lightning_dml.index.kinds import faiss_module

    faiss = faiss_module()
    return {"library": __version__, "faiss": faiss.__version__, "torch": torch.__version__}


def folder_uid(folder: str | os.PathLike) -> str | None:
    """The ``uid`` of the manifest of ``folder`` (``""`` for a folder written before uids), ``None`` when there is no
    readable manifest: what tells a reader whether the folder was replaced since it read it."""
    try:
        data = json.loads((Path(folder) / MANIFEST).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return str(data.get("uid", "")) if isinstance(data, dict) else None


@dataclass
class Manifest:
    """The content of ``manifest.json`` (see the module docstring)."""

    kind: str
    metric: str
    embedding_dim: int
    options: dict[str, Any] = field(default_factory=dict)
    shards: int = 1
    count: int = 0
    next_id: int = 0
    checkpoint: dict[str, str] | None = None
    input_spec: dict[str, Any] | None = None
    preprocess: dict[str, Any] | None = None
    model: str | None = None
    gallery: list[str] = field(default_factory=list)
    calibration: dict[str, Any] | None = None
    width: int | None = None
    uid: str = ""
    format: int = FORMAT
    library: str = ""
    faiss: str = ""
    torch: str = ""

    @property
    def checkpoint_sha256(self) -> str | None:
        return None if not self.checkpoint else self.checkpoint.get("sha256")

    def checkpoint_change(self) -> str | None:
        """Whether the checkpoint the index was built from is still the file it was: ``None`` when it is (or when
        the index records no checkpoint file and digest), else one line saying what changed (the file is missing, or
        its content is not the content indexed: the gallery's embeddings are of other weights).

        The file's sha256 is computed again (:func:`~lightning_dml.checkpoints.checkpoint_record`; one read of the
        file) and compared with the one recorded at build: a size and modification time would not tell a re-trained
        checkpoint of the same model (the same size to the byte) copied with its time kept (``cp -p``, ``rsync
        -a``), and the digest is what the index, ``search`` and ``index evaluate --queries`` already check."""
        path, recorded = (self.checkpoint or {}).get("path"), self.checkpoint_sha256
        if not path or not recorded:
            return None
        from lightning_dml.checkpoints import checkpoint_record

        if not Path(path).is_file():
            return f"the checkpoint {path} the index was built from is missing"
        now = (checkpoint_record(path) or {}).get("sha256")
        if now == recorded:
            return None
        return (f"the checkpoint {path} changed since the index was built (sha256 {recorded[:12]}... at build, "
                f"{str(now)[:12]}... now): the index holds embeddings of the old weights; rebuild it "
                "(lightning-dml index build --overwrite) to search with the new ones")

    def to_json(self) -> str:
        return json.dumps({**dataclasses.asdict(self), **versions()}, indent=2, sort_keys=True)

    def write(self, folder: Path) -> None:
        path = folder / MANIFEST
        tmp = path.with_name(f".{MANIFEST}.{os.getpid()}.tmp")
        tmp.write_text(self.to_json() + "\n")
        os.replace(tmp, path)

    @classmethod
    def read(cls, folder: str | os.PathLike) -> "Manifest":
        folder = Path(folder)
        if not folder.exists():
            raise MissingFileError(f"index folder {folder} does not exist (lightning-dml index build --out writes one)")
        if not folder.is_dir():
            raise IndexFolderError(f"index {folder} is a file; an index is a folder (lightning-dml index build --out)")
        path = folder / MANIFEST
        if not path.is_file():
            raise IndexFolderError(f"{folder} is not an index folder: it has no {MANIFEST}")
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
            raise IndexFolderError(f"{path} is not readable JSON ({error})") from None
        if not isinstance(data, dict):
            raise IndexFolderError(f"{path} must hold a JSON object, it holds {type(data).__name__}")
        if data.get("format") != FORMAT:
            raise IndexFolderError(
                f"{path}: index format {data.get('format')!r}, this version of lightning-dml reads format {FORMAT}: "
                "rebuild the index (lightning-dml index build)"
            )
        names = {f.name for f in dataclasses.fields(cls)}
        missing = [k for k in ("kind", "metric", "embedding_dim") if k not in data]
        if missing:
            raise IndexFolderError(f"{path}: missing key(s) {', '.join(missing)}")
        manifest = cls(**{k: v for k, v in data.items() if k in names})
        if manifest.metric not in ("cosine", "euclidean"):
            raise IndexFolderError(f"{path}: metric {manifest.metric!r}, expected 'cosine' or 'euclidean'")
        if manifest.width is not None and manifest.width != manifest.embedding_dim:
            raise IndexFolderError(
                f"{path}: width {manifest.width!r} differs from embedding_dim {manifest.embedding_dim}"
            )
        return manifest
