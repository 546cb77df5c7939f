"""Callbacks: the before/after retrieval comparison that ``make demo`` prints, checkpoints a preempted run resumes
from, what is logged during training (pair-similarity histograms, Recall@K over epochs, a retrieval grid image)
and the predictions file that ``lightning-dml predict`` writes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import BasePredictionWriter, ModelCheckpoint
from pytorch_lightning.utilities import rank_zero_info

from lightning_dml.data.base import split_eval_batch
from lightning_dml.metrics import RetrievalMetrics

_COLUMNS = ("recall@1", "recall@2", "recall@4", "recall@8", "map@r", "nmi")


@torch.no_grad()
def evaluate_embeddings(
    embed, dataloader: torch.utils.data.DataLoader, device: torch.device, clustering: bool = True
) -> dict[str, float]:
    """Retrieval metrics of ``embed(images)`` over every batch of ``dataloader``.

    Batches are evaluation batches of a data module (see :func:`~lightning_dml.data.base.split_eval_batch`), so
    query/gallery benchmarks are evaluated query against gallery.
    """
    metric = RetrievalMetrics(recall_at=(1, 2, 4, 8), clustering=clustering).to(device)
    for batch in dataloader:
        images, targets = split_eval_batch(batch)
        targets = {k: None if v is None else v.to(device) for k, v in targets.items()}
        metric.update(embed(images.to(device)), **targets)
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


class PeriodicCheckpoint(ModelCheckpoint):
    """``last.ckpt`` every ``every_n_train_steps`` training steps and at the end of every training epoch.

    Preemptible cluster jobs lose at most ``every_n_train_steps`` steps: the checkpoint holds the model,
    optimizer, scheduler, loop progress and the training loader's position in its epoch (see
    :class:`~lightning_dml.data.resumable.ResumableDataLoader`), so ``--ckpt_path last`` continues the run as
    if it had never stopped. Only ``last.ckpt`` is kept (each save replaces the previous one). The
    ``lightning-dml`` CLI adds one as ``--periodic_checkpoint.*``.

    Args:
        dirpath: folder of the checkpoint (the CLI defaults it to ``<default_root_dir>/checkpoints``).
        every_n_train_steps: optimizer steps between two mid-epoch checkpoints.
    """

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int = 1000) -> None:
        if every_n_train_steps < 1:
            raise ValueError(f"every_n_train_steps must be >= 1, got {every_n_train_steps}")
        super().__init__(dirpath=dirpath, save_last=True, save_top_k=0, every_n_train_steps=every_n_train_steps)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Also save at every epoch end (after the epoch's validation), whatever the step count."""
        if self._should_skip_saving_checkpoint(trainer):
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))


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
        if trainer.is_global_zero:
            self.write(Path(self.dirpath or trainer.log_dir or trainer.default_root_dir))

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


