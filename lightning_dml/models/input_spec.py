"""The input convention a backbone expects: declared by the backbone (the models package), read by the data modules."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from lightning_dml.errors import UserInputError


class InputSpecMismatchError(UserInputError, ValueError):
    """A data module's ``input_spec`` set by hand differs from the one its model's backbone declares."""


#: resampling filters the transforms accept (torchvision ``InterpolationMode`` values, timm's names)
INTERPOLATIONS = ("bilinear", "bicubic", "nearest")


@dataclass(frozen=True)
class InputSpec:
    """How images must be presented to a backbone.

    Args:
        color: channel order: ``"RGB"``, ``"BGR"`` (Caffe models such as BN-Inception) or ``"L"`` (grey).
        scale: the value of a white pixel before normalisation: ``1.0`` (torchvision) or ``255.0`` (Caffe).
        mean: per-channel mean subtracted, on the ``scale`` scale, in ``color`` order.
        std: per-channel divisor applied after the mean, on the ``scale`` scale, in ``color`` order.
        crop_size: side of the square crop the network sees (224 or 227 in the papers).
        resize_size: shorter side the test transform resizes to before the centre crop (256 in the papers).
            ``None``: ``floor(crop_size / crop_pct)`` (timm's rule) when ``crop_pct`` is given, else 256.
        interpolation: resampling filter of the resize and random-resized-crop transforms: ``"bilinear"`` (the
            papers, torchvision), ``"bicubic"`` (most timm weights) or ``"nearest"``.
        crop_pct: fraction of the resized image the test-time centre crop keeps (timm's data config
            ``crop_pct``). ``None``: ``crop_size / resize_size`` (224 / 256 = 0.875). Given together with
            ``resize_size``, the two must agree (``resize_size == floor(crop_size / crop_pct)``).
    """

    color: Literal["RGB", "BGR", "L"] = "RGB"
    scale: float = 1.0
    mean: tuple[float, ...] = (0.485, 0.456, 0.406)
    std: tuple[float, ...] = (0.229, 0.224, 0.225)
    crop_size: int = 224
    resize_size: int | None = None
    interpolation: Literal["bilinear", "bicubic", "nearest"] = "bilinear"
    crop_pct: float | None = None

    def __post_init__(self) -> None:
        if self.interpolation not in INTERPOLATIONS:
            raise ValueError(f"interpolation must be one of {INTERPOLATIONS}, got {self.interpolation!r}")
        if self.crop_pct is not None and not 0 < self.crop_pct <= 1:
            raise ValueError(f"crop_pct must be in (0, 1], got {self.crop_pct}")
        if self.resize_size is None:
            resize = 256 if self.crop_pct is None else math.floor(self.crop_size / self.crop_pct)
            object.__setattr__(self, "resize_size", int(resize))
        elif self.crop_pct is not None and math.floor(self.crop_size / self.crop_pct + 1e-6) != self.resize_size:
            raise ValueError(
                f"crop_pct {self.crop_pct} and resize_size {self.resize_size} disagree for crop_size "
                f"{self.crop_size} (resize_size must be floor(crop_size / crop_pct)); give only one of them"
            )
        if self.crop_pct is None and self.resize_size > 0:
            object.__setattr__(self, "crop_pct", self.crop_size / self.resize_size)
        channels = 1 if self.color == "L" else 3
        if self.color not in ("RGB", "BGR", "L"):
            raise ValueError(f"color must be 'RGB', 'BGR' or 'L', got {self.color!r}")
        if self.scale not in (1.0, 255.0):
            raise ValueError(f"scale must be 1.0 or 255.0, got {self.scale}")
        if len(self.mean) != channels or len(self.std) != channels:
            raise ValueError(
                f"{self.color} input needs {channels} mean and std values, got {len(self.mean)} and {len(self.std)}"
            )
        if any(s <= 0 for s in self.std):
            raise ValueError(f"std values must be positive, got {self.std}")
        if not 0 < self.crop_size <= self.resize_size:
            raise ValueError(f"need 0 < crop_size <= resize_size, got {self.crop_size} and {self.resize_size}")

    @property
    def channels(self) -> int:
        return 1 if self.color == "L" else 3


#: torchvision's ImageNet models: RGB in [0, 1], ImageNet mean and std.
TORCHVISION_IMAGENET = InputSpec()

#: BN-Inception from ``pretrainedmodels`` (Caffe-converted): BGR in [0, 255], mean [104, 117, 128], std 1.
BNINCEPTION = InputSpec(color="BGR", scale=255.0, mean=(104.0, 117.0, 128.0), std=(1.0, 1.0, 1.0))


def backbone_input_spec(model: object) -> InputSpec | None:
    """The :class:`InputSpec` a model's backbone declares (``model.backbone.input_spec``), or ``None``.

    The CLI links it to the data module's ``input_spec`` (``link_arguments(..., apply_on="instantiate")``), so a
    config cannot pair a backbone with another backbone's preprocessing; ``None`` keeps the data module's default.
    """
    backbone = getattr(model, "backbone", model)
    spec = getattr(backbone, "input_spec", None)
    if spec is not None and not isinstance(spec, InputSpec):
        raise TypeError(f"{type(backbone).__name__}.input_spec must be an InputSpec, got {type(spec).__name__}")
    return spec
