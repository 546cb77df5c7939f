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

from lightning_dml.index.build import add_gallery, build_index
from lightning_dml.index.index import EmbeddingIndex, IndexTable
from lightning_dml.index.kinds import KINDS, IndexOptionError
from lightning_dml.index.manifest import IndexFolderError, IndexMismatchError, Manifest

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
