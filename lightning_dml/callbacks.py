"""Callbacks: the before/after retrieval comparison that ``make demo`` prints."""

from __future__ import annotations

from pathlib import Path

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_info

from lightning_dml.metrics import RetrievalMetrics

_COLUMNS = ("recall@1", "recall@2", "recall@4", "recall@8", "map@r", "nmi")


@torch.no_grad()
def evaluate_embeddings(
    embed, dataloader: torch.utils.data.DataLoader, device: torch.device, clustering: bool = True
) -> dict[str, float]:
    """Retrieval metrics of ``embed(images)`` over every batch of ``dataloader`` (items ``(image, label, index)``)."""
    metric = RetrievalMetrics(recall_at=(1, 2, 4, 8), clustering=clustering).to(device)
    for batch in dataloader:
        images, labels = batch[0].to(device), batch[1].to(device)
        indices = batch[2].to(device) if len(batch) > 2 else None
        metric.update(embed(images), labels, indices=indices)
    return metric.compute()


def format_table(rows: dict[str, dict[str, float]], columns: tuple[str, ...] = _COLUMNS) -> str:
    """A fixed-width text table: one row per evaluated model, metrics in percent."""
    name_width = max(len(name) for name in rows) + 2
    header = "".join(f"{c:>10}" for c in columns)
    lines = [f"{'':<{name_width}}{header}"]
    for name, values in rows.items():
        lines.append(f"{name:<{name_width}}" + "".join(f"{100 * values[c]:>10.1f}" for c in columns))
    return "\n".join(lines)


class RetrievalComparison(pl.Callback):
    """Evaluate the test split three ways and print a table when training ends.

    Rows, in order: ``raw pixels`` (flattened input images as embeddings), ``untrained network`` (the model
    before its first step) and ``trained network`` (the model when ``fit`` ends). Each row has Recall@1/2/4/8,
    MAP@R and NMI on the test classes, which the training classes do not include. The table is also written to
    ``<log_dir>/retrieval_comparison.txt`` and the rows are logged as ``comparison/<row>/<metric>``.
    """

    def __init__(self, clustering: bool = True) -> None:
        super().__init__()
        self.clustering = clustering
        self.rows: dict[str, dict[str, float]] = {}

    def _evaluate(self, trainer: pl.Trainer, embed) -> dict[str, float]:
        loader = trainer.datamodule.test_dataloader()
        return evaluate_embeddings(embed, loader, trainer.strategy.root_device, self.clustering)

    def _evaluate_model(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, float]:
        was_training = pl_module.training
        pl_module.eval()
        try:
            return self._evaluate(trainer, pl_module)
        finally:
            pl_module.train(was_training)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.datamodule is None:
            raise ValueError("RetrievalComparison needs a LightningDataModule with a test_dataloader()")
        self.rows = {
            "raw pixels": self._evaluate(trainer, lambda images: images.flatten(1)),
            "untrained network": self._evaluate_model(trainer, pl_module),
        }

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.rows["trained network"] = self._evaluate_model(trainer, pl_module)
        table = format_table(self.rows)
        if trainer.is_global_zero:
            print(f"\nRetrieval on the test classes (%):\n{table}\n", flush=True)
            if trainer.log_dir is not None:
                path = Path(trainer.log_dir) / "retrieval_comparison.txt"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(table + "\n")
        for logger in trainer.loggers:
            logger.log_metrics(
                {f"comparison/{row.replace(' ', '_')}/{k}": v for row, vals in self.rows.items() for k, v in vals.items()}
            )
        rank_zero_info("RetrievalComparison: done")
