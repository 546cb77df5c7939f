"""Functional retrieval and clustering metrics on plain tensors: the library's one evaluation pipeline.

Definitions (SPEC section 9.3; the retrieval protocol of Song et al., CVPR 2016, and the metrics of Musgrave,
Belongie & Lim, *A Metric Learning Reality Check*, ECCV 2020):

* **Recall@K**: fraction of queries with at least one same-class item among their K nearest neighbours. In
  all-vs-all mode each query is removed from its own ranking (by index). Every query counts; a query with no
  other item of its class scores 0.
* **Precision@1**: fraction of queries whose nearest neighbour has their class (equals Recall@1).
* **R-Precision**: for a query with R same-class gallery items, the fraction of them among its R nearest
  neighbours. **MAP@R**: ``(1/R) sum_{i<=R} P(i) rel(i)``. Queries with R = 0 are excluded from both.
* **NMI**: normalised mutual information with arithmetic-mean normalisation (Manning et al.; scikit-learn's
  default) between the class labels and a k-means clustering with k = number of classes.
* **F1** (Song et al. 2016): pairwise precision/recall of "same cluster" against "same class", from the
  contingency counts.

Ranking: cosine similarity of L2-normalised embeddings (default) or Euclidean distance. **Tie rule**: at equal
exact (float64) score, the gallery item with the smaller index in the split ranks first. Neighbour lists and
ranks are exact (those of a float64 brute force); see :mod:`lightning_dml.metrics._search`. Everything computes on
the device of the embeddings unless ``device`` says otherwise.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_dml.distributed import all_gather_object, get_rank, get_world_size
from lightning_dml.input_checks import check_embeddings, check_finite, check_labels, check_per_row, check_same_device
from lightning_dml.metrics._ddp import agree_search_settings, run_distributed
from lightning_dml.metrics._device import resolve_precision, tile_sizes
from lightning_dml.metrics._precision import Scorer
from lightning_dml.metrics._progress import track
from lightning_dml.metrics._search import ExactSearch
from lightning_dml.metrics.kmeans import kmeans
from lightning_dml.scaling import l2_normalize

__all__ = [
    "PreparedSet",
    "RetrievalStats",
    "check_inputs",
    "clustering_metrics",
    "compute_device",
    "contingency",
    "f1_score",
    "kmeans",
    "knn",
    "map_at_r",
    "nmi",
    "precision_at_1",
    "prepare",
    "r_precision",
    "recall_at_k",
    "retrieval_metrics",
    "retrieval_stats",
    "stats_to_metrics",
]


# --------------------------------------------------------------------------------------------- validation
def check_inputs(
    embeddings: Tensor,
    labels: Tensor,
    indices: Tensor | None = None,
    query_mask: Tensor | None = None,
    gallery_mask: Tensor | None = None,
    *,
    where: str = "inputs",
) -> None:
    """Raise ``ValueError`` naming the problem for malformed metric inputs (:mod:`lightning_dml.input_checks`)."""
    check_embeddings(embeddings, where=where, allow_empty=True)
    n = embeddings.shape[0]
    check_labels(labels, n, where=where)
    check_finite(embeddings, where=where)
    for name, t, kind in (("indices", indices, "integer"), ("query_mask", query_mask, "bool"), ("gallery_mask", gallery_mask, "bool")):
        if t is not None:
            check_per_row(t, n, name, kind=kind, where=where)
            check_same_device(t, embeddings, name, where=where)
    check_same_device(labels, embeddings, "labels", where=where)
    if (query_mask is None) != (gallery_mask is None):
        raise ValueError(f"{where}: give both query_mask and gallery_mask (In-Shop mode) or neither (all-vs-all)")


def _check_options(recall_at: Sequence[int], metric: str) -> None:
    for k in recall_at:
        if int(k) < 1:
            raise ValueError(f"recall_at values must be >= 1, got {k}")
    if metric not in ("cosine", "euclidean"):
        raise ValueError(f"metric must be 'cosine' or 'euclidean', got {metric!r}")


def compute_device(embeddings: Tensor, device: torch.device | str | None = None) -> torch.device:
    """The device the metrics compute on: ``device`` when given, else where the embeddings are."""
    return embeddings.device if device is None else torch.device(device)


@dataclass
class PreparedSet:
    """Evaluation set on its compute device, rows sorted by their (unique) index in the split."""

    embeddings: Tensor  # float32 [N, D]
    labels: Tensor  # int64 [N]
    indices: Tensor  # int64 [N], strictly increasing
    query_mask: Tensor | None
    gallery_mask: Tensor | None


def prepare(
    embeddings: Tensor,
    labels: Tensor,
    indices: Tensor | None = None,
    query_mask: Tensor | None = None,
    gallery_mask: Tensor | None = None,
    *,
    device: torch.device | str | None = None,
    validate: bool = True,
) -> PreparedSet:
    """Validate (unless ``validate=False``: checked already), move to the compute device as float32, sort by index.

    ``indices`` must be unique here (``RetrievalMetrics`` drops the copies that DDP padding repeats before it
    calls the functional core); a repeated index raises ``ValueError``.
    """
    if validate:
        check_inputs(embeddings, labels, indices, query_mask, gallery_mask)
    dev = compute_device(embeddings, device)
    x = embeddings.detach().to(dev, torch.float32)
    y = labels.detach().to(dev, torch.long)
    n = x.shape[0]
    if n == 0:
        raise ValueError("no samples to evaluate: the metric received 0 embeddings")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("embeddings overflow float32 (values beyond +-3.4e38 became Inf)")
    qm = None if query_mask is None else query_mask.detach().to(dev)
    gm = None if gallery_mask is None else gallery_mask.detach().to(dev)
    if indices is None:
        return PreparedSet(x.contiguous(), y, torch.arange(n, device=dev), qm, gm)
    idx = indices.detach().to(dev, torch.long)
    order = torch.argsort(idx, stable=True)
    idx, x, y = idx[order], x[order], y[order]
    repeated = (idx[1:] == idx[:-1]).nonzero()
    if repeated.numel():
        raise ValueError(
            f"index {int(idx[int(repeated[0, 0])])} appears more than once; indices must be unique "
            "(RetrievalMetrics removes identical DistributedSampler padding copies before computing)"
        )
    qm = None if qm is None else qm[order]
    gm = None if gm is None else gm[order]
    return PreparedSet(x.contiguous(), y, idx, qm, gm)


# --------------------------------------------------------------------------------------------- retrieval
@dataclass
class RetrievalStats:
    """Per-query exact retrieval statistics (queries in increasing split-index order).

    Attributes:
        first_positive_rank: number of gallery items ranked ahead of the best same-class item; -1 if none.
        num_relevant: R, the number of same-class gallery items (query excluded).
        relevance: ``[Q, k]`` bool, whether each of the k nearest neighbours has the query's class.
        neighbors: ``[Q, k]`` row positions (into the prepared set) of the neighbours, -1 for padding.
        scores: ``[Q, k]`` float64 scores of the neighbours (exact where their order needed it).
        query_rows: ``[Q]`` row positions of the queries in the prepared set.
    """

    first_positive_rank: Tensor
    num_relevant: Tensor
    relevance: Tensor
    neighbors: Tensor
    scores: Tensor
    query_rows: Tensor


def _items(ps: PreparedSet) -> tuple[Tensor, Tensor]:
    n = ps.labels.numel()
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
) -> ExactSearch:
    """Set up the chunked exact search over a prepared set, on the set's device.

    Tile sizes: explicit ``query_block`` / ``gallery_chunk``, else from ``tile_memory`` bytes, else from the free
    memory of the device (:func:`lightning_dml.metrics._device.tile_sizes`). With ``distributed`` the processes
    first agree on one precision and one global tile grid (:func:`~lightning_dml.metrics._ddp.agree_search_settings`:
    the most precise of the per-process ``"auto"`` resolutions, the smallest tiles; different requested precisions,
    metrics or set shapes are a ``ValueError`` on every process).
    """
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
    return ExactSearch(Scorer(x, metric, resolved), ps.labels, q, g, query_block=qb, gallery_chunk=gc)


def retrieval_stats(
    embeddings: Tensor,
    labels: Tensor,
    *,
    indices: Tensor | None = None,
    query_mask: Tensor | None = None,
    gallery_mask: Tensor | None = None,
    metric: str = "cosine",
    k: int | None = None,
    rank_ks: Sequence[int] = (1,),
    precision: str = "auto",
    device: torch.device | str | None = None,
    query_block: int | None = None,
    gallery_chunk: int | None = None,
    tile_memory: int | None = None,
    distributed: bool = False,
    process_group: Any = None,
    validate: bool = True,
) -> RetrievalStats:
    """Exact per-query statistics: rank of the best same-class item and the k-nearest-neighbour relevance.

    The evaluation pipeline (prepare -> exact search -> statistics); :func:`retrieval_metrics` and
    ``RetrievalMetrics`` reduce its output to the metric dictionary.

    Args:
        k: length of the neighbour lists; default = the largest R (what MAP@R needs), at least 1.
        rank_ks: the K values for which ``first_positive_rank < K`` must be decided exactly (Recall@K).
            The reported rank is exact where the approximate pass leaves it ambiguous for one of these K;
            elsewhere it is a lower bound on the same side of every K as the exact rank.
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
    ps = prepare(embeddings, labels, indices, query_mask, gallery_mask, device=device, validate=validate)
    search = build_search(
        ps, metric=metric, precision=precision, query_block=query_block, gallery_chunk=gallery_chunk,
        tile_memory=tile_memory, distributed=distributed, process_group=process_group,
    )
    if k is None:
        k = max(1, int(search.num_positives.max()))
    ks = tuple(sorted({int(v) for v in rank_ks}))
    if distributed and get_world_size(process_group) > 1:
        res = run_distributed(search, int(k), ks, process_group)
    else:
        res = search.run(int(k), ks)
    nb = torch.where(res.neighbors >= 0, search.g_items[res.neighbors.clamp(min=0)], res.neighbors)
    q_rows = search.q_items
    rel = (nb >= 0) & (ps.labels[nb.clamp(min=0)] == ps.labels[q_rows].unsqueeze(1))
    return RetrievalStats(res.first_positive_rank, res.num_positives, rel, nb, res.scores, q_rows)


