"""Functional retrieval metrics on plain tensors: the library's one evaluation pipeline.

Definitions (``docs/metrics.md``; SPEC section 9.3; the retrieval protocol of Song et al., CVPR 2016, and the
metrics of Musgrave, Belongie & Lim, *A Metric Learning Reality Check*, ECCV 2020):

* **Recall@K**: fraction of queries with at least one relevant item among their K nearest neighbours. Every
  query counts; a query with no relevant item scores 0. **Precision@1** equals Recall@1.
* **Precision@K**: relevant items among the K nearest neighbours, divided by K (every query counts).
* **MRR**: mean of ``1 / (rank of the first relevant item + 1)`` over the whole ranking (0 without one); the rank
  is exact for every query whatever else is asked for.
* **R-Precision**, **MAP@R** (Musgrave et al. 2020), **NDCG@K** (binary gains, log2 discount) and **MAP** (mean
  average precision over the whole ranking): averaged over the queries with R > 0.
* **FNMR@FMR** (verification): over all (query, gallery) pairs, the threshold at which the false match rate over
  every negative pair is at most the given rate F (at most ``floor(F x negatives)`` negatives accepted, in exact
  rational arithmetic: F is the decimal number written, :func:`exact_rate`), and the false non-match rate over
  every positive pair there; 0.0 without a positive pair. ``0 < F <= 1``; F = 1 accepts every pair (threshold
  ``-inf``, FNMR 0.0).

**Relevance**: labels ``[N]`` (same label) or label sets ``[N, L]`` padded with -1 (the sets intersect).
**Exclusion**: a query never matches itself (by position); with ``sequence`` ids, gallery items of the query's
sequence are ignored (neither relevant nor irrelevant). **Categories**: ``category`` ids add every metric per
category of the queries (``category/<name>/<metric>``).

Ranking: cosine similarity of L2-normalised embeddings (default) or Euclidean distance. **Tie rule**: at equal exact
(float64) score, the gallery item with the smaller index in the split ranks first. Everything is exact (equal to a
float64 brute force) and computed on the device of the embeddings unless ``device`` says otherwise.

The pipeline, one stage per module: the task (``_task``: relevance, exclusions) -> score tiles (``_scores``) ->
candidates (``_scan`` filling ``_candidates``) -> exact ranks (``_ranks``; ``_ddp`` under DDP) -> per-query statistics
(``_statistics``) -> metrics (here). Clustering metrics: :mod:`lightning_dml.metrics.clustering`.

**The public face of the engine.** The ``_`` modules are internal; other packages of the library (``retrieval``,
``report``, ...) use only the names of this module's ``__all__``, whose contracts are:

* :func:`prepare` -> :class:`PreparedSet`, then :func:`build_search` -> ``(task, scorer, grid)``: the task's
  ``q_items`` / ``g_items`` (row positions of the queries and gallery items), ``positives(rows)`` (the (query row,
  gallery position) pairs that are relevant), ``relevant(rows, gpos)``; the scorer's ``exact(q_items, g_items)``
  (float64 exact scores), ``error_bound(q_items, g_items)`` (per query ``w``: ``|approx - exact| <= w``),
  ``score_scale`` and ``norms64``; the grid's ``num_blocks(task)``, ``block_rows(task, b)`` and
  ``gallery_chunk``.
* :func:`score_tile` ``(scorer, task, rows, c0, c1)``: the approximate scores of query rows ``rows`` against gallery
  positions ``[c0, c1)``, float32, within the scorer's ``error_bound`` of the exact ones, excluded pairs ``-inf``.
* :func:`retrieval_stats` -> :class:`RetrievalStats`; :func:`parse_metric` -> :class:`MetricName`;
  :func:`per_query` ``(stats, name)`` -> ``(values, included)`` (float64 per query, the queries averaged; a query
  left out gets 0.0, never NaN);
  :func:`exact_mean` (the correctly rounded mean ``reduce_metrics`` uses); :func:`exact_rate` (a false match rate
  as the exact rational ``fnmr@fmr`` uses).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_dml.distributed import get_rank, get_world_size
from lightning_dml.input_checks import check_embeddings, check_finite, check_per_row, check_same_device
from lightning_dml.metrics._candidates import SearchRequest, exact_rate
from lightning_dml.metrics._ddp import agree_search_settings, run_distributed
from lightning_dml.metrics._device import resolve_precision, tile_sizes
from lightning_dml.metrics._ranks import run_search
from lightning_dml.metrics._scan import Grid
from lightning_dml.metrics._scores import Scorer, score_tile
from lightning_dml.metrics._statistics import (
    MetricName,
    RetrievalStats,
    exact_mean,
    parse_metric,
    per_query,
    reduce_metrics,
)
from lightning_dml.metrics._task import RetrievalTask
from lightning_dml.metrics.clustering import clustering_metrics, contingency, f1_score, nmi
from lightning_dml.metrics.kmeans import kmeans
from lightning_dml.widths import check_width_fits, check_widths, width_key

__all__ = [
    "MetricName",
    "PreparedSet",
    "RetrievalStats",
    "build_search",
    "check_inputs",
    "clustering_metrics",
    "compute_device",
    "contingency",
    "exact_mean",
    "exact_rate",
    "f1_score",
    "kmeans",
    "knn",
    "map_at_r",
    "metric_names",
    "nmi",
    "parse_metric",
    "per_query",
    "precision_at_1",
    "prepare",
    "r_precision",
    "recall_at_k",
    "retrieval_metrics",
    "retrieval_stats",
    "score_tile",
    "stats_to_metrics",
]


# --------------------------------------------------------------------------------------------- validation
def check_labels_or_sets(labels: object, length: int, *, where: str) -> None:
    """``labels``: ``[N]`` integer class ids, or ``[N, L]`` integer label sets padded with -1 (values >= -1)."""
    if isinstance(labels, Tensor) and labels.ndim == 2:
        if labels.shape[0] != length:
            raise ValueError(f"{where}: labels has {labels.shape[0]} rows but embeddings has {length} rows")
        if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
            raise ValueError(f"{where}: label sets must be an integer tensor, got dtype {labels.dtype}")
        if labels.shape[1] == 0:
            raise ValueError(f"{where}: label sets [N, L] need L >= 1 columns, got shape {tuple(labels.shape)}")
        if labels.numel() and int(labels.min()) < -1:
            raise ValueError(
                f"{where}: label sets hold labels >= 0 padded with -1, got {int(labels.min())} (row "
                f"{int((labels < -1).any(dim=1).nonzero()[0])})"
            )
        return
    check_per_row(labels, length, "labels", kind="integer", where=where)


def check_inputs(
    embeddings: Tensor,
    labels: Tensor,
    indices: Tensor | None = None,
    query_mask: Tensor | None = None,
    gallery_mask: Tensor | None = None,
    sequence: Tensor | None = None,
    category: Tensor | None = None,
    *,
    where: str = "inputs",
) -> None:
    """Raise ``ValueError`` naming the problem for malformed metric inputs (:mod:`lightning_dml.input_checks`)."""
    check_embeddings(embeddings, where=where, allow_empty=True)
    n = embeddings.shape[0]
    check_labels_or_sets(labels, n, where=where)
    check_finite(embeddings, where=where)
    for name, t, kind in (
        ("indices", indices, "integer"), ("query_mask", query_mask, "bool"), ("gallery_mask", gallery_mask, "bool"),
        ("sequence", sequence, "integer"), ("category", category, "integer"),
    ):
        if t is not None:
            check_per_row(t, n, name, kind=kind, where=where)
            check_same_device(t, embeddings, name, where=where)
    check_same_device(labels, embeddings, "labels", where=where)
    if (query_mask is None) != (gallery_mask is None):
        raise ValueError(f"{where}: give both query_mask and gallery_mask (In-Shop mode) or neither (all-vs-all)")


def compute_device(embeddings: Tensor, device: torch.device | str | None = None) -> torch.device:
    """The device the metrics compute on: ``device`` when given, else where the embeddings are."""
    return embeddings.device if device is None else torch.device(device)


def metric_names(
    recall_at: Sequence[int] = (1, 2, 4, 8), map_at_r: bool = True, metrics: Sequence[str] = ()
) -> list[MetricName]:
    """The metrics of a call: ``recall@K`` for each K, ``precision@1``, with ``map_at_r`` ``r_precision`` and
    ``map@r``, then the opt-in ``metrics`` by name (``precision@K``, ``ndcg@K``, ``mrr``, ``map``, ``fnmr@fmr=F``);
    duplicates once."""
    for k in recall_at:
        if int(k) < 1:
            raise ValueError(f"recall_at values must be >= 1, got {k}")
    names = [f"recall@{int(k)}" for k in recall_at] + ["precision@1"]
    if map_at_r:
        names += ["r_precision", "map@r"]
    if isinstance(metrics, str):
        metrics = [metrics]
    out: dict[str, MetricName] = {}
    for name in [*names, *metrics]:
        m = parse_metric(name)
        out.setdefault(m.key, m)
    return list(out.values())


@dataclass
class PreparedSet:
    """Evaluation set on its compute device, rows sorted by their (unique) index in the split."""

    embeddings: Tensor  # float32 [N, D]
    labels: Tensor  # int64 [N] or [N, L] label sets padded with -1
    indices: Tensor  # int64 [N], strictly increasing
    query_mask: Tensor | None
    gallery_mask: Tensor | None
    sequence: Tensor | None = None  # int64 [N], negative: no sequence
    category: Tensor | None = None  # int64 [N], negative: no category


def prepare(
    embeddings: Tensor,
    labels: Tensor,
    indices: Tensor | None = None,
    query_mask: Tensor | None = None,
    gallery_mask: Tensor | None = None,
    *,
    sequence: Tensor | None = None,
    category: Tensor | None = None,
    device: torch.device | str | None = None,
    validate: bool = True,
) -> PreparedSet:
    """Validate (unless ``validate=False``: checked already), move to the compute device as float32, sort by index.

    ``indices`` must be unique here (``RetrievalMetrics`` drops the copies that DDP padding repeats before it
    calls the functional core); a repeated index raises ``ValueError``.
    """
    if validate:
        check_inputs(embeddings, labels, indices, query_mask, gallery_mask, sequence, category)
    dev = compute_device(embeddings, device)
    x = embeddings.detach().to(dev, torch.float32)
    n = x.shape[0]
    if n == 0:
        raise ValueError("no samples to evaluate: the metric received 0 embeddings")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("embeddings overflow float32 (values beyond +-3.4e38 became Inf)")
    rest = [None if t is None else t.detach().to(dev) for t in (labels, query_mask, gallery_mask, sequence, category)]
    rest[0] = rest[0].long()
    for i in (3, 4):
        rest[i] = None if rest[i] is None else rest[i].long()
    if indices is None:
        return PreparedSet(x.contiguous(), rest[0], torch.arange(n, device=dev), *rest[1:])
    idx = indices.detach().to(dev, torch.long)
    order = torch.argsort(idx, stable=True)
    idx = idx[order]
    repeated = (idx[1:] == idx[:-1]).nonzero()
    if repeated.numel():
        raise ValueError(
            f"index {int(idx[int(repeated[0, 0])])} appears more than once; indices must be unique "
            "(RetrievalMetrics removes identical DistributedSampler padding copies before computing)"
        )
    x = x[order]
    rest = [None if t is None else t[order] for t in rest]
    return PreparedSet(x.contiguous(), rest[0], idx, *rest[1:])


# --------------------------------------------------------------------------------------------- retrieval
def _items(ps: PreparedSet) -> tuple[Tensor, Tensor]:
    n = ps.labels.shape[0]
    if ps.query_mask is None:
        all_items = torch.arange(n, device=ps.labels.device)
        return all_items, all_items
    q = ps.query_mask.nonzero().squeeze(1)
    g = ps.gallery_mask.nonzero().squeeze(1)
    if q.numel() == 0:
        raise ValueError("query_mask selects no query")
    if g.numel() == 0:
        raise ValueError("gallery_mask selects no gallery item")
    return q, g


def build_search(
    ps: PreparedSet,
    *,
    metric: str = "cosine",
    precision: str = "auto",
    query_block: int | None = None,
    gallery_chunk: int | None = None,
    tile_memory: int | None = None,
    distributed: bool = False,
    process_group: Any = None,
) -> tuple[RetrievalTask, Scorer, Grid]:
    """Set up the exact search over a prepared set, on the set's device: the task, the scorer, the tile grid.

    Tile sizes: explicit ``query_block`` / ``gallery_chunk``, else from ``tile_memory`` bytes, else from the free
    memory of the device (:func:`lightning_dml.metrics._device.tile_sizes`). With ``distributed`` the processes
    first agree on one precision and one global tile grid (:func:`~lightning_dml.metrics._ddp.agree_search_settings`:
    the most precise of the per-process ``"auto"`` resolutions, the smallest tiles; different requested precisions,
    metrics or set shapes are a ``ValueError`` on every process).
    """
    if metric not in ("cosine", "euclidean"):
        raise ValueError(f"metric must be 'cosine' or 'euclidean', got {metric!r}")
    x = ps.embeddings
    if metric == "cosine":
        zero = (x == 0).all(dim=1)
        if bool(zero.any()):
            raise ValueError(
                f"cosine metric: {int(zero.sum())} embedding(s) have zero norm (first at split index "
                f"{int(ps.indices[zero.nonzero()[0, 0]])}); they have no direction"
            )
    resolved = resolve_precision(precision, x.device)
    q, g = _items(ps)
    qb, gc = tile_sizes(x.device, q.numel(), g.numel(), query_block, gallery_chunk, tile_memory)
    if distributed and get_world_size(process_group) > 1:
        resolved, (qb, gc) = agree_search_settings(
            precision, resolved, metric, (qb, gc), tuple(x.shape), x.device, process_group
        )
    task = RetrievalTask(ps.labels, q, g, ps.sequence)
    return task, Scorer(x, metric, resolved), Grid(qb, gc)


def _list_length(names: Sequence[MetricName], task: RetrievalTask) -> int:
    """Neighbour-list length the metrics need: the largest R for MAP@R / R-Precision, the K of Precision@K and
    NDCG@K; at least 1."""
    k = 1
    for m in names:
        if m.kind in ("map@r", "r_precision") and task.num_relevant.numel():
            k = max(k, int(task.num_relevant.max()))
        elif m.kind in ("precision", "ndcg"):
            k = max(k, m.k)
    return k


def _rank_ks(names: Sequence[MetricName]) -> set[int]:
    """The K whose "first relevant rank < K" the metrics decide: each ``recall@K``, and 1 for ``precision@1``."""
    return {m.k for m in names if m.kind == "recall" or (m.kind == "precision" and m.k == 1)}


def retrieval_stats(
    embeddings: Tensor,
    labels: Tensor,
    *,
    indices: Tensor | None = None,
    query_mask: Tensor | None = None,
    gallery_mask: Tensor | None = None,
    sequence: Tensor | None = None,
    category: Tensor | None = None,
    metric: str = "cosine",
    k: int | None = None,
    rank_ks: Sequence[int] = (1,),
    metrics: Sequence[str | MetricName] = (),
    exact_scores: bool = False,
    precision: str = "auto",
    device: torch.device | str | None = None,
    query_block: int | None = None,
    gallery_chunk: int | None = None,
    tile_memory: int | None = None,
    distributed: bool = False,
    process_group: Any = None,
    validate: bool = True,
) -> RetrievalStats:
    """Exact per-query statistics: rank of the first relevant item, R, the k-nearest-neighbour relevance (and, as
    ``metrics`` need them, the rank of every relevant item and the exact pair thresholds of ``fnmr@fmr``).

    The evaluation pipeline (prepare -> task -> exact search -> statistics); :func:`retrieval_metrics` and
    ``RetrievalMetrics`` reduce its output to the metric dictionary.

    Args:
        sequence: ``[N]`` sequence ids: gallery items sharing the query's (non-negative) id are ignored for it.
        category: ``[N]`` category ids, kept per query in the statistics (for per-category metrics).
        k: length of the neighbour lists; default = what ``metrics`` need (at least 1).
        rank_ks: the K values for which ``first_positive_rank < K`` must be decided exactly (Recall@K), beside
            those ``metrics`` decide (each ``recall@K``; 1 for ``precision@1``). The reported rank is exact where the
            approximate pass leaves it ambiguous for one of these K; elsewhere it is a lower bound on the same side
            of every K as the exact rank. It is exact for every query when ``mrr`` or ``map`` is among the metrics.
        metrics: metric names (or parsed names) whose statistics to compute (see :func:`metric_names`): the
            statistics are complete for each of them, whatever else is asked for.
        exact_scores: every neighbour score and the neighbour order exact (else the relevance sequence is exact,
            but runs of near-tied items of one relevance keep gallery order and approximate scores).
        precision: approximate-pass precision, ``"auto"``, ``"fp32"``, ``"tf32"`` or ``"bf16"`` (results are exact
            in every case; see :func:`lightning_dml.metrics._device.resolve_precision`).
        device: compute device; default where the embeddings are (``"cpu"`` forces the host).
        query_block, gallery_chunk, tile_memory: tile sizes or a tile memory budget in bytes (see
            :func:`build_search`).
        distributed: under an initialised ``torch.distributed`` run, every process passes the *same* full set and
            scores its share of queries; all processes return the full, identical statistics.
        process_group: the process group of ``distributed`` (default group when None).
        validate: check the inputs (``False`` when the caller checked them already).
    """
    ps = prepare(
        embeddings, labels, indices, query_mask, gallery_mask, sequence=sequence, category=category, device=device,
        validate=validate,
    )
    task, scorer, grid = build_search(
        ps, metric=metric, precision=precision, query_block=query_block, gallery_chunk=gallery_chunk,
        tile_memory=tile_memory, distributed=distributed, process_group=process_group,
    )
    names = [m if isinstance(m, MetricName) else parse_metric(m) for m in metrics]
    request = SearchRequest(
        k=_list_length(names, task) if k is None else int(k),
        rank_ks=tuple(sorted({int(v) for v in rank_ks} | _rank_ks(names))),
        exact_scores=bool(exact_scores),
        positive_ranks=any(m.kind == "map" for m in names),
        fmrs=tuple(sorted({m.rate for m in names if m.kind == "fnmr@fmr"})),
        exact_rank=any(m.kind == "mrr" for m in names),
    )
    if distributed and get_world_size(process_group) > 1:
        res, pairs = run_distributed(task, scorer, grid, request, process_group)
    else:
        res, pairs = run_search(task, scorer, grid, request)
    rows = torch.arange(task.q_items.numel(), device=task.device).unsqueeze(1).expand_as(res.neighbors)
    relevance = task.relevant(rows, res.neighbors)
    nb = torch.where(res.neighbors >= 0, task.g_items[res.neighbors.clamp(min=0)], res.neighbors)
    return RetrievalStats(
        res.first_positive_rank, res.num_positives, relevance, nb, res.scores, task.q_items, res.positive_ranks,
        None if ps.category is None else ps.category[task.q_items], pairs, scorer.score_scale,
    )


def _warn_recall_beyond_gallery(
    recall_at: Sequence[int], labels: Tensor, query_mask: Tensor | None, gallery_mask: Tensor | None,
    options: dict[str, Any],
) -> None:
    """Warn (on rank 0 only under ``distributed``) when a K of Recall@K exceeds the items a query is ranked against:
    such a Recall@K silently equals Recall@(gallery size). Python shows a given warning once per place."""
    if query_mask is None:
        ranked = labels.shape[0] - 1
    else:
        ranked = int(gallery_mask.sum()) - int(bool((query_mask & gallery_mask).any()))
    beyond = sorted({int(k) for k in recall_at if int(k) > ranked})
    if not beyond or (options.get("distributed") and get_rank(options.get("process_group")) != 0):
        return
    warnings.warn(
        f"recall_at {beyond} exceed(s) the {ranked} gallery items a query is ranked against: Recall@K for those K "
        f"equals Recall@{ranked}",
        UserWarning,
        stacklevel=3,
    )


def retrieval_metrics(
    embeddings: Tensor,
    labels: Tensor,
    *,
    recall_at: Sequence[int] = (1, 2, 4, 8),
    map_at_r: bool = True,
    metrics: Sequence[str] = (),
    indices: Tensor | None = None,
    query_mask: Tensor | None = None,
    gallery_mask: Tensor | None = None,
    sequence: Tensor | None = None,
    category: Tensor | None = None,
    category_names: Sequence[str] | dict[int, str] | None = None,
    metric: str = "cosine",
    widths: Sequence[int] = (),
    **options: Any,
) -> dict[str, float]:
    """Recall@K, Precision@1, (optionally) R-Precision and MAP@R, and the opt-in ``metrics``, exactly.

    The single evaluation pipeline of the library (``RetrievalMetrics.compute`` calls it): :func:`retrieval_stats`
    reduced by :func:`~lightning_dml.metrics._statistics.reduce_metrics`. ``metrics``: ``precision@K``, ``ndcg@K``,
    ``mrr``, ``map`` and ``fnmr@fmr=F`` (which adds ``threshold@fmr=F``). With ``category``, every metric except
    ``fnmr@fmr`` also per category as ``category/<name>/<metric>`` (``<name>``: ``category_names[id]`` or the id).
    ``options`` are those of :func:`retrieval_stats`: ``precision``, ``device``, ``query_block``,
    ``gallery_chunk``, ``tile_memory``, ``distributed``, ``process_group``, ``validate``.

    ``widths`` (nested widths ``d_1 < d_2 < ...``, Matryoshka embeddings): every metric again on the leading ``d``
    dimensions of the embeddings (re-normalised for the cosine metric), keyed ``w<d>/<metric>``
    (:func:`lightning_dml.widths.width_key`); each width is its own exact search over the same set (per-category
    figures at the full width only). A width beyond the embedding's is a :class:`~lightning_dml.widths.WidthError`.
    """
    if metric not in ("cosine", "euclidean"):
        raise ValueError(f"metric must be 'cosine' or 'euclidean', got {metric!r}")
    if len(widths):
        widths = check_widths(list(widths), "retrieval_metrics")
        check_width_fits(widths[-1], embeddings.shape[1], "retrieval_metrics")
        task = {"recall_at": recall_at, "map_at_r": map_at_r, "metrics": metrics, "indices": indices,
                "query_mask": query_mask, "gallery_mask": gallery_mask, "sequence": sequence, "metric": metric}
        out = retrieval_metrics(embeddings, labels, category=category, category_names=category_names, **task, **options)
        full = dict(out)
        for width in widths:
            cut = full if width == embeddings.shape[1] else retrieval_metrics(
                embeddings[:, :width], labels, **task, **options
            )
            out.update({width_key(width, key): value for key, value in cut.items() if not key.startswith("category/")})
        return out
    names = metric_names(recall_at, map_at_r, metrics)
    rank_ks = sorted({m.k for m in names if m.kind == "recall"} | {1})
    stats = retrieval_stats(
        embeddings, labels, indices=indices, query_mask=query_mask, gallery_mask=gallery_mask, sequence=sequence,
        category=category, metric=metric, rank_ks=rank_ks, metrics=names, **options,
    )
    _warn_recall_beyond_gallery(recall_at, labels, query_mask, gallery_mask, options)
    return reduce_metrics(stats, names, category_names)


def stats_to_metrics(
    stats: RetrievalStats, recall_at: Sequence[int] = (1, 2, 4, 8), map_at_r_: bool = True
) -> dict[str, float]:
    """The metric dictionary (``recall@K``, ``precision@1``, ``r_precision``, ``map@r``) from statistics."""
    return reduce_metrics(stats, metric_names(recall_at, map_at_r_))


def _stats(first_positive_rank: Tensor, relevance: Tensor | None = None, num_relevant: Tensor | None = None) -> RetrievalStats:
    empty = torch.empty(first_positive_rank.numel(), 0, dtype=torch.bool, device=first_positive_rank.device)
    r = num_relevant if num_relevant is not None else torch.zeros_like(first_positive_rank)
    return RetrievalStats(first_positive_rank, r, empty if relevance is None else relevance, empty.long(), empty.double(), r)


def recall_at_k(first_positive_rank: Tensor, k: int) -> float:
    """Recall@K from the per-query rank of the first relevant item (-1 = none: scores 0)."""
    if first_positive_rank.numel() == 0:
        raise ValueError("recall_at_k: no queries")
    return reduce_metrics(_stats(first_positive_rank), [parse_metric(f"recall@{int(k)}")])[f"recall@{int(k)}"]


def precision_at_1(first_positive_rank: Tensor) -> float:
    """Precision@1 over all queries: the nearest neighbour is relevant (= Recall@1)."""
    return recall_at_k(first_positive_rank, 1)


def r_precision(relevance: Tensor, num_relevant: Tensor) -> float:
    """R-Precision (Musgrave et al. 2020), averaged over queries with R > 0; 0.0 if there are none."""
    return reduce_metrics(_stats(num_relevant, relevance, num_relevant), [parse_metric("r_precision")])["r_precision"]


def map_at_r(relevance: Tensor, num_relevant: Tensor) -> float:
    """MAP@R (Musgrave et al. 2020): mean over queries with R > 0 of (1/R) sum_{i<=R} P(i) rel(i)."""
    return reduce_metrics(_stats(num_relevant, relevance, num_relevant), [parse_metric("map@r")])["map@r"]


def knn(
    query: Tensor,
    gallery: Tensor | None = None,
    k: int = 1,
    *,
    metric: str = "cosine",
    precision: str = "auto",
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Exact k nearest neighbours, in chunks, never building a full N x M matrix.

    Args:
        query: ``[Q, D]`` embeddings.
        gallery: ``[M, D]``; ``None`` searches ``query`` against itself, each row excluded from its own list.
        k: number of neighbours.
        device: compute device; default where ``query`` is.

    Returns:
        ``(scores, indices)``: exact float64 scores (cosine similarity, or negative squared Euclidean
        distance) and gallery row indices, ``[Q, k]``, ordered by score then index (tie rule). Rows with
        fewer than k candidates are padded with ``-inf`` / ``-1``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if metric not in ("cosine", "euclidean"):
        raise ValueError(f"metric must be 'cosine' or 'euclidean', got {metric!r}")
    # every item a label of its own: a neighbour search has no relevant items (with one label for all, the task
    # would list every query-gallery pair as a positive: Q x M pairs, N^2 for a self-search)
    if gallery is None:
        n = query.shape[0] if isinstance(query, Tensor) and query.ndim == 2 else 0
        dev = query.device if isinstance(query, Tensor) else None
        ps = prepare(query, torch.arange(n, device=dev), device=device)
    else:
        if not isinstance(gallery, Tensor) or gallery.ndim != 2 or query.ndim != 2 or gallery.shape[1] != query.shape[1]:
            raise ValueError(
                f"query [Q, D] and gallery [M, D] must be 2-D with the same D, got {tuple(query.shape)} and "
                f"{tuple(getattr(gallery, 'shape', ()))}"
            )
        nq, ng = query.shape[0], gallery.shape[0]
        emb = torch.cat([query.detach().float(), gallery.detach().float().to(query.device)])
        qm = torch.zeros(nq + ng, dtype=torch.bool, device=query.device)
        qm[:nq] = True
        ps = prepare(emb, torch.arange(nq + ng, device=query.device), None, qm, ~qm, device=device)
    task, scorer, grid = build_search(ps, metric=metric, precision=precision)
    res, _ = run_search(task, scorer, grid, SearchRequest(k=int(k), rank_ks=(), exact_scores=True))
    scores = res.scores if scorer.score_scale == 1.0 else res.scores / scorer.score_scale
    return scores, res.neighbors
