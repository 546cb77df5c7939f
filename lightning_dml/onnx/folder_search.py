"""An index folder searched without PyTorch: its faiss files, table and manifest read with faiss, csv and NumPy.

:class:`FolderSearch` is what ``lightning-dml search --runtime onnx`` searches: the folder of
:class:`~lightning_dml.index.EmbeddingIndex` (``manifest.json``, ``index.faiss`` or ``shard-*.faiss``, ``table.csv``),
read and checked as :meth:`~lightning_dml.index.EmbeddingIndex.load` reads it (a folder replaced while it is read
is read again; a swap stopped halfway is recovered first, :mod:`lightning_dml.index.folder`), and searched as
:meth:`~lightning_dml.index.EmbeddingIndex.search` searches (queries L2-normalised for ``cosine``; the best ``k`` by
score, then by the smaller id, also where equal scores straddle the k-th place: the same ids). Float32 vectors
only: an index of compressed vectors (``--vectors int8|binary``) or of another store is searched by the torch
runtime.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path
from typing import Any

import numpy as np

from lightning_dml.errors import UserInputError
from lightning_dml.index.folder import settle
from lightning_dml.index.manifest import IndexFolderError, IndexMismatchError, Manifest, folder_uid
from lightning_dml.onnx.runtime import ONNX_MODEL, OnnxEmbedder

__all__ = ["FolderSearch", "onnx_embedder"]

_TABLE = "table.csv"
_TABLE_COLUMNS = ("id", "path", "label", "size", "mtime_ns")  # lightning_dml.index.index.TABLE_COLUMNS
_ATTEMPTS = 5
#: the kinds of lightning_dml.index.kinds.KINDS, searched here with their search options (nprobe, ef_search)
_KINDS = ("flat", "ivf_flat", "ivf_pq", "hnsw")


def _faiss() -> Any:
    # not lightning_dml.index.kinds.faiss_module: that module imports lightning_dml.index.vectors, which imports torch
    try:
        import faiss
    except ImportError:
        raise UserInputError("the embedding index needs faiss: pip install 'lightning-dml[faiss]'") from None
    return faiss


def _set_search_options(shards: list[Any], kind: str, options: dict[str, Any], k: int) -> None:
    """``nprobe`` of an IVF index, ``efSearch`` (at least ``k``) of an HNSW one, on every shard (as
    :func:`lightning_dml.index.kinds.set_search_options`)."""
    faiss = _faiss()
    for shard in shards:
        if kind in ("ivf_flat", "ivf_pq"):
            faiss.extract_index_ivf(shard).nprobe = int(options["nprobe"])
        elif kind == "hnsw":
            inner = faiss.downcast_index(shard.index if hasattr(shard, "id_map") else shard)
            inner.hnsw.efSearch = max(int(options["ef_search"]), int(k))


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
    by ``index build --runtime onnx``) with the index's preprocessing (``manifest``: the one loaded with the vectors;
    a folder replaced since is an error, as :meth:`~lightning_dml.index.EmbeddingIndex.embedder` says); a folder
    without one is one line."""
    path = Path(folder) / ONNX_MODEL
    if not path.is_file():
        raise OnnxSearchError(f"index folder {folder} has no {ONNX_MODEL}: build it with lightning-dml index build "
                              "--runtime onnx, or leave out --runtime onnx")
    _check_unreplaced(folder, manifest)
    embedder = OnnxEmbedder(path, manifest.input_spec or {}, manifest.preprocess or {}, device=device,
                            batch_size=batch_size)
    _check_unreplaced(folder, manifest)  # the model read is the one of the folder these vectors came from
    return embedder


def _check_unreplaced(folder: str | os.PathLike, manifest: Manifest) -> None:
    if folder_uid(folder) != manifest.uid:
        raise IndexFolderError(f"index folder {folder} was replaced since it was loaded (index build --overwrite or "
                               "index add): its model need not be the one of the loaded vectors; load it again")


