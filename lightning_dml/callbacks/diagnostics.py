"""Training diagnostics: histograms of the positive/negative pair similarities and the Recall@K curve."""

from __future__ import annotations

from pathlib import Path

import pytorch_lightning as pl
import torch

__all__ = ["PairSimilarityHistogram", "RecallCurve"]


class PairSimilarityHistogram(pl.Callback):
    """Histograms of the cosine similarities of positive and negative pairs in training batches.

    The papers reason about these two distributions (MS Fig. 1 and Sec. 3, RLL Sec. 3, the tuplet margin paper's
    slack margin): training should pull the positive histogram towards 1 and push the negative one below it, and
    how much they overlap is what the pair weighting fights. Every ``every_n_steps`` training steps the callback
    takes the batch embeddings the model has just computed (a forward hook: no extra forward pass), L2-normalises
    them and logs

    * ``train/sim_pos_mean``, ``train/sim_neg_mean`` and ``train/sim_overlap`` (fraction of negative pairs more
      similar than the median positive pair) as scalars;
    * the two histograms to W&B (``wandb.Histogram``) or TensorBoard (``add_histogram``) when those loggers are
      attached;
    * ``history``: a list of ``{"step", "edges", "positive", "negative"}`` (counts over ``bins`` bins of
      [-1, 1]; ``step`` = optimizer steps taken before the batch) for notebooks and tests.

    Args:
        every_n_steps: training steps between two histograms.
        bins: number of histogram bins over [-1, 1].
    """

    def __init__(self, every_n_steps: int = 50, bins: int = 50) -> None:
        super().__init__()
        if every_n_steps < 1 or bins < 2:
            raise ValueError(f"need every_n_steps >= 1 and bins >= 2, got {every_n_steps} and {bins}")
        self.every_n_steps = every_n_steps
        self.bins = bins
        self.history: list[dict] = []
        self._capture = False
        self._step = 0
        self._embeddings: torch.Tensor | None = None
        self._handle = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._handle is None:
            self._handle = pl_module.register_forward_hook(self._hook)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _hook(self, module, inputs, output) -> None:
        if self._capture and module.training and isinstance(output, torch.Tensor) and output.ndim == 2:
            self._embeddings = output.detach()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch, batch_idx: int) -> None:
        self._capture = trainer.global_step % self.every_n_steps == 0
        self._step = trainer.global_step  # optimizer steps taken before this batch's embeddings
        self._embeddings = None

    @staticmethod
    def pair_similarities(embeddings: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Cosine similarities of the positive pairs (i < j, same label) and negative pairs (i < j, different)."""
        normalized = torch.nn.functional.normalize(embeddings.float(), dim=1)
        sims = (normalized @ normalized.T).clamp(-1.0, 1.0)
        upper = torch.triu(torch.ones_like(sims, dtype=torch.bool), diagonal=1)
        same = labels[:, None] == labels[None, :]
        return sims[upper & same], sims[upper & ~same]

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs, batch, batch_idx: int) -> None:
        embeddings, self._embeddings, self._capture = self._embeddings, None, False
        if embeddings is None:
            return
        labels = batch[1].to(embeddings.device)
        positive, negative = self.pair_similarities(embeddings, labels)
        if positive.numel() == 0 or negative.numel() == 0:
            return
        edges = torch.linspace(-1.0, 1.0, self.bins + 1)
        pos_counts = torch.histc(positive.cpu(), self.bins, -1.0, 1.0)
        neg_counts = torch.histc(negative.cpu(), self.bins, -1.0, 1.0)
        step = self._step
        self.history.append({"step": step, "edges": edges, "positive": pos_counts, "negative": neg_counts})
        overlap = (negative > positive.median()).float().mean()
        pl_module.log_dict(
            {"train/sim_pos_mean": positive.mean(), "train/sim_neg_mean": negative.mean(), "train/sim_overlap": overlap},
            on_step=True,
            on_epoch=False,
            batch_size=labels.shape[0],
        )
        if trainer.is_global_zero:
            self._log_histograms(trainer, positive.cpu(), negative.cpu(), step)

    def _log_histograms(self, trainer: pl.Trainer, positive: torch.Tensor, negative: torch.Tensor, step: int) -> None:
        from pytorch_lightning.loggers import TensorBoardLogger, WandbLogger

        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                import wandb

                logger.experiment.log(
                    {
                        "train/sim_pos": wandb.Histogram(positive.numpy(), num_bins=self.bins),
                        "train/sim_neg": wandb.Histogram(negative.numpy(), num_bins=self.bins),
                        "trainer/global_step": step,
                    }
                )
            elif isinstance(logger, TensorBoardLogger):
                logger.experiment.add_histogram("train/sim_pos", positive, step)
                logger.experiment.add_histogram("train/sim_neg", negative, step)


class RecallCurve(pl.Callback):
    """Recall@K over epochs: one row per validation, written as ``recall_curve.csv`` and ``recall_curve.png``.

    Reads the ``val/recall@K`` values :class:`~lightning_dml.module.DMLModule` logs at each validation (the
    papers' convergence plots, e.g. MS Fig. 6). ``history`` holds ``{"epoch", "step", "recall@1", ...}`` rows; it
    is saved in checkpoints, so a resumed run keeps the curve of the epochs before the interruption.

    Args:
        dirpath: folder of the CSV and the plot; the trainer's ``log_dir`` when ``None``.
        prefix: the logged metric prefix to follow.
    """

    def __init__(self, dirpath: str | None = None, prefix: str = "val/recall@") -> None:
        super().__init__()
        self.dirpath = dirpath
        self.prefix = prefix
        self.history: list[dict[str, float]] = []

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        values = {
            f"recall@{k[len(self.prefix):]}": float(v)
            for k, v in trainer.callback_metrics.items()
            if k.startswith(self.prefix) and k[len(self.prefix):].isdigit()
        }
        if not values:
            return
        self.history.append({"epoch": trainer.current_epoch, "step": trainer.global_step, **values})
        # every process asks: trainer.log_dir is a collective (a broadcast from rank 0) under DDP
        folder = Path(self.dirpath) if self.dirpath else Path(trainer.log_dir or trainer.default_root_dir)
        if trainer.is_global_zero:
            self.write(folder)

    def _columns(self) -> list[str]:
        keys = {k for row in self.history for k in row if k not in ("epoch", "step")}
        return sorted(keys, key=lambda k: int(k.split("@")[1]))

    def write(self, folder: Path) -> None:
        """Write ``recall_curve.csv`` and ``recall_curve.png`` into ``folder``."""
        from matplotlib.figure import Figure  # no pyplot: the user's backend (e.g. a notebook's) is left alone

        folder.mkdir(parents=True, exist_ok=True)
        columns = self._columns()
        lines = [",".join(["epoch", "step", *columns])]
        for row in self.history:
            lines.append(",".join([str(row["epoch"]), str(row["step"]), *(f"{row.get(c, float('nan')):.6f}" for c in columns)]))
        (folder / "recall_curve.csv").write_text("\n".join(lines) + "\n")
        fig = Figure(figsize=(5, 3.5))
        ax = fig.subplots()
        epochs = [row["epoch"] + 1 for row in self.history]
        for c in columns:
            ax.plot(epochs, [100 * row.get(c, float("nan")) for row in self.history], marker="o", label=c)
        ax.set_xlabel("epoch")
        ax.set_ylabel("%")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(folder / "recall_curve.png", dpi=100)

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.history = list(state_dict.get("history", []))
