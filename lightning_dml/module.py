"""``DMLModule``: backbone + embedding head + pair loss, trained with P x K batches, evaluated by retrieval."""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import pytorch_lightning as pl
import torch
from pytorch_lightning.utilities import rank_zero_warn
from pytorch_lightning.cli import LRSchedulerCallable, OptimizerCallable
from pytorch_lightning.strategies import DDPStrategy, SingleDeviceStrategy
from pytorch_lightning.trainer.states import TrainerFn
from torch import nn

from lightning_dml.checkpoints import CheckpointMismatchError, checkpoint_record, hparams_disagreements
from lightning_dml.checks import check_fit_combination, check_gather_combination, check_training_batch
from lightning_dml.gradient_cache import batch_statistics_layers, check_chunk_size, chunked_embeddings
from lightning_dml.losses import build_loss
from lightning_dml.losses.distributed import gathered_loss
from lightning_dml.losses.partial_fc import add_sharded_state, check_sharded_fit, take_sharded_state
from lightning_dml.miners import Miner, MinedLoss, build_miner
from lightning_dml.metrics import RetrievalMetrics, progress_bars
from lightning_dml.models.adapters import adapter_frozen_parameters, drop_frozen_weights, restore_frozen_weights
from lightning_dml.models.backbones import check_levels
from lightning_dml.models.heads import LinearEmbedding, MultiLevelEmbedding
from lightning_dml.regularizers import RegularizationTerms

_FUSION = ("none", "concat", "per_level")

#: the evaluation metrics shown on the progress bar (all of them are logged)
PROGRESS_BAR_METRICS = ("recall@1", "map@r")


def _has_parameters(loss: nn.Module) -> bool:
    """Whether a loss has (or will have, once its sizes are known) learnable parameters."""
    return bool(getattr(loss, "has_parameters", False)) or any(True for _ in loss.parameters())


def _default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-4)


def _build_miner(miner: nn.Module | str | None, loss: nn.Module) -> nn.Module | None:
    """The ``miner`` argument as a miner (a registry name is built); ``ValueError`` naming the loss when it does not
    accept ``indices_tuple``."""
    if miner is None:
        return None
    miner = build_miner(miner) if isinstance(miner, str) else miner
    if not isinstance(miner, Miner):
        raise ValueError(f"miner must be a lightning_dml.miners.Miner or a registry name, got {type(miner).__name__}")
    if not getattr(loss, "supports_indices_tuple", False):
        reason = getattr(loss, "indices_tuple_reason", None) or "its definition does not score a chosen set of pairs"
        raise ValueError(f"miner {type(miner).__name__} needs a loss that takes indices_tuple; {type(loss).__name__} "
                         f"does not: {reason}")
    return miner


def _needs_sizes(loss: nn.Module) -> bool:
    """Whether ``DMLModule`` fills in sizes of this loss at fit start (``num_classes`` and/or the embedding width)."""
    return bool(getattr(loss, "needs_num_classes", False) or getattr(loss, "needs_embedding_dim", False))


#: hyper-parameters derived from the data, not settings (``None``: fill in): compared with a checkpoint's by the
#: losses themselves
DERIVED_HPARAMS = ("loss_sizes",)

#: hyper-parameters that change how a step is computed, not what it computes: a run may resume with other values
EXECUTION_HPARAMS = ("embedding_chunk_size",)


def _describe_backbone(backbone: nn.Module) -> str:
    extra = backbone.extra_repr()
    return f"{type(backbone).__name__}({extra})" if extra else type(backbone).__name__


def _describe_architecture(arch: dict[str, Any]) -> str:
    text = f"backbone {arch.get('backbone', 'not recorded')}"
    if arch.get("features") is not None:
        text += f" ({arch['features']} features)"
    text += f", embedding width {arch.get('embedding_width', 'unknown')}"
    if arch.get("fusion", "none") != "none":
        text += f", fusion {arch['fusion']!r}"
    return text


def _shape_examples(items: list[tuple[str, tuple, tuple]], limit: int = 2) -> str:
    shown = ", ".join(
        f"{key}: {list(theirs)} in the checkpoint, {list(mine)} here" for key, theirs, mine in items[:limit]
    )
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")


