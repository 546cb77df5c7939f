"""``ValidationSummary``: the last validation metrics as a table at the end of ``fit``."""

from __future__ import annotations

import pytorch_lightning as pl

from lightning_dml.callbacks.retrieval import RetrievalComparison, format_table

__all__ = ["ValidationSummary"]


class ValidationSummary(pl.Callback):
    """Print the metrics of the last validation (``val/recall@1``, ``val/map@r``, ...) when ``fit`` ends.

    Lightning prints such a table after ``validate`` and ``test`` but not after ``fit``; with the logger off or W&B
    offline the terminal would show no figure at all. The table has one row per metric, values in percent, and
    is printed by rank 0 only (the metrics are already global: every process holds the same values). Nothing is
    printed when no validation ran, or when a :class:`~lightning_dml.callbacks.RetrievalComparison` prints its
    own table at the end of the same fit (the demo shows one table). The ``lightning-dml`` CLI adds one to every
    run.

    Args:
        prefix: the logged metric prefix to show.
    """

    def __init__(self, prefix: str = "val/") -> None:
        super().__init__()
        self.prefix = prefix
        self.table: str | None = None

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.table = None
        if any(isinstance(cb, RetrievalComparison) for cb in trainer.callbacks):
            return
        values = {
            k[len(self.prefix) :]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(self.prefix)
        }
        if not values:
            return
        self.table = format_table({name: {"value": value} for name, value in values.items()}, columns=("value",))
        if trainer.is_global_zero:
            print(
                f"\nLast validation (epoch {trainer.current_epoch}, step {trainer.global_step}), %:\n{self.table}\n",
                flush=True,
            )