def recall_at_k(first_positive_rank: Tensor, k: int) -> float:
    """Recall@K from the per-query rank of the best same-class item (-1 = none: scores 0)."""
    if first_positive_rank.numel() == 0:
        raise ValueError("recall_at_k: no queries")
    hit = (first_positive_rank >= 0) & (first_positive_rank < k)
    return float(hit.double().mean())


def precision_at_1(first_positive_rank: Tensor) -> float:
    """Precision@1 over all queries: the nearest neighbour has the query's class (= Recall@1)."""
    return recall_at_k(first_positive_rank, 1)


def _r_mask(relevance: Tensor, num_relevant: Tensor) -> tuple[Tensor, Tensor]:
    keep = num_relevant > 0
    rel = relevance[keep]
    r = num_relevant[keep]
    if r.numel() and rel.shape[1] < int(r.max()):
        raise ValueError(f"neighbour lists of length {rel.shape[1]} are shorter than the largest R = {int(r.max())}")
    in_r = torch.arange(rel.shape[1], device=rel.device).unsqueeze(0) < r.unsqueeze(1)
    return rel & in_r, r


def r_precision(relevance: Tensor, num_relevant: Tensor) -> float:
    """R-Precision (Musgrave et al. 2020), averaged over queries with R > 0; 0.0 if there are none."""
    rel, r = _r_mask(relevance, num_relevant)
    if r.numel() == 0:
        return 0.0
    return float((rel.sum(dim=1).double() / r.double()).mean())


