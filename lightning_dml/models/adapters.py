"""Parameter-efficient fine-tuning of a timm backbone: which weights train, and the adapter modules that add some.

:class:`~lightning_dml.models.TimmBackbone` takes ``adapter=`` one of :data:`ADAPTERS`; :func:`apply_adapter`
changes the timm model in place and returns the names of the parameters that train (every other parameter of the
model gets ``requires_grad=False`` and is left out of the optimizer and of the checkpoints):

* ``"lora"``: LoRA (Hu et al., ICLR 2022, Eq. 3: ``h = W0 x + (alpha / r) B A x``, ``A`` ``[r, in]`` random,
  ``B`` ``[out, r]`` zero at the start, ``W0`` frozen) on the ``nn.Linear`` layers named by ``targets``
  (default: a ViT block's attention ``attn.qkv``, ``attn.proj`` and MLP ``mlp.fc1``, ``mlp.fc2``), through the
  ``peft`` library's ``inject_adapter_in_model`` (its LoRA layers: ``lora_A``/``lora_B``, A initialised as
  ``nn.Linear``'s Kaiming-uniform, B zeros; the frozen weight becomes ``<layer>.base_layer.weight``). Trainable:
  ``r * (in + out)`` per adapted layer. :func:`merge_adapter` folds ``(alpha / r) B A`` into ``W0`` and puts the
  plain ``nn.Linear`` back, so an export needs no ``peft``.
* ``"bias"``: BitFit (Ben Zaken et al., ACL 2022): every bias of the model trains (linear, convolution and
  normalisation biases), nothing else.
* ``"norm"``: the affine parameters (weight and bias) of every normalisation layer train (LayerNorm, GroupNorm,
  BatchNorm, RMSNorm and their timm subclasses), nothing else (BatchNorm running statistics keep updating in
  training mode, as when the whole model trains).
* ``"vpt"``: VPT-deep (Jia et al., ECCV 2022, Sec. 3.2): ``n`` learned prompt tokens ``P_{i-1}`` enter every
  transformer layer ``L_i`` after the class (and register) tokens, and the layer's outputs at their positions
  are dropped, ``[x_i, _, E_i] = L_i([x_{i-1}, P_{i-1}, E_{i-1}])``, ``i = 1..N`` (the paper's VPT-deep
  equation; the head reads ``x_N`` as before). :class:`VisualPrompts` holds ``P`` ``[N, n, C]`` and inserts/drops
  them with forward hooks on the model's blocks, so the timm weights keep their names; initialised as the
  authors' code (KMnP/vpt ``models/vit_prompt/vit.py``): uniform in ``+-sqrt(6 / (3 * patch_h * patch_w + C))``.
  Timm ``VisionTransformer`` models only (ViT, DeiT, DINO, DINOv2, CLIP). Trainable: ``N * n * C``.

An adapter that the backbone cannot take (VPT on a CNN, LoRA where no target linear exists) is one
:class:`AdapterError` naming the backbone. Checkpoints of a model with an adapter hold the trained parameters
alone (:func:`drop_frozen_weights`, with a fingerprint of the frozen weights they were trained on);
:func:`restore_frozen_weights` puts the frozen weights of the model as built (its pretrained weights) back before
the checkpoint loads, and refuses a checkpoint trained on other frozen weights.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from lightning_dml.errors import UserInputError

__all__ = [
    "ADAPTERS",
    "LORA_TARGETS",
    "AdapterError",
    "VisualPrompts",
    "adapter_frozen_parameters",
    "apply_adapter",
    "drop_frozen_weights",
    "frozen_fingerprint",
    "merge_adapter",
    "restore_frozen_weights",
]

ADAPTERS = ("lora", "bias", "norm", "vpt")
#: the linears LoRA adapts by default: a timm ViT block's attention and MLP projections
LORA_TARGETS = ("attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2")
#: the checkpoint entry (under ``checkpoint["lightning_dml"]``) that records what the adapter was trained on
CHECKPOINT_KEY = "adapter"
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm, nn.RMSNorm)


class AdapterError(UserInputError, ValueError):
    """An adapter that does not exist, has invalid options, or that this backbone cannot take."""


def _describe(model: nn.Module, model_name: str) -> str:
    return f"backbone {model_name} ({type(model).__name__})"


# ------------------------------------------------------------------------------------------------ LoRA
def lora_target_names(model: nn.Module, targets: Sequence[str]) -> list[str]:
    """Names of the ``nn.Linear`` modules of ``model`` whose name is, or ends with ``.``, one of ``targets``."""
    return [
        name for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and any(name == t or name.endswith(f".{t}") for t in targets)
    ]


def _apply_lora(model: nn.Module, model_name: str, r: int, alpha: float, dropout: float,
                targets: Sequence[str]) -> None:
    if int(r) < 1 or alpha <= 0 or not 0 <= dropout < 1:
        raise AdapterError(f"LoRA needs lora_r >= 1, lora_alpha > 0 and 0 <= lora_dropout < 1; got r={r}, "
                           f"alpha={alpha}, dropout={dropout}")
    if isinstance(targets, str) or not targets:
        raise AdapterError(f"lora_targets must be a non-empty list of module names, got {targets!r}")
    names = lora_target_names(model, targets)
    if not names:
        raise AdapterError(
            f"adapter 'lora' needs nn.Linear layers named {', '.join(targets)} (lora_targets); "
            f"{_describe(model, model_name)} has none"
        )
    try:
        from peft import LoraConfig, inject_adapter_in_model
    except ImportError:
        raise AdapterError("adapter 'lora' needs the peft package: pip install 'lightning-dml[peft]'") from None
    config = LoraConfig(r=int(r), lora_alpha=float(alpha), lora_dropout=float(dropout), target_modules=names)
    inject_adapter_in_model(config, model)


def _lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The peft LoRA layers of ``model`` (empty when none was injected; peft is not imported then)."""
    if not any("lora_A" in name for name, _ in model.named_parameters()):
        return []
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [(name, module) for name, module in model.named_modules() if isinstance(module, BaseTunerLayer)]


