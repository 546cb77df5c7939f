"""The faiss index of each index kind, its settings, sharding and the GPU.

Kinds (Johnson, Douze & Jégou, *Billion-scale similarity search with GPUs*, IEEE TBD 2019, for the faiss library;
the names of faiss's ``index_factory``):

* ``flat`` (``IDMap2,Flat``): exact search, every vector compared (the library's exact engine gives the same ids).
* ``ivf_flat`` (``IVF{nlist},Flat``): inverted file (Sivic & Zisserman, ICCV 2003): a k-means coarse quantizer of
  ``nlist`` cells; a query visits its ``nprobe`` nearest cells and compares their vectors exactly.
* ``ivf_pq`` (``IVF{nlist},PQ{m}x{nbits}``): the inverted file with product-quantized vectors (Jégou, Douze &
  Schmid, *Product quantization for nearest neighbor search*, TPAMI 2011): ``m`` sub-vectors of ``nbits`` bits each.
* ``hnsw`` (``IDMap2,HNSW{M},Flat``): the hierarchical navigable small-world graph (Malkov & Yashunin, TPAMI 2020);
  ``M`` links per node, ``ef_construction`` and ``ef_search`` the beam widths.

Defaults (:func:`resolve_options`, from the number ``n`` of vectors the index is trained with):
``nlist = clamp(round(4 sqrt(n)), 1, n // 39)`` (faiss asks for 39 training points per centroid), ``nprobe = min(8,
nlist)``; ``m`` the largest divisor of ``d`` not above ``d / 4``, ``nbits = clamp(floor(log2(n / 39)), 1, 8)``;
``M = 32``, ``ef_construction = 40``, ``ef_search = 64`` (raised to ``k`` when a search asks for more).

Compressed vectors (``flat`` only; options ``vectors`` = ``int8`` / ``binary`` and ``rescore``): the codes indexes
and the exact re-scoring of :mod:`lightning_dml.index.vectors`.

Sharding (:func:`make_shards`): the vectors are dealt to ``shards`` indexes of the same kind, the IVF ones sharing one
trained coarse quantizer (and PQ codebooks), and searched together through faiss's ``IndexShards``, which merges
the shards' results by score. Each shard is its own file, so a shard can live on another disk or GPU
(:func:`to_gpus`: ``faiss.index_cpu_to_all_gpus`` with ``shard=True`` spreads one index over the GPUs).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from lightning_dml.errors import UserInputError
from lightning_dml.index import vectors as V

__all__ = [
    "KINDS",
    "IndexOptionError",
    "check_kind",
    "faiss_module",
    "build_faiss_index",
    "faiss_metric",
    "make_shards",
    "resolve_options",
    "set_search_options",
    "supports_remove",
    "to_gpus",
]

#: index kind -> its options and their defaults (``None``: derived from the data, :func:`resolve_options`)
KINDS: dict[str, dict[str, int | None]] = {
    "flat": {},
    "ivf_flat": {"nlist": None, "nprobe": None},
    "ivf_pq": {"nlist": None, "nprobe": None, "m": None, "nbits": None},
    "hnsw": {"M": 32, "ef_construction": 40, "ef_search": 64},
}


class IndexOptionError(UserInputError, ValueError):
    """An unknown index kind, an unknown option of a kind or an impossible value."""


def faiss_module() -> Any:
    """The ``faiss`` module, or a :class:`~lightning_dml.errors.UserInputError` saying how to install it."""
    try:
        import faiss
    except ImportError:
        raise UserInputError(
            "the embedding index needs faiss: pip install 'lightning-dml[faiss]' (faiss-cpu; a faiss GPU build "
            "works too)"
        ) from None
    return faiss


def faiss_metric(metric: str) -> int:
    faiss = faiss_module()

    if metric == "cosine":
        return faiss.METRIC_INNER_PRODUCT
    if metric == "euclidean":
        return faiss.METRIC_L2
    raise IndexOptionError(f"metric must be 'cosine' or 'euclidean', got {metric!r}")


def _largest_divisor(d: int, at_most: int) -> int:
    return max(m for m in range(1, max(1, at_most) + 1) if d % m == 0)


def check_kind(kind: str, options: dict[str, Any]) -> None:
    """An :class:`IndexOptionError` for an unknown kind or an option the kind does not have."""
    if kind not in KINDS:
        raise IndexOptionError(f"unknown index kind {kind!r}; expected one of {', '.join(KINDS)}")
    options, vector_options = V.vector_options(options)
    V.check_vectors(kind, **vector_options)  # --vectors / --rescore (lightning_dml.index.vectors)
    unknown = sorted(n for n, v in options.items() if n not in KINDS[kind] and v is not None)
    if unknown:
        known = ", ".join(KINDS[kind]) or "none"
        raise IndexOptionError(f"index kind {kind!r} has no option {', '.join(unknown)} (its options: {known})")


def resolve_options(kind: str, options: dict[str, Any], n: int, d: int) -> dict[str, int]:
    """The kind's full settings: ``options`` checked (names, integers >= 1, ``d % m == 0``) and completed with the
    defaults of the module docstring for ``n`` training vectors of size ``d``."""
    if kind not in KINDS:
        raise IndexOptionError(f"unknown index kind {kind!r}; expected one of {', '.join(KINDS)}")
    allowed = KINDS[kind]
    options, vector_options = V.vector_options(options)
    unknown = sorted(set(options) - set(allowed))
    if unknown:
        known = ", ".join(allowed) or "none"
        raise IndexOptionError(f"index kind {kind!r} has no option {', '.join(unknown)} (its options: {known})")
    out: dict[str, int] = {}
    for name, value in options.items():
        if value is None:
            continue
        if isinstance(value, bool) or int(value) != value or int(value) < 1:
            raise IndexOptionError(f"index option {name} must be an integer >= 1, got {value!r}")
        out[name] = int(value)
    n = max(int(n), 1)
    if kind in ("ivf_flat", "ivf_pq"):
        out.setdefault("nlist", max(1, min(int(round(4 * math.sqrt(n))), n // 39)))
        if out["nlist"] > n:
            raise IndexOptionError(f"nlist {out['nlist']} exceeds the {n} vectors the index is trained with")
        out.setdefault("nprobe", min(8, out["nlist"]))
    if kind == "ivf_pq":
        out.setdefault("m", _largest_divisor(d, d // 4))
        if d % out["m"]:
            raise IndexOptionError(f"ivf_pq: m = {out['m']} must divide the embedding size {d}")
        out.setdefault("nbits", int(min(8, max(1, math.floor(math.log2(max(n / 39, 2)))))))
        if out["nbits"] > 16:
            raise IndexOptionError(f"ivf_pq: nbits = {out['nbits']} must be at most 16")
        if 2 ** out["nbits"] > n:
            raise IndexOptionError(f"ivf_pq: nbits = {out['nbits']} needs at least {2 ** out['nbits']} training "
                                   f"vectors, the index has {n}")
    if kind == "hnsw":
        for name, default in allowed.items():
            out.setdefault(name, int(default))
    return {**out, **V.check_vectors(kind, **vector_options)}


def factory_string(kind: str, options: dict[str, int]) -> str:
    """faiss's ``index_factory`` description of ``kind`` (ids kept by ``IDMap2`` where the index has none)."""
    if kind == "flat":
        return "IDMap2,Flat"
    if kind == "ivf_flat":
        return f"IVF{options['nlist']},Flat"
    if kind == "ivf_pq":
        return f"IVF{options['nlist']},PQ{options['m']}x{options['nbits']}"
    if kind == "hnsw":
        return f"IDMap2,HNSW{options['M']},Flat"
    raise IndexOptionError(f"unknown index kind {kind!r}; expected one of {', '.join(KINDS)}")


