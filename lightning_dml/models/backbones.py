"""Backbones: image -> pooled feature vector ``[B, out_features]``, and pooled multi-level features.

Every backbone is a :class:`Backbone`:

* ``forward(images)`` returns the globally pooled output of its last stage, ``[B, out_features]``;
* ``forward_levels(images)`` returns the pooled outputs of three stages, low to high (BN-Inception:
  inception-3c / 4e / 5b, the RLL "L, M, H" levels and GPW's multi-level fusion; ResNet: stages 2 / 3 / 4;
  GoogLeNet: inception-3b / 4e / 5b), with widths ``level_features`` and names ``level_names``;
* ``input_spec`` is the :class:`~lightning_dml.models.input_spec.InputSpec` its weights expect (the data module
  consumes it: colour order, value scale, mean, std).

Backbones are built by class path (``lightning_dml.models.BNInception``) or by name through the small registry
:data:`BACKBONES` / :func:`build_backbone`. Pretrained weights are read from an explicit ``weights_path`` or
the standard cache (``$TORCH_HOME/hub/checkpoints/<file name>``, the files torchvision and ``pretrainedmodels``
download); a missing cache file is downloaded on first use from :data:`~lightning_dml.models.weights.WEIGHTS`
(verified, under a file lock). Offline (``LIGHTNING_DML_OFFLINE=1``), a missing file raises
:class:`~lightning_dml.errors.OfflineError` (a ``FileNotFoundError``) saying which file is needed and where.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from lightning_dml.download import fetch_weights
from lightning_dml.errors import CorruptFileError, MissingFileError
from lightning_dml.models.input_spec import BNINCEPTION, TORCHVISION_IMAGENET, InputSpec
from lightning_dml.models.records import RecordsInitArgs
from lightning_dml.models.weights import WEIGHTS, weights_entry

Pooling = Literal["avg", "max", "avgmax"]

__all__ = [
    "BACKBONES",
    "BNINCEPTION_URL",
    "BNInception",
    "Backbone",
    "GlobalPool",
    "GoogLeNet",
    "Pooling",
    "ResNet101",
    "ResNet50",
    "SmallConvNet",
    "build_backbone",
    "check_levels",
    "load_state_dict_file",
    "torch_hub_checkpoint_dir",
]

#: where ``pretrainedmodels`` downloads BN-Inception from; the cache file is this URL's base name
BNINCEPTION_URL = WEIGHTS["bninception"].url


class GlobalPool(nn.Module):
    """Global average, max, or average + max pooling of a ``[B, C, H, W]`` map to ``[B, C]``."""

    def __init__(self, mode: Pooling = "avg") -> None:
        super().__init__()
        if mode not in ("avg", "max", "avgmax"):
            raise ValueError(f"pooling must be 'avg', 'max' or 'avgmax', got {mode!r}")
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode == "avg":
            return x.mean(dim=(2, 3))
        if self.mode == "max":
            return x.amax(dim=(2, 3))
        return x.mean(dim=(2, 3)) + x.amax(dim=(2, 3))

    def extra_repr(self) -> str:
        return f"mode={self.mode!r}"


def torch_hub_checkpoint_dir() -> Path:
    """Where torchvision and ``pretrainedmodels`` cache downloaded weights: ``$TORCH_HOME/hub/checkpoints``."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def load_state_dict_file(weights_path: str | os.PathLike, what: str, hint: str) -> dict[str, torch.Tensor]:
    """Load a state dict from ``weights_path``, or explain which file is missing and where it goes."""
    path = Path(weights_path).expanduser()
    if not path.is_file():
        raise MissingFileError(
            f"pretrained weights for {what} not found: {path} does not exist. {hint} "
            "Or set pretrained: false to start from random weights."
        )
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # noqa: BLE001 - truncated or foreign files fail in many ways; name the file
        raise CorruptFileError(
            f"pretrained weights for {what}: cannot read {path} ({type(error).__name__}: {error}). The file is "
            f"truncated or not a PyTorch weights file: delete it (a cached file is then downloaded again). {hint}"
        ) from error
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    if not isinstance(state, dict):
        raise CorruptFileError(f"{path} does not hold a state dict (a mapping of parameter names to tensors)")
    return state


