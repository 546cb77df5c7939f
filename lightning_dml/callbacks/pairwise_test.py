"""``PairwiseRerankTest``: the learned pairwise re-ranker as post-processing of ``lightning-dml test``
(``lightning-dml test ... --rerank pairwise:model=DIR,top_n=N``; issue 30 s.1).

At the end of ``test`` the items the module's :class:`~lightning_dml.metrics.RetrievalMetrics`
(``pl_module.test_metrics``) gathered are searched once more by the exact engine
(:func:`~lightning_dml.metrics.functional.retrieval_stats`: the same search as the test metrics, with their masks,
sequences and label sets), each query's first ``top_n`` results are re-scored by the re-ranker and sorted by its
logit (ties: the exact order), and Recall@K and MAP@R are computed from these lists
(:func:`lightning_dml.index.pairwise.permuted_metrics`; items beyond ``top_n`` keep their exact rank). They are
logged as ``test/pairwise/recall@K`` and ``test/pairwise/map@r`` beside the test metrics, so the test's one table
prints them (percent, two decimals). Lightning calls a callback's ``on_test_epoch_end`` before the module's, where
the module computes and resets its metric (as :class:`~lightning_dml.callbacks.RetrievalReport` relies on).

The re-ranker's inputs: ``embeddings``: the test embeddings as an index stores them
(:func:`~lightning_dml.index.rerank.as_stored`); ``images``: the test dataset's items (``dataset[i][0]``, its eval
transform), read again block by block. Its base checkpoint sha256 must be the tested checkpoint's
(``--ckpt_path``), checked when the test starts (:meth:`check_checkpoint`).

Under DDP the metric's states are gathered on every process, every process re-ranks the whole set (the same
result) and the values are logged as global (``sync_dist`` with ``max`` of equal values, as the module logs).
"""

from __future__ import annotations

import os
from typing import Any

import pytorch_lightning as pl
import torch
from torch import Tensor

from lightning_dml.distributed import get_world_size
from lightning_dml.errors import UserInputError

__all__ = ["PairwiseRerankTest"]

#: the logged keys: ``test/<PREFIX>/recall@K``, ``test/<PREFIX>/map@r``
PREFIX = "pairwise"


class PairwiseRerankTest(pl.Callback):
    """Re-rank the test's exact ranked lists with a learned pairwise re-ranker (module docstring).

    Args:
        rerank: ``pairwise:model=DIR,top_n=N`` (:func:`lightning_dml.index.pairwise.parse_chain`); a training-free
            re-ranker (alone or before it) is refused: ``index evaluate --rerank`` measures those.
    """

    def __init__(self, rerank: str) -> None:
        super().__init__()
        from lightning_dml.index.pairwise import PairwiseRerank
        from lightning_dml.index.rerank import RerankOptionError, parse_rerank

        reranker = parse_rerank(rerank)
        if not isinstance(reranker, PairwiseRerank) or reranker.first is not None:
            raise RerankOptionError(f"test --rerank {rerank!r}: the test re-ranks with pairwise:model=DIR,top_n=N "
                                    "alone (the training-free re-rankers are measured by lightning-dml index evaluate "
                                    "--rerank)")
        self.reranker = reranker
        #: the last re-ranked lists (every process): ``{"query": [Q] dataset indices, "ranked": [Q, L] dataset
        #: indices (-1 padding), "metrics": {...}}``
        self.result: dict[str, Any] | None = None
        self._checked: str | None = None

    def check_checkpoint(self, ckpt_path: str | None) -> None:
        """Loads the re-ranker (a missing or broken folder: one line) and refuses one whose base checkpoint is not
        ``ckpt_path`` (by sha256; none given: refused, the initial weights are no base model). A path checked
        already is not read again."""
        from lightning_dml.checkpoints import checkpoint_record
        from lightning_dml.index.pairwise import check_base

        key = None if ckpt_path is None else os.path.realpath(str(ckpt_path))
        if key is not None and key == self._checked:
            return
        model = self.reranker.load("cpu")
        sha = None if ckpt_path is None else (checkpoint_record(str(ckpt_path)) or {}).get("sha256")
        check_base(model, sha, f"the tested checkpoint {ckpt_path}" if ckpt_path else "the test", self.reranker.model)
        self._checked = key

    def on_test_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.check_checkpoint(trainer.ckpt_path)  # the file Lightning loaded (``last`` resolved)

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        from lightning_dml.metrics import RetrievalMetrics

        metric = getattr(pl_module, "test_metrics", None)
        if not isinstance(metric, RetrievalMetrics):
            raise UserInputError("test --rerank: the model has no RetrievalMetrics test_metrics (DMLModule's)")
        with metric.sync_context(should_sync=get_world_size() > 1):
            data = metric._gathered()  # our own class's states, as its compute() reads them
        dataset = _dataset(trainer.test_dataloaders)
        self.result = rerank_test_set(self.reranker, data, metric.metric, metric.recall_at, dataset)
        for name, value in self.result["metrics"].items():
            pl_module.log(f"test/{PREFIX}/{name}", value, sync_dist=True, reduce_fx="max")


