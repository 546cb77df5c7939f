"""Search a gallery: an embedding index (faiss) built from a checkpoint, its search, evaluation against the exact
engine, re-ranking, search cuts and an HTTP server (``docs/serving.md``).

* :class:`EmbeddingIndex` (:mod:`~lightning_dml.index.index`): build from tensors, save/load a folder, search, add,
  remove, changed files, embed images with the exported model;
* :func:`build_index` / :func:`add_gallery` (:mod:`~lightning_dml.index.build`): from a checkpoint and an image
  folder or table, through Lightning's predict loop;
* :func:`evaluate_index` (:mod:`~lightning_dml.index.evaluate`): the index against the exact engine;
* index kinds (:mod:`~lightning_dml.index.kinds`): ``flat``, ``ivf_flat``, ``ivf_pq``, ``hnsw``, sharding;
* commands: ``lightning-dml index build|add|evaluate|status`` (:mod:`~lightning_dml.index.command`),
  ``lightning-dml search`` (:mod:`~lightning_dml.index.search`).
"""

from __future__ import annotations

import importlib
from typing import Any

# name -> module: imported on first use (PEP 562), so that `lightning-dml search` and `serve` do not import
# build_index's Lightning predict loop
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
}

__all__ = [
    "KINDS",
    "EmbeddingIndex",
    "IndexFolderError",
    "IndexMismatchError",
    "IndexOptionError",
    "IndexTable",
    "Manifest",
    "add_gallery",
    "build_index",
]


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
