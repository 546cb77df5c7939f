"""Backbones: image -> pooled feature vector ``[B, out_features]``.

Every backbone exposes ``out_features`` (the width its head receives). Pretrained weights are never downloaded:
they are read from the standard local caches or an explicit ``weights_path``, and a missing file raises
:class:`FileNotFoundError` saying which file is needed and where to put it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch
from torch import nn

Pooling = Literal["avg", "max", "avgmax"]


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


def torch_hub_checkpoint_dir() -> Path:
    """Where torchvision caches downloaded weights: ``$TORCH_HOME/hub/checkpoints``."""
    return Path(torch.hub.get_dir()) / "checkpoints"


def load_state_dict_file(weights_path: str | os.PathLike, what: str, hint: str) -> dict[str, torch.Tensor]:
    """Load a state dict from ``weights_path``, or explain which file is missing and where it goes."""
    path = Path(weights_path).expanduser()
    if not path.is_file():
        raise FileNotFoundError(
            f"pretrained weights for {what} not found: {path} does not exist. {hint} "
            "Or set pretrained: false to start from random weights."
        )
    state = torch.load(path, map_location="cpu", weights_only=True)
    if isinstance(state, dict) and "state_dict" in state and isinstance(state["state_dict"], dict):
        state = state["state_dict"]
    return state


class SmallConvNet(nn.Module):
    """A four-block CNN for small images (the embedded Glyphs dataset): conv-BN-ReLU blocks, global pooling.

    Each block is one 3x3 convolution (two with ``double_conv``), the first three followed by 2x2 max pooling.

    Args:
        in_channels: input channels (1 for the grey glyphs).
        width: channels of the first block; the second and third double them.
        double_conv: two convolutions per block instead of one.
        pooling: global pooling mode.
    """

    def __init__(
        self, in_channels: int = 1, width: int = 32, double_conv: bool = False, pooling: Pooling = "avg"
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = in_channels
        for block in range(4):
            out = width * 2 ** min(block, 2)
            for conv in range(2 if double_conv else 1):
                layers += [
                    nn.Conv2d(channels if conv == 0 else out, out, 3, padding=1, bias=False),
                    nn.BatchNorm2d(out),
                    nn.ReLU(inplace=True),
                ]
            if block < 3:
                layers.append(nn.MaxPool2d(2))
            channels = out
        self.features = nn.Sequential(*layers)
        self.pool = GlobalPool(pooling)
        self.out_features = channels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.features(x))


class ResNet50(nn.Module):
    """torchvision ResNet-50 without its classifier (the tuplet margin paper's backbone; the modern baseline).

    Input convention: RGB, values in [0, 1], ImageNet mean/std.

    Args:
        pretrained: load ImageNet weights (``IMAGENET1K_V1``) from ``weights_path`` or torchvision's cache
            (``$TORCH_HOME/hub/checkpoints/resnet50-0676ba61.pth``).
        weights_path: explicit weights file; overrides the cache.
        pooling: global pooling mode.
    """

    out_features = 2048

    def __init__(self, pretrained: bool = True, weights_path: str | None = None, pooling: Pooling = "avg") -> None:
        super().__init__()
        from torchvision.models import ResNet50_Weights, resnet50

        model = resnet50(weights=None)
        if pretrained:
            weights = ResNet50_Weights.IMAGENET1K_V1
            filename = os.path.basename(weights.url)
            path = weights_path or torch_hub_checkpoint_dir() / filename
            hint = (
                f"Copy torchvision's {filename} (from {weights.url} on a machine with internet) to "
                f"{torch_hub_checkpoint_dir()} or pass weights_path."
            )
            model.load_state_dict(load_state_dict_file(path, "resnet50", hint))
        model.fc = nn.Identity()
        model.avgpool = nn.Identity()
        self.body = nn.Sequential(*(m for name, m in model.named_children() if name not in ("avgpool", "fc")))
        self.pool = GlobalPool(pooling)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.pool(self.body(x))
