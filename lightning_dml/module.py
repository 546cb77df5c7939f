"""``DMLModule``: backbone + embedding head + pair loss, trained with P x K batches, evaluated by retrieval."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn

from lightning_dml.losses import build_loss
from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.models.heads import LinearEmbedding


def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-4)


class DMLModule(pl.LightningModule):
    """A deep-metric-learning model: ``embedding = head(backbone(image))``, trained with a pair loss.

    ``forward`` returns *raw* embeddings; the loss and the retrieval metrics L2-normalise them where their paper
    does (SPEC 9.2). Validation and test compute :class:`~lightning_dml.metrics.RetrievalMetrics` over the whole
    evaluated split and log them as ``val/recall@1``, ``test/map@r``, ...

    Args:
        backbone: a module mapping images to pooled features, exposing ``out_features``.
        loss: a pair loss (``class_path``/``init_args`` in configs) or its registry name (``"multi_similarity"``).
        embedding_dim: width of the embedding.
        head_norm: normalisation after the embedding layer: ``"none"``, ``"batch"`` or ``"layer"``.
        head_lr_multiplier: the head's learning rate is the optimizer's learning rate times this (10 in the MS,
            GPW and RLL papers: new layers learn faster than the pretrained backbone).
        optimizer: optimizer factory called with the parameter groups (Adam, lr 1e-4 by default).
        lr_scheduler: optional scheduler factory called with the optimizer; stepped every epoch, or every step
            when ``scheduler_interval="step"`` (iteration-based schedules, as in the MS code).
        scheduler_interval: ``"epoch"`` or ``"step"``.
        recall_at: the K of the logged Recall@K.
        clustering: also compute NMI and F1 of a k-means clustering at evaluation.
        gather_distributed: under DDP, score each process's batch against the embeddings of all processes
            (autograd-aware all-gather), so every anchor sees the negatives of the global batch.
    """

    def __init__(
        self,
        backbone: nn.Module,
        loss: nn.Module | str = "multi_similarity",
        embedding_dim: int = 512,
        head_norm: str = "none",
        head_lr_multiplier: float = 1.0,
        optimizer: OptimizerCallable = _default_optimizer,
        lr_scheduler: LRSchedulerCallable | None = None,
        scheduler_interval: str = "epoch",
        recall_at: Sequence[int] = (1, 2, 4, 8),
        clustering: bool = True,
        gather_distributed: bool = False,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone", "loss", "optimizer", "lr_scheduler"])
        if not hasattr(backbone, "out_features"):
            raise ValueError(f"backbone {type(backbone).__name__} must expose `out_features` (its feature width)")
        if head_lr_multiplier <= 0:
            raise ValueError(f"head_lr_multiplier must be positive, got {head_lr_multiplier}")
        if scheduler_interval not in ("epoch", "step"):
            raise ValueError(f"scheduler_interval must be 'epoch' or 'step', got {scheduler_interval!r}")
        self.backbone = backbone
        self.head = LinearEmbedding(int(backbone.out_features), embedding_dim, head_norm)
        self.loss = build_loss(loss) if isinstance(loss, str) else loss
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.scheduler_interval = scheduler_interval
        self.head_lr_multiplier = head_lr_multiplier
        self.gather_distributed = gather_distributed
        metric_args = {"recall_at": tuple(recall_at), "clustering": clustering}
        self.val_metrics = RetrievalMetrics(**metric_args)
        self.test_metrics = RetrievalMetrics(**metric_args)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.backbone(images))

    # ------------------------------------------------------------------ training
    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch[0], batch[1]
        embeddings = self(images)
        if self.gather_distributed and self.trainer.world_size > 1:
            from lightning_dml.losses.distributed import gather_from_other_ranks

            ref_embeddings, ref_labels = gather_from_other_ranks(embeddings, labels)
            loss = self.loss(embeddings, labels, ref_embeddings=ref_embeddings, ref_labels=ref_labels)
        else:
            loss = self.loss(embeddings, labels)
        self.log("train/loss", loss, prog_bar=True, batch_size=labels.shape[0])
        return loss

    # ------------------------------------------------------------------ evaluation
    def _evaluation_step(self, metric: RetrievalMetrics, batch: Sequence[torch.Tensor]) -> None:
        images, labels = batch[0], batch[1]
        indices = batch[2] if len(batch) > 2 else None
        metric.update(self(images), labels, indices=indices)

    def _log_metrics(self, metric: RetrievalMetrics, prefix: str) -> dict[str, float]:
        values = metric.compute()
        metric.reset()
        self.log_dict({f"{prefix}/{k}": v for k, v in values.items()}, sync_dist=False, rank_zero_only=False)
        return values

    def validation_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        self._evaluation_step(self.val_metrics, batch)

    def on_validation_epoch_end(self) -> None:
        self._log_metrics(self.val_metrics, "val")

    def test_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> None:
        self._evaluation_step(self.test_metrics, batch)

    def on_test_epoch_end(self) -> None:
        self._log_metrics(self.test_metrics, "test")

    def predict_step(self, batch: Sequence[torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> dict:
        out = {"embeddings": self(batch[0]), "labels": batch[1]}
        if len(batch) > 2:
            out["indices"] = batch[2]
        return out

    # ------------------------------------------------------------------ optimisation
    def parameter_groups(self) -> list[dict[str, Any]]:
        """Backbone and head parameters as separate groups (the head's lr is scaled in configure_optimizers)."""
        head_params = list(self.head.parameters())
        loss_params = [p for p in self.loss.parameters() if p.requires_grad]
        groups = [{"params": list(self.backbone.parameters()), "name": "backbone"}]
        groups.append({"params": head_params + loss_params, "name": "head"})
        return groups

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameter_groups())
        for group in optimizer.param_groups:
            if group.get("name") == "head":
                group["lr"] = group["lr"] * self.head_lr_multiplier
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler_interval}}