# ------------------------------------------------------------------------------------------------ VPT-deep
class VisualPrompts(nn.Module):
    """VPT-deep's prompts (Jia et al., ECCV 2022, Sec. 3.2): ``prompts[i]`` ``[n, C]`` enter block ``i``.

    :meth:`attach` registers, on each block, a forward pre-hook that inserts ``prompts[i]`` after the
    ``num_prefix`` class/register tokens and a forward hook that drops the block's outputs at those positions;
    every block's input and output is thus the model's usual token sequence (``forward_features`` and
    ``forward_intermediates`` are unchanged outside the blocks).
    """

    def __init__(self, depth: int, tokens: int, width: int, patch_area: int, num_prefix: int) -> None:
        super().__init__()
        self.num_prefix = int(num_prefix)
        self.prompts = nn.Parameter(torch.empty(depth, tokens, width))
        bound = math.sqrt(6.0 / float(3 * patch_area + width))  # the authors' code (KMnP/vpt vit_prompt/vit.py)
        nn.init.uniform_(self.prompts, -bound, bound)

    def insert(self, index: int, block: nn.Module, args: tuple, kwargs: dict[str, Any]) -> tuple[tuple, dict]:
        """Pre-hook of block ``index``: ``[prefix, E] -> [prefix, P_index, E]``."""
        if kwargs.get("attn_mask") is not None or kwargs.get("is_causal"):
            raise AdapterError("adapter 'vpt' does not support attention masks (NaFlex / causal attention)")
        x = args[0]
        prompts = self.prompts[index].to(x.dtype).expand(x.shape[0], -1, -1)
        x = torch.cat([x[:, : self.num_prefix], prompts, x[:, self.num_prefix :]], dim=1)
        return (x, *args[1:]), kwargs

    def drop(self, index: int, block: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
        """Forward hook of block ``index``: the outputs at the prompts' positions are discarded."""
        n = self.prompts.shape[1]
        return torch.cat([output[:, : self.num_prefix], output[:, self.num_prefix + n :]], dim=1)

    def attach(self, blocks: Sequence[nn.Module]) -> None:
        # functools.partial of bound methods (not closures): a deep copy of the backbone hooks its own prompts
        for index, block in enumerate(blocks):
            block.register_forward_pre_hook(functools.partial(self.insert, index), with_kwargs=True)
            block.register_forward_hook(functools.partial(self.drop, index))


def _apply_vpt(model: nn.Module, model_name: str, tokens: int) -> VisualPrompts:
    from timm.models.vision_transformer import VisionTransformer

    if not isinstance(model, VisionTransformer):
        raise AdapterError(
            f"adapter 'vpt' (visual prompt tuning) needs a timm VisionTransformer (ViT, DeiT, DINO, DINOv2, CLIP); "
            f"{_describe(model, model_name)} is not one"
        )
    if int(tokens) < 1:
        raise AdapterError(f"vpt_tokens must be >= 1, got {tokens}")
    patch = tuple(model.patch_embed.patch_size)
    prompts = VisualPrompts(len(model.blocks), int(tokens), int(model.embed_dim), patch[0] * patch[-1],
                            int(model.num_prefix_tokens))
    prompts.attach(list(model.blocks))
    return prompts


# ------------------------------------------------------------------------------------------------ all adapters
def apply_adapter(
    model: nn.Module,
    model_name: str,
    adapter: str,
    *,
    lora_r: int = 8,
    lora_alpha: float = 8.0,
    lora_dropout: float = 0.0,
    lora_targets: Sequence[str] = LORA_TARGETS,
    vpt_tokens: int = 10,
) -> VisualPrompts | None:
    """Apply ``adapter`` to the timm ``model`` in place and freeze every parameter of it that the adapter does not
    train (see the module docstring). Returns the :class:`VisualPrompts` for ``"vpt"`` (the caller keeps it as a
    submodule: its parameter lives outside the timm model), else ``None``."""
    if adapter not in ADAPTERS:
        raise AdapterError(f"unknown adapter {adapter!r}; adapters: {', '.join(ADAPTERS)} (or none)")
    prompts = None
    if adapter == "lora":
        _apply_lora(model, model_name, lora_r, lora_alpha, lora_dropout, lora_targets)
        trains = [p for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name]
    elif adapter == "bias":
        trains = [p for name, p in model.named_parameters() if name.endswith("bias")]
    elif adapter == "norm":
        trains = [p for m in model.modules() if isinstance(m, _NORMS) for p in m.parameters(recurse=False)]
    else:
        prompts = _apply_vpt(model, model_name, vpt_tokens)
        trains = []
    if adapter != "vpt" and not trains:
        what = {"bias": "bias", "norm": "normalisation layer"}.get(adapter, "LoRA")
        raise AdapterError(f"adapter {adapter!r}: {_describe(model, model_name)} has no {what} parameters to train")
    keep = {id(p) for p in trains}
    for p in model.parameters():
        p.requires_grad_(id(p) in keep)
    return prompts


def adapter_frozen_parameters(backbone: nn.Module) -> dict[str, nn.Parameter]:
    """``{name: parameter}`` of ``backbone`` (names relative to it) that its adapter keeps frozen; empty for a
    backbone without adapter."""
    frozen = getattr(backbone, "adapter_frozen_names", None)
    if not frozen:
        return {}
    return {name: p for name, p in backbone.named_parameters() if name in frozen}


def merge_adapter(backbone: nn.Module) -> nn.Module:
    """``backbone`` (a :class:`~lightning_dml.models.TimmBackbone`, changed in place) without its adapter where the
    adapter folds into the weights: LoRA's ``(alpha / r) B A`` is added to each frozen ``W0`` (peft's ``merge``)
    and the plain ``nn.Linear`` takes the LoRA layer's place; bias- and norm-only tuning are plain weights already.
    The recorded constructor arguments (``init_args``) then say ``adapter=None``, so the safe export format
    rebuilds it without ``peft``. VPT's prompts cannot be folded into weights: the backbone keeps them."""
    adapter = getattr(backbone, "adapter", None)
    if adapter not in ("lora", "bias", "norm"):
        return backbone
    model = backbone.model
    for name, layer in _lora_layers(model):
        layer.merge(safe_merge=True)  # raises on non-finite merged weights
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, layer.get_base_layer())
    backbone.adapter = None
    backbone.adapter_frozen_names = frozenset()
    for p in backbone.parameters():
        p.requires_grad_(True)
    if getattr(backbone, "init_args", None) is not None:
        object.__setattr__(backbone, "init_args", {**backbone.init_args, "adapter": None})
    return backbone


