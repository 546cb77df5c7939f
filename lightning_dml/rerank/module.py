"""Training a pairwise re-ranker with ``lightning-dml fit``: binary cross-entropy on mined pairs.

STIR (Shabanov et al. 2023) trains its siamese transformer as a binary classifier of (query, candidate) pairs;
the paper states the loss in words, without a numbered equation, so this follows the authors' code in OML
(``oml/lightning/pipelines/train_postprocessor.py``: ``torch.nn.BCEWithLogitsLoss()`` on the model's output with
the target ``is_negative``). With the logit ``z`` of a pair being the *same* class (this library's sign
convention, :mod:`lightning_dml.rerank.models`) and its target ``y`` in {0, 1}:

    ``loss = mean over pairs of  -[ w y log sigmoid(z) + (1 - y) log(1 - sigmoid(z)) ]``

(:func:`pair_bce`; ``w`` = ``pos_weight``, 1 in OML; a value above 1 weighs the positives up when the mined lists
hold few of them). OML's target "the pair is negative" on the logit of a negative pair is the same loss with both
signs flipped. OML mines its pairs inside each training batch (``PairsMiner`` on the batch's precomputed
embeddings); here they are each training query's top-n lists over the whole training split
(:mod:`lightning_dml.rerank.data`), the lists the re-ranker re-scores at search time.

:class:`PairwiseRerankerModule` trains the re-ranker on :class:`~lightning_dml.rerank.data.PairwiseRerankDataModule`
batches and, when ``output`` is given, writes the re-ranker folder (:func:`~lightning_dml.rerank.io.save_reranker`,
with the base checkpoint's sha256, the embedding width and the base model's preprocessing) when training ends.

**Model selection on held-out classes.** When the data module holds out classes (``data.val_classes``), the module
measures Recall@1 of the held-out classes' re-ranked top-n lists (:func:`~lightning_dml.rerank.data.recall_at_1`)
before the first step and after every epoch, logs it (``val/rerank_recall@1``) and, when training ends, keeps (and
saves) the weights of the best of these measurements, the earliest on ties. For a residual re-ranker
(:mod:`lightning_dml.rerank.models`) the measurement before the first step is the base ranking's, so the saved
re-ranker is the base ranking unless training improved the held-out classes' lists (early stopping by a validation
split; the best weights are kept in memory, so a resumed fit selects among its own epochs only).
"""

from __future__ import annotations

import copy
import os
from typing import Any

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_dml.errors import UserInputError
from lightning_dml.rerank.models import PairwiseReranker

__all__ = ["PairwiseRerankerModule", "pair_bce"]


def pair_bce(logits: Tensor, target: Tensor, pos_weight: float = 1.0) -> Tensor:
    """The binary cross-entropy of pair logits (module docstring), computed in float32 from the logits
    (``F.binary_cross_entropy_with_logits``: no overflow for large ``|z|``)."""
    weight = torch.tensor(float(pos_weight), device=logits.device)
    return F.binary_cross_entropy_with_logits(logits.float(), target.float(), pos_weight=weight)