class FolderSearch:
    """The faiss index, ids, paths and labels of an index folder (:meth:`load`), searched from NumPy queries."""

    def __init__(self, folder: Path, manifest: Manifest, shards: list[Any], ids: np.ndarray, paths: list[str],
                 labels: list[str]) -> None:
        self.folder = folder
        self.manifest = manifest
        self.shards = shards
        if len(shards) == 1:
            self.faiss_index = shards[0]
        else:  # searched together, results merged by score (lightning_dml.index.kinds.make_shards)
            self.faiss_index = _faiss().IndexShards(int(manifest.embedding_dim), True, False)
            for shard in shards:
                self.faiss_index.add_shard(shard)
        self.ids, self.paths, self.labels = ids, paths, labels
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
        faiss = _faiss()
        manifest = Manifest.read(folder)
        vectors = (manifest.options or {}).get("vectors", "float32")
        if manifest.kind not in _KINDS or vectors != "float32":
            raise OnnxSearchError(f"index {folder}: the ONNX search path searches float32 indexes of kinds "
                                  f"{', '.join(_KINDS)}; this one is {manifest.kind} with {vectors} vectors: search "
                                  "it with --runtime torch")
        names = ["index.faiss"] if manifest.shards == 1 else [f"shard-{i}.faiss" for i in range(manifest.shards)]
        shards = []
        for name in names:
            path = folder / name
            if not path.is_file():
                raise IndexFolderError(f"index folder {folder}: {name} is missing (the manifest lists "
                                       f"{manifest.shards} shard(s))")
            try:
                shards.append(faiss.read_index(str(path)))
            except RuntimeError as error:
                raise IndexFolderError(f"{path} is not a readable faiss index ({str(error).splitlines()[0]})") from None
        ids, paths, labels = _read_table(folder / _TABLE)
        total = sum(int(s.ntotal) for s in shards)
        d = int(manifest.embedding_dim)
        if total != len(ids) or manifest.count != len(ids) or any(int(s.d) != d for s in shards):
            raise IndexFolderError(f"index folder {folder} is inconsistent: the faiss index holds {total} vectors of "
                                   f"size {shards[0].d}, {_TABLE} {len(ids)} rows, the manifest {manifest.count} items "
                                   f"of size {d} (rebuild it)")
        return cls(folder, manifest, shards, ids, paths, labels)

    def embedder(self, device: str = "cpu", batch_size: int = 64) -> OnnxEmbedder:
        """The folder's ONNX model with the index's preprocessing (:func:`onnx_embedder`)."""
        return onnx_embedder(self.folder, self.manifest, device, batch_size)

    def search(self, queries: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        """``(scores [Q, k] float32, ids [Q, k] int64)`` of raw query embeddings, best first (``-inf`` / ``-1``
        padding): :meth:`lightning_dml.index.EmbeddingIndex.search`'s results."""
        x = np.asarray(queries, dtype=np.float32)
        if x.ndim != 2 or x.shape[1] != self.dim:
            raise IndexMismatchError(f"the queries have shape {tuple(x.shape)}, the index {self.folder} holds "
                                     f"embeddings of size {self.dim}: they come from another model")
        if self.metric == "cosine":
            x = x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), np.float32(1e-12))
        x = np.ascontiguousarray(x, dtype=np.float32)
        k, total = int(k), len(self)
        fetch = k if k >= total else k + 1  # a tie across the k-th place is searched again with more (as search)
        scores, ids = self._faiss_search(x, fetch)
        while fetch < total:
            tied = (ids[:, -1] >= 0) & (scores[:, -1] == scores[:, k - 1])
            if not tied.any():
                break
            fetch = min(2 * fetch, total)
            more_scores, more_ids = self._faiss_search(x[tied], fetch)
            grown_scores = np.full((len(ids), fetch), -np.inf, dtype=np.float32)
            grown_ids = np.full((len(ids), fetch), -1, dtype=np.int64)
            grown_scores[:, : scores.shape[1]], grown_ids[:, : ids.shape[1]] = scores, ids
            grown_scores[tied], grown_ids[tied] = more_scores, more_ids
            scores, ids = grown_scores, grown_ids
        # order: score, then the smaller id; padding (-inf, -1) last
        by_id = np.argsort(np.where(ids >= 0, ids, np.iinfo(np.int64).max), axis=1, kind="stable")
        scores, ids = np.take_along_axis(scores, by_id, 1), np.take_along_axis(ids, by_id, 1)
        order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
        scores, ids = np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)
        if scores.shape[1] < k:  # k above the gallery size: padded as faiss pads
            pad = k - scores.shape[1]
            scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf)
            ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
        return scores, ids

    def _faiss_search(self, x: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
        _set_search_options(self.shards, self.manifest.kind, self.manifest.options, k)
        distances, ids = self.faiss_index.search(x, k)
        scores = -distances if self.metric == "euclidean" else distances
        return np.where(ids >= 0, scores, -np.inf).astype(np.float32), ids.astype(np.int64)

    def results(self, scores: np.ndarray, ids: np.ndarray) -> list[list[dict[str, Any]]]:
        """Result lists ``[{"id", "path", "label", "score"}, ...]`` per query (padding left out)."""
        out = []
        for q in range(ids.shape[0]):
            found = []
            for j in range(ids.shape[1]):
                r = self._row.get(int(ids[q, j]), -1)
                if ids[q, j] < 0 or r < 0:
                    continue
                found.append({"id": int(ids[q, j]), "path": self.paths[r], "label": self.labels[r],
                              "score": float(scores[q, j])})
            out.append(found)
        return out
