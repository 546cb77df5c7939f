"""``RetrievalMetrics``: exact zero-shot retrieval and clustering metrics as a ``torchmetrics.Metric``.

Accumulates raw embeddings, labels and split indices (list states, ``dist_reduce_fx="cat"``). ``compute()``
de-duplicates the rows that ``DistributedSampler`` padding repeats (by index), sorts them by index, and
computes the metrics of :mod:`lightning_dml.metrics.functional`. Under DDP each process scores its share of
the global query blocks (block b goes to process ``b % world_size``) against the full gallery and the
per-query results are gathered, so every figure equals the single-process one to the last digit. In
all-vs-all mode the work unit is a tile of the symmetric similarity matrix (each tile serves both of its
query blocks); partial counts and candidate lists are merged across processes before the exact finish.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities.data import dim_zero_cat

from lightning_dml.metrics import functional as F
from lightning_dml.metrics._progress import progress_bars

__all__ = ["RetrievalMetrics"]


def _dist_info(group: Any) -> tuple[int, int]:
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return 1, 0
    return torch.distributed.get_world_size(group), torch.distributed.get_rank(group)


def _all_gather(obj: Any, group: Any, world: int) -> list[Any]:
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


class RetrievalMetrics(Metric):
    """Recall@K, Precision@1, R-Precision, MAP@R, NMI and F1 for deep-metric-learning retrieval.

    Definitions in SPEC section 9.3 (see :mod:`lightning_dml.metrics.functional`): Song et al. (CVPR 2016)
    Recall@K protocol, each query removed from its own ranking by index; MAP@R and R-Precision of Musgrave et
    al. (ECCV 2020); NMI (arithmetic normalisation) and pairwise F1 of a k-means clustering with k = number
    of classes. Ties are broken by the split index (smaller first); neighbour lists are exact.

    Args:
        recall_at: the K of Recall@K.
        clustering: compute ``nmi`` and ``f1`` (k-means).
        kmeans_seeds: number of k-means runs (seeds 0..n-1) averaged.
        map_at_r: compute ``map@r`` and ``r_precision``.
        metric: ``"cosine"`` (on L2-normalised embeddings) or ``"euclidean"``.
        precision: approximate-pass precision, ``"auto"`` (bf16 when the CPU has fast bf16, else fp32),
            ``"fp32"`` or ``"bf16"``. Results are exact in every case.
        kmeans_iters: Lloyd iterations per k-means run.
        kmeans_backend: ``"auto"``, ``"torch"`` or ``"faiss"``.
        query_block, gallery_chunk: chunk sizes of the search (memory ~ 4 * query_block * gallery_chunk bytes).
        distributed_split: under DDP split the query blocks across processes (else each recomputes all).
        progress: show progress bars (tqdm) over the retrieval tiles and the k-means iterations in ``compute``.

    ``update(embeddings, labels, indices=None, query_mask=None, gallery_mask=None)``: ``indices`` is the
    position of each item in its split; pass it under DDP (it removes padding duplicates and makes the
    result independent of sharding). ``query_mask``/``gallery_mask`` select In-Shop mode (queries ranked
    against the gallery); without them every item is a query against all others.
    """

    is_differentiable = False
    higher_is_better = True
    full_state_update = False

    def __init__(
        self,
        recall_at: Sequence[int] = (1, 2, 4, 8),
        clustering: bool = True,
        kmeans_seeds: int = 1,
        map_at_r: bool = True,
        metric: str = "cosine",
        precision: str = "auto",
        kmeans_iters: int = 20,
        kmeans_backend: str = "auto",
        query_block: int = 2048,
        gallery_chunk: int = 8192,
        distributed_split: bool = True,
        progress: bool = False,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        recall_at = tuple(int(k) for k in recall_at)
        if any(k < 1 for k in recall_at):
            raise ValueError(f"recall_at values must be >= 1, got {recall_at}")
        if metric not in ("cosine", "euclidean"):
            raise ValueError(f"metric must be 'cosine' or 'euclidean', got {metric!r}")
        if precision not in ("auto", "fp32", "bf16"):
            raise ValueError(f"precision must be 'auto', 'fp32' or 'bf16', got {precision!r}")
        if kmeans_seeds < 1:
            raise ValueError(f"kmeans_seeds must be >= 1, got {kmeans_seeds}")
        if kmeans_backend not in ("auto", "torch", "faiss"):
            raise ValueError(f"kmeans_backend must be 'auto', 'torch' or 'faiss', got {kmeans_backend!r}")
        self.recall_at = recall_at
        self.clustering = bool(clustering)
        self.kmeans_seeds = int(kmeans_seeds)
        self.map_at_r = bool(map_at_r)
        self.metric = metric
        self.precision = precision
        self.kmeans_iters = int(kmeans_iters)
        self.kmeans_backend = kmeans_backend
        self.query_block = int(query_block)
        self.gallery_chunk = int(gallery_chunk)
        self.distributed_split = bool(distributed_split)
        self.progress = bool(progress)
        self.add_state("embeddings", default=[], dist_reduce_fx="cat")
        self.add_state("labels", default=[], dist_reduce_fx="cat")
        self.add_state("indices", default=[], dist_reduce_fx="cat")
        self.add_state("query_mask", default=[], dist_reduce_fx="cat")
        self.add_state("gallery_mask", default=[], dist_reduce_fx="cat")

    def update(
        self,
        embeddings: Tensor,
        labels: Tensor,
        indices: Tensor | None = None,
        query_mask: Tensor | None = None,
        gallery_mask: Tensor | None = None,
    ) -> None:
        """Store a batch of raw embeddings ``[B, D]`` with labels ``[B]`` (and optional indices / masks)."""
        F.check_inputs(embeddings, labels, indices, query_mask, gallery_mask, where="RetrievalMetrics.update")
        if len(self.embeddings) and self.embeddings[0].shape[1] != embeddings.shape[1]:
            raise ValueError(
                f"RetrievalMetrics.update: embedding dimension changed from {self.embeddings[0].shape[1]} "
                f"to {embeddings.shape[1]}"
            )
        n = embeddings.shape[0]
        dev = embeddings.device
        self.embeddings.append(embeddings.detach().float())
        self.labels.append(labels.detach().long())
        self.indices.append(
            indices.detach().long() if indices is not None else torch.full((n,), -1, dtype=torch.long, device=dev)
        )
        self.query_mask.append(query_mask.detach() if query_mask is not None else torch.ones(n, dtype=torch.bool, device=dev))
        self.gallery_mask.append(
            gallery_mask.detach() if gallery_mask is not None else torch.ones(n, dtype=torch.bool, device=dev)
        )

    # ------------------------------------------------------------------------------------------- compute
    def _gathered(self) -> F.PreparedSet:
        # list states before a DDP sync, concatenated tensors after it
        if isinstance(self.embeddings, list) and not self.embeddings:
            raise ValueError("RetrievalMetrics.compute() called with no data: call update() with embeddings first")
        emb = dim_zero_cat(self.embeddings)
        lab = dim_zero_cat(self.labels)
        idx = dim_zero_cat(self.indices)
        qm = dim_zero_cat(self.query_mask)
        gm = dim_zero_cat(self.gallery_mask)
        if emb.shape[0] == 0:
            raise ValueError("RetrievalMetrics.compute() called with no data: call update() with embeddings first")
        missing = idx < 0
        if bool(missing.all()):
            idx = None
        elif bool(missing.any()):
            raise ValueError("RetrievalMetrics: indices were given for some update() calls but not for others")
        inshop = not (bool(qm.all()) and bool(gm.all()))
        return F.prepare(emb, lab, idx, qm if inshop else None, gm if inshop else None)

    def compute(self) -> dict[str, float]:
        """All metrics as a ``dict[str, float]`` (values in [0, 1])."""
        if self.progress:
            with progress_bars():
                return self._compute()
        return self._compute()

    def _compute(self) -> dict[str, float]:
        ps = self._gathered()
        world, rank = _dist_info(self.process_group)
        split = self.distributed_split and world > 1
        search = F.build_search(
            ps, metric=self.metric, precision=self.precision, query_block=self.query_block, gallery_chunk=self.gallery_chunk
        )
        k = max(1, int(search.num_positives.max())) if self.map_at_r else 1
        ks = tuple(sorted(set(self.recall_at) | {1}))
        if split:
            res = search.run_distributed(k, ks, rank, world, lambda obj: _all_gather(obj, self.process_group, world))
        else:
            res = search.run(k, ks)
        stats = F._stats_from_result(search, res, search.q_items)
        out = F.stats_to_metrics(stats, self.recall_at, self.map_at_r)
        if self.clustering:
            out.update(self._clustering(ps, world, rank, split))
        return out

    def _clustering(self, ps: F.PreparedSet, world: int, rank: int, split: bool) -> dict[str, float]:
        # cluster the evaluated set (the queries in In-Shop mode are not special: use all items)
        x, y = ps.embeddings, ps.labels

        def run(seed: int) -> tuple[float, float]:
            r = F.clustering_metrics(
                x, y, metric=self.metric, seeds=1, iters=self.kmeans_iters, backend=self.kmeans_backend, seed_offset=seed
            )
            return r["nmi"], r["f1"]

        if split:
            mine = {s: run(s) for s in range(rank, self.kmeans_seeds, world)}
            merged: dict[int, tuple[float, float]] = {}
            for part in _all_gather(mine, self.process_group, world):
                merged.update(part)
            vals = [merged[s] for s in range(self.kmeans_seeds)]
        else:
            vals = [run(s) for s in range(self.kmeans_seeds)]
        return {"nmi": sum(v[0] for v in vals) / len(vals), "f1": sum(v[1] for v in vals) / len(vals)}
