"""Search a gallery: an embedding index (faiss) built from a checkpoint, its search, evaluation against the exact
engine, re-ranking, search cuts and an HTTP server (``docs/serving.md``).

* :class:`EmbeddingIndex` (:mod:`~lightning_dml.index.index`): build from tensors, save/load a folder, search, add,
  remove, changed files, embed images with the exported model;
* :func:`build_index` / :func:`add_gallery` (:mod:`~lightning_dml.index.build`): from a checkpoint and an image
  folder or table, through Lightning's predict loop;
* :func:`evaluate_index` (:mod:`~lightning_dml.index.evaluate`): the index against the exact engine;
* index kinds (:mod:`~lightning_dml.index.kinds`): ``flat``, ``ivf_flat``, ``ivf_pq``, ``hnsw``, sharding;
* stores (:mod:`~lightning_dml.index.stores`): :func:`open_index` / :func:`close_index` open a gallery in an index
  folder or in a Milvus collection (:class:`MilvusIndex`, :func:`build_milvus_index`, :func:`add_milvus_gallery`:
  :mod:`~lightning_dml.index.milvus`, the same search API; pymilvus is imported only when a Milvus store is used);
* :func:`calibrate_index` (:mod:`~lightning_dml.index.calibrate`): a match threshold at a false (non-)match rate,
  stored with the gallery (folder or Milvus collection);
* commands: ``lightning-dml index build|add|evaluate|status`` (:mod:`~lightning_dml.index.command`),
  ``lightning-dml search`` (:mod:`~lightning_dml.index.search`).
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module: imported on first use (PEP 562), so that `lightning-dml search` and `serve` do not import
# build_index's Lightning predict loop, and `import lightning_dml.index` imports neither torch nor pymilvus
_WHERE: dict[str, str] = {
    "add_gallery": "lightning_dml.index.build",
    "build_index": "lightning_dml.index.build",
    "EmbeddingIndex": "lightning_dml.index.index",
    "IndexTable": "lightning_dml.index.index",
    "KINDS": "lightning_dml.index.kinds",
    "IndexOptionError": "lightning_dml.index.kinds",
    "IndexFolderError": "lightning_dml.index.manifest",
    "IndexMismatchError": "lightning_dml.index.manifest",
    "Manifest": "lightning_dml.index.manifest",
    "STORES": "lightning_dml.index.stores",
    "StoreOptionError": "lightning_dml.index.stores",
    "close_index": "lightning_dml.index.stores",
    "open_index": "lightning_dml.index.stores",
    "MilvusIndex": "lightning_dml.index.milvus",
    "MilvusStoreError": "lightning_dml.index.milvus",
    "add_milvus_gallery": "lightning_dml.index.milvus",
    "build_milvus_index": "lightning_dml.index.milvus",
    "calibrate_index": "lightning_dml.index.calibrate",
    "CalibrationError": "lightning_dml.index.calibrate",
    "CalibrationMismatchError": "lightning_dml.index.calibrate",
}

__all__ = [
    "KINDS",
    "STORES",
    "CalibrationError",
    "CalibrationMismatchError",
    "EmbeddingIndex",
    "IndexFolderError",
    "IndexMismatchError",
    "IndexOptionError",
    "IndexTable",
    "Manifest",
    "MilvusIndex",
    "MilvusStoreError",
    "StoreOptionError",
    "add_gallery",
    "add_milvus_gallery",
    "build_index",
    "build_milvus_index",
    "calibrate_index",
    "close_index",
    "open_index",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
