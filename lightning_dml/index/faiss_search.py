"""An index folder's faiss files read and searched with faiss and NumPy only (no torch), the library's tie rule
included: what the ONNX search path (:mod:`lightning_dml.onnx.folder_search`) searches with, and what
:class:`~lightning_dml.index.EmbeddingIndex` does with tensors.

* :func:`read_shards`: ``index.faiss`` or ``shard-0.faiss``, ``shard-1.faiss``, ... as the manifest lists them
  (:meth:`~lightning_dml.index.EmbeddingIndex.load`'s files and messages);
* :func:`faiss_scores`: faiss's top-n as similarities (negated distances for ``euclidean`` and for the Hamming
  distances of ``binary`` codes), ``-inf`` / ``-1`` padding, with the kind's search options set;
* :func:`best_k_arrays`: the best ``k`` by score, then by the smaller id, also where equal scores straddle the
  k-th place (:func:`lightning_dml.index.index.best_k`'s rule, on arrays: one result more is fetched, and a row
  whose (k+1)-th score equals its k-th is searched again with twice as many until the tie ends).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from lightning_dml.index import kinds as K
from lightning_dml.index.manifest import IndexFolderError, Manifest

__all__ = ["best_k_arrays", "faiss_names", "faiss_scores", "read_shards"]


def faiss_names(shards: int) -> list[str]:
    """The faiss file names of an index of ``shards`` shards."""
    return ["index.faiss"] if shards == 1 else [f"shard-{i}.faiss" for i in range(shards)]


def read_shards(folder: str | os.PathLike, manifest: Manifest, mmap: bool = False) -> list[Any]:
    """The faiss shards of an index folder (``mmap``: memory-mapped where faiss can, the IVF kinds); a missing or
    unreadable file is one :class:`~lightning_dml.index.manifest.IndexFolderError` naming it."""
    faiss = K.faiss_module()
    folder = Path(folder)
    shards = []
    for name in faiss_names(manifest.shards):
        path = folder / name
        if not path.is_file():
            raise IndexFolderError(f"index folder {folder}: {name} is missing (the manifest lists "
                                   f"{manifest.shards} shard(s))")
        try:
            flags = faiss.IO_FLAG_MMAP if mmap and manifest.kind in ("ivf_flat", "ivf_pq") else 0
            shards.append(faiss.read_index(str(path), flags))
        except RuntimeError as error:
            raise IndexFolderError(f"{path} is not a readable faiss index ({str(error).splitlines()[0]})") from None
    return shards


def faiss_scores(faiss_index: Any, manifest: Manifest, x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """faiss's ``n`` results of the float32 queries ``x`` (prepared: L2-normalised for ``cosine``) as
    ``(similarities [Q, n] float32, ids [Q, n] int64)``, ``-inf`` / ``-1`` padding."""
    K.set_search_options(faiss_index, manifest.kind, manifest.options, n)
    distances, ids = faiss_index.search(x, n)
    scores = np.asarray(distances, dtype=np.float32)
    if manifest.metric == "euclidean" or manifest.options.get("vectors") == "binary":  # distances (Hamming)
        scores = -scores
    ids = np.asarray(ids, dtype=np.int64)
    return np.where(ids >= 0, scores, np.float32(-np.inf)).astype(np.float32), ids


def best_k_arrays(search: Callable[[np.ndarray, int], tuple[np.ndarray, np.ndarray]], x: np.ndarray, k: int,
                  limit: int) -> tuple[np.ndarray, np.ndarray]:
    """The ``k`` best results of each query by score, then by the smaller id, from ``search(x, n) -> (scores
    [Q, n], ids [Q, n])`` (a store's top-n in its own order of ties, ``-1`` padding), ``-inf`` / ``-1`` padding to
    ``k`` columns; ``limit``: the most results the store can return (module docstring)."""
    fetch = min(k if k >= limit else k + 1, limit)
    scores, ids = search(x, max(fetch, 1))
    while fetch < limit:
        tied = (ids[:, -1] >= 0) & (scores[:, -1] == scores[:, k - 1])
        if not tied.any():
            break
        fetch = min(2 * fetch, limit)
        more_scores, more_ids = search(x[tied], fetch)
        grown_scores = np.full((len(ids), fetch), -np.inf, dtype=np.float32)
        grown_ids = np.full((len(ids), fetch), -1, dtype=np.int64)
        grown_scores[:, : scores.shape[1]], grown_ids[:, : ids.shape[1]] = scores, ids
        grown_scores[tied], grown_ids[tied] = more_scores, more_ids
        scores, ids = grown_scores, grown_ids
    by_id = np.argsort(np.where(ids >= 0, ids, np.iinfo(np.int64).max), axis=1, kind="stable")
    scores, ids = np.take_along_axis(scores, by_id, 1), np.take_along_axis(ids, by_id, 1)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    scores, ids = np.take_along_axis(scores, order, 1), np.take_along_axis(ids, order, 1)
    if scores.shape[1] < k:  # fewer results than k
        pad = k - scores.shape[1]
        scores = np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf)
        ids = np.pad(ids, ((0, 0), (0, pad)), constant_values=-1)
    return scores.astype(np.float32, copy=False), ids.astype(np.int64, copy=False)