def map_at_r(relevance: Tensor, num_relevant: Tensor) -> float:
    """MAP@R (Musgrave et al. 2020): mean over queries with R > 0 of (1/R) sum_{i<=R} P(i) rel(i)."""
    rel, r = _r_mask(relevance, num_relevant)
    if r.numel() == 0:
        return 0.0
    relf = rel.double()
    prec = torch.cumsum(relf, dim=1) / torch.arange(1, rel.shape[1] + 1, dtype=torch.float64, device=rel.device)
    ap = (prec * relf).sum(dim=1) / r.double()
    return float(ap.mean())


def stats_to_metrics(
    stats: RetrievalStats, recall_at: Sequence[int] = (1, 2, 4, 8), map_at_r_: bool = True
) -> dict[str, float]:
    """The metric dictionary (``recall@K``, ``precision@1``, ``r_precision``, ``map@r``) from statistics."""
    out = {f"recall@{int(k)}": recall_at_k(stats.first_positive_rank, int(k)) for k in recall_at}
    out["precision@1"] = precision_at_1(stats.first_positive_rank)
    if map_at_r_:
        out["r_precision"] = r_precision(stats.relevance, stats.num_relevant)
        out["map@r"] = map_at_r(stats.relevance, stats.num_relevant)
    return out


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
    indices: Tensor | None = None,
    query_mask: Tensor | None = None,
    gallery_mask: Tensor | None = None,
    metric: str = "cosine",
    **options: Any,
) -> dict[str, float]:
    """Recall@K, Precision@1 and (optionally) R-Precision and MAP@R, exactly, in one chunked pass.

    The single evaluation pipeline of the library (``RetrievalMetrics.compute`` calls it): :func:`retrieval_stats`
    reduced by :func:`stats_to_metrics`; neighbour lists of length max R are only built with ``map_at_r``.
    ``options`` are those of :func:`retrieval_stats`: ``precision``, ``device``, ``query_block``,
    ``gallery_chunk``, ``tile_memory``, ``distributed``, ``process_group``, ``validate``.
    """
    _check_options(recall_at, metric)
    stats = retrieval_stats(
        embeddings, labels, indices=indices, query_mask=query_mask, gallery_mask=gallery_mask, metric=metric,
        k=None if map_at_r else 1, rank_ks=tuple(recall_at) + (1,), **options,
    )
    _warn_recall_beyond_gallery(recall_at, labels, query_mask, gallery_mask, options)
    return stats_to_metrics(stats, recall_at, map_at_r)


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
    if gallery is None:
        n = query.shape[0] if isinstance(query, Tensor) and query.ndim == 2 else 0
        dev = query.device if isinstance(query, Tensor) else None
        ps = prepare(query, torch.zeros(n, dtype=torch.long, device=dev), device=device)
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
        ps = prepare(emb, torch.zeros(nq + ng, dtype=torch.long, device=query.device), None, qm, ~qm, device=device)
    search = build_search(ps, metric=metric, precision=precision)
    res = search.run(int(k), (), exact_scores=True)
    scores = res.scores if search.scorer.score_scale == 1.0 else res.scores / search.scorer.score_scale
    return scores, res.neighbors


