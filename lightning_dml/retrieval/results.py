"""``RetrievalResults``: what the model retrieves for every query, from the exact engine, kept and queried.

Built from embeddings and labels (with the query/gallery masks, sequences, categories and label sets the metrics
take) or from a predictions file of ``lightning-dml predict``. Per query: its top-k gallery items with their exact
scores and relevance, the number of relevant items R, the exact rank of its first relevant item and its average
precision over the whole ranking (``map``) and at R (``map@r``), all from
:func:`lightning_dml.metrics.functional.retrieval_stats`: the same search, tie rule and conventions as
:class:`~lightning_dml.metrics.RetrievalMetrics`, computed on the embeddings' device in tiles (no N x N matrix) and,
with ``distributed=True``, split over the DDP processes (every process gets the whole result). Recall@K and
MAP@R recomputed from it equal ``RetrievalMetrics``' to the last digit.

Saved as one ``.npz`` file (:meth:`RetrievalResults.save`, arrays plus one JSON metadata entry), so a report can be
rebuilt without the model.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from lightning_dml.data.cache_dir import atomic_path
from lightning_dml.metrics import functional as F
from lightning_dml.metrics.functional import exact_mean, parse_metric, per_query

__all__ = ["RetrievalResults"]

#: format version of the ``.npz`` file written by :meth:`RetrievalResults.save`
FORMAT_VERSION = 1
#: the options of ``compute`` that the pair histogram shares with the search
_SEARCH_OPTIONS = ("precision", "device", "query_block", "gallery_chunk", "tile_memory", "distributed", "process_group")


def _as_numpy(t: Tensor | np.ndarray | None) -> np.ndarray | None:
    if t is None:
        return None
    return t.detach().cpu().numpy() if isinstance(t, Tensor) else np.asarray(t)


def _row_classes(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, class) pairs of ``[N]`` labels (one per row) or ``[N, L]`` label sets padded with -1 (one per distinct
    label of a row, by row then class)."""
    if labels.ndim == 1:
        return np.arange(labels.size), labels
    rows, cols = np.nonzero(labels >= 0)
    pairs = np.unique(np.stack([rows, labels[rows, cols]], 1).reshape(-1, 2), axis=0)
    return pairs[:, 0], pairs[:, 1]