# ---------------------------------------------------------------------------------------------- predictions file
def _merge_predictions(outputs: Sequence[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Concatenate ``predict_step`` outputs (CPU) into one ``embeddings``/``labels``/``indices`` dict."""
    merged: dict[str, list[torch.Tensor]] = {"embeddings": [], "labels": [], "indices": []}
    for out in outputs:
        if "indices" not in out:
            raise ValueError(
                "PredictionWriter needs the dataset index of every item: predict_step must return 'indices' "
                "(DMLModule does when the batch is (image, label, index, ...), as every data module yields)"
            )
        for key in merged:
            merged[key].append(torch.as_tensor(out[key]).detach().cpu())
    if not merged["indices"]:
        empty = torch.empty(0, dtype=torch.long)
        return {"embeddings": torch.empty(0, 0), "labels": empty, "indices": empty}
    return {k: torch.cat(v) for k, v in merged.items()}


def _sorted_unique(merged: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The items sorted by index, each index once (the first occurrence)."""
    indices = merged["indices"].long()
    order = torch.sort(indices, stable=True).indices
    sorted_indices = indices[order]
    keep = torch.ones_like(sorted_indices, dtype=torch.bool)
    keep[1:] = sorted_indices[1:] != sorted_indices[:-1]
    order = order[keep]
    return {
        "embeddings": merged["embeddings"][order].float(),
        "labels": merged["labels"][order].long(),
        "indices": indices[order],
    }


class PredictionWriter(BasePredictionWriter):
    """Write everything ``predict`` computed into ONE file, loadable with :func:`load_predictions`.

    The file (``torch.save``) holds a dict:

    * ``embeddings``: float32 ``[N, D]`` raw embeddings (``DMLModule.forward``; L2-normalise for cosine search),
    * ``labels``: int64 ``[N]``, ``indices``: int64 ``[N]`` (position of the item in the predicted dataset; sorted,
      each once),
    * ``paths``: ``list[str]`` of the image file of each item when the predicted dataset has ``paths`` (the file
      data modules: CUB-200, Cars196, SOP, In-Shop, image folders and lists), else ``None`` (in-memory datasets such
      as Glyphs, whose ``labels`` index ``GlyphsDataModule.class_names``, one character per class).

    Under DDP every process sends its items to rank 0 (``all_gather_object``), which drops duplicate indices and
    writes the single file. ``lightning-dml predict`` adds one writing ``<log_dir>/predictions.pt``. Only one
    predict dataloader is supported.

    Args:
        output_path: the file; ``<trainer.log_dir or default_root_dir>/predictions.pt`` when ``None``.
    """

    def __init__(self, output_path: str | None = None) -> None:
        super().__init__(write_interval="epoch")
        self.output_path = output_path
        self.written_path: Path | None = None

    def resolve_path(self, trainer: pl.Trainer) -> Path:
        """Where the file goes for this trainer."""
        if self.output_path is not None:
            return Path(self.output_path)
        return Path(trainer.log_dir or trainer.default_root_dir) / "predictions.pt"

    @staticmethod
    def _dataset(trainer: pl.Trainer) -> Any:
        loaders = trainer.predict_dataloaders
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0] if len(loaders) == 1 else None
        return getattr(loaders, "dataset", None)

    def write_on_epoch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Sequence[Any], batch_indices: Sequence[Any]
    ) -> None:
        if predictions and isinstance(predictions[0], list):  # one list per dataloader
            if len(predictions) != 1:
                raise ValueError(f"PredictionWriter supports one predict dataloader, got {len(predictions)}")
            predictions = predictions[0]
        merged = _merge_predictions(predictions)  # an empty shard (more processes than items) still gathers
        if trainer.world_size > 1 and torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * trainer.world_size
            torch.distributed.all_gather_object(gathered, merged)
            parts = [p for p in gathered if p["indices"].numel() > 0]
            merged = {k: torch.cat([p[k] for p in parts]) for k in merged} if parts else merged
        if not trainer.is_global_zero:
            return
        result: dict[str, Any] = _sorted_unique(merged)
        dataset = self._dataset(trainer)
        paths = getattr(dataset, "paths", None)
        result["paths"] = None if paths is None else [str(paths[i]) for i in result["indices"].tolist()]
        path = self.resolve_path(trainer)
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(result, path)
        self.written_path = path
        rank_zero_info(f"PredictionWriter: {len(result['indices'])} embeddings written to {path}")


def load_predictions(path: str | Path) -> dict[str, Any]:
    """Load a :class:`PredictionWriter` file: ``{"embeddings", "labels", "indices", "paths"}`` (see there)."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"no predictions file at {path} (lightning-dml predict writes <log_dir>/predictions.pt)")
    data = torch.load(path, map_location="cpu", weights_only=True)
    missing = {"embeddings", "labels", "indices", "paths"} - set(data)
    if missing:
        raise ValueError(f"{path} is not a predictions file: missing {sorted(missing)}")
    return data


# ---------------------------------------------------------------------------------------------- retrieval grid
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

    @torch.no_grad()
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
        was_training = pl_module.training
        pl_module.eval()
        try:
            device = pl_module.device
            embeddings = torch.cat([pl_module(images[i : i + 256].to(device)).cpu() for i in range(0, len(images), 256)])
        finally:
            pl_module.train(was_training)
        return retrieval_grid(images, labels, embeddings, self.num_queries, self.top_k, seed=self.seed)

    def log_grid(self, trainer: pl.Trainer, grid: np.ndarray) -> None:
        """Send ``grid`` to the trainer's loggers, or save it as a PNG when none can take an image."""
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

            folder = Path(trainer.log_dir or trainer.default_root_dir) / "retrievals"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(grid).save(folder / f"epoch={trainer.current_epoch}-step={trainer.global_step}.png")

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or not trainer.is_global_zero:
            return
        self.last_grid = self.make_grid(trainer, pl_module)
        self.log_grid(trainer, self.last_grid)