# --------------------------------------------------------------------------------------------- clustering
def contingency(labels: Tensor, clusters: Tensor) -> Tensor:
    """Sparse contingency counts: a ``[M]`` int64 tensor of the non-zero cells n_{class, cluster}."""
    if labels.ndim != 1 or clusters.ndim != 1 or labels.shape != clusters.shape:
        raise ValueError(f"labels and clusters must be 1-D of equal length, got {tuple(labels.shape)} and {tuple(clusters.shape)}")
    _, li = torch.unique(labels, return_inverse=True)
    _, ci = torch.unique(clusters, return_inverse=True)
    key = li.long() * (int(ci.max()) + 1 if ci.numel() else 1) + ci.long()
    _, counts = torch.unique(key, return_counts=True)
    return counts


def _entropy(counts: Tensor, n: float) -> Tensor:
    p = counts.double() / n
    return -(p * torch.log(p)).sum()


def nmi(labels: Tensor, clusters: Tensor) -> float:
    """Normalised mutual information, arithmetic-mean normalisation (= scikit-learn's default).

    NMI = I(Y; C) / ((H(Y) + H(C)) / 2). As in scikit-learn, two single-cluster labelings score 1.0.
    """
    labels = labels.detach().long()
    clusters = clusters.detach().long().to(labels.device)
    n = labels.numel()
    if n == 0:
        raise ValueError("nmi: empty labelling")
    _, cy = torch.unique(labels, return_counts=True)
    _, cc = torch.unique(clusters, return_counts=True)
    if (cy.numel() == 1 and cc.numel() == 1):
        return 1.0
    _, li = torch.unique(labels, return_inverse=True)
    _, ci = torch.unique(clusters, return_inverse=True)
    key = li * cc.numel() + ci
    uk, nij = torch.unique(key, return_counts=True)
    ai = cy[uk // cc.numel()].double()
    bj = cc[uk % cc.numel()].double()
    nij = nij.double()
    mi = float((nij / n * (torch.log(nij) + math.log(n) - torch.log(ai) - torch.log(bj))).sum())
    mi = max(mi, 0.0)
    hy = float(_entropy(cy, n))
    hc = float(_entropy(cc, n))
    denom = (hy + hc) / 2
    if mi == 0.0 or denom == 0.0:
        return 0.0
    return min(1.0, mi / max(denom, mi))


def f1_score(labels: Tensor, clusters: Tensor) -> float:
    """Clustering F1 of Song et al. (2016) over all item pairs, from contingency counts.

    precision = |same cluster and same class| / |same cluster|, recall = |same cluster and same class| /
    |same class|, F1 = 2PR / (P + R). A zero denominator gives 0 for that term (documented convention).
    """
    labels = labels.detach().long()
    clusters = clusters.detach().long().to(labels.device)
    if labels.numel() == 0:
        raise ValueError("f1_score: empty labelling")

    def pairs(c: Tensor) -> float:
        c = c.double()
        return float((c * (c - 1) / 2).sum())

    both = pairs(contingency(labels, clusters))
    same_cluster = pairs(torch.unique(clusters, return_counts=True)[1])
    same_class = pairs(torch.unique(labels, return_counts=True)[1])
    p = both / same_cluster if same_cluster > 0 else 0.0
    r = both / same_class if same_class > 0 else 0.0
    return 2 * p * r / (p + r) if p + r > 0 else 0.0


def clustering_metrics(
    embeddings: Tensor,
    labels: Tensor,
    *,
    metric: str = "cosine",
    seeds: int = 1,
    iters: int = 20,
    backend: str = "auto",
    seed_offset: int = 0,
    device: torch.device | str | None = None,
    distributed: bool = False,
    process_group: Any = None,
    validate: bool = True,
) -> dict[str, float]:
    """NMI and F1 of k-means (k = number of classes), averaged over ``seeds`` runs (seeds ``seed_offset + s``).

    In cosine mode the embeddings are L2-normalised before clustering (scale-safely: each row is first divided
    by a power of two near its largest entry, so no norm overflows). The torch k-means runs on ``device``
    (default: where the embeddings are); ``backend="faiss"`` runs on the CPU. With ``distributed`` (every process
    passing the same set) seed ``s`` runs on process ``s % world`` and the figures are gathered.
    """
    if validate:
        check_inputs(embeddings, labels, where="clustering_metrics")
    if metric not in ("cosine", "euclidean"):
        raise ValueError(f"metric must be 'cosine' or 'euclidean', got {metric!r}")
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    dev = compute_device(embeddings, device)
    x = embeddings.detach().to(dev, torch.float32)
    y = labels.detach().to(dev)
    if metric == "cosine":
        x = l2_normalize(x, dim=1)
    k = int(torch.unique(y).numel())
    rank, world = (get_rank(process_group), get_world_size(process_group)) if distributed else (0, 1)
    mine = range(rank, seeds, world)
    done = {}
    for s in track(mine, "k-means seeds") if len(mine) > 1 else mine:
        assign = kmeans(x, k, iters=iters, seed=seed_offset + s, backend=backend)
        done[s] = (nmi(y, assign), f1_score(y, assign))
    if world > 1:
        for part in all_gather_object(done, process_group):
            done.update(part)
    vals = [done[s] for s in range(seeds)]
    return {"nmi": float(sum(v[0] for v in vals) / seeds), "f1": float(sum(v[1] for v in vals) / seeds)}
