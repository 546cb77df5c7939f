"""Any ``timm`` image model as a backbone: its features without the classifier, its preprocessing, its levels.

:class:`TimmBackbone` wraps ``timm.create_model(model_name, num_classes=0)`` (ViT, DINO, DINOv2, CLIP, ConvNeXt,
ResNet, ... with a pretrained tag such as ``vit_small_patch16_224.dino``). It follows the :class:`Backbone`
contract of the other backbones:

* ``forward(images)`` -> ``[B, out_features]``: the pooled features (``pooling=None``: the model's own head
  pooling without its classifier, timm's "pre-logits" features; see :class:`TimmBackbone`);
* ``forward_levels(images)`` -> three pooled levels, low to high, through timm's ``forward_intermediates``:
  for an isotropic model (ViT: every block has the same width and stride) the blocks at a third, two thirds and
  the end of the depth (12 blocks: blocks 4, 8 and 12, i.e. ``blocks.3``, ``blocks.7``, ``blocks.11``), each
  through the model's final norm; for a staged model (ConvNeXt, ResNet) its last three stages (ConvNeXt
  ``stages.1``-``stages.3``, ResNet ``layer2``-``layer4``, as for torchvision's ResNet). The last level is
  always ``forward(images)``;
* ``input_spec``: mean, std, interpolation and crop percentage from timm's data config of the pretrained tag,
  the crop size from the model as built (``patch_embed.img_size``, so an ``img_size`` override is followed).

Pretrained weights come through timm's own loading: ``pretrained=True`` downloads the tag's weights on first use
(Hugging Face Hub, cached under ``$HF_HOME/hub``; tags without a hub copy: their URL, cached under
``$TORCH_HOME/hub/checkpoints``) and ``weights_path`` loads a local file through
``pretrained_cfg_overlay={"file": ...}``, so timm's key remapping applies to it. Offline
(``LIGHTNING_DML_OFFLINE=1`` or ``HF_HUB_OFFLINE=1``) the cache is read without any request; every failure
(unknown name or tag, missing file, nothing cached while offline, failed download) is one
:class:`~lightning_dml.errors.UserInputError` naming the model, what was looked for and where.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlparse

import timm
import torch
from torch import nn

from lightning_dml.download import env_flag, is_offline
from lightning_dml.errors import DownloadError, MissingFileError, OfflineError, UserInputError
from lightning_dml.models.adapters import LORA_TARGETS, apply_adapter
from lightning_dml.models.backbones import Backbone
from lightning_dml.models.input_spec import INTERPOLATIONS, InputSpec

TimmPooling = Literal["avg", "max", "avgmax", "token", "gem"]

__all__ = ["TimmBackbone", "TimmPooling", "UnknownModelError", "timm_input_spec"]

_POOLINGS = ("avg", "max", "avgmax", "token", "gem")
#: the Hugging Face Hub weight files timm reads, in its order of preference
_HUB_FILES = ("model.safetensors", "pytorch_model.bin")


class UnknownModelError(UserInputError, ValueError):
    """A timm model name or pretrained tag that timm does not know."""


def _native_pooling(model: nn.Module) -> str:
    """The pooling of the model's own head: ViT's ``global_pool`` string, or a CNN head's pooling type."""
    pool = getattr(model, "global_pool", None)
    if pool is None and hasattr(model, "head"):
        pool = getattr(model.head, "global_pool", None)
    if isinstance(pool, str):
        return pool
    return str(getattr(pool, "pool_type", ""))


