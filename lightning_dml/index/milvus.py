"""A gallery in a Milvus collection (:class:`MilvusIndex`): the :class:`~lightning_dml.index.EmbeddingIndex` API
(``build``, ``add``, ``remove``, ``search``, ``vectors``, ``results``, ``check_model``, ``embedder``, ``manifest``,
``metric``, ``len``) over a Milvus server (``http://host:19530``) or Milvus Lite (the embedded Milvus of the
``milvus-lite`` package: a local ``.db`` URI), so that a gallery can grow past one machine on an existing
distributed engine. ``lightning-dml index build|add|evaluate``, ``search`` and ``serve`` reach it with
``--store milvus --uri URI`` (:mod:`lightning_dml.index.stores`), ``--index``/``--out`` naming the collection.

What is stored where:

* the collection (one row per item): ``id`` (INT64, primary key, the item's id), ``vector`` (FLOAT_VECTOR of the
  embedding size: the vector as the index compares it, L2-normalised for ``cosine``), ``path`` and ``label``
  (VARCHAR), ``size`` and ``mtime_ns`` (INT64, ``-1``: no file), behind a ``FLAT`` Milvus index (exact search) with
  the metric ``IP`` (``cosine``) or ``L2`` (``euclidean``: Milvus reports the squared distance, negated here);
* the collection's properties: ``lightning_dml.manifest``, the :class:`~lightning_dml.index.manifest.Manifest` as
  JSON (checkpoint path and sha256, embedding size, metric, input spec and preprocessing, gallery sources,
  ``next_id``, ``model``: the absolute path of the exported model, and ``calibration``: the match threshold of
  ``lightning-dml index calibrate --store milvus``, :mod:`lightning_dml.index.calibrate`, which ``search`` and
  ``serve`` read as from a folder's manifest), and ``lightning_dml.model_sha256``, the sha256 of that model file;
* the exported model (``embedding_model.safetensors``, the safe format of :mod:`lightning_dml.export`) is a local
  file: Milvus holds vectors, not models. ``build`` writes it into ``model_dir/<collection>__<uid>/`` (default
  ``model_dir``: ``<URI>.models`` beside a Milvus Lite ``.db``; a server URI needs one) and records its absolute
  path and sha256; a machine that embeds queries (``search``, ``serve``, ``index add``) needs the file at that path
  (a shared file system, or the same path), and a file whose sha256 is not the recorded one is refused.

The name given (``--index``) is a Milvus alias of a collection ``<name>__<uid>``: ``build`` fills a new collection
and then points the alias at it (``alter_alias``) and drops the old one, so a build stopped at any point leaves the
old gallery whole (its left-over half-built collection ``<name>__<uid>`` holds no alias and can be dropped). An
index opened before a rebuild (a running ``serve``) keeps the collection it opened, and once that is dropped refuses
to search in one :class:`~lightning_dml.index.manifest.IndexFolderError` (its model need not be the new vectors'):
open it again.
``add`` reserves its ids in the manifest (``next_id``) before it inserts, so ids are never reused; an ``add``
stopped midway leaves the rows inserted so far (each whole), and ``lightning-dml index add`` run again adds the
rest. Milvus Lite opens a ``.db`` in one process at a time (another process: one
:class:`MilvusStoreError`); on a Milvus server, writers of one collection are not coordinated: run one ``build``
or ``add`` of a collection at a time.

Search: :meth:`MilvusIndex.search` returns what :meth:`EmbeddingIndex.search` returns for a ``flat`` index: the
``k`` best items by score, then by the smaller id. Milvus orders equal scores in no specified order (Milvus Lite:
an unstable ``numpy.argsort`` of its brute-force distances), so the results are fetched with one more than ``k``,
searched again with twice as many while the last score fetched equals the ``k``-th, and ordered by (score, id)
here. Milvus returns at most :data:`MILVUS_TOPK` results per query (a server's ``topk`` limit).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_dml.errors import UserInputError
from lightning_dml.index.index import EmbeddingIndex, IndexTable, best_k, query_array
from lightning_dml.index.manifest import FORMAT, IndexFolderError, IndexMismatchError, Manifest

__all__ = ["MILVUS_TOPK", "MilvusIndex", "MilvusStoreError", "connect", "is_local_uri"]

#: most results Milvus returns for one query (a Milvus server's ``topk`` limit)
MILVUS_TOPK = 16384
MANIFEST_PROPERTY = "lightning_dml.manifest"
MODEL_SHA_PROPERTY = "lightning_dml.model_sha256"
MODEL = "embedding_model.safetensors"
#: rows inserted / fetched per Milvus request
BATCH_ROWS = 1000
_MAX_VARCHAR = 65535
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,180}$")
_REMOTE = ("http://", "https://", "tcp://", "grpc://")
_EXTRA = "pip install 'lightning-dml[milvus]'"


class MilvusStoreError(UserInputError, ValueError):
    """A Milvus store that cannot be used: pymilvus missing, a bad URI or collection name, a server that does not
    answer, a Milvus Lite database open in another process, a collection that is not a lightning-dml gallery."""


def is_local_uri(uri: str) -> bool:
    """Whether ``uri`` is a Milvus Lite database (a local path ending in ``.db``), not a server."""
    return not str(uri).startswith(_REMOTE)


def _check_uri(uri: str) -> str:
    uri = str(uri)
    if uri.startswith(_REMOTE):
        return uri
    if not uri.endswith(".db"):
        raise MilvusStoreError(f"--uri {uri}: a Milvus server (http://host:19530) or a Milvus Lite database file "
                               "ending in .db (e.g. ./gallery.db)")
    return uri


def _check_name(name: str) -> str:
    if not _NAME.match(str(name)) or "__" in str(name):
        raise MilvusStoreError(f"collection name {name!r}: letters, digits and single underscores, starting with a "
                               "letter or underscore, at most 181 characters (Milvus's rule; '__' is the store's)")
    return str(name)


@contextlib.contextmanager
def _quiet() -> Iterator[None]:
    """pymilvus, Milvus Lite and its gRPC server (a calls pymilvus makes that Milvus Lite does not implement) log
    failures with a traceback; the errors that matter are raised here as one line."""
    loggers = [logging.getLogger(n) for n in ("pymilvus", "milvus_lite", "grpc._server")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _pymilvus() -> Any:
    try:
        import pymilvus
    except ImportError:
        raise MilvusStoreError(f"--store milvus needs pymilvus (and milvus-lite for a .db URI): {_EXTRA}") from None
    return pymilvus


def connect(uri: str) -> Any:
    """A ``pymilvus.MilvusClient`` of ``uri`` (a server, or a Milvus Lite ``.db`` opened in this process); one
    :class:`MilvusStoreError` when it cannot be reached or opened."""
    pymilvus = _pymilvus()
    uri = _check_uri(uri)
    if is_local_uri(uri):
        try:
            import milvus_lite  # noqa: F401
        except ImportError:
            raise MilvusStoreError(f"--uri {uri}: a .db URI is a Milvus Lite database, which needs milvus-lite: "
                                   f"{_EXTRA}") from None
        Path(uri).expanduser().absolute().parent.mkdir(parents=True, exist_ok=True)
    # Milvus Lite's in-process gRPC server allows a keepalive ping every 5 minutes only (gRPC's default policy), and
    # answers pymilvus's default pings every 10 s on an idle connection with GOAWAY "too_many_pings"
    options = {"grpc_options": {"grpc.keepalive_time_ms": 300_000}} if is_local_uri(uri) else {}
    try:
        with _quiet():
            return pymilvus.MilvusClient(uri=uri, timeout=30, **options)
    except Exception as error:  # noqa: BLE001 - any connection failure is one line
        why = " ".join(str(getattr(error, "message", error)).split())
        if is_local_uri(uri):
            raise MilvusStoreError(f"--uri {uri}: the Milvus Lite database cannot be opened ({why}); Milvus Lite "
                                   "opens a .db in one process at a time: is another lightning-dml command or "
                                   "serve using it?") from None
        raise MilvusStoreError(f"--uri {uri}: no Milvus server answers ({why})") from None


def release(uri: str) -> None:
    """Close a Milvus Lite database this process opened (another process may open it then); nothing for a server."""
    if is_local_uri(uri):
        try:
            from milvus_lite import server_manager_instance
        except ImportError:
            return
        with _quiet():
            server_manager_instance.release_server(str(Path(uri).expanduser().absolute()))


def _call(what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, a Milvus failure as one :class:`MilvusStoreError` naming ``what``."""
    try:
        with _quiet():
            return fn(*args, **kwargs)
    except UserInputError:
        raise
    except Exception as error:  # noqa: BLE001 - pymilvus raises MilvusException and grpc errors
        if type(error).__module__.split(".")[0] not in ("pymilvus", "grpc", "milvus_lite"):
            raise
        why = " ".join(str(getattr(error, "message", error)).split())
        raise MilvusStoreError(f"Milvus: {what} failed ({type(error).__name__}: {why})") from None


