"""An index folder searched without PyTorch: its faiss files, table and manifest read with faiss, csv and NumPy.

:class:`FolderSearch` is what ``lightning-dml search --runtime onnx`` searches: the folder of
:class:`~lightning_dml.index.EmbeddingIndex` (``manifest.json``, ``index.faiss`` or ``shard-*.faiss``, ``table.csv``,
``embeddings.npy``), read and checked as :meth:`~lightning_dml.index.EmbeddingIndex.load` reads it (a folder replaced
while it is read is read again; a swap stopped halfway is recovered first, :mod:`lightning_dml.index.folder`), and
searched as :meth:`~lightning_dml.index.EmbeddingIndex.search` searches, with the library's torch-free pieces: the
faiss files and the tie rule of :mod:`lightning_dml.index.faiss_search` (queries L2-normalised for ``cosine``; the
best ``k`` by score, then by the smaller id, also where equal scores straddle the k-th place), and, for compressed
vectors (``--vectors int8|binary --rescore N``), the exact re-scoring of
:func:`lightning_dml.index.vectors.rescore_arrays` against the memory-mapped ``embeddings.npy``. An index built with
``--width W`` gets queries cut to their leading ``W`` dimensions (:class:`~lightning_dml.onnx.runtime.OnnxEmbedder`'s
``width``), normalised here as the gallery was.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import numpy as np

from lightning_dml.errors import UserInputError
from lightning_dml.index import kinds as K
from lightning_dml.index import vectors as V
from lightning_dml.index.faiss_search import best_k_arrays, faiss_scores, read_shards
from lightning_dml.index.folder import settle
from lightning_dml.index.manifest import IndexFolderError, IndexMismatchError, Manifest, folder_uid
from lightning_dml.onnx.runtime import ONNX_MODEL, OnnxEmbedder

__all__ = ["FolderSearch", "onnx_embedder"]

_TABLE = "table.csv"
_EMBEDDINGS = "embeddings.npy"  # lightning_dml.index.index.EMBEDDINGS
_TABLE_COLUMNS = ("id", "path", "label", "size", "mtime_ns")  # lightning_dml.index.index.TABLE_COLUMNS
_ATTEMPTS = 5


class OnnxSearchError(UserInputError, ValueError):
    """An index folder or an option the ONNX search path does not serve."""


def _read_table(path: Path) -> tuple[np.ndarray, list[str], list[str]]:
    """``(ids, paths, labels)`` of an index's ``table.csv`` (the columns of
    :class:`~lightning_dml.index.index.IndexTable`)."""
    if not path.is_file():
        raise IndexFolderError(f"index folder {path.parent}: {path.name} is missing")
    try:
        with open(path, newline="", encoding="utf-8") as handle:
            rows = list(csv.reader(handle))
        if not rows or tuple(rows[0]) != _TABLE_COLUMNS:
            raise IndexFolderError(f"{path}: the header must be {','.join(_TABLE_COLUMNS)}")
        ids = np.asarray([int(r[0]) for r in rows[1:]], dtype=np.int64)
        return ids, [r[1] for r in rows[1:]], [r[2] for r in rows[1:]]
    except (UnicodeDecodeError, csv.Error, ValueError, IndexError) as error:
        raise IndexFolderError(f"{path}: unreadable table ({type(error).__name__}: {error})") from None


def onnx_embedder(folder: str | os.PathLike, manifest: Manifest, device: str = "cpu",
                  batch_size: int = 64) -> OnnxEmbedder:
    """The :class:`~lightning_dml.onnx.runtime.OnnxEmbedder` of an index folder's ``embedding_model.onnx`` (written
    by ``index build --runtime onnx``) with the index's preprocessing and width (``manifest``: the one loaded with
    the vectors; a folder replaced since is an error, as :meth:`~lightning_dml.index.EmbeddingIndex.embedder`
    says); a folder without one is one line."""
    path = Path(folder) / ONNX_MODEL
    if not path.is_file():
        raise OnnxSearchError(f"index folder {folder} has no {ONNX_MODEL}: build it with lightning-dml index build "
                              "--runtime onnx, or leave out --runtime onnx")
    _check_unreplaced(folder, manifest)
    embedder = OnnxEmbedder(path, manifest.input_spec or {}, manifest.preprocess or {}, device=device,
                            batch_size=batch_size, width=manifest.width)
    _check_unreplaced(folder, manifest)  # the model read is the one of the folder these vectors came from
    return embedder


def _check_unreplaced(folder: str | os.PathLike, manifest: Manifest) -> None:
    if folder_uid(folder) != manifest.uid:
        raise IndexFolderError(f"index folder {folder} was replaced since it was loaded (index build --overwrite or "
                               "index add): its model need not be the one of the loaded vectors; load it again")


class FolderSearch:
    """The faiss index, ids, paths and labels of an index folder (:meth:`load`), searched from NumPy queries;
    ``vectors``: the stored float32 vectors (memory-mapped ``embeddings.npy``), read for re-scoring and for the
    exact scores of calibrated match flags."""

    def __init__(self, folder: Path, manifest: Manifest, shards: list[Any], ids: np.ndarray, paths: list[str],
                 labels: list[str], vectors: np.ndarray) -> None:
        self.folder = folder
        self.manifest = manifest
        self.shards = shards
        self.faiss_index = K.make_shards(shards, int(manifest.embedding_dim))  # merged by score when sharded
        self.ids, self.paths, self.labels = ids, paths, labels
        self.vectors = vectors
        self._row = {int(i): r for r, i in enumerate(ids.tolist())}

    def __len__(self) -> int:
        return len(self.paths)

    @property
    def metric(self) -> str:
        return self.manifest.metric

    @property
    def dim(self) -> int:
        return int(self.manifest.embedding_dim)

    @classmethod
    def load(cls, folder: str | os.PathLike) -> "FolderSearch":
        folder = Path(folder)
        for _ in range(_ATTEMPTS):
            settle(folder)
            uid = folder_uid(folder)
            try:
                loaded = cls._load(folder)
            except (UserInputError, OSError):
                if folder_uid(folder) != uid:
                    continue  # replaced while read
                raise
            if folder_uid(folder) == loaded.manifest.uid:
                return loaded
        raise IndexFolderError(f"index folder {folder} was replaced {_ATTEMPTS} times while it was read; "
                               "load it again when its writers are done")

    @classmethod
    def _load(cls, folder: Path) -> "FolderSearch":
        manifest = Manifest.read(folder)
        if manifest.kind not in K.KINDS:
            raise OnnxSearchError(f"index {folder}: unknown kind {manifest.kind!r} (expected one of "
                                  f"{', '.join(K.KINDS)})")
        shards = read_shards(folder, manifest)
        ids, paths, labels = _read_table(folder / _TABLE)
        try:
            vectors = np.load(folder / _EMBEDDINGS, mmap_mode="r", allow_pickle=False)
        except FileNotFoundError:
            raise IndexFolderError(f"index folder {folder}: {_EMBEDDINGS} is missing") from None
        except (OSError, ValueError) as error:
            raise IndexFolderError(f"{folder / _EMBEDDINGS} is not a readable .npy file ({error})") from None
        total = sum(int(s.ntotal) for s in shards)
        d = int(manifest.embedding_dim)
        if (total != len(ids) or manifest.count != len(ids) or any(int(s.d) != d for s in shards)
                or vectors.shape != (len(ids), d)):
            raise IndexFolderError(f"index folder {folder} is inconsistent: the faiss index holds {total} vectors of "
                                   f"size {shards[0].d}, {_TABLE} {len(ids)} rows, {_EMBEDDINGS} the shape "
                                   f"{tuple(vectors.shape)}, the manifest {manifest.count} items of size {d} "
                                   "(rebuild it)")
        return cls(folder, manifest, shards, ids, paths, labels, vectors)

    def embedder(self, device: str = "cpu", batch_size: int = 64) -> OnnxEmbedder:
        """The folder's ONNX model with the index's preprocessing and width (:func:`onnx_embedder`)."""
        return onnx_embedder(self.folder, self.manifest, device, batch_size)

    def prepare(self, queries: np.ndarray) -> np.ndarray:
        """Raw query embeddings ``[Q, D]`` as the index compares them: float32, L2-normalised for ``cosine``
        (as :func:`lightning_dml.index.index.query_array`); another size is one line."""
        x = np.asarray(queries, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise IndexMismatchError(f"the queries have shape {tuple(x.shape)}, the index {self.folder} holds "
                                     f"embeddings of size {self.dim}: they come from another model")
        if self.metric == "cosine":
            x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), np.float32(1e-12))
        return np.ascontiguousarray(x, dtype=np.float32)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores [Q, k] float32, ids [Q, k] int64)`` of raw query embeddings, best first (``-inf`` / ``-1``
        padding): :meth:`lightning_dml.index.EmbeddingIndex.search`'s results, re-scored candidates included."""
        x = self.prepare(queries)
        asked, rescore = int(k), V.rescore_count(self.manifest.options)
        k = asked if rescore is None else max(asked, min(rescore, len(self)))  # the candidates of a re-scoring

        def search(batch: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
            return faiss_scores(self.faiss_index, self.manifest, batch, n)

        scores, ids = best_k_arrays(search, x, k, len(self))
        if rescore is not None:  # the best k of the candidates by the exact score of the full-precision vectors
            scores, ids = V.rescore_arrays(x, ids, self.vectors, self.rows_of, self.metric, asked)
        return scores, ids

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """Table row of each id (``-1`` for an id not in the table)."""
        return np.asarray([self._row.get(int(i), -1) for i in np.asarray(ids).reshape(-1).tolist()], dtype=np.int64)

    def results(self, scores: np.ndarray, ids: np.ndarray,
                flags: np.ndarray | None = None) -> list[list[dict[str, Any]]]:
        """Result lists ``[{"id", "path", "label", "score"}, ...]`` per query (padding left out), with
        ``"match"`` from ``flags [Q, k]`` where given."""
        out = []
        for q in range(ids.shape[0]):
            found = []
            for j in range(ids.shape[1]):
                r = self._row.get(int(ids[q, j]), -1)
                if ids[q, j] < 0 or r < 0:
                    continue
                row = {"id": int(ids[q, j]), "path": self.paths[r], "label": self.labels[r],
                       "score": float(scores[q, j])}
                if flags is not None:
                    row["match"] = bool(flags[q, j])
                found.append(row)
            out.append(found)
        return out