def _dataset(loaders: Any) -> Any:
    if isinstance(loaders, (list, tuple)):
        loaders = loaders[0] if len(loaders) == 1 else None
    return getattr(loaders, "dataset", None)


def rerank_test_set(reranker: Any, data: dict[str, Any], metric: str, recall_at: Any, dataset: Any = None
                    ) -> dict[str, Any]:
    """The re-ranked lists and metrics of a gathered evaluation set (``data``: embeddings, labels, indices, masks,
    sequence, category as :class:`~lightning_dml.metrics.RetrievalMetrics` holds them), see the module docstring."""
    from lightning_dml.index.pairwise import permuted_metrics, rerank_ranked
    from lightning_dml.index.rerank import as_stored
    from lightning_dml.metrics import functional as MF

    emb = data["embeddings"]
    idx = torch.arange(emb.shape[0], device=emb.device) if data["indices"] is None else data["indices"].long()
    order = torch.argsort(idx, stable=True)
    sorted_index = idx[order]
    top_n = int(reranker.top_n)
    stats = MF.retrieval_stats(
        emb, data["labels"], indices=data["indices"], query_mask=data["query_mask"],
        gallery_mask=data["gallery_mask"], sequence=data["sequence"], category=data["category"], metric=metric,
        metrics=["map@r", f"precision@{top_n}", *(f"recall@{int(k)}" for k in recall_at)],
        rank_ks=tuple(int(k) for k in recall_at), exact_scores=True, validate=False,
    )
    model = reranker.load(emb.device)
    device = next(iter(model.parameters()), torch.empty(0, device=emb.device)).device
    ranked = stats.neighbors  # rows of the set sorted by index
    q_rows = stats.query_rows
    if model.inputs == "embeddings":
        stored = as_stored(emb[order].float(), metric)
        q_in: Any = stored[q_rows].to(device)

        def fn(rows: Tensor) -> Tensor:
            return stored[rows.clamp_min(0)].to(device)
    else:
        if dataset is None:
            raise UserInputError("test --rerank: a pairwise re-ranker of images needs the test dataset's images (one "
                                 "test dataloader)")

        def pixels(rows: Tensor) -> Tensor:
            flat = rows.reshape(-1).cpu()
            items = [dataset[int(sorted_index[int(r)])][0] if r >= 0 else None for r in flat.tolist()]
            shape = next(t for t in items if t is not None).shape
            out = torch.stack([torch.zeros(shape) if t is None else t.float() for t in items])
            return out.reshape(*rows.shape, *shape).to(device)

        def q_in(sl: slice) -> Tensor:
            return pixels(q_rows[sl].unsqueeze(1)).squeeze(1)

        fn = pixels
    base = stats.scores / float(stats.score_scale)  # the exact engine's scores, in the metric's own units
    perm = rerank_ranked(model, ranked.to(device), q_in, fn, top_n, base.to(device)).to(ranked.device)
    values = permuted_metrics(perm, stats.relevance, stats.num_relevant, stats.first_positive_rank, recall_at)
    n = perm.shape[1]
    ranked = torch.cat([ranked[:, :n].gather(1, perm), ranked[:, n:]], 1)
    as_index = torch.where(ranked >= 0, sorted_index[ranked.clamp_min(0)], ranked)
    return {"query": sorted_index[q_rows].cpu(), "ranked": as_index.cpu(), "metrics": values}