class PairwiseRerankerModule(pl.LightningModule):
    """A :class:`~lightning_dml.rerank.models.PairwiseReranker` trained with :func:`pair_bce`.

    Args:
        reranker: the model (``class_path: lightning_dml.rerank.ConcatSiamese`` or ``FeatureDistanceSiamese``).
        lr: AdamW learning rate (OML's STIR config: AdamW).
        weight_decay: AdamW weight decay.
        pos_weight: weight of the positive pairs in the loss (1: the paper's plain BCE).
        output: the re-ranker folder written when training ends (``None``: none; the checkpoints still hold the
            weights).
    """

    def __init__(self, reranker: PairwiseReranker, lr: float = 1e-4, weight_decay: float = 0.05,
                 pos_weight: float = 1.0, output: str | None = None) -> None:
        super().__init__()
        if not isinstance(reranker, PairwiseReranker):
            raise UserInputError(f"model.reranker must be a lightning_dml.rerank re-ranker, got {type(reranker).__name__}")
        if lr <= 0 or weight_decay < 0 or pos_weight <= 0:
            raise UserInputError(f"need lr > 0, weight_decay >= 0 and pos_weight > 0; got {lr}, {weight_decay}, "
                                 f"{pos_weight}")
        self.save_hyperparameters(ignore=["reranker"])
        self.reranker = reranker
        self.lr, self.weight_decay, self.pos_weight = float(lr), float(weight_decay), float(pos_weight)
        self.output = None if output is None else os.fspath(output)
        #: the best held-out measurement and its weights (model selection, module docstring); set in training
        self.best: dict[str, Any] | None = None

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        return self.reranker(x1, x2)

    def on_fit_start(self) -> None:
        datamodule = getattr(self.trainer, "datamodule", None)
        inputs = getattr(datamodule, "inputs", None)
        if inputs is not None and inputs != self.reranker.inputs:
            raise UserInputError(f"data.inputs is {inputs!r} but the {self.reranker.kind} re-ranker takes "
                                 f"{self.reranker.inputs!r}: set data.init_args.inputs: {self.reranker.inputs}")

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        x1, x2, target, base = batch
        logits = self.reranker.pair_logits(x1, x2, base)
        loss = pair_bce(logits, target, self.pos_weight)
        with torch.no_grad():
            accuracy = ((logits > 0).float() == target).float().mean()
        self.log("train/loss", loss, prog_bar=True, batch_size=target.numel())
        self.log("train/pair_accuracy", accuracy, batch_size=target.numel())
        return loss

    @torch.no_grad()
    def validation_recall(self) -> float | None:
        """Recall@1 of the data module's held-out classes' lists re-ranked by the re-ranker in eval mode (None: no
        validation split)."""
        from torch.utils.data import DataLoader

        from lightning_dml.rerank.data import recall_at_1

        datamodule = getattr(self.trainer, "datamodule", None)
        val_set = getattr(datamodule, "val_set", None)
        if val_set is None or len(val_set) == 0:
            return None
        was_training = self.reranker.training
        self.reranker.eval()
        logits = []
        loader = DataLoader(val_set, batch_size=max(256, int(getattr(datamodule, "batch_size", 256))), shuffle=False,
                            num_workers=0)
        with torch.autocast(device_type=self.device.type, enabled=False):
            for x1, x2, _, base in loader:
                logits.append(self.reranker.pair_logits(x1.to(self.device).float(), x2.to(self.device).float(),
                                                        base.to(self.device)).float().cpu())
        self.reranker.train(was_training)
        return recall_at_1(torch.cat(logits), val_set.pairs)

    def _select(self, epoch: int) -> None:
        value = self.validation_recall()
        if value is None:
            return
        self.log("val/rerank_recall@1", value, batch_size=1)
        if self.best is None or value > self.best["recall@1"]:
            self.best = {"recall@1": value, "epoch": epoch, "state": copy.deepcopy(self.reranker.state_dict())}
        if self.best.get("before") is None:
            self.best["before"] = value

    def on_train_start(self) -> None:
        self.best = None
        self._select(0)  # the untrained re-ranker (a residual one: the base ranking)

    def on_train_epoch_end(self) -> None:
        self._select(int(self.current_epoch) + 1)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.reranker.parameters(), lr=self.lr, weight_decay=self.weight_decay)

    def on_train_end(self) -> None:
        best = getattr(self, "best", None)
        if best is not None:
            self.reranker.load_state_dict(best["state"])
        if self.output is None or not self.trainer.is_global_zero:
            return
        from lightning_dml.rerank.io import save_reranker

        datamodule = getattr(self.trainer, "datamodule", None)
        record = getattr(datamodule, "base_record", None) or {}
        spec = getattr(datamodule, "input_spec", None) if self.reranker.inputs == "images" else None
        pairs = getattr(datamodule, "pairs", None)
        extra = {"base_checkpoint": record.get("path"), "top_n": getattr(datamodule, "top_n", None),
                 "metric": getattr(datamodule, "metric", None), "pairs": None if pairs is None else len(pairs),
                 "positive_pairs": None if pairs is None else int(pairs.target.sum()),
                 "epochs": int(self.current_epoch), "steps": int(self.global_step)}
        if best is not None:
            extra["validation"] = {"val_classes": getattr(datamodule, "val_classes", None),
                                   "val_pairs": len(datamodule.val_pairs), "recall@1_before_training": best["before"],
                                   "recall@1": best["recall@1"], "kept_epoch": best["epoch"]}
        was_training = self.reranker.training
        save_reranker(self.reranker.eval(), self.output, base_checkpoint_sha256=record.get("sha256"),
                      embedding_dim=getattr(datamodule, "embedding_dim", None), input_spec=spec, extra=extra)
        self.reranker.train(was_training)
        print(f"lightning-dml: wrote the re-ranker folder {self.output}", flush=True)
