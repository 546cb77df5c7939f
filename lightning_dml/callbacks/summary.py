"""``ValidationSummary``: the last validation metrics as a table at the end of ``fit``."""

from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.trainer.states import TrainerFn

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

    A fit can end after training steps that no validation saw (``max_steps`` or ``max_time`` between two
    validations): :meth:`is_stale` says so, from :attr:`validated_step`. The ``lightning-dml`` CLI then validates
    once more after ``fit`` (``--validate_at_end``, on by default) and sets :attr:`final_validation`, so that the
    table is printed after that validation (:meth:`print_table`) instead of at the end of ``fit``.

    Args:
        prefix: the logged metric prefix to show.
    """

    def __init__(self, prefix: str = "val/") -> None:
        super().__init__()
        self.prefix = prefix
        self.table: str | None = None
        #: ``trainer.global_step`` when the last validation of the current ``fit`` ended (``None``: none yet)
        self.validated_step: int | None = None
        #: set by a caller that validates once more after a stale fit (the CLI): the table waits for it
        self.final_validation = False

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.validated_step = None
        self.table = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING:
            self.validated_step = trainer.global_step

    def is_stale(self, trainer: pl.Trainer) -> bool:
        """Whether the fit that just ended trained steps after its last validation (or validated never), while it
        has validation (a validation loader, ``limit_val_batches > 0``). ``False`` when a
        :class:`~lightning_dml.callbacks.RetrievalComparison` ends the fit with its own table."""
        if any(isinstance(cb, RetrievalComparison) for cb in trainer.callbacks):
            return False
        return bool(trainer.enable_validation) and self.validated_step != trainer.global_step

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.table = None
        if self.final_validation and self.is_stale(trainer):
            return  # printed after the final validation
        self.print_table(trainer)

    def print_table(self, trainer: pl.Trainer) -> str | None:
        """Print (rank 0) and return the table of the ``prefix`` metrics in ``trainer.callback_metrics``."""
        self.table = None
        if any(isinstance(cb, RetrievalComparison) for cb in trainer.callbacks):
            return None
        values = {
            k[len(self.prefix) :]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(self.prefix)
        }
        if not values:
            return None
        self.table = format_table({name: {"value": value} for name, value in values.items()}, columns=("value",))
        if trainer.is_global_zero:
            if self.validated_step is None or self.validated_step == trainer.global_step:
                when = f"epoch {trainer.current_epoch}, step {trainer.global_step}"
            else:  # a stale table (no final validation): say which step it is of
                when = f"step {self.validated_step}; fit ended at step {trainer.global_step}, not validated since"
            print(f"\nLast validation ({when}), %:\n{self.table}\n", flush=True)
        return self.table
