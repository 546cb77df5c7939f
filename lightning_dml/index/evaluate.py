"""What an approximate index costs, measured against the library's exact engine: ``lightning-dml index evaluate``.

:func:`evaluate_index` searches the same queries twice, with the index and with the exact engine
(:func:`lightning_dml.metrics.functional.knn` for the neighbour lists,
:func:`~lightning_dml.metrics.functional.retrieval_metrics` for the exact metrics), on the vectors stored in the
index folder:

* **neighbour recall@k**: for each query, the fraction of its exact ``k`` nearest gallery items that the index
  returns among its ``k`` results, averaged over the queries (1.0 for ``flat`` up to ties at the k-th score);
* **Recall@K** and **MAP@R** (Musgrave et al., ECCV 2020; ``docs/metrics.md``) of both rankings, with the library's
  definitions (relevant: the same label); the index's ranked lists are as long as the largest R, padded with
  non-relevant entries where the index returns fewer results;
* the index's search time (seconds, all queries, and milliseconds per query; a measurement of this machine, not a
  result) and its size: bytes per vector of its faiss index (:func:`lightning_dml.index.vectors.index_bytes`: codes,
  ids, cells or graph; the ``embeddings.npy`` a re-scoring index memory-maps is not counted).

An index of compressed vectors (``index build --vectors int8|binary [--rescore N]``, :mod:`lightning_dml.index.vectors`)
is its row ``index (flat, binary + rescore N)``: its neighbour recall and metrics are against the exact search of the
full-precision vectors.

:func:`format_table` prints the rates in percent with two decimals, as every command does
(:mod:`lightning_dml.metrics_format`); ``--format json`` keeps the fractions.

Queries: without ``queries`` every gallery item is a query against the others (leave-one-out, the metrics'
all-vs-all mode: the item itself is dropped from its index results); with ``queries`` (embeddings of the index's
model and their labels) they are ranked against the whole gallery. Every gallery item (and query) needs a label.

Re-ranking: ``rerank`` (a ``--rerank`` text, :func:`lightning_dml.index.rerank.parse_rerank`) adds a row of the
exact ranking re-ranked (:func:`lightning_dml.index.rerank.rerank_metrics`; the learned pairwise re-ranker:
:func:`lightning_dml.index.pairwise.pairwise_metrics`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from lightning_dml.errors import UserInputError
from lightning_dml.index import vectors as V
from lightning_dml.index.index import EmbeddingIndex
from lightning_dml.metrics import functional as MF
from lightning_dml.metrics_format import format_metric

__all__ = ["EvaluationError", "evaluate_index", "format_table"]


class EvaluationError(UserInputError, ValueError):
    """An index or queries that cannot be evaluated (items without labels)."""


def _label_ids(gallery: Sequence[str], queries: Sequence[str] | None) -> tuple[Tensor, Tensor | None]:
    names = sorted(set(gallery) | set(queries or ()))
    ids = {name: i for i, name in enumerate(names)}
    g = torch.tensor([ids[v] for v in gallery], dtype=torch.long)
    q = None if queries is None else torch.tensor([ids[v] for v in queries], dtype=torch.long)
    return g, q


def _check_labels(labels: Sequence[str], paths: Sequence[str], what: str) -> None:
    empty = [i for i, v in enumerate(labels) if not v]
    if empty:
        first = paths[empty[0]] if paths else f"item {empty[0]}"
        raise EvaluationError(
            f"{what}: {len(empty)} item(s) without a label (e.g. {first}); evaluation needs the class of every item "
            "(a gallery folder of class folders, or a table with a label column)"
        )


def _list_metrics(relevance: Tensor, num_relevant: Tensor, recall_at: Sequence[int]) -> dict[str, float]:
    hit = relevance.any(dim=1)
    first = torch.where(hit, relevance.double().argmax(dim=1), torch.full_like(num_relevant, -1))
    out = {f"recall@{int(k)}": MF.recall_at_k(first, int(k)) for k in recall_at}
    out["map@r"] = MF.map_at_r(relevance, num_relevant)
    return out


def evaluate_index(
    index: EmbeddingIndex,
    queries: Tensor | None = None,
    query_labels: Sequence[str] | None = None,
    *,
    k: int = 10,
    recall_at: Sequence[int] = (1, 2, 4, 8),
    rerank: str | None = None,
) -> dict[str, Any]:
    """``{"rows": {name: {metric: value}}, "neighbour_recall@k": float, "k": k, "queries": Q, "search_seconds": s}``
    with the rows ``exact`` and ``index`` (and ``exact + <rerank>``); see the module docstring."""
    if len(index) < 2:
        raise EvaluationError(f"index {index.folder}: {len(index)} item(s); evaluation needs at least 2")
    _check_labels(index.table.labels, index.table.paths, f"index {index.folder}")
    loo = queries is None
    if rerank:  # a learned re-ranker that cannot re-rank this index is refused before any work
        from lightning_dml.index.pairwise import PairwiseRerank
        from lightning_dml.index.rerank import parse_rerank

        pairwise = parse_rerank(rerank)
        if isinstance(pairwise, PairwiseRerank):
            pairwise.check_index(index, queries_are_images=loo)
    if not loo:
        if query_labels is None or len(query_labels) != queries.shape[0]:
            raise ValueError("query_labels must give one label per query")
        _check_labels(query_labels, [], "queries")
        index.check_model(embedding_dim=queries.shape[1])
    gl, ql = _label_ids(index.table.labels, None if loo else list(query_labels))
    gallery = index.embeddings  # as the index compares them
    qv = gallery if loo else queries.detach().float().cpu()
    if not loo and index.metric == "cosine":
        qv = torch.nn.functional.normalize(qv, dim=1)
    ql = gl if loo else ql
    n_rank = len(index) - (1 if loo else 0)
    r = (ql.unsqueeze(1) == gl.unsqueeze(0)).sum(1) - (1 if loo else 0)
    k = min(int(k), n_rank)
    length = min(max(int(r.max()), max(recall_at), k, 1), n_rank)

    # exact: metrics by the evaluation pipeline, neighbour lists by knn (gallery positions)
    if loo:
        exact = MF.retrieval_metrics(gallery, gl, recall_at=recall_at, metric=index.metric)
        _, exact_nb = MF.knn(gallery, None, k=k, metric=index.metric)
    else:
        emb = torch.cat([qv, gallery])
        qmask = torch.zeros(emb.shape[0], dtype=torch.bool)
        qmask[: qv.shape[0]] = True
        exact = MF.retrieval_metrics(emb, torch.cat([ql, gl]), recall_at=recall_at, query_mask=qmask,
                                     gallery_mask=~qmask, metric=index.metric)
        _, exact_nb = MF.knn(qv, gallery, k=k, metric=index.metric)
    exact_rows = {name: exact[name] for name in [*(f"recall@{int(v)}" for v in recall_at), "map@r"]}

    # the index: ids -> gallery positions; leave-one-out drops the query's own id
    began = time.perf_counter()
    _, ids = index.search(qv, length + (1 if loo else 0))
    seconds = time.perf_counter() - began
    pos = torch.from_numpy(index.table.rows_of(ids.numpy())).view_as(ids)
    if loo:
        own = pos == torch.arange(pos.shape[0]).unsqueeze(1)
        keep = torch.sort(own.long(), dim=1, stable=True).indices[:, :length]
        pos = pos.gather(1, keep)
        pos = torch.where(own.gather(1, keep), -1, pos)
    pos = pos[:, :length]
    relevance = (pos >= 0) & (gl[pos.clamp_min(0)] == ql.unsqueeze(1))
    approx = _list_metrics(relevance, r, recall_at)

    found = pos[:, :k]
    same = (found.unsqueeze(2) == exact_nb.unsqueeze(1)) & (found.unsqueeze(2) >= 0)
    valid = (exact_nb >= 0).sum(1).clamp_min(1)
    neighbour_recall = float((same.any(1).sum(1) / valid).mean())

    vector_options = V.vector_options(index.options)[1]
    packed = "" if not vector_options else f", {vector_options['vectors']}" + (
        f" + rescore {vector_options['rescore']}" if "rescore" in vector_options else "")
    rows = {"exact": exact_rows, f"index ({index.kind}{packed})": approx}
    if rerank:
        from lightning_dml.index.pairwise import PairwiseRerank, pairwise_metrics
        from lightning_dml.index.rerank import parse_rerank, rerank_metrics

        reranker = parse_rerank(rerank)
        if isinstance(reranker, PairwiseRerank):  # the exact lists, their first top_n re-scored
            rows[f"exact + {rerank}"] = pairwise_metrics(reranker, index, None if loo else queries,
                                                         None if loo else ql, gl, recall_at=recall_at)
        elif reranker is not None:
            rows[f"exact + {rerank}"] = rerank_metrics(
                reranker, gallery, gl, None if loo else qv, None if loo else ql, recall_at=recall_at,
                metric=index.metric,
            )
    return {"rows": rows, "neighbour_recall@k": neighbour_recall, "k": k, "queries": int(qv.shape[0]),
            "search_seconds": seconds, "search_ms_per_query": 1000 * seconds / max(1, int(qv.shape[0])),
            "bytes_per_vector": (index.stored_bytes() if hasattr(index, "stored_bytes")  # a Milvus gallery
                                 else V.index_bytes(index)) / len(index), "kind": index.kind, "options": index.options}


def format_table(result: dict[str, Any]) -> str:
    """The evaluation as a text table: one row per ranking, Recall@K, MAP@R, the index's neighbour recall@k; values
    as every command prints them (:func:`lightning_dml.metrics_format.format_metric`: percent, two decimals)."""
    rows = result["rows"]
    metrics = list(next(iter(rows.values())))
    nr = f"neighbour_recall@{result['k']}"
    header = ["ranking", *metrics, nr]
    lines = []
    for name, values in rows.items():
        extra = format_metric(nr, result["neighbour_recall@k"]) if name.startswith("index") else ""
        lines.append([name, *(format_metric(m, values[m]) for m in metrics), extra])
    widths = [max(len(str(row[c])) for row in [header, *lines]) for c in range(len(header))]
    text = [" | ".join(str(cell).ljust(w) for cell, w in zip(row, widths)) for row in [header, *lines]]
    text.insert(1, "-+-".join("-" * w for w in widths))
    options = ", ".join(f"{k}={v}" for k, v in result["options"].items())
    size = f", {result['bytes_per_vector']:.1f} bytes per vector" if "bytes_per_vector" in result else ""
    per_query = f" ({result['search_ms_per_query']:.3f} ms per query)" if "search_ms_per_query" in result else ""
    text.append(f"{result['queries']} queries, index {result['kind']}" + (f" ({options})" if options else "")
                + f"{size}, index search {result['search_seconds']:.3f} s{per_query}")
    return "\n".join(text)