def _cached_weights(name: str, weights_path: str | os.PathLike | None) -> dict[str, torch.Tensor]:
    """The state dict at ``weights_path``, or ``WEIGHTS[name]`` in the torch hub cache, downloaded when missing."""
    if weights_path is not None:
        return load_state_dict_file(weights_path, name, "Check weights_path.")
    remote = weights_entry(name)
    cache = torch_hub_checkpoint_dir()
    hint = (
        f"Copy {remote.file_name} (from {remote.url}) to {cache} (set TORCH_HOME to move that folder), or pass "
        "weights_path, or set pretrained: false to start from random weights."
    )
    return load_state_dict_file(fetch_weights(remote, cache, name, hint), name, hint)


class Backbone(RecordsInitArgs, nn.Module):
    """Base class of the backbones: pooled last-stage features and pooled multi-level features.

    Subclasses set ``out_features``, ``level_features``, ``level_names`` and ``input_spec`` and implement
    :meth:`forward_levels`; ``forward`` returns its last element.
    ``init_args`` records the constructor's arguments (:class:`~lightning_dml.models.records.RecordsInitArgs`), so
    the safe export format can rebuild the backbone from plain data.

    Args:
        pooling: global pooling of every returned feature map: ``"avg"``, ``"max"`` or ``"avgmax"`` (their sum).
    """

    out_features: int
    level_features: tuple[int, ...]
    level_names: tuple[str, ...]
    input_spec: InputSpec

    def __init__(self, pooling: Pooling = "avg") -> None:
        super().__init__()
        self.pool = GlobalPool(pooling)

    def forward_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        """The unpooled feature maps of the levels, low to high."""
        raise NotImplementedError(f"{type(self).__name__} must implement forward_maps()")

    def forward_levels(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Pooled features of the levels, low to high: a list of ``[B, level_features[i]]``."""
        return [self.pool(m) for m in self.forward_maps(x)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_levels(x)[-1]


class _StagedBackbone(Backbone):
    """A backbone made of consecutive stages whose outputs are the levels (the first stage includes the stem)."""

    stages: nn.ModuleList

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def forward_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        x = self._prepare(x)
        maps = []
        for stage in self.stages:
            x = stage(x)
            maps.append(x)
        return maps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._prepare(x)
        for stage in self.stages:
            x = stage(x)
        return self.pool(x)


class SmallConvNet(_StagedBackbone):
    """A four-block CNN for small images (the embedded Glyphs dataset): conv-BN-ReLU blocks, global pooling.

    Each block is one 3x3 convolution (two with ``double_conv``), the first three followed by 2x2 max pooling.
    The levels are the outputs of blocks 2, 3 and 4. Random initialisation only (there are no pretrained weights).

    Args:
        in_channels: input channels (1 for the grey glyphs).
        width: channels of the first block; the second and third double them.
        double_conv: two convolutions per block instead of one.
        pooling: global pooling mode.
    """

    def __init__(
        self, in_channels: int = 1, width: int = 32, double_conv: bool = False, pooling: Pooling = "avg"
    ) -> None:
        super().__init__(pooling)
        if in_channels not in (1, 3):
            raise ValueError(f"in_channels must be 1 (grey) or 3 (RGB), got {in_channels}")
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        blocks: list[nn.Sequential] = []
        widths = []
        channels = in_channels
        for block in range(4):
            out = width * 2 ** min(block, 2)
            layers: list[nn.Module] = []
            for conv in range(2 if double_conv else 1):
                layers += [
                    nn.Conv2d(channels if conv == 0 else out, out, 3, padding=1, bias=False),
                    nn.BatchNorm2d(out),
                    nn.ReLU(inplace=True),
                ]
            if block < 3:
                layers.append(nn.MaxPool2d(2))
            blocks.append(nn.Sequential(*layers))
            widths.append(out)
            channels = out
        self.stages = nn.ModuleList([nn.Sequential(blocks[0], blocks[1]), blocks[2], blocks[3]])
        self.level_features = tuple(widths[1:])
        self.level_names = ("block2", "block3", "block4")
        self.out_features = channels
        # the Glyphs data module's defaults: pixels in [0, 1], mean 0.1, std 0.25
        color = "L" if in_channels == 1 else "RGB"
        self.input_spec = InputSpec(
            color=color, mean=(0.1,) * in_channels, std=(0.25,) * in_channels, crop_size=32, resize_size=32
        )


class _TorchvisionResNet(_StagedBackbone):
    """torchvision ResNet without its classifier; levels: stages 2, 3 and 4 (``layer2``, ``layer3``, ``layer4``)."""

    _builder: str

    def __init__(self, pretrained: bool = True, weights_path: str | None = None, pooling: Pooling = "avg") -> None:
        super().__init__(pooling)
        import torchvision.models as tvm

        model = getattr(tvm, self._builder)(weights=None)
        if pretrained:
            model.load_state_dict(_cached_weights(self._builder, weights_path))
        stem = nn.Sequential(model.conv1, model.bn1, model.relu, model.maxpool, model.layer1, model.layer2)
        self.stages = nn.ModuleList([stem, model.layer3, model.layer4])
        self.level_features = (512, 1024, 2048)
        self.level_names = ("layer2", "layer3", "layer4")
        self.out_features = 2048
        self.input_spec = TORCHVISION_IMAGENET


class ResNet50(_TorchvisionResNet):
    """torchvision ResNet-50 (the tuplet margin paper's backbone; the modern baseline).

    Input: RGB in [0, 1], ImageNet mean/std (:data:`~lightning_dml.models.input_spec.TORCHVISION_IMAGENET`).

    Args:
        pretrained: load the ImageNet weights (``IMAGENET1K_V1``) from ``weights_path`` or torchvision's cache
            (``$TORCH_HOME/hub/checkpoints/resnet50-0676ba61.pth``).
        weights_path: explicit weights file; overrides the cache.
        pooling: global pooling mode.
    """

    _builder = "resnet50"


class ResNet101(_TorchvisionResNet):
    """torchvision ResNet-101 (the tuplet margin paper's Table 6 ablation).

    Args:
        pretrained: load the ImageNet weights (``IMAGENET1K_V1``) from ``weights_path`` or torchvision's cache
            (``$TORCH_HOME/hub/checkpoints/resnet101-63fe2227.pth``).
        weights_path: explicit weights file; overrides the cache.
        pooling: global pooling mode.
    """

    _builder = "resnet101"


class GoogLeNet(_StagedBackbone):
    """torchvision GoogLeNet (Inception V1; the N-pair paper's backbone), without classifier and auxiliary heads.

    Levels: inception-3b (480), inception-4e (832), inception-5b (1024). Input: torchvision's convention (RGB in
    [0, 1], ImageNet mean/std); like torchvision's pretrained model, the input is re-mapped to the ``(x - 0.5) /
    0.5`` scale the weights were trained on (``transform_input``).

    Args:
        pretrained: load the ImageNet weights (``IMAGENET1K_V1``) from ``weights_path`` or torchvision's cache
            (``$TORCH_HOME/hub/checkpoints/googlenet-1378be20.pth``).
        weights_path: explicit weights file; overrides the cache.
        pooling: global pooling mode.
    """

    def __init__(self, pretrained: bool = True, weights_path: str | None = None, pooling: Pooling = "avg") -> None:
        super().__init__(pooling)
        from torchvision.models import GoogLeNet as TVGoogLeNet

        # the released state dict includes the auxiliary classifiers: build them to load it, then drop them
        model = TVGoogLeNet(aux_logits=True, transform_input=True, init_weights=not pretrained)
        if pretrained:
            model.load_state_dict(_cached_weights("googlenet", weights_path))
        m = model
        self.stages = nn.ModuleList(
            [
                nn.Sequential(m.conv1, m.maxpool1, m.conv2, m.conv3, m.maxpool2, m.inception3a, m.inception3b),
                nn.Sequential(m.maxpool3, m.inception4a, m.inception4b, m.inception4c, m.inception4d, m.inception4e),
                nn.Sequential(m.maxpool4, m.inception5a, m.inception5b),
            ]
        )
        self.level_features = (480, 832, 1024)
        self.level_names = ("inception3b", "inception4e", "inception5b")
        self.out_features = 1024
        self.input_spec = TORCHVISION_IMAGENET
        mean = torch.tensor(TORCHVISION_IMAGENET.mean).view(1, 3, 1, 1)
        std = torch.tensor(TORCHVISION_IMAGENET.std).view(1, 3, 1, 1)
        # x_tv = x * std / 0.5 + (mean - 0.5) / 0.5  (torchvision GoogLeNet._transform_input)
        self.register_buffer("_in_scale", std / 0.5, persistent=False)
        self.register_buffer("_in_shift", (mean - 0.5) / 0.5, persistent=False)

    def _prepare(self, x: torch.Tensor) -> torch.Tensor:
        return x * self._in_scale.to(x.dtype) + self._in_shift.to(x.dtype)


class BNInception(Backbone):
    """BN-Inception (GoogLeNet V2, Ioffe & Szegedy 2015) from ``pretrainedmodels``: the MS, RLL and GPW backbone.

    Levels: inception-3c (576 channels), inception-4e (1056), inception-5b (1024): the outputs RLL attaches its
    "L", "M" and "H" embeddings to (RLL Sec. 4.4) and GPW's multi-level fusion ("v2", GPW Sec. IV) uses.
    Input: the Caffe convention of the converted weights, BGR in [0, 255] minus mean [104, 117, 128]
    (:data:`~lightning_dml.models.input_spec.BNINCEPTION`).

    Args:
        pretrained: load the ImageNet weights from ``weights_path`` or the torch hub cache
            (``$TORCH_HOME/hub/checkpoints/bn_inception-52deb4733.pth``, the file ``pretrainedmodels`` downloads).
        weights_path: explicit weights file; overrides the cache. State dicts that store BatchNorm vectors as
            ``[1, C]`` (other ports of the Caffe model) are accepted.
        pooling: global pooling mode.
    """

    def __init__(self, pretrained: bool = True, weights_path: str | None = None, pooling: Pooling = "avg") -> None:
        super().__init__(pooling)
        from pretrainedmodels.models.bninception import BNInception as _BNInception

        net = _BNInception(num_classes=1000)
        if pretrained:
            state = _cached_weights("bninception", weights_path)
            expected = net.state_dict()
            state = {
                k: v.reshape(expected[k].shape) if k in expected and v.numel() == expected[k].numel() else v
                for k, v in state.items()
            }
            net.load_state_dict(state)
        # the classifier is not used: pooled features go to the embedding head
        net.global_pool = nn.Identity()
        net.last_linear = nn.Identity()
        self.net = net
        self.level_features = (576, 1056, 1024)
        self.level_names = ("inception_3c", "inception_4e", "inception_5b")
        self.out_features = 1024
        self.input_spec = BNINCEPTION
        # ``features`` is one long function: the inception-3c and 4e outputs are caught as the inputs of the next
        # block's first convolution (they are not modified in place)
        self._captured: dict[str, torch.Tensor] | None = None
        net.inception_4a_1x1.register_forward_pre_hook(self._catcher("inception_3c"))
        net.inception_5a_1x1.register_forward_pre_hook(self._catcher("inception_4e"))

    def _catcher(self, name: str) -> Callable[[nn.Module, tuple[Any, ...]], None]:
        def hook(module: nn.Module, inputs: tuple[Any, ...]) -> None:
            if self._captured is not None:
                self._captured[name] = inputs[0]

        return hook

    def forward_maps(self, x: torch.Tensor) -> list[torch.Tensor]:
        self._captured = {}
        try:
            top = self.net.features(x)
            maps = [self._captured["inception_3c"], self._captured["inception_4e"], top]
        finally:
            self._captured = None
        return maps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.net.features(x))


#: backbone name -> class (``build_backbone`` and ``DMLModule(backbone="name")``)
BACKBONES: dict[str, type[Backbone]] = {
    "bninception": BNInception,
    "googlenet": GoogLeNet,
    "resnet50": ResNet50,
    "resnet101": ResNet101,
    "small_convnet": SmallConvNet,
}


def build_backbone(name: str, **kwargs: Any) -> Backbone:
    """Build a backbone by registry name, e.g. ``build_backbone("resnet50", pretrained=False, pooling="max")``,
    or any timm model as ``"timm:<name>"``, e.g. ``build_backbone("timm:vit_small_patch16_224.dino")``
    (:class:`~lightning_dml.models.timm_backbone.TimmBackbone`)."""
    if name.startswith("timm:"):
        from lightning_dml.models.timm_backbone import TimmBackbone

        return TimmBackbone(name[len("timm:") :], **kwargs)
    if name not in BACKBONES:
        raise ValueError(f"unknown backbone {name!r}; valid names: {', '.join(sorted(BACKBONES))}")
    return BACKBONES[name](**kwargs)


def check_levels(backbone: nn.Module) -> Sequence[int]:
    """The level widths of a backbone that supports multi-level features, or a ValueError saying it does not."""
    if not hasattr(backbone, "forward_levels") or not hasattr(backbone, "level_features"):
        raise ValueError(
            f"backbone {type(backbone).__name__} has no multi-level features (forward_levels / level_features); "
            f"use one of {', '.join(sorted(BACKBONES))} or fusion='none'"
        )
    return tuple(int(c) for c in backbone.level_features)
