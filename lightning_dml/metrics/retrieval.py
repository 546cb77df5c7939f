"""``RetrievalMetrics``: exact zero-shot retrieval and clustering metrics as a ``torchmetrics.Metric``.

A thin stateful layer over :mod:`lightning_dml.metrics.functional`: it accumulates raw embeddings, labels and
split indices (list states, ``dist_reduce_fx="cat"``, gathered by torchmetrics under DDP), checks every batch once
in ``update``, drops at ``compute()`` the rows that ``DistributedSampler`` padding repeats (by index), and hands the
set to :func:`~lightning_dml.metrics.functional.retrieval_metrics` and
:func:`~lightning_dml.metrics.functional.clustering_metrics`, on the device of the states (or ``compute_device``).
Under DDP every process scores its share of the work against the full gallery and the results are gathered, so
every figure equals the single-process one to the last digit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.utilities import rank_zero_warn
from torchmetrics.utilities.data import dim_zero_cat

from lightning_dml.metrics import functional as F
from lightning_dml.metrics._device import PRECISIONS
from lightning_dml.metrics._progress import progress_bars
from lightning_dml.widths import check_width_fits, check_widths, cut, width_key

__all__ = ["RetrievalMetrics", "eval_batch_targets"]


def eval_batch_targets(batch: Sequence[Tensor]) -> dict[str, Tensor | None]:
    """The keyword arguments of ``RetrievalMetrics.update`` carried by an evaluation batch of the data modules.

    Evaluation items are ``(image, label, index)``, ``(image, label, index, is_query, is_gallery)`` for the
    query/gallery benchmarks (In-Shop), or ``(image, label, index, is_query, is_gallery, sequence, category)`` for
    tables with sequences and categories (:class:`~lightning_dml.data.CSVDataModule`; -1: none); ``label`` may be a
    label set padded with -1. The images (first entry) are not used.
    """
    if not isinstance(batch, (list, tuple)) or len(batch) not in (2, 3, 5, 7):
        length = len(batch) if isinstance(batch, (list, tuple)) else "-"
        raise ValueError(
            "an evaluation batch must be (images, labels[, indices[, is_query, is_gallery[, sequence, category]]]), "
            f"got {type(batch).__name__} of length {length}"
        )
    n = len(batch)
    return {
        "labels": batch[1],
        "indices": batch[2] if n > 2 else None,
        "query_mask": batch[3] if n > 4 else None,
        "gallery_mask": batch[4] if n > 4 else None,
        "sequence": batch[5] if n > 6 else None,
        "category": batch[6] if n > 6 else None,
    }


def drop_padding(indices: Tensor, *rows: Tensor) -> tuple[Tensor, ...]:
    """Keep the first row of each index (DistributedSampler pads a shard by repeating items): ``(indices, *rows)``
    without the repeats, in index order.

    Rows that share an index must be identical copies; a conflict (same index, different label, embedding, mask,
    sequence or category) raises ``ValueError``.
    """
    order = torch.argsort(indices, stable=True)
    idx = indices[order]
    first = torch.ones_like(idx, dtype=torch.bool)
    first[1:] = idx[1:] != idx[:-1]
    if bool(first.all()):
        return (indices, *rows)
    rows = tuple(t[order] for t in rows)
    ref = first.nonzero().squeeze(1)[torch.cumsum(first.long(), 0) - 1]
    same = torch.ones_like(first)
    for t in rows:
        same &= (t == t[ref]).reshape(t.shape[0], -1).all(dim=1)
    if not bool(same.all()):
        bad = int(idx[(~same).nonzero()[0, 0]])
        raise ValueError(
            f"index {bad} appears more than once with different labels, embeddings, masks, sequences or categories; "
            "repeated indices are only allowed for identical copies (DistributedSampler padding)"
        )
    return (idx[first], *(t[first] for t in rows))


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
        precision: approximate-pass precision, ``"auto"`` (CUDA: TF32 on GPUs with TF32 tensor cores, else fp32;
            CPU: fp32; a property of the device, never a timing),
            ``"fp32"``, ``"tf32"`` or ``"bf16"``. Results are exact in every case. Under DDP every process must be
            given the same value; the processes agree on one precision before the search.
        kmeans_iters: Lloyd iterations per k-means run.
        kmeans_backend: ``"auto"``, ``"torch"`` or ``"faiss"`` (CPU).
        compute_device: where ``compute()`` runs: ``None`` = where the states are (the module's device),
            ``"cpu"`` forces the host (for a GPU too small to hold the set), or any ``torch.device``.
        query_block, gallery_chunk: tile sizes of the search; ``None`` sizes them from ``tile_memory`` or the free
            memory of the device (CPU: 2048 x 8192).
        tile_memory: memory budget in bytes for the score tiles (``None``: a quarter of the free GPU memory, at
            most 4 GB; CPU: fixed tiles).
        distributed_split: under DDP split the search and the k-means seeds across processes (else each
            process recomputes all).
        progress: show progress bars (tqdm) over the retrieval tiles and the k-means iterations in ``compute``.
        metrics: opt-in metrics by name (``docs/metrics.md``): ``precision@K``, ``ndcg@K``, ``mrr``, ``map`` (over
            the whole ranking) and ``fnmr@fmr=F`` (verification over all pairs, ``0 < F <= 1`` read exactly as the
            decimal written; adds ``threshold@fmr=F``; FNMR 0.0 without a positive pair, and at F = 1). Each
            figure is the same whether asked for alone or with others.
        category_names: names of the category ids for the per-category keys (``category/<name>/recall@1``): a
            sequence indexed by id or a dict; default the ids.
        widths: nested widths ``d_1 < d_2 < ... <= D`` (Matryoshka embeddings, :class:`~lightning_dml.losses.
            MatryoshkaLoss`): every metric (clustering included, per-category figures excepted) again on the leading
            ``d`` dimensions of the stored embeddings, keyed ``w<d>/<metric>`` (``w64/recall@1``, ``w64/nmi``), from
            the same update pass; each width is its own exact search, equal to evaluating the cut embeddings alone.

    ``update(embeddings, labels, indices=None, query_mask=None, gallery_mask=None, sequence=None, category=None)``:
    ``labels`` are ``[B]`` class ids or ``[B, L]`` label sets padded with -1 (relevant: the sets intersect; the
    width L must stay the same across calls); ``indices`` is the position of each item in its split; pass it under
    DDP (it removes padding duplicates and makes the result independent of sharding). ``query_mask``/
    ``gallery_mask`` select query/gallery mode (queries ranked against the gallery; an item may be both, it never
    matches itself); without them every item is a query against all others. ``sequence`` ids (-1: none): gallery
    items sharing the query's sequence are ignored. ``category`` ids (-1: none): every metric also per category of
    the queries. NMI and F1 need one class per item: with label sets they are not computed (a warning says so).
    ``update_from_batch(embeddings, batch)`` takes an evaluation batch of the data modules as it comes.
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
        compute_device: torch.device | str | None = None,
        query_block: int | None = None,
        gallery_chunk: int | None = None,
        tile_memory: int | None = None,
        distributed_split: bool = True,
        progress: bool = False,
        metrics: Sequence[str] = (),
        category_names: Sequence[str] | dict[int, str] | None = None,
        widths: Sequence[int] = (),
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.widths = check_widths(list(widths), "RetrievalMetrics") if len(widths) else []
        recall_at = tuple(int(k) for k in recall_at)
        self.names = F.metric_names(recall_at, map_at_r, metrics)  # checks every name and K
        if metric not in ("cosine", "euclidean"):
            raise ValueError(f"metric must be 'cosine' or 'euclidean', got {metric!r}")
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
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
        self.compute_device = None if compute_device is None else torch.device(compute_device)
        self.query_block = query_block
        self.gallery_chunk = gallery_chunk
        self.tile_memory = tile_memory
        self.distributed_split = bool(distributed_split)
        self.progress = bool(progress)
        self.metrics = tuple(metrics) if not isinstance(metrics, str) else (metrics,)
        self.category_names = category_names
        self._warned_label_sets = False
        for name in _STATES:
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def update(
        self,
        embeddings: Tensor,
        labels: Tensor,
        indices: Tensor | None = None,
        query_mask: Tensor | None = None,
        gallery_mask: Tensor | None = None,
        sequence: Tensor | None = None,
        category: Tensor | None = None,
    ) -> None:
        """Store a batch of raw embeddings ``[B, D]`` with labels ``[B]`` or label sets ``[B, L]`` (and optional
        indices, masks, sequence and category ids)."""
        where = "RetrievalMetrics.update"
        F.check_inputs(embeddings, labels, indices, query_mask, gallery_mask, sequence, category, where=where)
        if self.widths:
            check_width_fits(self.widths[-1], embeddings.shape[1], "RetrievalMetrics(widths)")
        if len(self.embeddings) and self.embeddings[0].shape[1] != embeddings.shape[1]:
            raise ValueError(
                f"{where}: embedding dimension changed from {self.embeddings[0].shape[1]} to {embeddings.shape[1]}"
            )
        if len(self.labels) and self.labels[0].shape[1:] != labels.shape[1:]:
            raise ValueError(
                f"{where}: labels changed from shape [B{', ' + str(self.labels[0].shape[1]) if self.labels[0].ndim == 2 else ''}] "
                f"to {list(labels.shape)}: give every batch the same kind of labels (label sets padded to one width L)"
            )
        n = embeddings.shape[0]
        dev = embeddings.device

        def given(t: Tensor | None, fill: int | bool, dtype: torch.dtype) -> Tensor:
            return t.detach().to(dtype) if t is not None else torch.full((n,), fill, dtype=dtype, device=dev)

        self.embeddings.append(embeddings.detach().float())
        self.labels.append(labels.detach().long())
        self.indices.append(given(indices, -1, torch.long))
        self.query_mask.append(given(query_mask, True, torch.bool))
        self.gallery_mask.append(given(gallery_mask, True, torch.bool))
        self.sequence.append(given(sequence, -1, torch.long))
        self.category.append(given(category, -1, torch.long))

    def update_from_batch(self, embeddings: Tensor, batch: Sequence[Tensor]) -> None:
        """``update`` from the embeddings of an evaluation batch ``(images, labels, indices[, is_query, is_gallery])``
        (the images are not used)."""
        self.update(embeddings, **eval_batch_targets(batch))

    # ------------------------------------------------------------------------------------------- compute
    def _gathered(self) -> dict[str, Any]:
        # list states before a DDP sync, concatenated tensors after it
        if isinstance(self.embeddings, list) and not self.embeddings:
            raise ValueError("RetrievalMetrics.compute() called with no data: call update() with embeddings first")
        emb, lab, idx, qm, gm, seq, cat = (dim_zero_cat(getattr(self, name)) for name in _STATES)
        if emb.shape[0] == 0:
            raise ValueError("RetrievalMetrics.compute() called with no data: call update() with embeddings first")
        if self.compute_device is not None:  # the explicit device (e.g. the CPU path for a GPU too small)
            emb, lab, idx, qm, gm, seq, cat = (t.to(self.compute_device) for t in (emb, lab, idx, qm, gm, seq, cat))
        missing = idx < 0
        if bool(missing.all()):
            idx = None
        elif bool(missing.any()):
            raise ValueError("RetrievalMetrics: indices were given for some update() calls but not for others")
        else:
            idx, emb, lab, qm, gm, seq, cat = drop_padding(idx, emb, lab, qm, gm, seq, cat)
        inshop = not (bool(qm.all()) and bool(gm.all()))
        return {
            "embeddings": emb, "labels": lab, "indices": idx,
            "query_mask": qm if inshop else None, "gallery_mask": gm if inshop else None,
            "sequence": seq if bool((seq >= 0).any()) else None, "category": cat if bool((cat >= 0).any()) else None,
        }

    def compute(self) -> dict[str, float]:
        """All metrics as a ``dict[str, float]`` (values in [0, 1]; ``threshold@fmr=F`` is a score)."""
        # progress bars when asked for here, else as the caller's context says (DMLModule turns them on)
        with progress_bars() if self.progress else contextlib.nullcontext():
            data = self._gathered()
            common = {"metric": self.metric, "distributed": self.distributed_split,
                      "process_group": self.process_group, "validate": False}
            out = F.retrieval_metrics(
                **data, recall_at=self.recall_at, map_at_r=self.map_at_r, metrics=self.metrics,
                category_names=self.category_names, precision=self.precision, query_block=self.query_block,
                gallery_chunk=self.gallery_chunk, tile_memory=self.tile_memory, widths=self.widths, **common,
            )
            if self.clustering and data["labels"].ndim == 2:
                if not self._warned_label_sets:
                    self._warned_label_sets = True
                    rank_zero_warn("RetrievalMetrics: nmi and f1 need one class per item; with label sets they are not "
                                   "computed (clustering=False silences this)")
            elif self.clustering:
                # cluster the evaluated set (query/gallery mode: query and gallery items alike), in index order
                x, y = data["embeddings"], data["labels"]
                if data["indices"] is not None:
                    order = torch.argsort(data["indices"])
                    x, y = x[order], y[order]
                full: dict[str, float] = {}
                for width in [None, *self.widths]:
                    values = dict(full) if width == x.shape[1] else F.clustering_metrics(
                        cut(x, width, "RetrievalMetrics"), y, seeds=self.kmeans_seeds, iters=self.kmeans_iters,
                        backend=self.kmeans_backend, **common,
                    )
                    full = full or values
                    out.update(values if width is None else {width_key(width, k): v for k, v in values.items()})
        return out


#: the list states of :class:`RetrievalMetrics` (concatenated by torchmetrics under DDP)
_STATES = ("embeddings", "labels", "indices", "query_mask", "gallery_mask", "sequence", "category")