class DMLModule(pl.LightningModule):
    """A deep-metric-learning model: ``embedding = head(backbone(image))``, trained with a pair loss.

    ``forward`` returns *raw* embeddings; the loss and the retrieval metrics L2-normalise them where their paper
    does (SPEC 9.2). Validation and test compute :class:`~lightning_dml.metrics.RetrievalMetrics` over the whole
    evaluated split and log them as ``val/recall@1``, ``test/map@r``, ...

    Training tricks of the papers are options: frozen BatchNorm (``freeze_bn``, GPW Sec. IV: +4.3 R@1 on CUB), the
    backbone frozen for the first epochs (``freeze_backbone_epochs``, GPW: 5), a larger learning rate for the new
    layers (``head_lr_multiplier``, 10 in MS/GPW/RLL), iteration- or epoch-based schedules
    (``scheduler_interval``), and multi-level fusion (``fusion``: RLL-(L,M,H), GPW "v2").

    Args:
        backbone: a module mapping images to pooled features, exposing ``out_features`` (e.g.
            :class:`~lightning_dml.models.BNInception`, by ``class_path`` in configs, or
            ``build_backbone("bninception", pretrained=False)`` in Python).
        loss: a pair loss (``class_path``/``init_args`` in configs) or its registry name (``"multi_similarity"``).
        miner: a miner (:mod:`lightning_dml.miners`, pml's contract; ``class_path``/``init_args`` in configs) or its
            registry name (``"batch_hard"``): the loss is then called on the miner's pairs or triplets,
            ``loss(embeddings, labels, indices_tuple=miner(embeddings, labels))`` (docs/miners.md); the loss must
            accept ``indices_tuple``. Under ``gather_distributed`` the miner sees the global batch
            (:class:`~lightning_dml.miners.MinedLoss`). ``None``: no miner.
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
        metrics: more evaluation metrics by name (:class:`~lightning_dml.metrics.RetrievalMetrics`,
            ``docs/metrics.md``): ``precision@K``, ``ndcg@K``, ``mrr``, ``map``, ``fnmr@fmr=F`` (e.g.
            ``["precision@10", "mrr", "fnmr@fmr=0.001"]``); checked when the module is built. Evaluation batches
            with categories (:class:`~lightning_dml.data.CSVDataModule`) also give every metric per category,
            ``val/category/<name>/recall@1``, named by the data module's ``category_names``.
        metric_widths: nested widths ``d_1 < d_2 < ...`` at which every metric is computed again on the leading
            ``d`` dimensions of the embedding (a Matryoshka model, :class:`~lightning_dml.losses.MatryoshkaLoss`),
            logged as ``val/w<d>/recall@1`` (:class:`~lightning_dml.metrics.RetrievalMetrics` ``widths``).
        gather_distributed: under DDP, score each process's batch against the embeddings of all processes
            (autograd-aware all-gather), so every anchor sees the negatives of the global batch: the loss and
            the gradients equal one process holding the global batch, for every loss and reduction option
            (:mod:`lightning_dml.losses.distributed`). Losses that declare ``gather_mode = None`` (N-pair, the
            per-sample proxy and classification losses) are rejected when fit starts.
        fusion: ``"none"``: one embedding of the backbone's last stage. ``"concat"``: one ``embedding_dim``-wide
            embedding per backbone level (BN-Inception inception-3c/4e/5b, ResNet stages 2/3/4), concatenated
            (``3 * embedding_dim`` wide) and trained with one loss on the concatenation (GPW "v2", SPEC 2.7 [I]).
            ``"per_level"``: the same embeddings, one loss per level summed with weight 1 each (RLL's deep
            supervision, SPEC 4.4 [C]); evaluation uses the concatenation (RLL-(L,M,H)).
        normalize_levels: with fusion, L2-normalise each level's embedding before concatenating.
        freeze_bn: keep every BatchNorm layer of the backbone frozen: running statistics (eval mode) and affine
            parameters (no gradient, left out of the optimizer). GPW Sec. IV / Table I; the MS code's
            ``set_bn_eval`` freezes the statistics. The head's own BatchNorm (``head_norm="batch"``) still trains.
        freeze_backbone_epochs: train only the head (and loss parameters) for this many epochs; the backbone runs
            in eval mode without gradient (weights and BN statistics unchanged), then trains (GPW: 5 epochs).
            Under DDP this needs ``strategy: ddp_find_unused_parameters_true`` (the backbone has no gradient in
            the frozen epochs).
        loss_lr_multiplier: the learning rate of the loss's own parameters (proxies, class weights) is the
            optimizer's learning rate times this, independent of ``head_lr_multiplier`` (Proxy-Anchor: 100).
        loss_weight_decay: weight decay of the loss's parameters (0: none, whatever the optimizer's default).
        loss_sizes: the sizes of the loss's parameters, ``{"num_classes": ..., "embedding_dim": ...}``
            (``{"embedding_dim": ...}`` for :class:`~lightning_dml.losses.CrossBatchMemory`). Leave it out:
            ``setup("fit")`` fills it in from the data (see below) and a checkpoint records it, so that
            ``lightning-dml test --ckpt_path ...`` rebuilds the loss before loading the weights. Ignored for losses
            without sizes to fill in.
        layer_decay: layer-wise learning-rate decay of a timm backbone (:class:`~lightning_dml.models.TimmBackbone`;
            BEiT, Bao et al. 2022, Sec. 2.6 / DeiT III fine-tuning): the backbone's parameters are grouped by depth
            with timm's ``param_groups_layer_decay`` (ViT: patch and position embeddings and tokens = layer 0,
            block ``i`` = layer ``i + 1``, the final norm with the last block) and layer ``l`` of ``L`` trains at
            ``lr * layer_decay ** (L - 1 - l)``: timm's ``lr_scale`` becomes each group's ``lr``. The same
            grouping gives norms, biases, position embeddings and class/register tokens no weight decay (the other
            backbone parameters keep the optimizer's). ``1.0``: that weight-decay split without lr decay.
            ``None``: one backbone group.
        embedding_chunk_size: gradient caching (Gao et al., RepL4NLP 2021; :mod:`lightning_dml.gradient_cache`,
            ``docs/memory.md``): the training batch is embedded in chunks of this many images whose activations
            are not kept, the loss and its gradient w.r.t. the embeddings are computed over the whole batch (the
            gathered global batch with ``gather_distributed``), then each chunk is embedded again with its graph
            (same dropout / drop-path draws) and back-propagates its rows' gradients. Activation memory is that of
            one chunk, for one more forward per step; loss and gradients equal the unchunked step, except with
            BatchNorm layers that train (they normalise by each chunk's statistics: use ``freeze_bn`` and a
            ``head_norm`` other than ``"batch"``; a warning says so when fit starts). ``None``: off. Evaluation is
            not chunked. A run may resume with another value.
        regularizers: weighted regularization terms added to the training loss (``docs/regularizers.md``), each a
            dict ``{"regularizer": "lp", "weight": 0.001, "target": "embeddings", "init_args": {...}, "name": ...}``
            (:class:`~lightning_dml.regularizers.RegularizationTerms`): ``target: embeddings`` regularises the
            training batch's raw embeddings (each process's own batch under ``gather_distributed``; each level's
            with ``fusion="per_level"``, summed), ``target: loss_weights`` the rows of a proxy loss's ``proxies``. Each
            weighted term is logged as ``train/reg/<name>``; ``train/loss`` is the pair loss plus their sum.

    Losses with parameters (:class:`~lightning_dml.losses.ProxyLoss`: Proxy-Anchor, ArcFace, ...): a config may
    leave out their ``num_classes`` and ``embedding_dim``; ``setup("fit")`` fills them in from the data module's
    ``train_class_ids`` (the classes trained on, after any validation hold-out) and the head's output width
    (``3 * embedding_dim`` with ``fusion="concat"``), and saves them as the ``loss_sizes`` hyper-parameter so a
    checkpoint rebuilds the loss. Training labels are mapped to class indices ``0 .. num_classes - 1`` in the
    order of ``train_class_ids``. A module built with ``loss_sizes`` (from a checkpoint) has its losses complete at
    once, and ``setup("fit")`` checks the data against them. With ``fusion="per_level"`` each level has its own
    loss instance (:attr:`level_losses`). Their parameters form the optimizer group ``"loss"``. A loss that needs
    the width alone (``needs_embedding_dim``: :class:`~lightning_dml.losses.CrossBatchMemory`'s memory) gets it the
    same way.

    Checkpoints record :meth:`architecture`; :meth:`on_load_checkpoint` checks that a checkpoint fits the model
    (hyper-parameters, weights) and names both sides in one error when it does not. The checkpoint a stage's
    weights come from is logged as the ``checkpoint`` hyper-parameter (``None``: none was loaded).
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
        fusion: str = "none",
        normalize_levels: bool = False,
        freeze_bn: bool = False,
        freeze_backbone_epochs: int = 0,
        loss_lr_multiplier: float = 1.0,
        loss_weight_decay: float = 0.0,
        layer_decay: float | None = None,
        loss_sizes: dict[str, int] | None = None,
        metrics: Sequence[str] = (),
        metric_widths: Sequence[int] = (),
        embedding_chunk_size: int | None = None,
        regularizers: Sequence[dict[str, Any]] = (),
        miner: nn.Module | str | None = None,
    ) -> None:
        super().__init__()
        self.save_hyperparameters(ignore=["backbone", "loss", "optimizer", "lr_scheduler", "miner"])
        if not hasattr(backbone, "out_features"):
            raise ValueError(f"backbone {type(backbone).__name__} must expose `out_features` (its feature width)")
        if head_lr_multiplier <= 0:
            raise ValueError(f"head_lr_multiplier must be positive, got {head_lr_multiplier}")
        if scheduler_interval not in ("epoch", "step"):
            raise ValueError(f"scheduler_interval must be 'epoch' or 'step', got {scheduler_interval!r}")
        if fusion not in _FUSION:
            raise ValueError(f"fusion must be one of {_FUSION}, got {fusion!r}")
        if freeze_backbone_epochs < 0:
            raise ValueError(f"freeze_backbone_epochs must be >= 0, got {freeze_backbone_epochs}")
        if loss_lr_multiplier <= 0 or loss_weight_decay < 0:
            raise ValueError(
                "need loss_lr_multiplier > 0 and loss_weight_decay >= 0, "
                f"got {loss_lr_multiplier} and {loss_weight_decay}"
            )
        if layer_decay is not None:
            if not 0 < layer_decay <= 1:
                raise ValueError(f"layer_decay must be in (0, 1], got {layer_decay}")
            if not hasattr(getattr(backbone, "model", None), "group_matcher"):
                raise ValueError(
                    f"layer_decay needs a timm backbone (lightning_dml.models.TimmBackbone) whose layers timm can "
                    f"group; {type(backbone).__name__} is not one"
                )
        self.embedding_chunk_size = check_chunk_size(embedding_chunk_size)
        self.layer_decay = layer_decay
        self.backbone = backbone
        self.fusion = fusion
        self.freeze_bn = freeze_bn
        self.freeze_backbone_epochs = int(freeze_backbone_epochs)
        self._backbone_frozen = False
        if fusion == "none":
            self.head: nn.Module = LinearEmbedding(int(backbone.out_features), embedding_dim, head_norm)
        else:
            levels = check_levels(backbone)
            self.head = MultiLevelEmbedding(levels, embedding_dim, head_norm, normalize_levels)
        if freeze_bn:
            for p in self._backbone_bn_parameters():
                p.requires_grad_(False)
            self._apply_frozen_modes()
        self.loss = build_loss(loss) if isinstance(loss, str) else loss
        #: with ``fusion="per_level"`` and a loss with parameters: one loss per level (the first is ``self.loss``)
        self.level_losses = self._make_level_losses()
        self.miner = _build_miner(miner, self.loss)
        self.regularization = RegularizationTerms(regularizers, self.loss, per_level=fusion == "per_level")
        self.loss_lr_multiplier = float(loss_lr_multiplier)
        self.loss_weight_decay = float(loss_weight_decay)
        if loss_sizes:
            self._apply_loss_sizes(loss_sizes)
        self._fit_started = False  # set by on_fit_start: later stages evaluate the fit's weights
        #: the training split's class labels, sorted (set in ``setup("fit")`` for losses that need class indices)
        self.register_buffer("train_class_ids", None, persistent=False)
        self.optimizer_factory = optimizer
        self.scheduler_factory = lr_scheduler
        self.scheduler_interval = scheduler_interval
        self.head_lr_multiplier = head_lr_multiplier
        self.gather_distributed = gather_distributed
        metrics = (metrics,) if isinstance(metrics, str) else tuple(metrics)  # one name or a list of names
        metric_args = {"recall_at": tuple(recall_at), "clustering": clustering, "metrics": metrics,
                       "widths": list(metric_widths)}
        self.val_metrics = RetrievalMetrics(**metric_args)
        self.test_metrics = RetrievalMetrics(**metric_args)

    def _features(self, images: torch.Tensor) -> torch.Tensor | list[torch.Tensor]:
        """Backbone features (a list of levels with fusion), without gradient while the backbone is frozen."""
        with torch.set_grad_enabled(torch.is_grad_enabled() and not self._backbone_frozen):
            if self.fusion == "none":
                return self.backbone(images)
            return self.backbone.forward_levels(images)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Raw embeddings ``[B, embedding width]`` (the concatenation of the levels with fusion)."""
        return self.head(self._features(images))

    def embed_levels(self, images: torch.Tensor) -> list[torch.Tensor]:
        """One raw embedding per backbone level (``fusion`` must be ``"concat"`` or ``"per_level"``)."""
        if self.fusion == "none":
            raise ValueError("embed_levels needs fusion='concat' or 'per_level', this module has fusion='none'")
        return self.head.forward_levels(self._features(images))

    # ------------------------------------------------------------------ losses with parameters
    def _make_level_losses(self) -> nn.ModuleList | None:
        if self.fusion != "per_level" or not _has_parameters(self.loss):
            return None
        copies = [copy.deepcopy(self.loss) for _ in range(len(self.head.levels) - 1)]
        for loss in copies:
            if hasattr(loss, "reset_parameters"):
                loss.reset_parameters()  # each level its own proxies
        return nn.ModuleList([self.loss, *copies])

    def trained_losses(self) -> list[nn.Module]:
        """The loss instances that train: one per level with ``per_level`` fusion and parameters, else ``[loss]``."""
        return list(self.level_losses) if self.level_losses is not None else [self.loss]

    def _complete_losses(self, datamodule: Any) -> None:
        """Fill in ``num_classes`` / ``embedding_dim`` of the losses that need them (see the class docstring)."""
        losses = [loss for loss in self.trained_losses() if _needs_sizes(loss)]
        if not losses:
            return
        class_ids = None
        if any(getattr(loss, "needs_num_classes", False) for loss in losses):
            class_ids = getattr(datamodule, "train_class_ids", None)
        if class_ids is not None:
            num_classes = int(class_ids.numel())
        else:
            num_classes = getattr(datamodule, "num_train_classes", None)
        width = self.hparams.embedding_dim if self.fusion == "per_level" else int(self.head.embedding_dim)
        for loss in losses:
            if not getattr(loss, "needs_num_classes", False):  # the width alone (CrossBatchMemory)
                loss.complete(embedding_dim=width).to(self.device)
                continue
            loss.complete(num_classes=num_classes, embedding_dim=width)
            if not loss.is_complete:
                source = f"{type(datamodule).__name__} has no num_train_classes" if datamodule else "no data module"
                raise ValueError(
                    f"{type(loss).__name__} needs num_classes and it cannot be filled in ({source}): set it in the "
                    "loss's init_args"
                )
            if getattr(loss, "needs_class_counts", False) and getattr(loss, "class_counts", None) is None:
                counts = getattr(datamodule, "train_class_counts", None)  # DynamicArcFaceLoss's margins
                if counts is None:
                    raise ValueError(
                        f"{type(loss).__name__} needs class_counts and {type(datamodule).__name__} gives no "
                        "train_class_counts: set class_counts in the loss's init_args"
                    )
                loss.set_class_counts(counts)
            loss.to(self.device)
        if class_ids is not None:
            self.train_class_ids = class_ids.to(self.device)
        first = losses[0]
        self.hparams["loss_sizes"] = (
            {"num_classes": first.num_classes, "embedding_dim": first.embedding_dim}
            if getattr(first, "needs_num_classes", False) else {"embedding_dim": first.embedding_size}
        )

    def _apply_loss_sizes(self, sizes: dict[str, Any]) -> None:
        """Complete the losses that need sizes with ``sizes`` (a checkpoint's ``loss_sizes``) and record them."""
        completed = False
        for loss in self.trained_losses():
            if getattr(loss, "needs_num_classes", False):
                loss.complete(**sizes).to(self.device)
                completed = True
            elif getattr(loss, "needs_embedding_dim", False):
                loss.complete(embedding_dim=sizes.get("embedding_dim")).to(self.device)
                completed = True
        if completed:
            self.hparams["loss_sizes"] = dict(sizes)

    # ------------------------------------------------------------------ checkpoints
    def architecture(self) -> dict[str, Any]:
        """What a checkpoint's weights must fit: the backbone (class and settings), its feature width, the
        embedding width and the fusion. Saved in every checkpoint (``checkpoint["lightning_dml"]["architecture"]``)
        to name both sides when a checkpoint does not fit."""
        return {
            "backbone": _describe_backbone(self.backbone),
            "features": int(getattr(self.backbone, "out_features", 0)) or None,
            "embedding_width": int(self.head.embedding_dim),
            "fusion": self.fusion,
        }

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint.setdefault("lightning_dml", {})["architecture"] = self.architecture()
        drop_frozen_weights(self.backbone, checkpoint)  # an adapter's checkpoint: the trained weights alone
        if self.__dict__.get("sharded_loss_held"):  # all classes' centres, as an unsharded run saves them
            add_sharded_state(self.loss, checkpoint)

    def _attached_trainer(self) -> pl.Trainer | None:
        try:
            return self.trainer
        except RuntimeError:  # not attached (DMLModule.load_from_checkpoint)
            return None

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Before the weights load: rebuild the parameters of losses whose sizes ``setup("fit")`` filled in, and
        check that the checkpoint fits this model, each mismatch one
        :class:`~lightning_dml.checkpoints.CheckpointMismatchError`:

        * restored by a ``Trainer`` (``fit``/``validate``/``test``/``predict`` with ``ckpt_path``, including
          ``--ckpt_path last``), every hyper-parameter of the checkpoint must equal this model's (the key and both
          values are named) except the evaluation settings (``checkpoints.EVALUATION_HPARAMS``: metrics,
          recall_at, clustering) and :data:`EXECUTION_HPARAMS` (``embedding_chunk_size``): a resumed run
          continues with the settings it was trained with, an evaluation evaluates the model it names.
          ``DMLModule.load_from_checkpoint`` keeps Lightning's way (keyword arguments override the checkpoint's
          hyper-parameters);
        * the weights must fit: another backbone, embedding width or fusion names the checkpoint's and this
          model's architecture (:meth:`architecture`) instead of torch's list of size mismatches.
        """
        trainer = self._attached_trainer()
        where = f"checkpoint {trainer.ckpt_path}" if trainer is not None and trainer.ckpt_path else "the checkpoint"
        hparams = checkpoint.get("hyper_parameters") or {}
        if trainer is not None:
            keys = [
                k for k in hparams if not k.startswith("_") and k not in DERIVED_HPARAMS + EXECUTION_HPARAMS
            ]
            disagreements = hparams_disagreements(hparams, dict(self.hparams), keys=keys)
            if disagreements:
                details = "; ".join(
                    f"{key} is {mine!r} here, {theirs!r} in the checkpoint" for key, mine, theirs in disagreements
                )
                if trainer.state.fn == TrainerFn.FITTING:
                    advice = (
                        "a resumed run continues with the settings it was trained with: give the checkpoint's "
                        "values, or start a new run (lightning-dml: in another --trainer.default_root_dir)"
                    )
                else:
                    advice = (
                        "build the model with the checkpoint's values (lightning-dml: give the checkpoint file to "
                        "--ckpt_path and leave these keys out, so that they come from the checkpoint)"
                    )
                raise CheckpointMismatchError(
                    f"{where} was saved by a model with other hyper-parameters: {details}; {advice}"
                )
        sizes = hparams.get("loss_sizes")
        if sizes:
            try:
                self._apply_loss_sizes(sizes)
            except ValueError as error:
                raise CheckpointMismatchError(f"{where} does not fit this model's loss: {error}") from None
        if self.__dict__.get("sharded_loss_held"):  # this process's rows of the centres and of their optimizer state
            take_sharded_state(self.loss, checkpoint)
        restore_frozen_weights(self.backbone, checkpoint, where)  # an adapter's: on top of the frozen weights
        strategy = getattr(trainer, "strategy", None)
        if strategy is None or isinstance(strategy, (SingleDeviceStrategy, DDPStrategy)):  # not a sharded model
            self._check_weights_fit(checkpoint, where)

    def _check_weights_fit(self, checkpoint: dict[str, Any], where: str) -> None:
        theirs = checkpoint.get("state_dict") or {}
        own = self.state_dict()
        shapes = [
            (key, tuple(theirs[key].shape), tuple(own[key].shape))
            for key in own
            if key in theirs and hasattr(theirs[key], "shape") and tuple(theirs[key].shape) != tuple(own[key].shape)
        ]
        strict = getattr(self, "strict_loading", True)
        missing = [key for key in own if key not in theirs] if strict else []
        unexpected = [key for key in theirs if key not in own] if strict else []
        if not (shapes or missing or unexpected):
            return
        recorded = (checkpoint.get("lightning_dml") or {}).get("architecture")
        if recorded is None:  # written before the architecture was recorded: what the head's weight tells
            head = theirs.get("head.fc.weight")
            recorded = {"backbone": "not recorded in the checkpoint"}
            if head is not None and getattr(head, "ndim", 0) == 2:
                recorded.update(features=int(head.shape[1]), embedding_width=int(head.shape[0]))

        def count(items: list) -> str:
            return f"{len(items)} weight{'s' if len(items) > 1 else ''}"

        def examples(keys: list[str]) -> str:
            return ", ".join(keys[:2]) + (", ..." if len(keys) > 2 else "")

        problems = []
        if shapes:
            problems.append(f"{count(shapes)} of other shapes ({_shape_examples(shapes)})")
        if missing:
            problems.append(f"{count(missing)} of this model missing from it ({examples(missing)})")
        if unexpected:
            problems.append(f"{count(unexpected)} in it that this model does not have ({examples(unexpected)})")
        raise CheckpointMismatchError(
            f"{where} does not fit the model to load it into: it holds a model with "
            f"{_describe_architecture(recorded)}, the model (as configured) has "
            f"{_describe_architecture(self.architecture())}; {'; '.join(problems)}"
        )

    def _log_checkpoint(self) -> None:
        """Log ``checkpoint``: :func:`~lightning_dml.checkpoints.checkpoint_record` of the checkpoint the trainer
        restored for this stage (``None``: the module's own weights) as a hyper-parameter of the run. A stage that
        evaluates the weights of a ``fit`` of this module (the CLI's final validation) keeps the fit's record."""
        trainer = self.trainer
        if self._fit_started and trainer.state.fn != TrainerFn.FITTING and not trainer.ckpt_path:
            return
        if not trainer.loggers or not trainer.is_global_zero or not getattr(trainer, "enable_autolog_hparams", True):
            return
        record = checkpoint_record(trainer.ckpt_path)
        for logger in trainer.loggers:
            logger.log_hyperparams({"checkpoint": record})

    def on_fit_start(self) -> None:
        self._log_checkpoint()
        self._fit_started = True
        self._warn_chunked_batch_norm()

    def _warn_chunked_batch_norm(self) -> None:
        """With ``embedding_chunk_size``, warn once when BatchNorm layers train (they see chunk statistics)."""
        if self.embedding_chunk_size is None:
            return
        # the modes as fit starts (Lightning >= 2.2 keeps them; frozen BatchNorm is in eval mode)
        layers = batch_statistics_layers(self.backbone) + batch_statistics_layers(self.head)
        if layers:
            rank_zero_warn(
                f"embedding_chunk_size={self.embedding_chunk_size} with {len(layers)} BatchNorm layer(s) in training "
                "mode: each chunk is normalised by its own statistics, so the loss and gradients are not those of "
                "the unchunked batch (running statistics are updated once per chunk); for an exact step use "
                "freeze_bn=True and head_norm 'none' or 'layer'"
            )

    def on_validation_start(self) -> None:
        if self.trainer.state.fn == TrainerFn.VALIDATING:
            self._log_checkpoint()

    def on_test_start(self) -> None:
        self._log_checkpoint()

    def on_predict_start(self) -> None:
        self._log_checkpoint()

    def _class_indices(self, labels: torch.Tensor) -> torch.Tensor:
        """Training labels -> indices into ``train_class_ids`` (unchanged when no loss needs class indices)."""
        ids = self.train_class_ids
        if ids is None:
            return labels
        index = torch.searchsorted(ids, labels).clamp_(max=ids.numel() - 1)
        unknown = ids[index] != labels
        if bool(unknown.any()):
            raise ValueError(
                f"training label {int(labels[unknown][0])} is not one of the {ids.numel()} classes of the data "
                "module's training split (train_class_ids): the loss has no proxy for it"
            )
        return index

    # ------------------------------------------------------------------ training
    def _pair_loss(self, embeddings: torch.Tensor, labels: torch.Tensor, loss: nn.Module | None = None) -> torch.Tensor:
        loss = self.loss if loss is None else loss
        if self.miner is not None:  # the loss on the miner's tuples; under DDP the miner sees the global batch
            loss = MinedLoss(loss, self.miner)
        if self.gather_distributed and self.trainer.world_size > 1:
            # each loss's declared gather_mode: equal to one process holding the global batch (losses.distributed)
            return gathered_loss(loss, embeddings, labels)
        return loss(embeddings, labels)

    def _adopt_category_names(self, datamodule: Any) -> None:
        """Name the per-category metrics by the data module's ``category_names`` (a list indexed by category id, or
        a dict), when it has them."""
        names = getattr(datamodule, "category_names", None)
        if names:
            for metric in (self.val_metrics, self.test_metrics):
                metric.category_names = dict(names) if isinstance(names, dict) else list(names)

    def setup(self, stage: str) -> None:
        self._adopt_category_names(getattr(self.trainer, "datamodule", None))
        if stage == "fit":  # before any step: a loss and sampler that give no positive pairs cannot train
            datamodule = getattr(self.trainer, "datamodule", None)
            check_fit_combination(self.loss, datamodule)
            check_gather_combination(self.loss, self.gather_distributed)
            if getattr(self.loss, "sharded", False):  # Partial FC: options that cannot go with the shards
                check_sharded_fit(self, self.trainer.world_size)
            self._complete_losses(datamodule)
            if getattr(self.loss, "sharded", False) and self.trainer.world_size > 1:
                self._hold_sharded_loss()

    def _hold_sharded_loss(self) -> None:
        """A sharded loss (Partial FC) under DDP leaves the module's tree: Lightning's DistributedDataParallel
        wraps every parameter of the module, and would broadcast rank 0's centres and average the processes'
        centre gradients, while each process holds other classes. It stays ``self.loss`` (a plain attribute), is
        moved to the process's device, and its shard is in the optimizer's ``"loss"`` group; the checkpoint hooks
        add all classes' centres and their optimizer state (``partial_fc.add_sharded_state``)."""
        loss = self.loss.split()
        if "loss" in dict(self.named_children()):
            delattr(self, "loss")
            object.__setattr__(self, "loss", loss)
        self.trainer.strategy.precision_plugin.convert_module(loss)  # "64-true": the dtype the module will have
        loss.to(self.trainer.strategy.root_device)
        object.__setattr__(self, "sharded_loss_held", True)

    def training_step(self, batch: Sequence[torch.Tensor], batch_idx: int) -> torch.Tensor:
        images, labels = batch[0], batch[1]
        if batch_idx == 0:  # any data source: its first batch of every epoch must hold positive pairs
            check_training_batch(self.loss, labels)
        batch_size = labels.shape[0]
        labels = self._class_indices(labels)
        if self.fusion == "per_level":
            embeddings = self._training_embeddings(self.embed_levels, images)
            losses = self.trained_losses() if self.level_losses is not None else [self.loss] * len(embeddings)
            level_losses = [self._pair_loss(e, labels, f) for e, f in zip(embeddings, losses)]
            for name, value in zip(self.backbone.level_names, level_losses):
                self.log(f"train/loss_{name}", value, batch_size=batch_size, sync_dist=self.gather_distributed)
            loss = torch.stack(level_losses).sum()
        else:
            embeddings = self._training_embeddings(self, images)
            loss = self._pair_loss(embeddings, labels)
        loss = self._add_regularization(loss, embeddings, batch_size)
        # with gather_distributed the processes' values average to the global-batch loss (losses.distributed)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch_size, sync_dist=self.gather_distributed)
        return loss

    def _add_regularization(self, loss: torch.Tensor, embeddings: Any, batch_size: int) -> torch.Tensor:
        """``loss`` plus the weighted ``regularizers`` terms, each logged as ``train/reg/<name>``."""
        if not len(self.regularization):
            return loss
        terms = self.regularization(embeddings, self.trained_losses())
        for name, value in terms.items():
            self.log(f"train/reg/{name}", value, batch_size=batch_size, sync_dist=self.gather_distributed)
        return loss + torch.stack(list(terms.values())).sum().to(loss.dtype)

    def _training_embeddings(self, embed: Any, images: torch.Tensor) -> Any:
        """``embed(images)``, in chunks of ``embedding_chunk_size`` with gradient caching when it is set."""
        return chunked_embeddings(embed, images, self.embedding_chunk_size, self)

    # ------------------------------------------------------------------ training tricks
    def _backbone_bn_modules(self) -> list[nn.Module]:
        return [m for m in self.backbone.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]

    def _backbone_bn_parameters(self) -> list[nn.Parameter]:
        return [p for m in self._backbone_bn_modules() for p in m.parameters(recurse=False)]

    def _apply_frozen_modes(self) -> None:
        """Put a frozen backbone, or the frozen BatchNorm layers, in eval mode (their statistics stay fixed)."""
        if not hasattr(self, "backbone"):
            return
        if getattr(self, "_backbone_frozen", False):
            self.backbone.eval()
        elif getattr(self, "freeze_bn", False):
            for m in self._backbone_bn_modules():
                m.eval()

    def train(self, mode: bool = True) -> DMLModule:
        """Set train/eval mode; frozen BatchNorm layers and a frozen backbone stay in eval mode."""
        super().train(mode)
        if mode:
            self._apply_frozen_modes()
        return self

    def set_backbone_frozen(self, frozen: bool) -> None:
        """Freeze (no gradient, eval mode) or release the backbone; frozen BN parameters stay frozen."""
        self._backbone_frozen = frozen
        bn_params = {id(p) for p in self._backbone_bn_parameters()} if self.freeze_bn else set()
        bn_params |= {id(p) for p in adapter_frozen_parameters(self.backbone).values()}  # they stay frozen
        for p in self.backbone.parameters():
            p.requires_grad_(not frozen and id(p) not in bn_params)
        if not frozen and self.training:
            self.backbone.train()
        self._apply_frozen_modes()

    def on_train_start(self) -> None:
        # A fit resumed from a mid-epoch checkpoint does not call on_train_epoch_start for the interrupted epoch:
        # apply the freeze schedule of the restored epoch here too.
        self.on_train_epoch_start()

    def on_train_epoch_start(self) -> None:
        # Lightning (>= 2.2) does not call .train() when fit starts and restores each submodule's mode after
        # validation, so the frozen modes are (re)applied here
        frozen = self.current_epoch < self.freeze_backbone_epochs
        if frozen != self._backbone_frozen:
            self.set_backbone_frozen(frozen)
        self._apply_frozen_modes()

    def on_fit_end(self) -> None:
        if self._backbone_frozen:  # fit ended within the frozen epochs: hand back a trainable backbone
            self.set_backbone_frozen(False)

    # ------------------------------------------------------------------ evaluation
    def _evaluation_step(self, metric: RetrievalMetrics, batch: Sequence[torch.Tensor]) -> None:
        metric.update_from_batch(self(batch[0]), batch)

    def _log_metrics(self, metric: RetrievalMetrics, prefix: str) -> dict[str, float]:
        # the retrieval search and k-means can take minutes at SOP scale: show their progress where the
        # trainer shows its own (rank zero, progress bar enabled)
        show = self.trainer.progress_bar_callback is not None and self.trainer.is_global_zero
        with progress_bars(show):
            values = metric.compute()
        metric.reset()
        # The values are already global (RetrievalMetrics evaluates the whole split across processes) and equal on
        # every rank. sync_dist=True with reduce_fx="max" keeps them exact (the max of equal values; a mean would
        # divide a sum that may round) for one scalar all-reduce each, tells Lightning they are global (no
        # sync_dist warning under DDP), and leaves every rank the same value for ModelCheckpoint's monitor.
        # rank_zero_only=True would hide the monitored value from the other ranks.
        for name, value in values.items():
            self.log(
                f"{prefix}/{name}", value, prog_bar=name in PROGRESS_BAR_METRICS, sync_dist=True, reduce_fx="max"
            )
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
        """Backbone, head and loss parameters as separate groups (the head's and the loss's lr are scaled in
        configure_optimizers; the loss group has weight decay ``loss_weight_decay``, and exists only when the loss
        has parameters).

        With ``freeze_bn`` the backbone's BatchNorm weights and biases are left out (they never change).
        """
        head_params = list(self.head.parameters())
        loss_params = {id(p): p for f in self.trained_losses() for p in f.parameters() if p.requires_grad}
        loss_params = list(loss_params.values())  # once each (the first level's loss is also `self.loss`)
        frozen = {id(p) for p in self._backbone_bn_parameters()} if self.freeze_bn else set()
        frozen |= {id(p) for p in adapter_frozen_parameters(self.backbone).values()}  # an adapter's frozen weights
        backbone_params = [p for p in self.backbone.parameters() if id(p) not in frozen]
        if self.layer_decay is None:
            groups = [{"params": backbone_params, "name": "backbone"}]
        else:
            groups = self._layer_decay_groups(backbone_params)
        groups.append({"params": head_params, "name": "head"})
        if loss_params:
            groups.append({"params": loss_params, "name": "loss", "weight_decay": self.loss_weight_decay})
        return groups

    def _layer_decay_groups(self, backbone_params: list[nn.Parameter]) -> list[dict[str, Any]]:
        """The backbone's parameters grouped by timm's ``param_groups_layer_decay`` (``lr_scale`` per group,
        weight decay 0 for the no-decay groups, the optimizer's for the others); parameters outside the timm
        model (GeM's ``p``) form one more group at scale 1."""
        from timm.optim import param_groups_layer_decay

        model = self.backbone.model
        no_decay = set(getattr(model, "no_weight_decay", set)())
        timm_groups = param_groups_layer_decay(
            model, weight_decay=1.0, no_weight_decay_list=no_decay, layer_decay=float(self.layer_decay)
        )
        keep = {id(p) for p in backbone_params}
        groups: list[dict[str, Any]] = []
        for index, group in enumerate(timm_groups):
            params = [p for p in group["params"] if id(p) in keep]
            if not params:
                continue
            entry = {"params": params, "name": f"backbone.{index}", "lr_scale": float(group["lr_scale"])}
            if group["weight_decay"] == 0:
                entry["weight_decay"] = 0.0
            groups.append(entry)
        grouped = {id(p) for g in groups for p in g["params"]}
        rest = [p for p in backbone_params if id(p) not in grouped and p.requires_grad]
        if rest:
            groups.append({"params": rest, "name": "backbone.extra", "lr_scale": 1.0})
        return groups

    def configure_optimizers(self) -> Any:
        optimizer = self.optimizer_factory(self.parameter_groups())
        for group in optimizer.param_groups:
            if "lr_scale" in group:  # layer-wise decay: torch optimizers read ``lr``, not timm's ``lr_scale``
                group["lr"] = group["lr"] * group["lr_scale"]
            if group.get("name") == "head":
                group["lr"] = group["lr"] * self.head_lr_multiplier
            elif group.get("name") == "loss":
                group["lr"] = group["lr"] * self.loss_lr_multiplier
        if self.scheduler_factory is None:
            return optimizer
        scheduler = self.scheduler_factory(optimizer)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": self.scheduler_interval}}
