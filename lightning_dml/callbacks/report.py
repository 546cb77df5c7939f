"""``RetrievalReport``: the retrieval report of ``lightning-dml report`` at the end of ``test`` (and optionally of
each validation), written into the run's folder, with the worst queries and the per-class table logged to W&B
(``wandb.Table``) and an image grid of the worst queries logged to TensorBoard."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.loggers import TensorBoardLogger, WandbLogger
from pytorch_lightning.utilities import rank_zero_info, rank_zero_warn

from lightning_dml.distributed import get_world_size
from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.report.folder import ReportFolderError, check_report_folder
from lightning_dml.report.grid import results_grid
from lightning_dml.report.thumbnails import image_source
from lightning_dml.report.writer import Report, label_text, write_report
from lightning_dml.retrieval import RetrievalResults

__all__ = ["RetrievalReport"]


class RetrievalReport(pl.Callback):
    """Build the retrieval report (``docs/report.md``) from what the model's test (or validation) metric holds.

    At the end of ``test`` (and, with ``every_validation=True``, of each validation outside the sanity check) the
    items the module's :class:`~lightning_dml.metrics.RetrievalMetrics` (``pl_module.test_metrics`` /
    ``val_metrics``, as :class:`~lightning_dml.module.DMLModule` has them) gathered are searched once more by the
    exact engine into a :class:`~lightning_dml.retrieval.RetrievalResults` (the same search as the metrics, with
    the same masks, sequences and label sets; no second embedding pass). Lightning calls a callback's
    ``on_test_epoch_end`` before the module's, where the module computes and resets its metric.

    Under DDP every process takes part: the metric's states are gathered (torchmetrics' ``sync_context``) and the
    search is split over the processes (``distributed=True``); rank 0 alone writes the report and logs.

    What is written and logged:

    * the report folder (:func:`~lightning_dml.report.write_report`): ``folder`` or, by default,
      ``<trainer.log_dir>/report/<stage>`` (``stage``: ``test`` or ``val-epoch=<epoch>``), where a
      :class:`~pytorch_lightning.loggers.WandbLogger`'s shared ``save_dir`` gets the run id inserted
      (``<save_dir>/report/<run id>/<stage>``);
    * every ``WandbLogger``: ``<stage>/worst_queries``, a ``wandb.Table`` of the ``log_queries`` worst queries
      (query image, its top ``log_top_k`` as one image with green/red frames, the relevance flags, scores,
      neighbour labels, AP, R, first relevant rank) and ``<stage>/per_class`` (class, name, queries, items,
      Recall@1, MAP@R);
    * every :class:`~pytorch_lightning.loggers.TensorBoardLogger`: ``<stage>/worst_queries``, the same rows as one
      image (:func:`~lightning_dml.report.results_grid`).

    The folder follows ``lightning-dml report``'s rule (:mod:`~lightning_dml.report.folder`): new, empty or an
    earlier report, else (without ``overwrite``) a :class:`~lightning_dml.report.folder.ReportFolderError`, raised
    at set-up for the test report, before any work, on every process; every file is written atomically.

    Args:
        folder: where the report goes (``{stage}`` in it is replaced), or None for the default above.
        every_validation: also at the end of each validation.
        queries, per_page, top_k, bins, thumb_size, thumb_format: as ``lightning-dml report``'s options.
        log_queries: rows of the W&B table and of the TensorBoard grid (0: no logging).
        log_top_k: neighbours shown per logged row.
        overwrite: write into a folder that is not empty and not a report (replacing the report's files).
    """

    def __init__(
        self,
        folder: str | None = None,
        every_validation: bool = False,
        queries: int | None = 500,
        per_page: int = 50,
        top_k: int = 10,
        bins: int = 50,
        thumb_size: int = 96,
        thumb_format: str = "webp",
        log_queries: int = 16,
        log_top_k: int = 8,
        overwrite: bool = False,
    ) -> None:
        super().__init__()
        if int(top_k) < 1 or int(per_page) < 1 or int(log_queries) < 0 or int(log_top_k) < 1 or int(bins) < 0:
            raise ValueError("RetrievalReport: top_k, per_page and log_top_k must be >= 1, log_queries and bins >= 0")
        self.folder = folder
        self.every_validation = every_validation
        self.queries = queries
        self.per_page = int(per_page)
        self.top_k = int(top_k)
        self.bins = int(bins)
        self.thumb_size = int(thumb_size)
        self.thumb_format = thumb_format
        self.log_queries = int(log_queries)
        self.log_top_k = int(log_top_k)
        self.overwrite = bool(overwrite)
        #: the last report written (rank 0; None on the other ranks), and its results (every rank: the whole set)
        self.report: Report | None = None
        self.results: RetrievalResults | None = None

    # ------------------------------------------------------------------------------------------- hooks
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        """Refuse a test report's folder that is not new, empty or a report before the test runs: rank 0 checks,
        every process raises (the same error), so no process is left waiting in a collective."""
        if stage != "test":
            return
        problem = None
        if trainer.is_global_zero:
            try:
                check_report_folder(self.resolve_folder(trainer, "test"), self.overwrite, option="overwrite=True")
            except ReportFolderError as error:
                problem = str(error)
        problem = trainer.strategy.broadcast(problem, src=0)
        if problem is not None:
            raise ReportFolderError(f"RetrievalReport: {problem}")

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._build(trainer, getattr(pl_module, "test_metrics", None), "test", self._dataset(trainer.test_dataloaders))

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.every_validation and not trainer.sanity_checking:
            self._build(trainer, getattr(pl_module, "val_metrics", None), f"val-epoch={trainer.current_epoch}",
                        self._dataset(trainer.val_dataloaders))

    # ------------------------------------------------------------------------------------------- work
    @staticmethod
    def _dataset(loaders: Any) -> Any:
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0] if len(loaders) == 1 else None
        return getattr(loaders, "dataset", None)

    def resolve_folder(self, trainer: pl.Trainer, stage: str) -> Path:
        """The report folder of ``stage`` (see the class docstring); call it on every process (``log_dir``)."""
        if self.folder is not None:
            return Path(self.folder.replace("{stage}", stage))
        base = Path(trainer.log_dir or trainer.default_root_dir)
        logger = trainer.logger
        if isinstance(logger, WandbLogger):
            return Path(logger.save_dir or base) / "report" / str(logger.version) / stage
        return base / "report" / stage

    def _build(self, trainer: pl.Trainer, metric: Any, stage: str, dataset: Any) -> None:
        if not isinstance(metric, RetrievalMetrics):
            rank_zero_warn(f"RetrievalReport: the module has no RetrievalMetrics for {stage} (DMLModule's "
                           "test_metrics/val_metrics); no report")
            return
        folder = self.resolve_folder(trainer, stage)
        distributed = get_world_size() > 1
        with metric.sync_context(should_sync=distributed):
            # the states the metric gathered, as its compute() reads them (our own class: padding dropped)
            data = metric._gathered()
        indices = data["indices"]
        order = torch.arange(data["labels"].shape[0]) if indices is None else indices.detach().cpu()
        paths = getattr(dataset, "paths", None)
        names = getattr(trainer.datamodule, "class_names", None) if trainer.datamodule is not None else None
        results = RetrievalResults.compute(
            data["embeddings"], data["labels"], top_k=self.top_k, indices=indices, query_mask=data["query_mask"],
            gallery_mask=data["gallery_mask"], sequence=data["sequence"], category=data["category"],
            paths=None if paths is None else [str(paths[int(i)]) for i in order.tolist()],
            class_names=list(names) if names else None, metric=metric.metric, pair_histogram_bins=self.bins,
            distributed=distributed, process_group=metric.process_group,
        )
        self.results = results
        # the run's name on every process: trainer.log_dir broadcasts under DDP
        run = Path(trainer.log_dir or trainer.default_root_dir).resolve().name
        if not trainer.is_global_zero:
            return
        images = image_source(dataset=dataset) if dataset is not None else None
        self.report = write_report(
            results, folder, images=images, queries=self.queries, per_page=self.per_page,
            embeddings=data["embeddings"], embedding_indices=indices, thumb_size=self.thumb_size,
            thumb_format=self.thumb_format, title=f"{run}: retrieval report ({stage})", source={"stage": stage},
            overwrite=self.overwrite,
        )
        rank_zero_info(f"RetrievalReport: {self.report.index}")
        if self.log_queries:
            self._log(trainer, results, images, stage)

    def _log(self, trainer: pl.Trainer, results: RetrievalResults, images: Any, stage: str) -> None:
        rows = results.worst(self.log_queries).tolist()
        k = min(self.log_top_k, results.neighbors.shape[1])
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                self._log_wandb(logger, results, images, rows, k, stage, trainer.global_step)
            elif isinstance(logger, TensorBoardLogger):
                grid = results_grid(results, rows, images, top_k=k)
                logger.experiment.add_image(f"{stage}/worst_queries", grid, trainer.global_step, dataformats="HWC")

    @staticmethod
    def _log_wandb(logger: WandbLogger, results: RetrievalResults, images: Any, rows: list[int], k: int, stage: str,
                   step: int) -> None:
        import wandb

        from lightning_dml.report.grid import tile_image

        columns = ["query", "label", "top_k", "flags", "scores", "neighbor_labels", "ap", "r", "first_relevant_rank"]
        data = []
        for row in rows:
            q = int(results.query[row])
            nb = results.neighbors[row, :k]
            strip = results_grid(results, [row], images, top_k=k)
            labels = [label_text(results, int(np.searchsorted(results.index, i))) if i >= 0 else ""
                      for i in nb.tolist()]
            query_label = label_text(results, int(np.searchsorted(results.index, q)))
            ap = float(results.average_precision[row])
            data.append([
                wandb.Image(tile_image(images, q, 96), caption=f"item {q}"), query_label,
                wandb.Image(strip, caption="query, then its top-k (green: relevant, red: irrelevant)"),
                "".join("+" if f else "-" for f in results.relevant[row, :k]),
                " ".join(f"{s:.4f}" for s in results.scores[row, :k].tolist()), " | ".join(labels),
                None if ap != ap else ap, int(results.num_relevant[row]), int(results.first_relevant_rank[row]),
            ])
        logger.log_table(f"{stage}/worst_queries", columns=columns, data=data, step=step)
        per_class = results.per_class()
        logger.log_table(
            f"{stage}/per_class", columns=["class", "name", "queries", "items", "recall@1", "map@r"],
            data=[[c["class"], c["name"], c["queries"], c["items"], c["recall@1"], c["map@r"]] for c in per_class],
            step=step,
        )
