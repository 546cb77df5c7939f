"""Retrieval callbacks: the before/after comparison table that ``make demo`` prints and the retrieval grid image."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor

from lightning_dml.callbacks.embedding import embed_loader
from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.metrics_format import format_metric

__all__ = ["RetrievalComparison", "RetrievalGridLogger", "evaluate_embeddings", "format_table"]

_COLUMNS = ("recall@1", "recall@2", "recall@4", "recall@8", "map@r", "nmi")


def evaluate_embeddings(
    embed: torch.nn.Module | Callable[[Tensor], Tensor],
    dataloader: Iterable[Any],
    device: torch.device,
    clustering: bool = True,
) -> dict[str, float]:
    """Retrieval metrics of ``embed(images)`` over every batch of ``dataloader`` (a module is run in eval mode
    and its mode restored, see :func:`~lightning_dml.callbacks.embedding.embed_loader`).

    Batches are evaluation batches of a data module (unpacked by
    :meth:`~lightning_dml.metrics.RetrievalMetrics.update_from_batch`), so query/gallery benchmarks are evaluated
    query against gallery. Under DDP every process passes its shard and the metric gathers them (call it on every
    process).
    """
    embeddings, rest = embed_loader(embed, dataloader, device)
    metric = RetrievalMetrics(recall_at=(1, 2, 4, 8), clustering=clustering).to(device)
    if rest:
        metric.update_from_batch(embeddings, [embeddings, *(t.to(device) for t in rest)])
    return metric.compute()


def format_table(rows: dict[str, dict[str, float]], columns: tuple[str, ...] = _COLUMNS) -> str:
    """A fixed-width text table: one row per evaluated model, metrics as every command prints them
    (:func:`lightning_dml.metrics_format.format_metric`; ``-`` where a row lacks one)."""
    name_width = max(len(name) for name in rows) + 2
    header = "".join(f"{c:>10}" for c in columns)
    lines = [f"{'':<{name_width}}{header}"]
    for name, values in rows.items():
        cells = (format_metric(c, values[c], 10) if c in values else f"{'-':>10}" for c in columns)
        lines.append(f"{name:<{name_width}}" + "".join(cells))
    return "\n".join(lines)


class RetrievalComparison(pl.Callback):
    """Evaluate the test split three ways and print a table when training ends.

    Rows, in order: ``raw pixels`` (flattened input images as embeddings), ``untrained network`` (the model
    before its first step) and ``trained network`` (the model when training ends). Each row has Recall@1/2/4/8,
    MAP@R and NMI on the test classes, which the training classes do not include. The table is also written to
    ``<log_dir>/retrieval_comparison.txt`` and the rows are logged as ``comparison/<row>/<metric>``.

    Resumed runs: the first two rows are evaluated when a fit starts from scratch and saved in the callback's
    state in every checkpoint, so ``fit(ckpt_path=...)`` shows the figures of the run's real untrained network.
    A checkpoint without them (written without this callback) gives a table without the ``untrained network``
    row, and a note says so; the restored model is never reported as untrained.

    Under DDP every process evaluates its shard of the test split (the metric gathers them) and rank 0 prints
    and writes the table.

    Args:
        clustering: compute NMI (k-means); ``False`` leaves its column empty (``-``) and is faster.
    """

    def __init__(self, clustering: bool = True) -> None:
        super().__init__()
        self.clustering = clustering
        self.rows: dict[str, dict[str, float]] = {}
        self.note: str | None = None
        self._restored: dict[str, dict[str, float]] = {}

    def _evaluate(self, trainer: pl.Trainer, embed: torch.nn.Module | Callable[[Tensor], Tensor]) -> dict[str, float]:
        loader = trainer.datamodule.test_dataloader()
        return evaluate_embeddings(embed, loader, trainer.strategy.root_device, self.clustering)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.datamodule is None:
            raise ValueError("RetrievalComparison needs a LightningDataModule with a test_dataloader()")
        self.note = None
        if trainer.ckpt_path is None:  # a fresh start: the model has not been trained yet
            self.rows = {
                "raw pixels": self._evaluate(trainer, lambda images: images.flatten(1)),
                "untrained network": self._evaluate(trainer, pl_module),
            }
        elif "untrained network" in self._restored:  # resumed: the figures saved by the run's first fit
            self.rows = {name: dict(values) for name, values in self._restored.items()}
        else:
            self.rows = {"raw pixels": self._evaluate(trainer, lambda images: images.flatten(1))}
            self.note = (
                f"untrained network: not recorded in {trainer.ckpt_path} (the run resumed from it; the restored "
                "model is not untrained)"
            )

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # not on_fit_end: Lightning calls that after its strategy's teardown has moved the module to the CPU,
        # while the loader's batches still go to the root device (a CUDA fit failed here)
        self.rows["trained network"] = self._evaluate(trainer, pl_module)
        table = format_table(self.rows)
        log_dir = trainer.log_dir  # every process: a collective (broadcast from rank 0) under DDP
        if trainer.is_global_zero:
            note = f"{self.note}\n" if self.note else ""
            print(f"\nRetrieval on the test classes (%):\n{table}\n{note}", flush=True)
            if log_dir is not None:
                path = Path(log_dir) / "retrieval_comparison.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(table + "\n" + note)
        for logger in trainer.loggers:
            logger.log_metrics(
                {f"comparison/{row.replace(' ', '_')}/{k}": v for row, vals in self.rows.items() for k, v in vals.items()}
            )

    def state_dict(self) -> dict[str, Any]:
        """The rows measured before training (``raw pixels``, ``untrained network``), for resumed runs."""
        return {"rows": {name: dict(values) for name, values in self.rows.items() if name != "trained network"}}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._restored = {name: dict(values) for name, values in state_dict.get("rows", {}).items()}


class RetrievalGridLogger(pl.Callback):
    """Log a retrieval grid (:func:`~lightning_dml.visualize.retrieval_grid`) at the end of every validation.

    A fixed sample of ``sample_size`` items of the validation dataset (``seed``-ed choice, the same every epoch) is
    embedded on rank zero; ``num_queries`` of them (also fixed) are shown in rows with their ``top_k`` nearest
    neighbours within the sample, correct ones framed green, wrong ones red. The image goes to every logger with a
    ``log_image`` method (W&B: ``log_image(key=key, images=[grid])``), to TensorBoard's ``add_image``, and, when
    no logger took it, to ``<log_dir or default_root_dir>/retrievals/epoch=E-step=S.png``. ``last_grid`` holds the
    latest image (uint8 ``[H, W, 3]``). Not in ``configs/glyphs.yaml`` (keeps the demo fast); add it with
    ``--trainer.callbacks+=lightning_dml.callbacks.RetrievalGridLogger``.

    Args:
        num_queries: rows of the grid.
        top_k: neighbours per query.
        sample_size: items embedded (queries and their candidate neighbours).
        seed: seed of the sample and of the queries.
        key: the image's name in the loggers.
    """

    def __init__(
        self, num_queries: int = 8, top_k: int = 5, sample_size: int = 256, seed: int = 0, key: str = "val/retrievals"
    ) -> None:
        super().__init__()
        if num_queries < 1 or top_k < 1 or sample_size < max(num_queries, top_k + 1):
            raise ValueError(
                f"need num_queries >= 1, top_k >= 1 and sample_size >= max(num_queries, top_k + 1), got "
                f"{num_queries}, {top_k} and {sample_size}"
            )
        self.num_queries = num_queries
        self.top_k = top_k
        self.sample_size = sample_size
        self.seed = seed
        self.key = key
        self.last_grid: np.ndarray | None = None

    @staticmethod
    def _dataset(trainer: pl.Trainer) -> Any:
        datamodule = trainer.datamodule
        dataset = getattr(datamodule, "val_dataset", None) if datamodule is not None else None
        if dataset is None:
            loaders = trainer.val_dataloaders
            loader = loaders[0] if isinstance(loaders, (list, tuple)) and loaders else loaders
            dataset = getattr(loader, "dataset", None)
        if dataset is None:
            raise ValueError("RetrievalGridLogger needs a validation dataset (datamodule.val_dataset or a val loader)")
        return dataset

    def make_grid(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> np.ndarray:
        """Embed the fixed sample with ``pl_module`` and draw the grid."""
        from lightning_dml.visualize import retrieval_grid

        dataset = self._dataset(trainer)
        n = len(dataset)
        rng = np.random.default_rng(self.seed)
        chosen = np.sort(rng.choice(n, size=min(self.sample_size, n), replace=False))
        items = [dataset[int(i)] for i in chosen]
        items = [item for item in items if item is not None]  # corrupt images skipped by the dataset
        if len(items) < max(self.num_queries, self.top_k + 1):
            raise ValueError(f"RetrievalGridLogger: only {len(items)} readable items, too few for the grid")
        images = torch.stack([torch.as_tensor(item[0]) for item in items])
        labels = torch.as_tensor([int(item[1]) for item in items])
        batches = [images[i : i + 256] for i in range(0, len(images), 256)]
        embeddings, _ = embed_loader(pl_module, batches, pl_module.device)
        return retrieval_grid(images, labels, embeddings.cpu(), self.num_queries, self.top_k, seed=self.seed)

    def log_grid(self, trainer: pl.Trainer, grid: np.ndarray, folder: Path | None = None) -> None:
        """Send ``grid`` to the trainer's loggers, or save it as a PNG into ``folder/retrievals`` when none can take
        an image (``folder``: ``trainer.log_dir or default_root_dir`` when None)."""
        from pytorch_lightning.loggers import TensorBoardLogger

        logged = False
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):
                logger.log_image(key=self.key, images=[grid], step=trainer.global_step)
                logged = True
            elif isinstance(logger, TensorBoardLogger):
                logger.experiment.add_image(self.key, grid, trainer.global_step, dataformats="HWC")
                logged = True
        if not logged:
            from PIL import Image

            folder = Path(folder or trainer.log_dir or trainer.default_root_dir) / "retrievals"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(grid).save(folder / f"epoch={trainer.current_epoch}-step={trainer.global_step}.png")

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        # every process asks: trainer.log_dir is a collective (a broadcast from rank 0) under DDP
        folder = Path(trainer.log_dir or trainer.default_root_dir)
        if not trainer.is_global_zero:
            return
        self.last_grid = self.make_grid(trainer, pl_module)
        self.log_grid(trainer, self.last_grid, folder)