def _parse_manifest(text: str | None, where: str) -> Manifest:
    if text is None:
        raise MilvusStoreError(f"{where} is not a lightning-dml gallery: it has no {MANIFEST_PROPERTY} property")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise IndexFolderError(f"{where}: property {MANIFEST_PROPERTY} is not JSON ({error})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise IndexFolderError(f"{where}: manifest format {data.get('format') if isinstance(data, dict) else None!r}, "
                               f"this version of lightning-dml reads format {FORMAT}: rebuild it")
    missing = [k for k in ("kind", "metric", "embedding_dim") if k not in data]
    if missing or data.get("metric") not in ("cosine", "euclidean"):
        raise IndexFolderError(f"{where}: manifest without a valid kind, metric and embedding_dim")
    names = set(Manifest.__dataclass_fields__)
    return Manifest(**{k: v for k, v in data.items() if k in names})


class MilvusIndex:
    """A gallery in a Milvus collection with the :class:`~lightning_dml.index.EmbeddingIndex` API (module
    docstring). Open one with :meth:`open` (or :func:`lightning_dml.index.stores.open_index`), make one with
    :meth:`build` or :func:`build_milvus_index`. ``folder``: where it lives, for messages (``URI#collection``)."""

    kind = "flat"

    def __init__(self, client: Any, uri: str, collection: str, manifest: Manifest, model_sha256: str | None,
                 device: str = "cpu", name: str | None = None) -> None:
        self.client = client
        self.uri = str(uri)
        self.collection = collection  # the collection behind the name when it was opened (<name>__<uid>)
        self.name = name or collection
        self.manifest = manifest
        self.model_sha256 = model_sha256
        self.device = device
        self.folder = f"{self.uri}#{self.name}"
        self._embedder: Any = None
        self._all: tuple[IndexTable, np.ndarray] | None = None

    # --------------------------------------------------------------------------------------------- opening
    @classmethod
    def open(cls, uri: str, collection: str, device: str = "cpu") -> "MilvusIndex":
        """The gallery ``collection`` (the name given to :meth:`build`) at ``uri``; a missing collection or one
        that is not a lightning-dml gallery is one :class:`MilvusStoreError`."""
        collection = _check_name(collection)
        client = connect(uri)
        where = f"Milvus collection {collection} at {uri}"
        if not cls._has(client, collection):
            names = sorted(a for a in _call("listing aliases", client.list_aliases).get("aliases", []))
            raise MilvusStoreError(f"{where} does not exist (galleries there: {', '.join(names) or 'none'}; "
                                   "lightning-dml index build --store milvus writes one)")
        # the collection the name points at now: a rebuild moves the name and drops it (then refused, below)
        physical = _call(f"reading {where}", client.describe_alias, collection)["collection_name"]
        props = _call(f"reading {where}", client.describe_collection, physical).get("properties", {})
        manifest = _parse_manifest(props.get(MANIFEST_PROPERTY), where)
        _call(f"loading {where}", client.load_collection, physical)  # searchable (Milvus loads on demand)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(client, uri, physical, manifest, props.get(MODEL_SHA_PROPERTY), device=device, name=collection)

    @classmethod
    def check_name_free(cls, client: Any, uri: str, collection: str, replace: bool) -> bool:
        """Whether a gallery ``collection`` exists at ``uri`` (then ``replace`` must be true); a plain collection
        of that name (not a lightning-dml gallery) or a gallery without ``replace`` is one :class:`MilvusStoreError`."""
        where = f"Milvus collection {_check_name(collection)} at {uri}"
        if collection in _call("listing collections", client.list_collections):
            raise MilvusStoreError(f"{where} is a collection that is not a lightning-dml gallery (no alias); give "
                                   "another name")
        exists = cls._has(client, collection)
        if exists and not replace:
            raise MilvusStoreError(f"{where} exists; give another name, or --overwrite to replace it")
        return exists

    @staticmethod
    def _has(client: Any, collection: str) -> bool:
        return collection in _call("listing aliases", client.list_aliases).get("aliases", [])

    def _run(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """:func:`_call` on this gallery's collection; a collection dropped since it was opened (the name rebuilt
        with ``--overwrite``) is one :class:`~lightning_dml.index.manifest.IndexFolderError` saying so."""
        try:
            return _call(what, fn, *args, **kwargs)
        except MilvusStoreError:
            if self.collection not in _call("listing collections", self.client.list_collections):
                raise IndexFolderError(
                    f"gallery {self.folder} was rebuilt (lightning-dml index build --overwrite) since it was opened: "
                    "its model need not be the one of the new vectors; open it again") from None
            raise

    def close(self) -> None:
        """Close the connection (and a Milvus Lite database, so that another process can open it)."""
        with _quiet(), contextlib.suppress(Exception):
            self.client.close()
        release(self.uri)

    # --------------------------------------------------------------------------------------------- building
    @classmethod
    def build(
        cls,
        embeddings: Tensor | np.ndarray,
        table: IndexTable | None = None,
        metric: str = "cosine",
        manifest: dict[str, Any] | None = None,
        *,
        uri: str,
        collection: str,
        replace: bool = False,
        model_file: str | os.PathLike | None = None,
        model_dir: str | os.PathLike | None = None,
        device: str = "cpu",
    ) -> "MilvusIndex":
        """A gallery of ``embeddings [N, D]`` (raw; L2-normalised here for ``cosine``) and ``table`` (default ids
        0..N-1 without paths or labels) in a new collection behind the name ``collection`` at ``uri``.

        ``manifest``: more manifest fields (``checkpoint``, ``input_spec``, ``preprocess``, ``gallery``);
        ``model_file``: an exported model (safe format) copied to ``model_dir/<collection>__<uid>/`` (default
        ``model_dir``: ``<uri>.models`` for Milvus Lite) and recorded with its sha256; ``replace``: replace a
        gallery of that name (the alias moves to the new collection once it is complete; the old one is dropped).
        """
        collection = _check_name(collection)
        uri = _check_uri(uri)
        where = f"Milvus collection {collection} at {uri}"
        if metric not in ("cosine", "euclidean"):
            raise MilvusStoreError(f"metric must be 'cosine' or 'euclidean', got {metric!r}")
        vectors = EmbeddingIndex._prepare(embeddings, metric)
        n, d = vectors.shape
        if table is None:
            table = IndexTable(np.arange(n), [""] * n, [""] * n)
        if len(table) != n:
            raise ValueError(f"{n} embeddings but {len(table)} table rows")
        if len(np.unique(table.ids)) != n or table.ids.min() < 0:
            raise ValueError("table ids must be distinct and non-negative")
        if model_file is not None and model_dir is None:
            if not is_local_uri(uri):
                raise MilvusStoreError(f"{where}: give a local folder for the exported model (--model_dir): a "
                                       "Milvus server holds vectors, not models")
            model_dir = f"{Path(uri).expanduser().absolute()}.models"
        client = connect(uri)
        old = None
        if cls.check_name_free(client, uri, collection, replace):
            old = _call(f"reading {where}", client.describe_alias, collection)["collection_name"]
        uid = secrets.token_hex(8)
        physical = f"{collection}__{uid}"
        extra = dict(manifest or {})
        fields = {k: v for k, v in extra.items() if k in Manifest.__dataclass_fields__ and k not in (
            "kind", "metric", "embedding_dim", "options", "shards", "count", "next_id", "uid", "model")}
        meta = Manifest(kind="flat", metric=metric, embedding_dim=d, options={}, shards=1, count=n,
                        next_id=int(table.ids.max()) + 1, uid=uid, **fields)
        model_sha = None
        if model_file is not None:
            target = Path(model_dir).expanduser().absolute() / physical / MODEL
            _copy_atomic(Path(model_file), target)
            meta.model = str(target)
            from lightning_dml.data.decoded_cache import file_sha256

            model_sha = file_sha256(target)
        _create(client, physical, d, metric, meta, model_sha)
        index = cls(client, uri, physical, meta, model_sha, device=device, name=collection)
        index._insert(vectors, table)
        # the name moves to the complete collection at once; the old one (and its model) goes after
        if old is None:
            _call(f"naming {physical} {collection}", client.create_alias, physical, collection)
        else:
            _call(f"moving {collection} to {physical}", client.alter_alias, physical, collection)
            old_props = _call(f"reading {old}", client.describe_collection, old).get("properties", {})
            _call(f"dropping {old}", client.drop_collection, old)
            if model_dir is not None:
                _drop_model(old_props.get(MANIFEST_PROPERTY), old, Path(model_dir).expanduser().absolute())
        return index

    def _insert(self, vectors: np.ndarray, table: IndexTable) -> None:
        for start in range(0, len(table), BATCH_ROWS):
            rows = []
            for r in range(start, min(start + BATCH_ROWS, len(table))):
                path, label = table.paths[r], table.labels[r]
                if len(path.encode()) > _MAX_VARCHAR or len(label.encode()) > _MAX_VARCHAR:
                    raise MilvusStoreError(f"item {int(table.ids[r])}: a path or label longer than {_MAX_VARCHAR} "
                                           "bytes (Milvus's VARCHAR limit)")
                size, mtime = table.sizes[r], table.mtimes[r]
                rows.append({"id": int(table.ids[r]), "vector": vectors[r].tolist(), "path": path, "label": label,
                             "size": -1 if size is None else int(size),
                             "mtime_ns": -1 if mtime is None else int(mtime)})
            self._run(f"inserting into {self.folder}", self.client.insert, self.collection, rows)
        self._all = None

    # --------------------------------------------------------------------------------------------- properties
    @property
    def metric(self) -> str:
        """``cosine`` or ``euclidean`` (as :attr:`EmbeddingIndex.metric`)."""
        return self.manifest.metric

    @property
    def dim(self) -> int:
        return int(self.manifest.embedding_dim)

    @property
    def options(self) -> dict[str, Any]:
        return {}

    def stored_bytes(self) -> int:
        """Bytes of the vectors the FLAT collection searches (``index evaluate``'s bytes per vector): a float32
        vector and an int64 id per item; the path, label and file fields and Milvus's own overhead are not counted."""
        return len(self) * (4 * self.dim + 8)

    def __len__(self) -> int:
        found = self._run(f"counting {self.folder}", self.client.query, self.collection, filter="",
                          output_fields=["count(*)"])
        return int(found[0]["count(*)"])

    def __repr__(self) -> str:
        return (f"MilvusIndex(uri={self.uri!r}, collection={self.name!r}, metric={self.metric!r}, "
                f"dim={self.dim}, items={len(self)})")

    def _load_all(self) -> tuple[IndexTable, np.ndarray]:
        """Every row (table and vectors) in id order, read once until the next change through this object."""
        if self._all is None:
            it = self._run(f"reading {self.folder}", self.client.query_iterator, self.collection,
                           batch_size=BATCH_ROWS, filter="id >= 0",
                           output_fields=["id", "vector", "path", "label", "size", "mtime_ns"])
            rows: list[dict] = []
            while True:
                batch = _call(f"reading {self.folder}", it.next)
                if not batch:
                    break
                rows.extend(batch)
            _call(f"reading {self.folder}", it.close)
            rows.sort(key=lambda row: int(row["id"]))
            table = IndexTable([int(r["id"]) for r in rows], [r["path"] for r in rows], [r["label"] for r in rows],
                               [None if r["size"] < 0 else int(r["size"]) for r in rows],
                               [None if r["mtime_ns"] < 0 else int(r["mtime_ns"]) for r in rows])
            vectors = np.asarray([r["vector"] for r in rows], dtype=np.float32).reshape(len(rows), self.dim)
            self._all = table, vectors
        return self._all

    @property
    def table(self) -> IndexTable:
        """The whole id -> path/label table in id order (read from the collection; ``index evaluate``, ``add``)."""
        return self._load_all()[0]

    @property
    def embeddings(self) -> Tensor:
        """All stored vectors ``[N, D]`` in :attr:`table` order (as the index compares them)."""
        return torch.from_numpy(self._load_all()[1].copy())

    # --------------------------------------------------------------------------------------------- identity
    def check_model(self, checkpoint_sha256: str | None = None, embedding_dim: int | None = None,
                    what: str = "the queries") -> None:
        """:meth:`EmbeddingIndex.check_model`: another embedding size or checkpoint sha256 than the gallery's is
        one :class:`~lightning_dml.index.manifest.IndexMismatchError` naming both."""
        if embedding_dim is not None and int(embedding_dim) != self.dim:
            raise IndexMismatchError(f"{what} have embedding size {int(embedding_dim)}, the gallery {self.folder} "
                                     f"holds embeddings of size {self.dim}: they come from another model")
        mine = self.manifest.checkpoint_sha256
        if checkpoint_sha256 is not None and mine is not None and checkpoint_sha256 != mine:
            ckpt = (self.manifest.checkpoint or {}).get("path", "")
            raise IndexMismatchError(
                f"{what} were embedded with checkpoint sha256 {checkpoint_sha256}, the gallery {self.folder} with "
                f"checkpoint sha256 {mine} ({ckpt}): another model's embeddings cannot be searched in it")

    # --------------------------------------------------------------------------------------------- search
    def search(self, queries: Tensor, k: int, *, checkpoint_sha256: str | None = None) -> tuple[Tensor, Tensor]:
        """The ``k`` best items of each query, ``(scores [Q, k] float32, ids [Q, k] int64)`` on the queries'
        device, as :meth:`EmbeddingIndex.search` of a ``flat`` index (ties: module docstring)."""
        if not isinstance(queries, Tensor) or queries.ndim != 2:
            raise ValueError(f"queries must be a [Q, D] tensor, got {getattr(queries, 'shape', type(queries))}")
        self.check_model(checkpoint_sha256, queries.shape[1])
        k = int(k)
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        device = queries.device
        if queries.shape[0] == 0:
            return torch.empty(0, k, device=device), torch.empty(0, k, dtype=torch.long, device=device)
        x = query_array(queries, self.metric)
        total = len(self)
        if min(k, total) > MILVUS_TOPK:
            raise MilvusStoreError(f"k {k}: Milvus returns at most {MILVUS_TOPK} results per query")
        scores, ids = best_k(self._milvus_search, x, k, min(total, MILVUS_TOPK))
        return scores.to(device), ids.to(device)

    def _milvus_search(self, x: np.ndarray, k: int) -> tuple[Tensor, Tensor]:
        """Milvus's ``k`` results of the float32 queries ``x`` as similarity scores (``-inf`` / ``-1`` padding)."""
        scores = torch.full((x.shape[0], k), float("-inf"))
        ids = torch.full((x.shape[0], k), -1, dtype=torch.long)
        params = {"metric_type": "IP" if self.metric == "cosine" else "L2"}
        for start in range(0, x.shape[0], BATCH_ROWS):
            found = self._run(f"searching {self.folder}", self.client.search, self.collection,
                              data=x[start : start + BATCH_ROWS].tolist(), limit=k, anns_field="vector",
                              search_params=params, output_fields=["id"])
            for q, hits in enumerate(found, start=start):
                for j, hit in enumerate(list(hits)[:k]):
                    distance = float(hit["distance"])
                    scores[q, j] = distance if self.metric == "cosine" else -distance
                    ids[q, j] = int(hit["id"])
        return scores, ids

    def _get(self, ids: np.ndarray, fields: list[str]) -> dict[int, dict]:
        out: dict[int, dict] = {}
        for start in range(0, ids.size, BATCH_ROWS):
            part = [int(i) for i in ids[start : start + BATCH_ROWS].tolist()]
            for row in self._run(f"reading {self.folder}", self.client.get, self.collection, ids=part,
                                 output_fields=fields):
                out[int(row["id"])] = row
        return out

    def vectors(self, ids: Tensor) -> Tensor:
        """The stored vectors of ``ids [N]`` -> ``[N, D]`` float32 on ``ids``' device; an id not in the gallery
        is a ``KeyError``."""
        flat = torch.as_tensor(ids).reshape(-1)
        wanted = flat.cpu().numpy().astype(np.int64)
        rows = self._get(np.unique(wanted), ["vector"])
        missing = [int(i) for i in wanted.tolist() if int(i) not in rows]
        if missing:
            raise KeyError(f"ids not in the index: {missing[:5]}")
        out = np.asarray([rows[int(i)]["vector"] for i in wanted.tolist()], dtype=np.float32).reshape(-1, self.dim)
        return torch.from_numpy(out).to(flat.device)

    def results(self, scores: Tensor, ids: Tensor) -> list[list[dict[str, Any]]]:
        """Result lists ``[{"id", "path", "label", "score"}, ...]`` per query (``-1`` padding left out)."""
        ids_np = ids.detach().cpu().numpy()
        scores_np = scores.detach().cpu().double().numpy()
        rows = self._get(np.unique(ids_np[ids_np >= 0]), ["path", "label"])
        out = []
        for q in range(ids_np.shape[0]):
            found = []
            for j in range(ids_np.shape[1]):
                row = rows.get(int(ids_np[q, j]))
                if ids_np[q, j] < 0 or row is None:
                    continue
                found.append({"id": int(ids_np[q, j]), "path": row["path"], "label": row["label"],
                              "score": float(scores_np[q, j])})
            out.append(found)
        return out

    # --------------------------------------------------------------------------------------------- images
    @property
    def embedder(self) -> Any:
        """The :class:`~lightning_dml.index.embed.ImageEmbedder` of the exported model recorded in the manifest
        (its file's sha256 must be the recorded one)."""
        if self._embedder is None:
            from lightning_dml.data.decoded_cache import file_sha256
            from lightning_dml.index.embed import ImageEmbedder
            from lightning_dml.models.input_spec import InputSpec

            if not self.manifest.model:
                raise IndexFolderError(f"gallery {self.folder} has no exported model: it was built from tensors; "
                                       "embed queries yourself and call search()")
            path = Path(self.manifest.model)
            if not path.is_file():
                raise IndexFolderError(f"gallery {self.folder}: its exported model {path} is missing on this machine "
                                       "(the model is a local file: copy it there, docs/serving.md 'Milvus')")
            if self.model_sha256 and file_sha256(path) != self.model_sha256:
                raise IndexMismatchError(f"gallery {self.folder}: the model file {path} is not the one it was built "
                                         f"with (sha256 {self.model_sha256[:12]}... recorded): rebuild the gallery")
            spec = InputSpec(**{k: tuple(v) if isinstance(v, list) else v
                                for k, v in (self.manifest.input_spec or {}).items()})
            device = "cuda" if self.device != "cpu" and torch.cuda.is_available() else "cpu"
            self._embedder = ImageEmbedder(path, spec, self.manifest.preprocess or {}, device=device)
        return self._embedder

    def embed_images(self, images: Sequence[Any]) -> Tensor:
        """Raw embeddings ``[N, D]`` of image files or PIL images with the gallery's exported model."""
        return self.embedder(images)

    # --------------------------------------------------------------------------------------------- changes
    def _read_manifest(self) -> Manifest:
        props = self._run(f"reading {self.folder}", self.client.describe_collection,
                          self.collection).get("properties", {})
        return _parse_manifest(props.get(MANIFEST_PROPERTY), f"Milvus collection {self.folder}")

    def write_manifest(self) -> None:
        """Store :attr:`manifest` in the collection's properties (``count`` as it is now)."""
        self.manifest.count = len(self)
        self._run(f"writing the manifest of {self.folder}", self.client.alter_collection_properties,
                  self.collection, properties={MANIFEST_PROPERTY: self.manifest.to_json()})

    def update_manifest(self, change: Callable[[Manifest], None]) -> Manifest:
        """``change(manifest)`` applied to the manifest as stored now (read again from the collection's
        properties, not the copy read at :meth:`open`) and written back; :attr:`manifest` becomes the result, which
        is returned (how :func:`~lightning_dml.index.calibrate.calibrate_index` stores a threshold). ``change`` may
        raise to refuse; a name moved to another collection since :meth:`open` (a rebuild) is one
        :class:`~lightning_dml.index.manifest.IndexFolderError` and nothing is written. Milvus has no lock: writers
        of one collection are not coordinated (module docstring): run one at a time."""
        stored = self._read_manifest()  # also refuses a collection dropped since it was opened
        now = _call(f"reading {self.folder}", self.client.describe_alias, self.name)["collection_name"]
        if now != self.collection:
            raise IndexFolderError(f"gallery {self.folder} was rebuilt (lightning-dml index build --overwrite) since "
                                   "it was opened: open it again")
        change(stored)
        self._run(f"writing the manifest of {self.folder}", self.client.alter_collection_properties,
                  self.collection, properties={MANIFEST_PROPERTY: stored.to_json()})
        self.manifest = stored
        return stored

    def add(self, embeddings: Tensor | np.ndarray, paths: Sequence[str] | None = None,
            labels: Sequence[str] | None = None, *, checkpoint_sha256: str | None = None) -> Tensor:
        """Add items (raw embeddings of the gallery's model) and return their new ids (``next_id`` onwards, reserved
        in the stored manifest before the rows are inserted: ids are never reused)."""
        from lightning_dml.index.index import _stat

        x = torch.as_tensor(embeddings)
        if x.ndim != 2:
            raise ValueError(f"embeddings must be [N, D], got shape {tuple(x.shape)}")
        self.check_model(checkpoint_sha256, x.shape[1], what="the added embeddings")
        vectors = EmbeddingIndex._prepare(x, self.metric)
        n = vectors.shape[0]
        paths = [str(p) for p in paths] if paths is not None else [""] * n
        labels = [str(v) for v in labels] if labels is not None else [""] * n
        if len(paths) != n or len(labels) != n:
            raise ValueError(f"{n} embeddings, {len(paths)} paths and {len(labels)} labels")
        stored = self._read_manifest()  # the next id as stored now
        self.manifest.next_id = max(self.manifest.next_id, stored.next_id)
        # and the calibration as stored now (index calibrate since this object opened the gallery: the same model)
        self.manifest.calibration = stored.calibration
        ids = np.arange(self.manifest.next_id, self.manifest.next_id + n, dtype=np.int64)
        self.manifest.next_id += n
        self.write_manifest()
        stats = [_stat(p) if p else (None, None) for p in paths]
        self._insert(vectors, IndexTable(ids, paths, labels, [s for s, _ in stats], [m for _, m in stats]))
        self.manifest.count = len(self)
        return torch.from_numpy(ids)

    def remove(self, ids: Sequence[int] | Tensor) -> int:
        """Remove items by id and return how many were removed; an id not in the gallery is a ``KeyError``."""
        wanted = np.unique(torch.as_tensor(ids).reshape(-1).cpu().numpy().astype(np.int64))
        if wanted.size == 0:
            return 0
        present = self._get(wanted, ["id"])
        missing = [int(i) for i in wanted.tolist() if int(i) not in present]
        if missing:
            raise KeyError(f"ids not in the index: {missing[:5]}")
        for start in range(0, wanted.size, BATCH_ROWS):
            self._run(f"deleting from {self.folder}", self.client.delete, self.collection,
                      ids=[int(i) for i in wanted[start : start + BATCH_ROWS].tolist()])
        self._all = None
        self.manifest.count = len(self)
        return int(wanted.size)

    def changed_files(self) -> list[tuple[int, str, str]]:
        """``(id, path, "missing" | "modified")`` of the indexed files changed since they were embedded."""
        from lightning_dml.index.index import _stat

        table = self.table
        out = []
        for i, path, size, mtime in zip(table.ids.tolist(), table.paths, table.sizes, table.mtimes):
            if not path or size is None:
                continue
            now = _stat(path)
            if now == (None, None):
                out.append((i, path, "missing"))
            elif now != (size, mtime):
                out.append((i, path, "modified"))
        return out


def _create(client: Any, name: str, dim: int, metric: str, manifest: Manifest, model_sha: str | None) -> None:
    pymilvus = _pymilvus()
    types = pymilvus.DataType
    schema = client.create_schema(auto_id=False, enable_dynamic_field=False)
    schema.add_field("id", types.INT64, is_primary=True)
    schema.add_field("vector", types.FLOAT_VECTOR, dim=int(dim))
    schema.add_field("path", types.VARCHAR, max_length=_MAX_VARCHAR)
    schema.add_field("label", types.VARCHAR, max_length=_MAX_VARCHAR)
    schema.add_field("size", types.INT64)
    schema.add_field("mtime_ns", types.INT64)
    params = client.prepare_index_params()
    params.add_index(field_name="vector", index_type="FLAT", metric_type="IP" if metric == "cosine" else "L2")
    properties = {MANIFEST_PROPERTY: manifest.to_json()}
    if model_sha:
        properties[MODEL_SHA_PROPERTY] = model_sha
    _call(f"creating collection {name}", client.create_collection, name, schema=schema, index_params=params,
          consistency_level="Strong", properties=properties)


def _copy_atomic(source: Path, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=".model-", delete=False) as handle:
        tmp = Path(handle.name)
    try:
        shutil.copyfile(source, tmp)
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _drop_model(manifest_json: str | None, collection: str, model_root: Path) -> None:
    """Delete the model folder of a dropped collection when it is ``model_root/<collection>/`` (this build's
    ``model_dir``), nothing else: the old manifest's path comes from the store and is not trusted to name a folder."""
    try:
        model = json.loads(manifest_json or "{}").get("model")
    except (json.JSONDecodeError, AttributeError):
        return
    if isinstance(model, str) and Path(model).parent == model_root / collection:
        shutil.rmtree(model_root / collection, ignore_errors=True)


def build_milvus_index(
    config: str | os.PathLike,
    ckpt_path: str | os.PathLike,
    gallery: str | os.PathLike,
    *,
    uri: str,
    collection: str,
    model_dir: str | os.PathLike | None = None,
    split: str | None = None,
    replace: bool = False,
    accelerator: str = "auto",
    devices: int | str = 1,
    strategy: str = "auto",
    num_workers: int = 0,
    batch_size: int = 128,
    progress: bool = True,
) -> MilvusIndex | None:
    """:func:`~lightning_dml.index.build_index` into Milvus: embed ``gallery`` with the checkpoint's model
    (Lightning's predict loop; DDP: rank 0 writes), export the model (safe format) and store both (module
    docstring). Returns the gallery on rank 0, ``None`` on the other ranks."""
    import dataclasses

    from lightning_dml.export import export_embedding_model
    from lightning_dml.index.build import quiet_lightning
    from lightning_dml.index.embed import embedding_metric, load_checkpoint_model, predict_embeddings, preprocessing
    from lightning_dml.index.gallery import read_items
    from lightning_dml.index.index import _stat

    _check_name(collection)
    _check_uri(uri)
    if model_dir is None and not is_local_uri(uri):
        raise MilvusStoreError(f"--uri {uri}: give --model_dir, a local folder for the exported model (a Milvus "
                               "server holds vectors, not models)")
    items = read_items(gallery, split)
    with quiet_lightning():  # no "GPU available: ..." lines (lightning_dml.index.build)
        module, datamodule, record = load_checkpoint_model(config, ckpt_path)
        spec, preprocess = preprocessing(module, datamodule)
        embeddings = predict_embeddings(
            module, items.paths, spec, preprocess, accelerator=accelerator, devices=devices, strategy=strategy,
            num_workers=num_workers, batch_size=batch_size, progress=progress,
        )
    if embeddings is None:
        return None
    stats = [_stat(str(p)) for p in items.paths]
    table = IndexTable(range(len(items)), [str(p) for p in items.paths], items.labels,
                       [s for s, _ in stats], [m for _, m in stats])
    manifest = {"checkpoint": record, "input_spec": dataclasses.asdict(spec), "preprocess": preprocess,
                "gallery": [str(Path(gallery).expanduser().absolute())]}
    with tempfile.TemporaryDirectory(prefix="lightning-dml-milvus-") as tmp:
        example = torch.zeros(2, spec.channels, preprocess["crop_size"], preprocess["crop_size"])
        written = export_embedding_model(module, tmp, example, formats=("safetensors",))
        return MilvusIndex.build(embeddings, table, embedding_metric(module), manifest, uri=uri,
                                 collection=collection, replace=replace, model_file=written["safetensors"],
                                 model_dir=model_dir)


def add_milvus_gallery(index: MilvusIndex, gallery: str | os.PathLike, *, split: str | None = None,
                       batch_size: int = 64) -> dict[str, int]:
    """:func:`~lightning_dml.index.add_gallery` on a Milvus gallery: images of ``gallery`` not yet in it are
    embedded (the exported model) and added, changed ones (size, modification time, label) removed and added again
    under a new id. Returns ``{"added", "updated", "unchanged"}``."""
    from lightning_dml.index.gallery import read_items
    from lightning_dml.index.index import _stat

    if index.manifest.model is None:
        raise IndexFolderError(f"gallery {index.folder} has no exported model (built from tensors): use "
                               "MilvusIndex.add with embeddings")
    index.embedder  # a missing or replaced model stops the command before any change
    items = read_items(gallery, split)
    table = index.table
    known = {p: r for r, p in enumerate(table.paths)}
    new_rows, stale_ids = [], []
    unchanged = 0
    for i, path in enumerate(items.paths):
        row = known.get(str(path))
        if row is None:
            new_rows.append(i)
        elif _stat(str(path)) != (table.sizes[row], table.mtimes[row]) or items.labels[i] != table.labels[row]:
            stale_ids.append(int(table.ids[row]))
            new_rows.append(i)
        else:
            unchanged += 1
    source = str(Path(gallery).expanduser().absolute())
    if source not in index.manifest.gallery:
        index.manifest.gallery.append(source)
    if stale_ids:
        index.remove(stale_ids)
    for s in range(0, len(new_rows), batch_size):
        part = new_rows[s : s + batch_size]
        with torch.no_grad():
            embeddings = index.embed_images([items.paths[i] for i in part])
        index.add(embeddings, [str(items.paths[i]) for i in part], [items.labels[i] for i in part])
    index.write_manifest()
    return {"added": len(new_rows) - len(stale_ids), "updated": len(stale_ids), "unchanged": unchanged}
