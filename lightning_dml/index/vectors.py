"""Compressed vectors of a ``flat`` index and their exact re-scoring: ``index build --vectors int8|binary
--rescore N``.

The index keeps, in memory, codes instead of the float32 vectors and scans all of them (``flat``: no cells, no graph):

* ``int8``: scalar quantisation, one byte per dimension (faiss ``IndexScalarQuantizer`` ``QT_8bit``, factory
  ``SQ8``): each dimension's range is calibrated on the gallery the index is built with (faiss's default range
  statistic: that dimension's min and max), a value is coded as ``round((x - min) / (max - min) * 255)``, clipped,
  and decoded to the middle of its step; a query (float32) is compared with the decoded vectors (inner product for
  ``cosine``, squared L2 for ``euclidean``). Vectors added later are coded with the same calibration (values out of
  the range are clipped). D bytes per vector.
* ``binary``: one sign bit per dimension, ``bit = x >= 0`` (faiss ``fvec2bitvec``), searched by Hamming distance
  through faiss's binary-code index ``IndexLSH(d, d, rotate_data=False, train_thresholds=False)``, which packs the
  sign bits and scans them with the Hamming kernels of ``IndexBinaryFlat`` (``hammings_knn_hc``). Its score is the
  negated Hamming distance (an integer: many ties, ordered by the smaller id as every score of the library). Only
  for ``cosine`` (the sign pattern says which orthant a vector is in, an angle; it knows no length).
  D / 8 bytes per vector. As in sentence-transformers' ``quantize_embeddings`` ("binary" precision) and the binary
  retrieval of Yamada et al. (*Efficient Passage Retrieval with Hashing for Open-domain Question Answering*, ACL
  2021), the codes find candidates and the float vectors re-score them.

``rescore = N`` (:func:`rescore`): the index's best ``max(N, k)`` candidates of a query (at most the gallery; by
code score, then the smaller id, as :meth:`~lightning_dml.index.EmbeddingIndex.search` orders every result) are
scored again exactly, in float64, with the full-precision vectors of the folder's ``embeddings.npy`` (float32,
memory-mapped, ``np.load(mmap_mode="r")``: only the candidates' rows are read from disk), and the best ``k`` by
that exact score, then the smaller id, are the result. With ``N`` at least the gallery size the result is the exact
engine's (:func:`lightning_dml.metrics.functional.knn`: float64 scores, ties by the smaller id).

The choice is stored in the manifest's ``options`` (``{"vectors": "binary", "rescore": 100}``; absent for float32),
so ``search``, ``serve`` and ``index evaluate`` use it unchanged.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from lightning_dml.errors import UserInputError

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["VECTORS", "VectorsOptionError", "check_vectors", "index_bytes", "make_codes_index", "rescore",
           "rescore_arrays", "rescore_count", "vector_options"]

#: the vector formats of ``index build --vectors`` (float32: the default, the vectors themselves)
VECTORS = ("float32", "int8", "binary")
#: manifest option names this module owns
NAMES = ("vectors", "rescore")
_FAISS_FILE = re.compile(r"^(index|shard-\d+)\.faiss$")
_BLOCK = 1 << 24  # float64 values of the [queries, N, D] temporary of one re-scoring step (128 MiB)


class VectorsOptionError(UserInputError, ValueError):
    """An impossible ``--vectors`` / ``--rescore`` choice."""


def check_vectors(kind: str, vectors: str | None = None, rescore: int | None = None,
                  metric: str | None = None) -> dict[str, Any]:
    """The manifest options of a vector format: ``{}`` for float32, else ``{"vectors": ...}`` and ``"rescore"``;
    a :class:`VectorsOptionError` (one line) for an unknown format, a kind other than ``flat``, ``rescore``
    without compressed vectors or not an integer >= 1, ``binary`` with the ``euclidean`` metric."""
    vectors = "float32" if vectors is None else vectors
    if vectors not in VECTORS:
        raise VectorsOptionError(f"--vectors must be one of {', '.join(VECTORS)}, got {vectors!r}")
    if rescore is not None and (isinstance(rescore, bool) or not isinstance(rescore, (int, np.integer))
                                or int(rescore) < 1):
        raise VectorsOptionError(f"--rescore must be an integer >= 1 (candidates re-scored per query), got {rescore!r}")
    if vectors == "float32":
        if rescore is not None:
            raise VectorsOptionError("--rescore re-scores the candidates of compressed vectors: it needs --vectors "
                                     "int8 or binary (float32 vectors are scored exactly already)")
        return {}
    if kind != "flat":
        raise VectorsOptionError(f"--vectors {vectors} is a scan of compressed codes: it needs --kind flat, got "
                                 f"{kind!r} (ivf_pq compresses with its own product codes)")
    if vectors == "binary" and metric == "euclidean":
        raise VectorsOptionError("--vectors binary compares sign bits (angles): it needs the cosine metric, the "
                                 "model's is euclidean; use --vectors int8")
    return {"vectors": vectors, **({"rescore": int(rescore)} if rescore is not None else {})}


def vector_options(options: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``options`` split into (the kind's own options, this module's ``vectors`` / ``rescore``)."""
    return ({k: v for k, v in options.items() if k not in NAMES}, {k: v for k, v in options.items() if k in NAMES})


