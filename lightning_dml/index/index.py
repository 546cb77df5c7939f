"""``EmbeddingIndex``: a faiss index of a gallery's embeddings, its id -> path/label table and the model that made it.

An index folder (:meth:`EmbeddingIndex.save`, :meth:`EmbeddingIndex.load`) holds:

* ``manifest.json``: :class:`~lightning_dml.index.manifest.Manifest` (checkpoint sha256, input spec, embedding
  size, metric, kind and its options, versions);
* ``index.faiss`` (or ``shard-0.faiss``, ``shard-1.faiss``, ... for a sharded index): the faiss index, ids =
  the table's ids;
* ``table.csv``: ``id,path,label,size,mtime_ns``, one row per indexed item (``size``/``mtime_ns``: the image file's
  when it was embedded; empty for items added from tensors without a file);
* ``embeddings.npy``: float32 ``[N, D]``, the vectors as the index compares them (L2-normalised for ``cosine``), in
  table order: the exact vectors of re-ranking (:meth:`vectors`), of ``index evaluate``'s exact search, and of the
  rebuild of an HNSW index after :meth:`remove`;
* ``embedding_model.safetensors``: the embedding model in the safe format of
  :func:`~lightning_dml.export.export_embedding_model` (weights as tensors, a JSON record of the architecture,
  rebuilt from the library's own classes: loading it unpickles nothing), so :meth:`embed_images` and
  ``lightning-dml search`` need no training config (absent for an index built from tensors).

The folder is written and read as a whole (:mod:`lightning_dml.index.folder`): a save writes a new sibling folder
under the lock ``.NAME.lock`` beside it and swaps it in, so a reader or a killed writer never leaves or sees old
files mixed with new ones, and :meth:`EmbeddingIndex.load` reads a folder again when it was replaced meanwhile.

Scores are similarities, higher is better: the cosine similarity (``cosine``: inner product of L2-normalised
vectors) or the negated squared Euclidean distance (``euclidean``), as the library's exact engine
(:func:`lightning_dml.metrics.functional.knn`) reports them. Results are the best by score, then by the smaller id
(the exact engine's tie rule, also for equal scores across the k-th place; :meth:`EmbeddingIndex.search`): a
``flat`` index returns the exact engine's ids wherever no two scores are equal in float32 but not in float64.
``-1`` ids (score ``-inf``) pad rows with fewer than ``k`` results.
"""

from __future__ import annotations

import csv
import dataclasses
import os
import re
import secrets
import shutil
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from lightning_dml.errors import UserInputError
from lightning_dml.index import kinds as K
from lightning_dml.index.faiss_search import best_k_arrays, faiss_names, faiss_scores, read_shards
from lightning_dml.index import vectors as V
from lightning_dml.index.folder import DEFAULT_LOCK_TIMEOUT, IndexBusyError, real_folder, replacing, settle
from lightning_dml.index.manifest import MANIFEST, IndexFolderError, IndexMismatchError, Manifest, folder_uid

__all__ = ["EmbeddingIndex", "IndexTable"]

TABLE = "table.csv"
EMBEDDINGS = "embeddings.npy"
MODEL = "embedding_model.safetensors"
TABLE_COLUMNS = ("id", "path", "label", "size", "mtime_ns")
_FAISS_FILE = re.compile(r"^(index|shard-\d+)\.faiss$")
_LOAD_ATTEMPTS = 5


def query_array(queries: Tensor, metric: str) -> np.ndarray:
    """Queries as a store searches them: float32, L2-normalised for ``cosine`` (as the stored vectors), a
    C-contiguous numpy array on the CPU."""
    x = queries.detach().float()
    if metric == "cosine":
        x = torch.nn.functional.normalize(x, dim=1)
    return np.ascontiguousarray(x.cpu().numpy())


