"""Paper-standard image transforms, followed by the conversion to a backbone's :class:`InputSpec`.

Training: random resized crop to ``crop_size`` (224 in the MS, GPW-L and TML papers, 227 in RLL and the MS code)
and a random horizontal flip. Test: resize the shorter side to ``resize_size`` (256) and take the centre
``crop_size`` crop. Both resample with the spec's ``interpolation`` (bilinear by default; bicubic for most timm
weights). Both end with :class:`ToInputSpec`, which turns the uint8 RGB (or grey) image into the
tensor the backbone expects: channel order (RGB, or BGR for Caffe models such as BN-Inception), value scale (1 or
255) and per-channel mean/std.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torchvision import transforms as T

from lightning_dml.models.input_spec import InputSpec


class ToInputSpec:
    """Convert a uint8 image tensor ``[C, H, W]`` (RGB, or one grey channel) to the float input of ``spec``.

    ``out = (reorder(x) * spec.scale / 255 - mean) / std``, where ``reorder`` swaps RGB to BGR when the spec asks
    for it and ``mean``/``std`` are given in the spec's channel order and value scale.
    """

    def __init__(self, spec: InputSpec) -> None:
        self.spec = spec
        self.mean = torch.tensor(spec.mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(spec.std, dtype=torch.float32).view(-1, 1, 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        if image.dtype != torch.uint8 or image.ndim != 3:
            raise ValueError(f"ToInputSpec expects a uint8 [C, H, W] tensor, got {image.dtype} {tuple(image.shape)}")
        if image.shape[0] != self.spec.channels:
            raise ValueError(
                f"ToInputSpec: the image has {image.shape[0]} channels but the {self.spec.color} input spec needs "
                f"{self.spec.channels}"
            )
        x = image.to(torch.float32) * (self.spec.scale / 255.0)
        if self.spec.color == "BGR":
            x = x.flip(0)
        return (x - self.mean) / self.std

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec})"


def _interpolation(spec: InputSpec) -> T.InterpolationMode:
    """torchvision's resampling mode for the spec's ``interpolation`` (bilinear, bicubic or nearest)."""
    return T.InterpolationMode(spec.interpolation)


def default_resize_size(crop_size: int, spec: InputSpec) -> int:
    """The test-time resize for ``crop_size``: the spec's (256) when the crop lies between the spec's crop and
    resize sizes (224 or 227 -> 256, as in the papers), otherwise the spec's ratio (256/224) times the crop."""
    if spec.crop_size <= crop_size <= spec.resize_size:
        return spec.resize_size
    return max(crop_size, int(round(crop_size * spec.resize_size / spec.crop_size)))


def train_transform(
    spec: InputSpec, crop_size: int | None = None, crop_scale: tuple[float, float] = (0.08, 1.0)
) -> Callable:
    """Random resized crop (``crop_scale`` = area range, torchvision's default) + horizontal flip + spec conversion."""
    crop = spec.crop_size if crop_size is None else int(crop_size)
    return T.Compose(
        [
            T.RandomResizedCrop(crop, scale=tuple(crop_scale), interpolation=_interpolation(spec), antialias=True),
            T.RandomHorizontalFlip(),
            T.PILToTensor(),
            ToInputSpec(spec),
        ]
    )


def eval_transform(spec: InputSpec, crop_size: int | None = None, resize_size: int | None = None) -> Callable:
    """Resize the shorter side to ``resize_size`` + centre crop ``crop_size`` + spec conversion."""
    crop = spec.crop_size if crop_size is None else int(crop_size)
    resize = default_resize_size(crop, spec) if resize_size is None else int(resize_size)
    if resize < crop:
        raise ValueError(f"resize_size ({resize}) must be at least the crop size ({crop})")
    resize_op = T.Resize(resize, interpolation=_interpolation(spec), antialias=True)
    return T.Compose([resize_op, T.CenterCrop(crop), T.PILToTensor(), ToInputSpec(spec)])


__all__ = ["ToInputSpec", "default_resize_size", "eval_transform", "train_transform"]