@dataclass
class RetrievalResults:
    """Per-query retrieval results of one evaluated set (all arrays on the CPU, numpy).

    Items are named by their index in the split (``index``: position of the item in the dataset the embeddings
    came from). Queries are in increasing index order.

    Attributes:
        query: ``[Q]`` index of each query.
        neighbors: ``[Q, k]`` index of each query's k nearest gallery items, best first (tie rule: the smaller
            index first at equal exact score), ``-1`` where the gallery has fewer items.
        scores: ``[Q, k]`` their exact scores (cosine similarity, or negative squared Euclidean distance),
            ``-inf`` for padding.
        relevant: ``[Q, k]`` bool, whether each neighbour is relevant to the query.
        num_relevant: ``[Q]`` R, the relevant gallery items of the query (excluded items left out).
        first_relevant_rank: ``[Q]`` exact number of gallery items ranked ahead of the first relevant one, ``-1``
            when the query has none.
        average_precision: ``[Q]`` AP over the whole ranking (``map``'s per-query value), NaN when R = 0.
        average_precision_at_r: ``[Q]`` AP at R (``map@r``'s per-query value), NaN when R = 0.
        labels: ``[N]`` class ids or ``[N, L]`` label sets of every item, by index (``index`` below).
        index: ``[N]`` the indices of the evaluated items (sorted).
        is_query, is_gallery: ``[N]`` bool, or None for all-vs-all.
        sequence, category: ``[N]`` ids or None.
        paths: the image file of every item, or None.
        class_names, category_names: names of the label and category ids, or None.
        metric: ``"cosine"`` or ``"euclidean"``.
        r_precision: ``[Q]`` R-Precision of each query (``r_precision``'s per-query value), NaN when R = 0; None
            in files written before it was kept.
        pair_histogram: ``{"edges", "positive", "negative"}``, the exact histograms of the scores of every positive
            and every negative (query, gallery) pair (:func:`~lightning_dml.retrieval.pair_score_histogram`), when
            computed with ``pair_histogram_bins > 0``; else None.
    """

    query: np.ndarray
    neighbors: np.ndarray
    scores: np.ndarray
    relevant: np.ndarray
    num_relevant: np.ndarray
    first_relevant_rank: np.ndarray
    average_precision: np.ndarray
    average_precision_at_r: np.ndarray
    labels: np.ndarray
    index: np.ndarray
    is_query: np.ndarray | None = None
    is_gallery: np.ndarray | None = None
    sequence: np.ndarray | None = None
    category: np.ndarray | None = None
    paths: list[str] | None = None
    class_names: list[str] | None = None
    category_names: list[str] | None = None
    metric: str = "cosine"
    extra: dict[str, Any] = field(default_factory=dict)
    r_precision: np.ndarray | None = None
    pair_histogram: dict[str, list] | None = None

    # ------------------------------------------------------------------------------------------- building
    @classmethod
    def compute(
        cls,
        embeddings: Tensor,
        labels: Tensor,
        *,
        top_k: int = 10,
        indices: Tensor | None = None,
        query_mask: Tensor | None = None,
        gallery_mask: Tensor | None = None,
        sequence: Tensor | None = None,
        category: Tensor | None = None,
        paths: Sequence[str] | None = None,
        class_names: Sequence[str] | None = None,
        category_names: Sequence[str] | None = None,
        metric: str = "cosine",
        pair_histogram_bins: int = 0,
        **options: Any,
    ) -> RetrievalResults:
        """Search every query exactly and keep its results (``options``: those of
        :func:`~lightning_dml.metrics.functional.retrieval_stats`: ``precision``, ``device``, tiles,
        ``distributed``, ``process_group``). ``paths`` are in the order of ``embeddings`` (as ``indices``).
        ``pair_histogram_bins > 0`` also counts every pair's exact score into that many bins
        (:attr:`pair_histogram`; one more pass over every (query, gallery) pair)."""
        if int(top_k) < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        F.check_inputs(embeddings, labels, indices, query_mask, gallery_mask, sequence, category, where="RetrievalResults")
        n = embeddings.shape[0]
        if paths is not None and len(paths) != n:
            raise ValueError(f"RetrievalResults: {len(paths)} paths for {n} embeddings")
        idx = torch.arange(n, device=embeddings.device) if indices is None else indices.detach().long()
        order = torch.argsort(idx, stable=True)
        # the neighbour lists reach max(top_k, the largest R): Precision@top_k asks for top_k, MAP@R for R
        stats = F.retrieval_stats(
            embeddings, labels, indices=indices, query_mask=query_mask, gallery_mask=gallery_mask, sequence=sequence,
            category=category, metric=metric, metrics=["map", "map@r", f"precision@{int(top_k)}"], exact_scores=True,
            validate=False, **options,
        )
        ap, _ = per_query(stats, parse_metric("map"))
        ap_r, _ = per_query(stats, parse_metric("map@r"))
        r_prec, _ = per_query(stats, parse_metric("r_precision"))
        k = int(top_k)
        neighbors, scores, relevant = stats.neighbors[:, :k], stats.scores[:, :k], stats.relevance[:, :k]
        sorted_index = idx[order]
        nb = torch.where(neighbors >= 0, sorted_index[neighbors.clamp(min=0)], neighbors)
        none = stats.num_relevant == 0
        nan = torch.full_like(ap, float("nan"))

        def by_index(t: Tensor | None) -> np.ndarray | None:
            return None if t is None else _as_numpy(t.detach()[order])

        histogram = None
        if int(pair_histogram_bins) > 0:
            from lightning_dml.retrieval.histogram import pair_score_histogram

            histogram = pair_score_histogram(
                embeddings, labels, indices=indices, query_mask=query_mask, gallery_mask=gallery_mask,
                sequence=sequence, metric=metric, bins=int(pair_histogram_bins), validate=False,
                **{k: v for k, v in options.items() if k in _SEARCH_OPTIONS},
            )
        return cls(
            query=_as_numpy(sorted_index[stats.query_rows]),
            neighbors=_as_numpy(nb),
            scores=_as_numpy(scores / stats.score_scale),
            relevant=_as_numpy(relevant),
            num_relevant=_as_numpy(stats.num_relevant),
            first_relevant_rank=_as_numpy(stats.first_positive_rank),
            average_precision=_as_numpy(torch.where(none, nan, ap)),
            average_precision_at_r=_as_numpy(torch.where(none, nan, ap_r)),
            labels=by_index(labels),
            index=_as_numpy(sorted_index),
            is_query=by_index(query_mask),
            is_gallery=by_index(gallery_mask),
            sequence=by_index(sequence),
            category=by_index(category),
            paths=None if paths is None else [str(paths[int(i)]) for i in order.tolist()],
            class_names=None if class_names is None else [str(c) for c in class_names],
            category_names=None if category_names is None else [str(c) for c in category_names],
            metric=metric,
            r_precision=_as_numpy(torch.where(none, nan, r_prec)),
            pair_histogram=histogram,
        )

    @classmethod
    def from_predictions(
        cls, predictions: str | os.PathLike | dict[str, Any], *, top_k: int = 10, **options: Any
    ) -> RetrievalResults:
        """From a predictions file of ``lightning-dml predict`` (or the dict
        :func:`~lightning_dml.callbacks.load_predictions` returns): its embeddings, labels, indices and paths, and,
        where the file has them, ``query_mask``/``gallery_mask``, ``sequence``, ``category``, ``class_names`` and
        ``category_names``."""
        from lightning_dml.callbacks.predictions import load_predictions

        data = load_predictions(predictions) if not isinstance(predictions, dict) else predictions
        if data["embeddings"].shape[0] == 0:
            raise ValueError("the predictions hold no item")
        out = cls.compute(
            data["embeddings"], data["labels"], top_k=top_k, indices=data["indices"],
            query_mask=data.get("query_mask"), gallery_mask=data.get("gallery_mask"), sequence=data.get("sequence"),
            category=data.get("category"), paths=data.get("paths"), class_names=data.get("class_names"),
            category_names=data.get("category_names"), **options,
        )
        if data.get("checkpoint") is not None:
            out.extra["checkpoint"] = data["checkpoint"]
        return out

    # ------------------------------------------------------------------------------------------- metrics
    def recall_at(self, k: int) -> float:
        """Recall@K (every query counts; 0 without a relevant item), as ``RetrievalMetrics`` computes it."""
        r = self.first_relevant_rank
        return exact_mean(((r >= 0) & (r < int(k))).astype(np.float64), np.ones(r.shape, dtype=bool))

    def map_at_r(self) -> float:
        """MAP@R over the queries with R > 0 (0.0 when there is none), as ``RetrievalMetrics`` computes it."""
        return exact_mean(self.average_precision_at_r, self.num_relevant > 0)

    def r_precision_mean(self) -> float:
        """R-Precision over the queries with R > 0, as ``RetrievalMetrics`` computes it (``r_precision``)."""
        if self.r_precision is None:
            raise ValueError("these results have no per-query R-Precision (a file written before it was kept)")
        return exact_mean(self.r_precision, self.num_relevant > 0)

    def mean_average_precision(self) -> float:
        """MAP over the whole ranking, over the queries with R > 0."""
        return exact_mean(self.average_precision, self.num_relevant > 0)

    # ------------------------------------------------------------------------------------------- views
    def _position(self, index: np.ndarray) -> np.ndarray:
        """Positions (rows of the per-item arrays) of item indices."""
        return np.searchsorted(self.index, index)

    def query_labels(self) -> np.ndarray:
        """Labels (``[Q]`` or ``[Q, L]``) of the queries."""
        return self.labels[self._position(self.query)]

    def worst(self, n: int = 20, by: str = "ap") -> np.ndarray:
        """Positions (rows of the per-query arrays) of the ``n`` worst queries: lowest average precision
        (``by="ap"``; queries without a relevant item left out) or latest first relevant item
        (``by="first_relevant_rank"``; a query without one counts as the latest). Ties: the smaller index first."""
        if by == "ap":
            ok = np.flatnonzero(self.num_relevant > 0)
            key = self.average_precision[ok]
        elif by == "first_relevant_rank":
            ok = np.arange(self.query.size)
            rank = self.first_relevant_rank.astype(np.float64)
            key = -np.where(rank < 0, np.inf, rank)
        else:
            raise ValueError(f"by must be 'ap' or 'first_relevant_rank', got {by!r}")
        order = np.lexsort((self.query[ok], key))  # key ascending, then index
        return ok[order[: max(0, int(n))]]

    def _query_classes(self) -> tuple[np.ndarray, np.ndarray]:
        """(query row, class) pairs: one per query, or one per distinct label of a query's label set (a label
        written twice in one set is one class of the query)."""
        return _row_classes(self.query_labels())

    def class_name(self, c: int) -> str:
        return self.class_names[c] if self.class_names is not None and 0 <= c < len(self.class_names) else str(c)

    def per_class(self) -> list[dict[str, Any]]:
        """Each class's figures over its queries (a query with a label set counts under each of its labels):
        ``class``, ``name``, ``queries``, ``items`` (items of the class in the evaluated set), ``recall@1``,
        ``map@r`` (over its queries with R > 0; None without one). Sorted by class id."""
        rows, classes = self._query_classes()
        hit = (self.first_relevant_rank >= 0) & (self.first_relevant_rank < 1)
        sizes = dict(zip(*np.unique(_row_classes(self.labels)[1], return_counts=True)))
        out = []
        for c in np.unique(classes):
            mine = rows[classes == c]
            with_r = mine[self.num_relevant[mine] > 0]
            out.append({
                "class": int(c), "name": self.class_name(int(c)), "queries": int(mine.size),
                "items": int(sizes.get(c, 0)), "recall@1": float(hit[mine].mean()),
                "map@r": float(self.average_precision_at_r[with_r].mean()) if with_r.size else None,
            })
        return out

    def confused_pairs(self, n: int = 20) -> list[dict[str, Any]]:
        """The (query class, other class) pairs most often confused: for every query, each irrelevant neighbour
        ranked ahead of the query's first relevant item among its top k counts once for each (class of the query,
        class of the neighbour), a label written twice in one label set being one class.
        ``[{"query_class", "neighbor_class", "count", "examples": [(query row, neighbour column), ...]}]``, the
        largest counts first (ties: smaller class ids first), at most 5 examples each."""
        q_labels = self.query_labels()
        nb_labels = self.labels[self._position(np.where(self.neighbors >= 0, self.neighbors, self.index[0]))]
        k = self.neighbors.shape[1]
        first = np.where(self.first_relevant_rank < 0, k, np.minimum(self.first_relevant_rank, k))
        ahead = (np.arange(k)[None, :] < first[:, None]) & ~self.relevant & (self.neighbors >= 0)
        qi, col = np.nonzero(ahead)  # row-major: by query, then rank
        if q_labels.ndim == 1:
            a, b, where = q_labels[qi], nb_labels[qi, col], np.arange(qi.size)
        else:  # every (query class, neighbour class) combination of the two sets, each once per occurrence
            la, lb = q_labels[qi], nb_labels[qi, col]  # [P, L]
            pa, ia, ib = np.nonzero((la[:, :, None] >= 0) & (lb[:, None, :] >= 0))
            triples = np.unique(np.stack([pa, la[pa, ia], lb[pa, ib]], 1).reshape(-1, 3), axis=0)
            where, a, b = triples[:, 0], triples[:, 1], triples[:, 2]
        if a.size == 0:
            return []
        pairs, inverse, counts = np.unique(np.stack([a, b], 1), axis=0, return_inverse=True, return_counts=True)
        inverse = inverse.reshape(-1)
        ranked = np.lexsort((pairs[:, 1], pairs[:, 0], -counts))[: max(0, int(n))]
        out = []
        for p in ranked:
            occurrences = where[inverse == p][:5]
            out.append({
                "query_class": int(pairs[p, 0]), "neighbor_class": int(pairs[p, 1]), "count": int(counts[p]),
                "examples": [(int(qi[o]), int(col[o])) for o in occurrences],
            })
        return out

    # ------------------------------------------------------------------------------------------- files
    def save(self, path: str | os.PathLike) -> Path:
        """Write one ``.npz`` file: every array under its attribute name, plus ``meta`` (JSON: format version,
        metric, paths, names, extra). ``.npz`` is appended when missing. The file is written atomically (a
        temporary file beside it, flushed and renamed onto it: :func:`~lightning_dml.data.cache_dir.atomic_path`):
        a write that fails or is killed leaves an earlier file at ``path`` whole."""
        path = Path(path)
        if path.suffix != ".npz":
            path = path.with_name(path.name + ".npz")
        arrays = {}
        meta = {"format": FORMAT_VERSION, "extra": self.extra}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, np.ndarray):
                arrays[f.name] = value
            elif f.name != "extra":
                meta[f.name] = value
        with atomic_path(path, fsync=True) as temporary:
            np.savez_compressed(temporary, meta=np.array(json.dumps(meta)), **arrays)
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> RetrievalResults:
        """Read a file written by :meth:`save`."""
        with np.load(Path(path), allow_pickle=False) as data:
            meta = json.loads(str(data["meta"]))
            if meta.get("format") != FORMAT_VERSION:
                raise ValueError(f"{path}: retrieval results of format {meta.get('format')}, this version reads "
                                 f"{FORMAT_VERSION}")
            arrays = {name: data[name] for name in data.files if name != "meta"}
        extra = meta.pop("extra", {})
        meta.pop("format")
        return cls(**arrays, **meta, extra=extra)