def build_faiss_index(kind: str, options: dict[str, int], d: int, metric: str, train: np.ndarray | None) -> Any:
    """An empty faiss index of ``kind`` for vectors of size ``d``, trained on ``train`` when the kind needs it."""
    faiss = faiss_module()

    if options.get("vectors", "float32") != "float32":  # int8 / binary codes (lightning_dml.index.vectors)
        V.check_vectors(kind, options["vectors"], options.get("rescore"), metric)
        return V.make_codes_index(options["vectors"], d, faiss_metric(metric), train)
    index = faiss.index_factory(int(d), factory_string(kind, options), faiss_metric(metric))
    if kind == "hnsw":
        faiss.downcast_index(index.index).hnsw.efConstruction = int(options["ef_construction"])
    if not index.is_trained:
        if train is None or len(train) == 0:
            raise IndexOptionError(f"index kind {kind!r} must be trained: build it with at least one vector")
        index.train(np.ascontiguousarray(train, dtype=np.float32))
    set_search_options(index, kind, options, k=1)
    return index


def set_search_options(index: Any, kind: str, options: dict[str, int], k: int) -> None:
    """``nprobe`` of an IVF index, ``efSearch`` of an HNSW index (at least ``k``), on every shard."""
    faiss = faiss_module()

    for sub in shard_list(index):
        if kind in ("ivf_flat", "ivf_pq"):
            faiss.extract_index_ivf(sub).nprobe = int(options["nprobe"])
        elif kind == "hnsw":
            inner = faiss.downcast_index(sub.index if hasattr(sub, "id_map") else sub)
            inner.hnsw.efSearch = max(int(options["ef_search"]), int(k))


def shard_list(index: Any) -> list[Any]:
    """The shards of an ``IndexShards`` (``[index]`` for any other index)."""
    faiss = faiss_module()

    if isinstance(index, faiss.IndexShards):
        return [faiss.downcast_index(index.at(i)) for i in range(index.count())]
    return [index]


def make_shards(shards: list[Any], d: int) -> Any:
    """One faiss index searching ``shards`` together (``IndexShards``; the shard objects stay referenced)."""
    faiss = faiss_module()

    if len(shards) == 1:
        return shards[0]
    merged = faiss.IndexShards(int(d), True, False)  # threaded, ids as stored in the shards
    for shard in shards:
        merged.add_shard(shard)
    return merged


def supports_remove(kind: str) -> bool:
    """Whether faiss removes ids from this kind in place (HNSW graphs do not: the index is rebuilt)."""
    return kind != "hnsw"


def to_gpus(index: Any, kind: str, index_options: dict[str, Any] | None = None) -> Any:
    """``index`` on every GPU faiss sees (sharded over them), or unchanged without a GPU build, for ``hnsw`` and
    for int8 / binary codes (``index_options["vectors"]``; no GPU version of these faiss indexes)."""
    faiss = faiss_module()

    if (index_options or {}).get("vectors", "float32") != "float32":
        return index
    if kind == "hnsw" or not hasattr(faiss, "get_num_gpus") or faiss.get_num_gpus() < 1:
        return index
    options = faiss.GpuMultipleClonerOptions()
    options.shard = True
    return faiss.index_cpu_to_all_gpus(index, co=options)
