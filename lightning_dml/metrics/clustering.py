"""Clustering metrics of deep metric learning: NMI and F1 of a k-means clustering with k = number of classes.

Definitions (SPEC section 9.3): **NMI** is the normalised mutual information with arithmetic-mean normalisation
(Manning et al.; scikit-learn's default) between the class labels and the clustering; **F1** (Song et al., CVPR
2016) is the pairwise precision/recall of "same cluster" against "same class", from the contingency counts. The
k-means: :mod:`lightning_dml.metrics.kmeans`.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from lightning_dml.distributed import all_gather_object, get_rank, get_world_size
from lightning_dml.input_checks import check_embeddings, check_finite, check_labels, check_same_device
from lightning_dml.metrics._progress import track
from lightning_dml.metrics.kmeans import kmeans
from lightning_dml.scaling import l2_normalize

__all__ = ["clustering_metrics", "contingency", "f1_score", "nmi"]


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
        where = "clustering_metrics"
        check_embeddings(embeddings, where=where)
        check_labels(labels, embeddings.shape[0], where=where)
        check_finite(embeddings, where=where)
        check_same_device(labels, embeddings, "labels", where=where)
    if metric not in ("cosine", "euclidean"):
        raise ValueError(f"metric must be 'cosine' or 'euclidean', got {metric!r}")
    if seeds < 1:
        raise ValueError(f"seeds must be >= 1, got {seeds}")
    dev = embeddings.device if device is None else torch.device(device)
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