# ------------------------------------------------------------------------------------------------ checkpoints
def frozen_fingerprint(parameters: dict[str, nn.Parameter]) -> list[float]:
    """``[count, sum, sum of squares]`` of the frozen weights (float64): tells which base weights an adapter was
    trained on (another pretrained tag, random weights), without storing them."""
    if not parameters:
        return [0.0, 0.0, 0.0]
    with torch.no_grad():  # on the weights' device; two values copied back, once
        total = torch.stack([p.detach().double().sum() for p in parameters.values()]).sum()
        squares = torch.stack([p.detach().double().square().sum() for p in parameters.values()]).sum()
    return [float(sum(p.numel() for p in parameters.values())), float(total), float(squares)]


def drop_frozen_weights(backbone: nn.Module, checkpoint: dict[str, Any], prefix: str = "backbone.") -> None:
    """Remove the adapter's frozen weights from ``checkpoint["state_dict"]`` (keys ``prefix + name``) and record
    the adapter and :func:`frozen_fingerprint` of those weights under ``checkpoint["lightning_dml"]["adapter"]``.
    Buffers (BatchNorm statistics) stay. Nothing happens for a backbone without adapter."""
    frozen = adapter_frozen_parameters(backbone)
    if not frozen:
        return
    state = checkpoint.get("state_dict") or {}
    for name in frozen:
        state.pop(prefix + name, None)
    checkpoint.setdefault("lightning_dml", {})[CHECKPOINT_KEY] = {
        "adapter": getattr(backbone, "adapter", None),
        "base": getattr(backbone, "model_name", type(backbone).__name__),
        "fingerprint": frozen_fingerprint(frozen),
    }


