"""``PeriodicCheckpoint``: the ``last.ckpt`` a preempted run resumes from."""

from __future__ import annotations

from weakref import proxy

import pytorch_lightning as pl
from pytorch_lightning.callbacks import ModelCheckpoint

__all__ = ["PeriodicCheckpoint"]


class PeriodicCheckpoint(ModelCheckpoint):
    """``last.ckpt`` every ``every_n_train_steps`` training steps and at the end of every training epoch.

    Preemptible cluster jobs lose at most ``every_n_train_steps`` steps: the checkpoint holds the model,
    optimizer, scheduler, loop progress and the training loader's position in its epoch (see
    :class:`~lightning_dml.data.resumable.ResumableDataLoader`), so ``--ckpt_path last`` continues the run as
    if it had never stopped. Only ``last.ckpt`` is kept (each save replaces the previous one). The
    ``lightning-dml`` CLI adds one as ``--periodic_checkpoint.*``.

    The step saves are ``ModelCheckpoint``'s own (``save_last=True, save_top_k=0, every_n_train_steps=n``). The
    epoch-end save (after the epoch's validation, so the checkpoint holds its results) goes through the public
    ``Trainer.save_checkpoint``: ``ModelCheckpoint`` cannot combine a step and an epoch trigger.

    Args:
        dirpath: folder of the checkpoint (the CLI defaults it to ``<default_root_dir>/checkpoints``).
        every_n_train_steps: optimizer steps between two mid-epoch checkpoints.
    """

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int = 1000) -> None:
        if every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1, got {every_n_train_steps}")
        super().__init__(dirpath=dirpath, save_last=True, save_top_k=0, every_n_train_steps=every_n_train_steps)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Also save ``last.ckpt`` at every epoch end, whatever the step count (all processes take part)."""
        if trainer.fast_dev_run or trainer.sanity_checking:
            return
        path = self.format_checkpoint_name({}, self.CHECKPOINT_NAME_LAST)
        trainer.save_checkpoint(path, weights_only=self.save_weights_only)
        self.last_model_path = path
        for logger in trainer.loggers:  # as ModelCheckpoint does after each save (e.g. W&B's log_model)
            logger.after_save_checkpoint(proxy(self))
