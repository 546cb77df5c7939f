"""Functional retrieval and clustering metrics on plain tensors.

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
ranks are exact (those of a float64 brute force); see :mod:`lightning_dml.metrics._search`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_dml.metrics._progress import track
from lightning_dml.metrics._search import ExactSearch, Scorer, SearchResult, bf16_matmul_is_fast, resolve_precision
from lightning_dml.metrics.kmeans import kmeans

__all__ = [
    "PreparedSet",
    "RetrievalStats",
    "bf16_matmul_is_fast",
    "check_inputs",
    "clustering_metrics",
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
    """Raise ``ValueError`` naming the problem for malformed metric inputs."""
    if not isinstance(embeddings, Tensor) or embeddings.ndim != 2:
        shape = tuple(embeddings.shape) if isinstance(embeddings, Tensor) else type(embeddings).__name__
        raise ValueError(f"{where}: embeddings must be a 2-D tensor [N, D], got {shape}")
    if not embeddings.is_floating_point():
        raise ValueError(f"{where}: embeddings must be floating point, got dtype {embeddings.dtype}")
    n = embeddings.shape[0]
    if embeddings.shape[1] == 0:
        raise ValueError(f"{where}: embeddings have dimension D = 0")
    if not isinstance(labels, Tensor) or labels.ndim != 1 or labels.shape[0] != n:
        shape = tuple(labels.shape) if isinstance(labels, Tensor) else type(labels).__name__
        raise ValueError(f"{where}: labels must be a 1-D tensor with one entry per embedding ({n}), got {shape}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ValueError(f"{where}: labels must be an integer tensor, got dtype {labels.dtype}")
    finite = torch.isfinite(embeddings).all(dim=1)
    if not bool(finite.all()):
        bad = (~finite).nonzero().squeeze(1)
        kind = "NaN" if bool(torch.isnan(embeddings[bad[0]]).any()) else "Inf"
        raise ValueError(
            f"{where}: embeddings contain non-finite values ({kind}) in {bad.numel()} row(s), first at row {int(bad[0])}"
        )
    for name, t, integer in (("indices", indices, True), ("query_mask", query_mask, False), ("gallery_mask", gallery_mask, False)):
        if t is None:
            continue
        if not isinstance(t, Tensor) or t.ndim != 1 or t.shape[0] != n:
            shape = tuple(t.shape) if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{where}: {name} must be a 1-D tensor with one entry per embedding ({n}), got {shape}")
        if integer and (t.is_floating_point() or t.dtype == torch.bool):
            raise ValueError(f"{where}: {name} must be an integer tensor, got dtype {t.dtype}")
        if not integer and t.dtype != torch.bool:
            raise ValueError(f"{where}: {name} must be a bool tensor, got dtype {t.dtype}")
    if (query_mask is None) != (gallery_mask is None):
        raise ValueError(f"{where}: give both query_mask and gallery_mask (In-Shop mode) or neither (all-vs-all)")


@dataclass
class PreparedSet:
    """De-duplicated evaluation set, rows sorted by their index in the split."""

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
) -> PreparedSet:
    """Validate, move to CPU float32, drop repeated ``indices`` (DDP padding) and sort rows by index.

    Rows that share an index must be identical copies (the DistributedSampler pads by repeating items); a
    conflict (same index, different label or embedding) raises ``ValueError``.
    """
    check_inputs(embeddings, labels, indices, query_mask, gallery_mask)
    x = embeddings.detach().to("cpu", torch.float32)
    y = labels.detach().to("cpu", torch.long)
    n = x.shape[0]
    if n == 0:
        raise ValueError("no samples to evaluate: the metric received 0 embeddings")
    if not bool(torch.isfinite(x).all()):
        raise ValueError("embeddings overflow float32 (values beyond +-3.4e38 became Inf)")
    qm = None if query_mask is None else query_mask.detach().to("cpu")
    gm = None if gallery_mask is None else gallery_mask.detach().to("cpu")
    if indices is None:
        idx = torch.arange(n)
    else:
        idx = indices.detach().to("cpu", torch.long)
        order = torch.argsort(idx, stable=True)
        idx, x, y = idx[order], x[order], y[order]
        qm = None if qm is None else qm[order]
        gm = None if gm is None else gm[order]
        first = torch.ones(n, dtype=torch.bool)
        first[1:] = idx[1:] != idx[:-1]
        if not bool(first.all()):
            # each duplicate must equal the first row with that index
            grp = torch.cumsum(first.long(), 0) - 1
            keep_rows = first.nonzero().squeeze(1)
            ref = keep_rows[grp]
            same = (y == y[ref]) & (x == x[ref]).all(dim=1)
            if qm is not None:
                same &= (qm == qm[ref]) & (gm == gm[ref])
            if not bool(same.all()):
                bad = int(idx[(~same).nonzero()[0, 0]])
                raise ValueError(
                    f"index {bad} appears more than once with different labels, embeddings or masks; "
                    "repeated indices are only allowed for identical copies (DistributedSampler padding)"
                )
            idx, x, y = idx[first], x[first], y[first]
            qm = None if qm is None else qm[first]
            gm = None if gm is None else gm[first]
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
        scores: ``[Q, k]`` exact float64 scores of the neighbours.
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
        all_items = torch.arange(n)
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
    query_block: int = 2048,
    gallery_chunk: int = 8192,
) -> ExactSearch:
    """Set up the chunked exact search over a prepared set (global query blocks of ``query_block``)."""
    x = ps.embeddings
    if metric == "cosine":
        zero = torch.linalg.vector_norm(x, dim=1) == 0
        if bool(zero.any()):
            raise ValueError(
                f"cosine metric: {int(zero.sum())} embedding(s) have zero norm (first at split index "
                f"{int(ps.indices[zero.nonzero()[0, 0]])}); they have no direction"
            )
    scorer = Scorer(x, metric, resolve_precision(precision))
    q, g = _items(ps)
    return ExactSearch(scorer, ps.labels, q, g, query_block=query_block, gallery_chunk=gallery_chunk)


def _stats_from_result(search: ExactSearch, res: SearchResult, q_rows: Tensor) -> RetrievalStats:
    nb = torch.where(res.neighbors >= 0, search.g_items[res.neighbors.clamp(min=0)], res.neighbors)
    q_lab = search.labels[q_rows]
    rel = (nb >= 0) & (search.labels[nb.clamp(min=0)] == q_lab.unsqueeze(1))
    return RetrievalStats(res.first_positive_rank, res.num_positives, rel, nb, res.scores, q_rows)


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
    query_block: int = 2048,
    gallery_chunk: int = 8192,
) -> RetrievalStats:
    """Exact per-query statistics: rank of the best same-class item and the k-nearest-neighbour relevance.

    Args:
        k: length of the neighbour lists; default = the largest R (what MAP@R needs), at least 1.
        rank_ks: the K values for which ``first_positive_rank < K`` must be decided exactly (Recall@K).
            The reported rank is exact where the approximate pass leaves it ambiguous for one of these K;
            elsewhere it is a lower bound on the same side of every K as the exact rank.
    """
    ps = prepare(embeddings, labels, indices, query_mask, gallery_mask)
    search = build_search(ps, metric=metric, precision=precision, query_block=query_block, gallery_chunk=gallery_chunk)
    if k is None:
        k = max(1, int(search.num_positives.max()))
    res = search.run(int(k), tuple(sorted(set(int(v) for v in rank_ks))))
    return _stats_from_result(search, res, search.q_items)


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
    in_r = torch.arange(rel.shape[1]).unsqueeze(0) < r.unsqueeze(1)
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
    prec = torch.cumsum(relf, dim=1) / torch.arange(1, rel.shape[1] + 1, dtype=torch.float64)
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
    precision: str = "auto",
) -> dict[str, float]:
    """Recall@K, Precision@1 and (optionally) R-Precision and MAP@R, exactly, in one chunked pass."""
    for k in recall_at:
        if int(k) < 1:
            raise ValueError(f"recall_at values must be >= 1, got {k}")
    ps = prepare(embeddings, labels, indices, query_mask, gallery_mask)
    search = build_search(ps, metric=metric, precision=precision)
    k = max(1, int(search.num_positives.max())) if map_at_r else 1
    res = search.run(k, tuple(sorted({int(v) for v in recall_at} | {1})))
    stats = _stats_from_result(search, res, search.q_items)
    return stats_to_metrics(stats, recall_at, map_at_r)


def knn(
    query: Tensor,
    gallery: Tensor | None = None,
    k: int = 1,
    *,
    metric: str = "cosine",
    precision: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Exact k nearest neighbours, in chunks, never building a full N x M matrix.

    Args:
        query: ``[Q, D]`` embeddings.
        gallery: ``[M, D]``; ``None`` searches ``query`` against itself, each row excluded from its own list.
        k: number of neighbours.

    Returns:
        ``(scores, indices)``: exact float64 scores (cosine similarity, or negative squared Euclidean
        distance) and gallery row indices, ``[Q, k]``, ordered by score then index (tie rule). Rows with
        fewer than k candidates are padded with ``-inf`` / ``-1``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if gallery is None:
        y = torch.zeros(query.shape[0] if isinstance(query, Tensor) and query.ndim == 2 else 0, dtype=torch.long)
        ps = prepare(query, y)
    else:
        if not isinstance(gallery, Tensor) or gallery.ndim != 2 or query.ndim != 2 or gallery.shape[1] != query.shape[1]:
            raise ValueError(
                f"query [Q, D] and gallery [M, D] must be 2-D with the same D, got {tuple(query.shape)} and "
                f"{tuple(getattr(gallery, 'shape', ()))}"
            )
        nq, ng = query.shape[0], gallery.shape[0]
        emb = torch.cat([query.detach().float(), gallery.detach().float()])
        y = torch.zeros(nq + ng, dtype=torch.long)
        qm = torch.zeros(nq + ng, dtype=torch.bool)
        qm[:nq] = True
        ps = prepare(emb, y, None, qm, ~qm)
    search = build_search(ps, metric=metric, precision=precision)
    res = search.run(int(k), (), exact_scores=True)
    nb = res.neighbors
    return res.scores, nb


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
    labels = labels.detach().cpu().long()
    clusters = clusters.detach().cpu().long()
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
    labels = labels.detach().cpu().long()
    clusters = clusters.detach().cpu().long()
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
) -> dict[str, float]:
    """NMI and F1 of k-means (k = number of classes), averaged over ``seeds`` runs (seeds ``seed_offset + s``).

    In cosine mode the embeddings are L2-normalised before clustering.
    """
    check_inputs(embeddings, labels, where="clustering_metrics")
    x = embeddings.detach().to("cpu", torch.float32)
    if metric == "cosine":
        x = torch.nn.functional.normalize(x, dim=1)
    k = int(torch.unique(labels).numel())
    nmis, f1s = [], []
    for s in track(range(seeds), "k-means seeds") if seeds > 1 else range(seeds):
        assign = kmeans(x, k, iters=iters, seed=seed_offset + s, backend=backend)
        nmis.append(nmi(labels, assign))
        f1s.append(f1_score(labels, assign))
    return {"nmi": float(sum(nmis) / len(nmis)), "f1": float(sum(f1s) / len(f1s))}