def rescore_count(options: dict[str, Any]) -> int | None:
    """``N`` of an index whose candidates are re-scored (manifest ``options``), else ``None``."""
    n = options.get("rescore")
    return None if n is None or options.get("vectors", "float32") == "float32" else int(n)


def make_codes_index(vectors: str, d: int, metric: int, train: np.ndarray | None) -> Any:
    """An empty faiss index (ids kept by ``IDMap2``) of ``int8`` codes (trained on ``train``: the range of each
    dimension) or ``binary`` sign bits, for vectors of size ``d``; ``metric`` a faiss metric constant."""
    from lightning_dml.index.kinds import faiss_module

    faiss = faiss_module()
    if vectors == "binary":
        return faiss.IndexIDMap2(faiss.IndexLSH(int(d), int(d), False, False))
    if vectors != "int8":
        raise VectorsOptionError(f"no codes index for vectors {vectors!r}")
    index = faiss.index_factory(int(d), "IDMap2,SQ8", metric)
    if train is None or len(train) == 0:
        raise VectorsOptionError("--vectors int8 calibrates its range on the gallery: build it with at least one "
                                 "vector")
    index.train(np.ascontiguousarray(train, dtype=np.float32))
    return index


def rescore(queries: np.ndarray, ids: Tensor, stored: np.ndarray, rows_of: Any, metric: str,
            k: int) -> tuple[Tensor, Tensor]:
    """:func:`rescore_arrays` of candidate ids in a tensor, its results as tensors (on the CPU)."""
    import torch  # here: this module is imported by the torch-free ONNX search path (lightning_dml.onnx)

    scores, best = rescore_arrays(queries, ids.cpu().numpy(), stored, rows_of, metric, k)
    return torch.from_numpy(scores), torch.from_numpy(best)


def rescore_arrays(queries: np.ndarray, ids: np.ndarray, stored: np.ndarray, rows_of: Any, metric: str,
                   k: int) -> tuple[np.ndarray, np.ndarray]:
    """The best ``k`` of the candidate ``ids [Q, N]`` (``-1``: none) of ``queries [Q, D]`` (float32, prepared as
    the index compares them) by their exact float64 score against ``stored`` (the full-precision vectors, in table
    order, e.g. a memory map: only the candidates' rows are read), then by the smaller id: ``(scores [Q, k]
    float32, ids [Q, k] int64)``, ``-inf`` / ``-1`` padding. ``rows_of(ids)``: table rows of ids."""
    ids_np = np.asarray(ids).astype(np.int64, copy=False)
    q_count, n = ids_np.shape
    out_scores = np.full((q_count, k), -np.inf, dtype=np.float32)
    out_ids = np.full((q_count, k), -1, dtype=np.int64)
    width = min(k, n)
    chunk = max(1, min(256, _BLOCK // max(1, n * int(stored.shape[1]))))
    for start in range(0, q_count, chunk):
        cand = ids_np[start:start + chunk]
        rows = np.asarray(rows_of(cand.reshape(-1)), dtype=np.int64).reshape(cand.shape)
        valid = (cand >= 0) & (rows >= 0)
        wanted, where = np.unique(rows[valid], return_inverse=True)  # ascending rows: sequential reads of the map
        block = np.zeros(rows.shape + (stored.shape[1],), dtype=np.float64)
        block[valid] = np.asarray(stored[wanted], dtype=np.float64)[where]
        q = np.asarray(queries[start:start + chunk], dtype=np.float64)
        if metric == "cosine":
            exact = np.einsum("qnd,qd->qn", block, q)
        else:
            block -= q[:, None, :]
            exact = -np.einsum("qnd,qnd->qn", block, block)
        exact = np.where(valid, exact, -np.inf)
        tie_ids = np.where(valid, cand, np.iinfo(np.int64).max)
        order = np.lexsort((tie_ids, -exact), axis=-1)[:, :width]
        out_scores[start:start + chunk, :width] = np.take_along_axis(exact, order, 1)
        picked = np.take_along_axis(cand, order, 1)
        out_ids[start:start + chunk, :width] = np.where(np.take_along_axis(valid, order, 1), picked, -1)
    return out_scores, out_ids


def index_bytes(index: Any) -> int:
    """Bytes of an :class:`~lightning_dml.index.EmbeddingIndex`'s faiss index (codes, ids, cells or graph: what it
    holds in memory): the size of its faiss files in its folder, or of the serialised shards of an index in memory.
    The full-precision ``embeddings.npy`` beside it is not counted (on disk, memory-mapped by a re-scoring index)."""
    from lightning_dml.index.kinds import faiss_module, shard_list

    if index.folder is not None and os.path.isdir(index.folder):
        sizes = [e.stat().st_size for e in os.scandir(index.folder) if _FAISS_FILE.match(e.name)]
        if len(sizes) == int(index.manifest.shards):
            return int(sum(sizes))
    faiss = faiss_module()
    return int(sum(faiss.serialize_index(shard).size for shard in shard_list(index.faiss_index)))