def best_k(search: Callable[[np.ndarray, int], tuple[Tensor, Tensor]], x: np.ndarray, k: int,
           limit: int) -> tuple[Tensor, Tensor]:
    """The ``k`` best results of each query by score, then by the smaller id (the exact engine's tie rule), from
    ``search(x, n) -> (scores [Q, n], ids [Q, n])`` (a store's top-n in its own order of ties, ``-1`` padding),
    ``-inf`` / ``-1`` padding to ``k`` columns.

    One result more than asked is fetched: a row whose (k+1)-th score equals its k-th has a tie across the
    boundary and is searched again with twice as many (at most ``limit``, what the store can return) until the tie
    ends, so that the ``k`` kept are the best ``k`` of everything the store finds for the query, whatever ``k`` and
    the store's sharding or order of equal scores."""
    def search_arrays(queries: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
        scores, ids = search(queries, n)
        return scores.numpy(), ids.numpy()

    scores, ids = best_k_arrays(search_arrays, x, k, limit)  # the rule on arrays: lightning_dml.index.faiss_search
    return torch.from_numpy(scores), torch.from_numpy(ids)


def _link_or_copy(source: str, target: str) -> None:
    """Hard-link ``source`` as ``target`` (the old folder is deleted after the swap), or copy where links fail."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copy2(source, target)


def _stat(path: str) -> tuple[int | None, int | None]:
    try:
        stat = os.stat(path)
    except OSError:
        return None, None
    return int(stat.st_size), int(stat.st_mtime_ns)


class IndexTable:
    """The id -> path/label table of an index: parallel lists ``ids`` (int64), ``paths``, ``labels`` (``""``:
    none), ``sizes`` and ``mtimes`` (``None``: no file), in the order of the stored embeddings."""

    def __init__(self, ids: Sequence[int] = (), paths: Sequence[str] = (), labels: Sequence[str] = (),
                 sizes: Sequence[int | None] | None = None, mtimes: Sequence[int | None] | None = None) -> None:
        n = len(ids)
        if len(paths) != n or len(labels) != n:
            raise ValueError(f"table: {n} ids, {len(paths)} paths and {len(labels)} labels")
        self.ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self.paths = [str(p) for p in paths]
        self.labels = [str(v) for v in labels]
        self.sizes = list(sizes) if sizes is not None else [None] * n
        self.mtimes = list(mtimes) if mtimes is not None else [None] * n
        self._row: dict[int, int] | None = None

    def __len__(self) -> int:
        return len(self.paths)

    def rows_of(self, ids: np.ndarray) -> np.ndarray:
        """Table row of each id (``-1`` for an id not in the table)."""
        if self._row is None:
            self._row = {int(i): r for r, i in enumerate(self.ids.tolist())}
        row = self._row
        return np.asarray([row.get(int(i), -1) for i in np.asarray(ids).reshape(-1).tolist()], dtype=np.int64)

    def select(self, rows: np.ndarray) -> "IndexTable":
        rows = np.asarray(rows, dtype=np.int64)
        pick = rows.tolist()
        return IndexTable(self.ids[rows], [self.paths[r] for r in pick], [self.labels[r] for r in pick],
                          [self.sizes[r] for r in pick], [self.mtimes[r] for r in pick])

    def concat(self, other: "IndexTable") -> "IndexTable":
        return IndexTable(np.concatenate([self.ids, other.ids]), self.paths + other.paths, self.labels + other.labels,
                          self.sizes + other.sizes, self.mtimes + other.mtimes)

    def write(self, path: Path) -> None:
        with open(path, "w", newline="", encoding="utf-8") as handle:
            writer = csv.writer(handle)
            writer.writerow(TABLE_COLUMNS)
            for i, p, label, size, mtime in zip(self.ids.tolist(), self.paths, self.labels, self.sizes, self.mtimes):
                writer.writerow([i, p, label, "" if size is None else size, "" if mtime is None else mtime])

    @classmethod
    def read(cls, path: Path) -> "IndexTable":
        if not path.is_file():
            raise IndexFolderError(f"index folder {path.parent}: {path.name} is missing")
        try:
            with open(path, newline="", encoding="utf-8") as handle:
                rows = list(csv.reader(handle))
        except (UnicodeDecodeError, csv.Error) as error:
            raise IndexFolderError(f"{path} is not a UTF-8 CSV table ({type(error).__name__}: {error})") from None
        if not rows or tuple(rows[0]) != TABLE_COLUMNS:
            raise IndexFolderError(f"{path}: the header must be {','.join(TABLE_COLUMNS)}")
        try:
            body = rows[1:]
            ids = [int(r[0]) for r in body]
            sizes = [int(r[3]) if r[3] else None for r in body]
            mtimes = [int(r[4]) if r[4] else None for r in body]
        except (ValueError, IndexError) as error:
            raise IndexFolderError(f"{path}: unreadable row ({error})") from None
        return cls(ids, [r[1] for r in body], [r[2] for r in body], sizes, mtimes)


class EmbeddingIndex:
    """A searchable gallery: a faiss index (``kind``: ``flat``, ``ivf_flat``, ``ivf_pq``, ``hnsw``; module
    :mod:`lightning_dml.index.kinds`), its :class:`IndexTable`, the stored vectors and the :class:`Manifest`.

    Build it with :meth:`build` (from tensors) or :func:`~lightning_dml.index.build_index` (from a checkpoint and an
    image gallery), or :meth:`load` a saved folder. ``device``: ``"cpu"``, or ``"auto"``/``"cuda"``: the faiss index on
    every GPU when a faiss GPU build sees one (:func:`~lightning_dml.index.kinds.to_gpus`) and the exported model on
    the first GPU torch sees.
    """

    def __init__(self, faiss_shards: list[Any], table: IndexTable, vectors: np.ndarray, manifest: Manifest,
                 folder: Path | None = None, device: str = "cpu") -> None:
        self.manifest = manifest
        self.table = table
        self._vectors = vectors
        self._shards = faiss_shards
        self.folder = folder
        self.device = device
        self._embedder: Any = None
        self._faiss = None
        self._refresh()

    # --------------------------------------------------------------------------------------------- properties
    @property
    def kind(self) -> str:
        return self.manifest.kind

    @property
    def metric(self) -> str:
        """``cosine`` or ``euclidean`` (see the module docstring)."""
        return self.manifest.metric

    @property
    def dim(self) -> int:
        return int(self.manifest.embedding_dim)

    @property
    def options(self) -> dict[str, int]:
        return dict(self.manifest.options)

    @property
    def faiss_index(self) -> Any:
        """The faiss index searched (``IndexShards`` for a sharded index; on the GPUs with ``device`` a GPU)."""
        return self._faiss

    def __len__(self) -> int:
        return len(self.table)

    def __repr__(self) -> str:
        shards = f", shards={len(self._shards)}" if len(self._shards) > 1 else ""
        return f"EmbeddingIndex(kind={self.kind!r}, metric={self.metric!r}, dim={self.dim}, items={len(self)}{shards})"

    def _refresh(self) -> None:
        merged = K.make_shards(self._shards, self.dim)
        if self.device != "cpu":
            merged = K.to_gpus(merged, self.kind, self.manifest.options)
        self._faiss = merged
        self.manifest.count = len(self.table)
        self.manifest.shards = len(self._shards)

    # --------------------------------------------------------------------------------------------- building
    @staticmethod
    def _prepare(embeddings: Tensor | np.ndarray, metric: str, what: str = "embeddings") -> np.ndarray:
        x = torch.as_tensor(embeddings).detach()
        if x.ndim != 2 or x.shape[0] == 0 or x.shape[1] == 0:
            raise ValueError(f"{what} must be a non-empty [N, D] matrix, got shape {tuple(x.shape)}")
        x = x.float()
        if not torch.isfinite(x).all():
            bad = int((~torch.isfinite(x)).any(1).nonzero()[0])
            raise ValueError(f"{what}: row {bad} is not finite (NaN or inf)")
        if metric == "cosine":
            x = torch.nn.functional.normalize(x, dim=1)
        return np.ascontiguousarray(x.cpu().numpy(), dtype=np.float32)

    @classmethod
    def build(
        cls,
        embeddings: Tensor | np.ndarray,
        table: IndexTable | dict[str, Sequence] | None = None,
        kind: str = "flat",
        metric: str = "cosine",
        manifest: Manifest | dict[str, Any] | None = None,
        *,
        shards: int = 1,
        device: str = "cpu",
        **kind_options: Any,
    ) -> "EmbeddingIndex":
        """An index of ``embeddings [N, D]`` (raw; L2-normalised here for ``cosine``).

        Args:
            table: an :class:`IndexTable`, or ``{"paths": [...], "labels": [...]}`` (ids 0..N-1); default: ids
                0..N-1 without paths or labels.
            kind: ``flat``, ``ivf_flat``, ``ivf_pq`` or ``hnsw``; ``kind_options`` its settings (``nlist``,
                ``nprobe``, ``m``, ``nbits``, ``M``, ``ef_construction``, ``ef_search``; defaults in
                :mod:`~lightning_dml.index.kinds`).
            manifest: more manifest fields (``checkpoint``, ``input_spec``, ``preprocess``, ``gallery``).
            shards: number of faiss indexes the vectors are dealt to (round robin), searched together.
        """
        if metric not in ("cosine", "euclidean"):
            raise K.IndexOptionError(f"metric must be 'cosine' or 'euclidean', got {metric!r}")
        vectors = cls._prepare(embeddings, metric)
        n, d = vectors.shape
        if table is None:
            table = IndexTable(np.arange(n), [""] * n, [""] * n)
        elif not isinstance(table, IndexTable):
            paths = [str(p) for p in table.get("paths", [""] * n)]
            labels = [str(v) for v in table.get("labels", [""] * n)]
            ids = table.get("ids", np.arange(n))
            sizes, mtimes = zip(*[_stat(p) if p else (None, None) for p in paths]) if n else ((), ())
            table = IndexTable(ids, paths, labels, list(sizes), list(mtimes))
        if len(table) != n:
            raise ValueError(f"{n} embeddings but {len(table)} table rows")
        if len(np.unique(table.ids)) != n or (n and table.ids.min() < 0):
            raise ValueError("table ids must be distinct and non-negative")
        if int(shards) != shards or shards < 1 or shards > n:
            raise K.IndexOptionError(f"shards must be an integer in 1..{n} (the number of items), got {shards!r}")
        options = K.resolve_options(kind, kind_options, n, d)
        extra = dict(manifest) if isinstance(manifest, dict) else ({} if manifest is None else asdict(manifest))
        for key in ("kind", "metric", "embedding_dim", "options", "shards", "count", "next_id", "uid"):
            extra.pop(key, None)
        meta = Manifest(kind=kind, metric=metric, embedding_dim=d, options=options, shards=int(shards),
                        next_id=int(table.ids.max()) + 1 if n else 0,
                        **{k: v for k, v in extra.items() if k in Manifest.__dataclass_fields__})
        faiss_shards = cls._new_shards(kind, options, d, metric, vectors, int(shards))
        for s, shard in enumerate(faiss_shards):
            rows = np.arange(s, n, int(shards))
            shard.add_with_ids(vectors[rows], table.ids[rows])
        return cls(faiss_shards, table, vectors, meta, device=device)

    @classmethod
    def from_checkpoint(cls, config: str | os.PathLike, ckpt_path: str | os.PathLike, gallery: str | os.PathLike,
                        kind: str = "flat", out: str | os.PathLike | None = None,
                        **options: Any) -> "EmbeddingIndex | None":
        """:func:`~lightning_dml.index.build.build_index`: embed an image gallery with a checkpoint's model
        (Lightning's predict loop) and index it; ``None`` on the DDP ranks other than 0."""
        from lightning_dml.index.build import build_index

        return build_index(config, ckpt_path, gallery, kind, out, **options)

    @staticmethod
    def _new_shards(kind: str, options: dict[str, int], d: int, metric: str, train: np.ndarray, count: int) -> list:
        faiss = K.faiss_module()

        template = K.build_faiss_index(kind, options, d, metric, train)
        return [template] + [faiss.clone_index(template) for _ in range(count - 1)]

    # --------------------------------------------------------------------------------------------- saving
    def save(self, folder: str | os.PathLike, *, replace: bool = True,
             add_files: Callable[[Path], None] | None = None,
             lock_timeout: float = DEFAULT_LOCK_TIMEOUT) -> Path:
        """Write the index folder (module docstring) as a whole (:mod:`lightning_dml.index.folder`): under the
        folder's lock, every file is written into a fresh sibling folder, which then takes the place of ``folder``;
        a save stopped at any point leaves the old folder whole, and a reader sees the old or the new folder.

        The files of the folder this index was loaded from (or last saved to) that the save does not write itself
        (the exported model) are carried along. Saving back to that folder after another process saved it since is
        an :class:`~lightning_dml.index.folder.IndexBusyError` (its items would be lost: load it again, or hold
        :func:`~lightning_dml.index.folder.locked` from the load to the save). ``folder`` must be new, empty or an
        index folder; ``replace=False`` also refuses an index folder. ``add_files(staged)`` writes more files into
        the new folder before the swap (``build_index`` exports the model with it). ``lock_timeout``: seconds to
        wait for another writer of ``folder``."""
        faiss = K.faiss_module()

        source = self.folder
        uid = secrets.token_hex(8)

        def check(path: Path) -> None:
            if os.path.lexists(path) and not path.is_dir():
                raise IndexFolderError(f"{folder} is a file, not an index folder")
            is_index = (path / MANIFEST).is_file()
            if not is_index and path.is_dir() and any(path.iterdir()):
                raise IndexFolderError(
                    f"{folder} is a non-empty folder that is not an index: an index folder is replaced as a whole, "
                    "which would delete its files; give a new or empty folder"
                )
            if is_index and source is not None and real_folder(source) == path:
                if folder_uid(path) != self.manifest.uid:
                    raise IndexBusyError(
                        f"index folder {folder} was saved by another process since this index was loaded from it: "
                        "saving would drop that process's changes; load it again (lightning_dml.index.folder.locked "
                        "held from the load to the save keeps others out)"
                    )
            elif is_index and not replace:
                raise IndexFolderError(f"{folder} is an index folder already (written meanwhile by another "
                                       "process?); replace it with --overwrite (replace=True)")

        with replacing(folder, timeout=lock_timeout, what=f"saving an index of {len(self)} items",
                       check=check) as staged:
            if source is not None:
                self._carry(source, staged, link=real_folder(source) == real_folder(folder))
            if add_files is not None:
                add_files(staged)
            names = faiss_names(len(self._shards))
            for name, shard in zip(names, self._shards):
                faiss.write_index(shard, str(staged / name))
            self.table.write(staged / TABLE)
            with open(staged / EMBEDDINGS, "wb") as handle:
                np.save(handle, np.asarray(self._vectors))
            dataclasses.replace(self.manifest, uid=uid).write(staged)
        self.folder = Path(folder)
        self.manifest.uid = uid
        return self.folder

    def _carry(self, source: Path, staged: Path, link: bool) -> None:
        """Copy (``link``: hard-link where the file system can) into ``staged`` every entry of ``source`` that
        :meth:`save` does not write itself (not the manifest, table, vectors, faiss files, or hidden names)."""
        if not source.is_dir():
            raise IndexFolderError(f"index folder {source}, which this index was loaded from, is gone: its files (the "
                                   "exported model) cannot be carried along")
        before = folder_uid(source)
        if before != self.manifest.uid:
            raise IndexBusyError(f"index folder {source} was replaced since this index was loaded from it: its "
                                 "exported model may not be this index's; load the index again")
        written = {MANIFEST, TABLE, EMBEDDINGS}
        for entry in sorted(os.scandir(source), key=lambda e: e.name):
            if entry.name in written or entry.name.startswith(".") or _FAISS_FILE.match(entry.name):
                continue
            copy = _link_or_copy if link else shutil.copy2
            if entry.is_dir():
                shutil.copytree(entry.path, staged / entry.name, copy_function=copy)
            else:
                copy(entry.path, staged / entry.name)
        if folder_uid(source) != before:
            raise IndexBusyError(f"index folder {source} was replaced while its files were copied; save again")

    @classmethod
    def load(cls, folder: str | os.PathLike, device: str = "cpu", mmap: bool = False) -> "EmbeddingIndex":
        """Load an index folder; every missing or inconsistent file is one
        :class:`~lightning_dml.index.manifest.IndexFolderError` naming it. ``mmap``: memory-map the stored
        vectors (and the faiss files where faiss can) instead of reading them.

        A folder replaced while it is read (the manifest's ``uid`` changed) is read again, and a folder left missing
        by a save stopped halfway is restored first (:mod:`lightning_dml.index.folder`): the index is the complete
        old or new folder, never a mix."""
        folder = Path(folder)
        for _ in range(_LOAD_ATTEMPTS):
            settle(folder)
            uid = folder_uid(folder)
            try:
                index = cls._load_files(folder, device, mmap)
            except (UserInputError, OSError):
                if folder_uid(folder) != uid:
                    continue  # replaced while read
                raise
            if folder_uid(folder) == index.manifest.uid:
                return index
        raise IndexFolderError(f"index folder {folder} was replaced {_LOAD_ATTEMPTS} times while it was read; "
                               "load it again when its writers are done")

    @classmethod
    def _load_files(cls, folder: Path, device: str, mmap: bool) -> "EmbeddingIndex":
        manifest = Manifest.read(folder)
        shards = read_shards(folder, manifest, mmap)
        table = IndexTable.read(folder / TABLE)
        try:
            compressed = manifest.options.get("vectors", "float32") != "float32"  # float32 stays on disk
            vectors = np.load(folder / EMBEDDINGS, mmap_mode="r" if mmap or compressed else None, allow_pickle=False)
        except FileNotFoundError:
            raise IndexFolderError(f"index folder {folder}: {EMBEDDINGS} is missing") from None
        except (OSError, ValueError) as error:
            raise IndexFolderError(f"{folder / EMBEDDINGS} is not a readable .npy file ({error})") from None
        total = sum(int(s.ntotal) for s in shards)
        d = int(manifest.embedding_dim)
        problems = []
        if vectors.ndim != 2 or vectors.shape != (len(table), d):
            problems.append(f"{EMBEDDINGS} has shape {tuple(vectors.shape)}, expected ({len(table)}, {d})")
        if total != len(table):
            problems.append(f"the faiss index holds {total} vectors, {TABLE} {len(table)} rows")
        if any(int(s.d) != d for s in shards):
            problems.append(f"the faiss index has size {shards[0].d}, the manifest's embedding_dim is {d}")
        if manifest.count != len(table):
            problems.append(f"the manifest counts {manifest.count} items, {TABLE} has {len(table)}")
        if problems:
            raise IndexFolderError(f"index folder {folder} is inconsistent: {'; '.join(problems)} (was it written "
                                   "by two processes at once? rebuild it)")
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(shards, table, vectors, manifest, folder=folder, device=device)

    # --------------------------------------------------------------------------------------------- identity
    def check_model(self, checkpoint_sha256: str | None = None, embedding_dim: int | None = None,
                    what: str = "the queries") -> None:
        """An :class:`~lightning_dml.index.manifest.IndexMismatchError` naming both values when ``what`` comes from
        another model than the index (another checkpoint sha256, another embedding size)."""
        if embedding_dim is not None and int(embedding_dim) != self.dim:
            cut = "" if self.manifest.width is None else (
                f" (the leading {self.dim} dimensions of its model's embeddings, index build --width {self.dim}: "
                f"give queries of width {self.dim})")
            raise IndexMismatchError(
                f"{what} have embedding size {int(embedding_dim)}, the index {self.folder or ''} holds embeddings "
                f"of size {self.dim}{cut or ': they come from another model'}"
            )
        mine = self.manifest.checkpoint_sha256
        if checkpoint_sha256 is not None and mine is not None and checkpoint_sha256 != mine:
            ckpt = (self.manifest.checkpoint or {}).get("path", "")
            raise IndexMismatchError(
                f"{what} were embedded with checkpoint sha256 {checkpoint_sha256}, the index {self.folder or ''} "
                f"with checkpoint sha256 {mine} ({ckpt}): another model's embeddings cannot be searched in it"
            )

    # --------------------------------------------------------------------------------------------- search
    def search(self, queries: Tensor, k: int, *, checkpoint_sha256: str | None = None) -> tuple[Tensor, Tensor]:
        """The ``k`` best items of each query: ``(scores [Q, k] float32, ids [Q, k] int64)`` on the queries' device,
        best first, ``-1`` ids and ``-inf`` scores where fewer than ``k`` items are found.

        The ``k`` kept are the best by score, then by the smaller id, of the items the faiss index finds for the
        query (all of them for ``flat``), also where equal scores straddle the k-th place: the results for ``k``
        are the first ``k`` of those for any larger ``k``, and a sharded index returns what one index returns.

        ``queries`` are raw embeddings of the index's model (L2-normalised here for ``cosine``); another
        embedding size, or a ``checkpoint_sha256`` other than the index's, is an
        :class:`~lightning_dml.index.manifest.IndexMismatchError` naming both.
        """
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
        asked, rescore = k, V.rescore_count(self.manifest.options)
        if rescore is not None:  # candidates: the best max(N, k) by the codes' score (lightning_dml.index.vectors)
            k = max(k, min(rescore, len(self)))
        total = len(self)
        # one result more than asked: a row whose (k+1)-th score equals its k-th has a tie across the boundary,
        # and is searched again with twice as many until the tie ends, so that the k kept are the best k by
        # (score, smaller id) of everything the index finds for the query, whatever k and the sharding
        scores, ids = best_k(self._faiss_search, x, k, total)
        if rescore is not None:  # the best k of the candidates by the exact score of the full-precision vectors
            scores, ids = V.rescore(x, ids, self._vectors, self.table.rows_of, self.metric, asked)
        return scores.to(device), ids.to(device)

    def _faiss_search(self, x: np.ndarray, k: int) -> tuple[Tensor, Tensor]:
        """faiss's ``k`` results of the float32 queries ``x``, as similarity scores (``-inf`` / ``-1`` padding)."""
        scores, ids = faiss_scores(self._faiss, self.manifest, x, k)
        return torch.from_numpy(scores), torch.from_numpy(ids)

    def vectors(self, ids: Tensor) -> Tensor:
        """The stored vectors (as the index compares them) of ``ids [N]`` -> ``[N, D]`` float32 on ``ids``' device;
        an id not in the index is a ``KeyError``."""
        flat = torch.as_tensor(ids).reshape(-1)
        rows = self.table.rows_of(flat.cpu().numpy())
        if (rows < 0).any():
            raise KeyError(f"ids not in the index: {flat.cpu()[torch.from_numpy(rows < 0)][:5].tolist()}")
        out = torch.from_numpy(np.asarray(self._vectors[rows], dtype=np.float32))
        return out.to(flat.device)

    @property
    def embeddings(self) -> Tensor:
        """All stored vectors ``[N, D]`` in table order (as the index compares them; read into memory where they
        are memory-mapped)."""
        vectors = np.asarray(self._vectors, dtype=np.float32)
        return torch.from_numpy(vectors if vectors.flags.writeable else np.array(vectors))

    def results(self, scores: Tensor, ids: Tensor) -> list[list[dict[str, Any]]]:
        """Result lists ``[{"id", "path", "label", "score"}, ...]`` per query (``-1`` padding left out)."""
        ids_np = ids.detach().cpu().numpy()
        scores_np = scores.detach().cpu().double().numpy()
        rows = self.table.rows_of(ids_np).reshape(ids_np.shape)
        out = []
        for q in range(ids_np.shape[0]):
            found = []
            for j in range(ids_np.shape[1]):
                r = int(rows[q, j])
                if ids_np[q, j] < 0 or r < 0:
                    continue
                found.append({"id": int(ids_np[q, j]), "path": self.table.paths[r], "label": self.table.labels[r],
                              "score": float(scores_np[q, j])})
            out.append(found)
        return out

    # --------------------------------------------------------------------------------------------- images
    @property
    def embedder(self) -> Any:
        """The :class:`~lightning_dml.index.embed.ImageEmbedder` of the exported model beside the index."""
        if self._embedder is None:
            from lightning_dml.index.embed import ImageEmbedder
            from lightning_dml.models.input_spec import InputSpec

            if not self.manifest.model or self.folder is None:
                raise IndexFolderError(
                    f"index {self.folder or '(in memory)'} has no exported model: it was built from tensors; embed "
                    "queries yourself and call search(), or build it with lightning-dml index build"
                )
            self._check_unreplaced()
            path = self.folder / self.manifest.model
            if not path.is_file():
                raise IndexFolderError(f"index folder {self.folder}: the exported model {path.name} is missing")
            spec = InputSpec(**{k: tuple(v) if isinstance(v, list) else v
                                for k, v in (self.manifest.input_spec or {}).items()})
            device = "cuda" if self.device != "cpu" and torch.cuda.is_available() else "cpu"
            embedder = ImageEmbedder(path, spec, self.manifest.preprocess or {}, device=device,
                                     width=self.manifest.width)
            self._check_unreplaced()  # the model read is the one of the folder these vectors came from
            self._embedder = embedder
        return self._embedder

    def _check_unreplaced(self) -> None:
        """An :class:`~lightning_dml.index.manifest.IndexFolderError` when the folder this index was loaded from
        was replaced since (another ``uid`` in its manifest): its model need not be the one of these vectors."""
        if self.folder is not None and folder_uid(self.folder) != self.manifest.uid:
            raise IndexFolderError(
                f"index folder {self.folder} was replaced since this index was loaded (lightning-dml index build "
                "--overwrite or index add): its model need not be the one of the loaded vectors; load it again"
            )

    def embed_images(self, images: Sequence[str | os.PathLike | Image.Image]) -> Tensor:
        """Raw embeddings ``[N, D]`` of image files or PIL images with the index's exported model and
        preprocessing (batched; on the GPU when the index was loaded with a GPU ``device``)."""
        return self.embedder(images)

    # --------------------------------------------------------------------------------------------- changes
    def add(self, embeddings: Tensor | np.ndarray, paths: Sequence[str] | None = None,
            labels: Sequence[str] | None = None, *, checkpoint_sha256: str | None = None) -> Tensor:
        """Add items (raw embeddings of the index's model) and return their new ids (``next_id`` onwards; ids are
        never reused). Each goes to the shard holding the fewest items. An IVF index keeps its trained cells."""
        x = torch.as_tensor(embeddings)
        if x.ndim != 2:
            raise ValueError(f"embeddings must be [N, D], got shape {tuple(x.shape)}")
        self.check_model(checkpoint_sha256, x.shape[1], what="the added embeddings")
        vectors = self._prepare(x, self.metric)
        n = vectors.shape[0]
        paths = [str(p) for p in paths] if paths is not None else [""] * n
        labels = [str(v) for v in labels] if labels is not None else [""] * n
        if len(paths) != n or len(labels) != n:
            raise ValueError(f"{n} embeddings, {len(paths)} paths and {len(labels)} labels")
        ids = np.arange(self.manifest.next_id, self.manifest.next_id + n, dtype=np.int64)
        stats = [_stat(p) if p else (None, None) for p in paths]
        added = IndexTable(ids, paths, labels, [s for s, _ in stats], [m for _, m in stats])
        self._vectors = np.concatenate([np.asarray(self._vectors), vectors])
        self.table = self.table.concat(added)
        target = min(range(len(self._shards)), key=lambda s: (self._shards[s].ntotal, s))
        self._shards[target].add_with_ids(vectors, ids)
        self.manifest.next_id = int(ids[-1]) + 1 if n else self.manifest.next_id
        self._refresh()
        return torch.from_numpy(ids)

    def remove(self, ids: Sequence[int] | Tensor) -> int:
        """Remove items by id and return how many were removed; an id not in the index is a ``KeyError``. faiss
        removes them in place, except from ``hnsw`` graphs, which are rebuilt from the stored vectors."""
        wanted = np.unique(torch.as_tensor(ids).reshape(-1).cpu().numpy().astype(np.int64))
        rows = self.table.rows_of(wanted)
        if (rows < 0).any():
            raise KeyError(f"ids not in the index: {wanted[rows < 0][:5].tolist()}")
        if wanted.size == 0:
            return 0
        keep = np.setdiff1d(np.arange(len(self.table)), rows)
        if K.supports_remove(self.kind):
            for shard in self._shards:
                shard.remove_ids(wanted)
        else:
            kept = self.table.select(keep)
            vectors = np.asarray(self._vectors)[keep]
            self._shards = self._new_shards(self.kind, self.manifest.options, self.dim, self.metric, vectors,
                                            len(self._shards))
            for s, shard in enumerate(self._shards):
                part = np.arange(s, len(keep), len(self._shards))
                if part.size:
                    shard.add_with_ids(vectors[part], kept.ids[part])
        self.table = self.table.select(keep)
        self._vectors = np.asarray(self._vectors)[keep]
        self._refresh()
        return int(wanted.size)

    def changed_files(self) -> list[tuple[int, str, str]]:
        """``(id, path, what)`` of every indexed file that changed since it was embedded: ``"missing"`` (no
        longer there) or ``"modified"`` (another size or modification time). Items without a file are skipped."""
        out = []
        for i, path, size, mtime in zip(self.table.ids.tolist(), self.table.paths, self.table.sizes, self.table.mtimes):
            if not path or size is None:
                continue
            now = _stat(path)
            if now == (None, None):
                out.append((i, path, "missing"))
            elif now != (size, mtime):
                out.append((i, path, "modified"))
        return out


def warn_changed(index: EmbeddingIndex, limit: int = 5) -> list[tuple[int, str, str]]:
    """Warn (one ``UserWarning``) when gallery files changed since they were indexed; returns them."""
    changed = index.changed_files()
    if changed:
        shown = ", ".join(f"{p} ({what})" for _, p, what in changed[:limit])
        more = f" and {len(changed) - limit} more" if len(changed) > limit else ""
        warnings.warn(f"index {index.folder}: {len(changed)} gallery file(s) changed since they were indexed: "
                      f"{shown}{more}; lightning-dml index add --index {index.folder} --gallery ... re-embeds them",
                      UserWarning, stacklevel=2)
    return changed