def timm_input_spec(model: nn.Module) -> InputSpec:
    """The :class:`InputSpec` of a timm model: timm's data config of its pretrained tag (mean, std,
    interpolation, crop percentage) with the crop size of the model as built (``patch_embed.img_size``, which
    timm's data config ignores when ``img_size`` is overridden; other models: the data config's input size)."""
    from timm.data import resolve_model_data_config

    config = resolve_model_data_config(model)
    size = getattr(getattr(model, "patch_embed", None), "img_size", None) or config["input_size"][1:]
    size = tuple(int(s) for s in (size if isinstance(size, (tuple, list)) else (size, size)))
    if size[0] != size[1]:
        raise ValueError(f"{type(model).__name__}: non-square input size {size} is not supported (square crops only)")
    interpolation = config.get("interpolation", "bilinear")
    return InputSpec(
        color="RGB",
        scale=1.0,
        mean=tuple(float(m) for m in config["mean"]),
        std=tuple(float(s) for s in config["std"]),
        crop_size=size[0],
        interpolation=interpolation if interpolation in INTERPOLATIONS else "bilinear",
        crop_pct=float(config.get("crop_pct", 0.875)),
    )


class TimmBackbone(Backbone):
    """A ``timm`` model without its classifier (pooled features, three levels and its preprocessing).

    Args:
        model_name: any ``timm.create_model`` name, with or without a pretrained tag
            (``vit_small_patch16_224.dino``, ``vit_small_patch14_reg4_dinov2.lvd142m``,
            ``vit_base_patch16_clip_224.openai``, ``convnext_tiny.fb_in22k``, ``resnet50.a1_in1k``).
        pretrained: load the tag's pretrained weights (downloaded and cached by timm on first use), or
            ``weights_path``.
        pooling: how ``[B, tokens or H x W, C]`` features become ``[B, C]``. ``None`` (default): the model's own
            head pooling without the classifier (timm's pre-logits features): the class token for ViTs with one
            (DINO, DINOv2, CLIP, DeiT: ``"token"``), average pooling for CNNs and ConvNeXt (``"avg"``, followed by
            ConvNeXt's head LayerNorm), whatever timm's head does for other families. ``"token"``: the class
            token (models with one). ``"avg"``, ``"max"``, ``"avgmax"`` (their sum, as :class:`GlobalPool`):
            over the patch tokens (prefix and register tokens excluded) or the feature map. ``"gem"``:
            generalized mean, ``(mean(clamp(x, eps) ** p)) ** (1 / p)`` with a learnable ``p`` initialised to 3
            (Radenovic et al., TPAMI 2018, Eq. 2). A pooling other than the model's own is applied to the output of
            ``forward_features``; the model's head modules (ConvNeXt's head LayerNorm, a ViT's ``fc_norm``) are
            then removed, so every parameter gets a gradient.
        drop_path_rate: stochastic depth rate (passed to timm when > 0).
        grad_checkpointing: recompute activations in the backward pass (timm's ``set_grad_checkpointing``):
            less memory for large models, about a third more compute.
        weights_path: a local weights file loaded instead of the download, through timm's loader
            (``pretrained_cfg_overlay={"file": weights_path}``, so timm's key remapping applies).
        img_size: input size the model is built for (ViTs: the position embedding is resized to it, and the
            ``input_spec`` crop follows it); ``None``: the model's default.
        model_kwargs: further ``timm.create_model`` arguments as one mapping (``{depth: 6}``,
            ``{pretrained_cfg_overlay: {...}}``): the form a YAML config can give.
        timm_kwargs: the same as keyword arguments (Python); ``num_classes`` is always 0.
        adapter: parameter-efficient fine-tuning (:mod:`lightning_dml.models.adapters`, docs/models.md
            "Adapters"): ``"lora"`` (LoRA through ``peft`` on the ``lora_targets`` linears, rank ``lora_r``,
            scaling ``lora_alpha / lora_r``, ``lora_dropout`` on the adapter's input), ``"bias"`` (BitFit),
            ``"norm"`` (normalisation layers only) or ``"vpt"`` (VPT-deep, ``vpt_tokens`` prompts per block; timm
            ViTs). Only the adapter's parameters of the timm model train (and GeM's ``p``); checkpoints hold them
            without the frozen weights. ``None`` (default): every parameter trains.
        lora_r, lora_alpha, lora_dropout, lora_targets: LoRA's rank, scale numerator, dropout and target linears
            (module names or name suffixes; default ``attn.qkv``, ``attn.proj``, ``mlp.fc1``, ``mlp.fc2``).
        vpt_tokens: VPT's prompt tokens per block.

    Attributes:
        out_features: width of ``forward``'s output.
        level_features, level_names: widths and timm module names of the three levels (when the model has
            ``forward_intermediates`` and at least three feature stages or blocks).
        input_spec: the preprocessing of the weights (see :func:`timm_input_spec`).
    """

    def __init__(
        self,
        model_name: str,
        pretrained: bool = True,
        pooling: TimmPooling | None = None,
        drop_path_rate: float = 0.0,
        grad_checkpointing: bool = False,
        weights_path: str | None = None,
        img_size: int | None = None,
        model_kwargs: dict[str, Any] | None = None,
        adapter: str | None = None,
        lora_r: int = 8,
        lora_alpha: float = 8.0,
        lora_dropout: float = 0.0,
        lora_targets: Sequence[str] = LORA_TARGETS,
        vpt_tokens: int = 10,
        **timm_kwargs: Any,
    ) -> None:
        super().__init__()
        timm_kwargs = {**(model_kwargs or {}), **timm_kwargs}
        if img_size is not None:
            timm_kwargs["img_size"] = int(img_size)
        if pooling is not None and pooling not in _POOLINGS:
            raise ValueError(f"pooling must be one of {_POOLINGS} or None (the model's own), got {pooling!r}")
        if drop_path_rate < 0:
            raise ValueError(f"drop_path_rate must be >= 0, got {drop_path_rate}")
        if timm_kwargs.pop("num_classes", 0) != 0:
            raise ValueError("TimmBackbone builds models without classifier: num_classes must be 0")
        self.model_name = model_name
        if drop_path_rate > 0:
            timm_kwargs["drop_path_rate"] = float(drop_path_rate)
        self.model = _create_model(model_name, pretrained, weights_path, timm_kwargs)
        model = self.model
        if grad_checkpointing:
            model.set_grad_checkpointing(True)
        self.adapter = adapter
        self.num_prefix_tokens = int(getattr(model, "num_prefix_tokens", 0) or 0)
        self.has_class_token = getattr(model, "cls_token", None) is not None
        native = _native_pooling(model)
        if pooling is None:
            pooling = native if native in _POOLINGS else None
        if pooling == "token" and not self.has_class_token:
            raise ValueError(f"pooling='token' needs a model with a class token; {model_name} has none")
        #: ``None``: a head pooling of timm's own that is not one of ours (e.g. attention pooling, "map")
        self.pooling = pooling
        self._native = pooling is None or pooling == native
        if not self._native:
            # the head's own pooling and norms (ConvNeXt's head LayerNorm, a ViT's fc_norm) are bypassed: drop
            # them, so no parameter is left without gradient (DDP without find_unused_parameters)
            for attr in ("head", "fc_norm"):
                if isinstance(getattr(model, attr, None), nn.Module):
                    setattr(model, attr, nn.Identity())
        #: the pooling of the lower levels (the model's own head pooling applies to the last level only)
        self.level_pooling = pooling if pooling is not None else ("token" if self.has_class_token else "avg")
        if pooling == "gem":
            self.gem_p = nn.Parameter(torch.tensor(3.0))
        width = getattr(model, "head_hidden_size", None) if self._native else None
        self.out_features = int(width or model.num_features)
        self.input_spec = timm_input_spec(model)
        self._level_indices: tuple[int, ...] | None = None
        info = list(getattr(model, "feature_info", None) or [])
        if hasattr(model, "forward_intermediates") and len(info) >= 3:
            n = len(info)
            isotropic = len({entry.get("reduction") for entry in info}) == 1
            if isotropic:  # transformer blocks: a third, two thirds and the end of the depth
                indices = tuple(round(n * k / 3) - 1 for k in (1, 2, 3))
            else:  # stages of a CNN: the last three
                indices = (n - 3, n - 2, n - 1)
            self._level_indices = indices
            self.level_features = tuple(int(info[i]["num_chs"]) for i in indices[:-1]) + (self.out_features,)
            self.level_names = tuple(str(info[i]["module"]) for i in indices)
        #: names (relative to this module) of the parameters the adapter keeps frozen; empty without adapter
        self.adapter_frozen_names: frozenset[str] = frozenset()
        if adapter is not None:
            prompts = apply_adapter(model, model_name, adapter, lora_r=lora_r, lora_alpha=lora_alpha,
                                    lora_dropout=lora_dropout, lora_targets=lora_targets, vpt_tokens=vpt_tokens)
            if prompts is not None:
                self.vpt = prompts
            self.adapter_frozen_names = frozenset(n for n, p in self.named_parameters() if not p.requires_grad)

    # ------------------------------------------------------------------ pooling
    def _pool(self, tokens: torch.Tensor, prefix: torch.Tensor | None, mode: str) -> torch.Tensor:
        """Pool ``tokens`` ``[B, L, C]`` (patch tokens or flattened map positions); ``prefix``: ``[B, P, C]``."""
        if mode == "token":
            assert prefix is not None
            return prefix[:, 0]
        if mode == "avg":
            return tokens.mean(dim=1)
        if mode == "max":
            return tokens.amax(dim=1)
        if mode == "avgmax":
            return tokens.mean(dim=1) + tokens.amax(dim=1)
        p = self.gem_p.float().clamp(min=1.0)  # in fp32 under autocast: x ** p overflows bf16/fp16 ranges
        return tokens.float().clamp(min=1e-6).pow(p).mean(dim=1).pow(1.0 / p)

    def _split(self, features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``forward_features`` output -> (tokens ``[B, L, C]``, prefix tokens ``[B, P, C]`` or None)."""
        if features.ndim == 4:  # CNN map [B, C, H, W]
            return features.flatten(2).transpose(1, 2), None
        return features[:, self.num_prefix_tokens :], features[:, : self.num_prefix_tokens]

    def _head(self, features: torch.Tensor) -> torch.Tensor:
        if self._native:
            return self.model.forward_head(features, pre_logits=True)
        return self._pool(*self._split(features), self.level_pooling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._head(self.model.forward_features(x))

    def forward_levels(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Pooled features of the three levels, low to high; the last is ``forward(x)``."""
        if self._level_indices is None:
            raise ValueError(
                f"{self.model_name} has no multi-level features (they need timm's forward_intermediates and at "
                "least three blocks or stages)"
            )
        kwargs: dict[str, Any] = {"indices": list(self._level_indices[:-1]), "norm": True}
        if self.num_prefix_tokens:
            kwargs.update(output_fmt="NLC", return_prefix_tokens=True)
        final, intermediates = self.model.forward_intermediates(x, **kwargs)
        levels = []
        for level in intermediates:
            # ViT: (patch tokens [B, L, C], prefix tokens [B, P, C]); CNN: map [B, C, H, W]
            tokens, prefix = level if isinstance(level, tuple) else (level.flatten(2).transpose(1, 2), None)
            levels.append(self._pool(tokens, prefix, self.level_pooling))
        levels.append(self._head(final))
        return levels

    def extra_repr(self) -> str:
        adapter = f", adapter={self.adapter!r}" if self.adapter is not None else ""
        return f"model_name={self.model_name!r}, pooling={self.pooling!r}{adapter}"


def _create_model(
    model_name: str, pretrained: bool, weights_path: str | None, timm_kwargs: dict[str, Any]
) -> nn.Module:
    """``timm.create_model(model_name, num_classes=0)`` with its weights, or one clear error naming what failed."""
    from timm.models import is_model

    if not is_model(model_name):
        raise UnknownModelError(
            f"unknown timm model {model_name!r}: timm.is_model() does not know it. "
            f"List names with timm.list_models('*{model_name.split('.')[0][:8]}*')."
        )
    arch, _, tag = model_name.partition(".")
    if tag and f"{arch}.{tag}" not in timm.list_pretrained(f"{arch}.*"):
        tags = [name.partition(".")[2] for name in timm.list_pretrained(f"{arch}.*")]
        raise UnknownModelError(
            f"timm model {arch!r} has no pretrained tag {tag!r}; its tags: {', '.join(tags) or 'none'}"
        )
    if not pretrained:
        return timm.create_model(model_name, pretrained=False, num_classes=0, **timm_kwargs)
    overlay = dict(timm_kwargs.pop("pretrained_cfg_overlay", None) or {})
    where = _weights_source(model_name, weights_path, overlay)
    try:
        return timm.create_model(
            model_name, pretrained=True, num_classes=0, pretrained_cfg_overlay=overlay, **timm_kwargs
        )
    except UserInputError:
        raise
    except OSError as error:  # network, HTTP and hub errors, unreadable files
        raise DownloadError(
            f"pretrained weights of timm model {model_name!r}: loading {where} failed ({type(error).__name__}: "
            f"{error}). Check the connection, or pass weights_path, or set pretrained: false."
        ) from error


def _weights_source(model_name: str, weights_path: str | None, overlay: dict[str, Any]) -> str:
    """Where the weights come from (for messages); checks a local file, and the cache when offline.

    Mirrors timm's choice of source: a ``file`` in the overlay, else the Hugging Face Hub copy (``hf_hub_id``),
    else the URL. Offline, a Hub copy found in the cache is loaded as a file (no request at all).
    """
    from timm.models import get_pretrained_cfg

    if weights_path is not None:
        overlay["file"] = str(Path(weights_path).expanduser())
    if overlay.get("file"):
        path = Path(overlay["file"])
        if not path.is_file():
            raise MissingFileError(
                f"weights file for timm model {model_name!r} not found: {path} does not exist. "
                "Check weights_path, or set pretrained: false to start from random weights."
            )
        return str(path)
    base = get_pretrained_cfg(model_name)
    config = {**(base.to_dict() if base is not None else {}), **overlay}
    offline = is_offline() or env_flag("HF_HUB_OFFLINE")
    hint = "Pass weights_path, or set pretrained: false to start from random weights."
    hub_id, url = config.get("hf_hub_id"), config.get("url")
    if hub_id:
        from huggingface_hub import constants, try_to_load_from_cache

        files = (config["hf_hub_filename"],) if config.get("hf_hub_filename") else _HUB_FILES
        where = f"{', '.join(files)} of Hugging Face Hub repository {hub_id}"
        if not offline:
            return where
        for name in files:
            cached = try_to_load_from_cache(hub_id, name)
            if isinstance(cached, str):
                overlay["file"] = cached
                return cached
        raise OfflineError(
            f"pretrained weights of timm model {model_name!r}: {where} is not in the Hugging Face cache "
            f"{constants.HF_HUB_CACHE}, and downloads are switched off (LIGHTNING_DML_OFFLINE or HF_HUB_OFFLINE). "
            f"Run once online (or set HF_HOME to a filled cache). {hint}"
        )
    if url:
        cached_path = Path(torch.hub.get_dir()) / "checkpoints" / os.path.basename(urlparse(url).path)
        if offline and not cached_path.is_file():
            raise OfflineError(
                f"pretrained weights of timm model {model_name!r}: {cached_path} (from {url}) does not exist, and "
                "downloads are switched off (LIGHTNING_DML_OFFLINE or HF_HUB_OFFLINE). Run once online (or set "
                f"TORCH_HOME to a filled cache). {hint}"
            )
        return f"{url} (cached as {cached_path})"
    raise MissingFileError(f"timm model {model_name!r} has no pretrained weights (no file, hub id or url). {hint}")