def restore_frozen_weights(
    backbone: nn.Module, checkpoint: dict[str, Any], where: str, prefix: str = "backbone."
) -> None:
    """Before an adapter-only checkpoint loads: put the frozen weights of ``backbone`` as built (its pretrained
    weights) into ``checkpoint["state_dict"]``, after checking that the checkpoint was trained on the same frozen
    weights (:func:`frozen_fingerprint`: the sum of squares within 0.1 %, the sum within 1 % of the weights' norm,
    so a bf16 copy of the same weights passes and other weights do not). A checkpoint holding the whole backbone
    (trained without adapter) is left as it is; the weights check then names what does not fit."""
    state = checkpoint.get("state_dict")
    frozen = adapter_frozen_parameters(backbone)
    if not frozen or state is None or all(prefix + name in state for name in frozen):
        return
    from lightning_dml.checkpoints import CheckpointMismatchError

    record = (checkpoint.get("lightning_dml") or {}).get(CHECKPOINT_KEY)
    if not isinstance(record, dict):
        raise CheckpointMismatchError(
            f"{where} lacks {len([n for n in frozen if prefix + n not in state])} backbone weights and records no "
            "adapter: it is not an adapter checkpoint of this model"
        )
    theirs = [float(v) for v in record.get("fingerprint") or []]
    mine = frozen_fingerprint(frozen)
    # the sum up to ~1% of the weights' norm (bf16 rounding of many values), the sum of squares to 0.1%
    same = len(theirs) == 3 and theirs[0] == mine[0] and math.isclose(theirs[2], mine[2], rel_tol=1e-3) and \
        abs(theirs[1] - mine[1]) <= 1e-3 * abs(mine[1]) + 1e-2 * math.sqrt(mine[2])
    if not same:
        raise CheckpointMismatchError(
            f"{where} holds a {record.get('adapter')!r} adapter trained on other frozen weights of "
            f"{record.get('base')} than the backbone as built here ({getattr(backbone, 'model_name', '?')}, "
            f"adapter {getattr(backbone, 'adapter', None)!r}): build the backbone with the pretrained weights the "
            "adapter was trained on (same model_name tag, pretrained or weights_path)"
        )
    for name, p in frozen.items():
        state.setdefault(prefix + name, p.detach())
