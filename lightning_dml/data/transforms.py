"""Paper-standard image transforms, followed by the conversion to a backbone's :class:`InputSpec`.

Training: random resized crop to ``crop_size`` (224 in the MS, GPW-L and TML papers, 227 in RLL and the MS code)
and a random horizontal flip. Test: resize the shorter side to ``resize_size`` (256) and take the centre
``crop_size`` crop. Both resample with the spec's ``interpolation`` (bilinear by default; bicubic for most timm
weights). Both end with :class:`ToInputSpec`, which turns the uint8 RGB (or grey) image into the
tensor the backbone expects: channel order (RGB, or BGR for Caffe models such as BN-Inception), value scale (1 or
255) and per-channel mean/std.

The same transforms exist for the uint8 tensors of the decoded-image cache
(:mod:`lightning_dml.data.decoded_cache`, ``cache="decoded"``): :func:`tensor_train_transform` and
:func:`tensor_eval_transform` (torchvision.transforms.v2 on ``[C, H, W]`` uint8 tensors, no PIL). The cache stores
each image resized to the evaluation's shorter side, so the evaluation transform from the cache is the centre
crop alone (bit-identical to the uncached one when ``cache_size`` equals ``resize_size``), and the training
transform cuts its random resized crop from the stored image.

Device-side augmentation (``augment_on_device=True``): the training transforms stop after the crop and resize and
return a :class:`DeviceImage` (the uint8 crop and the flip decision, drawn from the same generator at the same
point as :class:`~torchvision.transforms.RandomHorizontalFlip` would); after the batch reached the device,
:func:`finish_on_device` flips the chosen images and converts the batch with :class:`ToInputSpec`, with the same
result, bit for bit, as the transforms in the workers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

import torch

from lightning_dml.models.input_spec import InputSpec

# torchvision is imported by the functions that build its transforms: importing it takes about 2 s (its ops import
# torch._dynamo), which the users of ToInputSpec and default_resize_size alone (lightning_dml.data.pil_eval: search,
# serve) do not pay
if TYPE_CHECKING:
    from torchvision.transforms import InterpolationMode


class ToInputSpec:
    """Convert a uint8 image tensor ``[C, H, W]`` (RGB, or one grey channel), or a batch ``[B, C, H, W]`` of them,
    to the float input of ``spec``, on the tensor's device.

    ``out = (reorder(x) * spec.scale / 255 - mean) / std``, where ``reorder`` swaps RGB to BGR when the spec asks
    for it and ``mean``/``std`` are given in the spec's channel order and value scale. Every element is computed
    by the same float32 operations whether it comes alone or in a batch, on the CPU or a GPU.
    """

    def __init__(self, spec: InputSpec) -> None:
        self.spec = spec
        self.mean = torch.tensor(spec.mean, dtype=torch.float32).view(-1, 1, 1)
        self.std = torch.tensor(spec.std, dtype=torch.float32).view(-1, 1, 1)
        self._on_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device.type == "cpu":
            return self.mean, self.std
        if device not in self._on_device:
            self._on_device[device] = (self.mean.to(device), self.std.to(device))
        return self._on_device[device]

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        self._check(image)
        return self.into(image, torch.empty(image.shape, dtype=torch.float32, device=image.device))

    def _check(self, image: torch.Tensor) -> None:
        if image.dtype != torch.uint8 or image.ndim not in (3, 4):
            raise ValueError(
                f"ToInputSpec expects a uint8 [C, H, W] or [B, C, H, W] tensor, got {image.dtype} {tuple(image.shape)}"
            )
        if image.shape[-3] != self.spec.channels:
            raise ValueError(
                f"ToInputSpec: the image has {image.shape[-3]} channels but the {self.spec.color} input spec needs "
                f"{self.spec.channels}"
            )

    def into(self, image: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """Write the conversion of the uint8 ``image`` into the float32 tensor ``out`` of the same shape (no
        allocation; the channel swap of a BGR spec is done on the uint8 pixels, the same values) and return it."""
        if self.spec.color == "BGR":
            image = image.flip(-3)
        out.copy_(image)
        out.mul_(self.spec.scale / 255.0)
        mean, std = self._constants(out.device)
        return out.sub_(mean).div_(std)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_on_device"] = {}  # device copies stay in their process
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec})"


class DeviceImage(NamedTuple):
    """A training image whose flip and conversion are left to the device (``augment_on_device=True``).

    ``pixels``: the uint8 crop ``[C, H, W]`` (a batch: ``[B, C, H, W]``); ``flip``: whether to flip it
    horizontally (a batch: a bool tensor ``[B]``). The DataLoader's ``default_collate`` batches the fields; the data
    module's ``on_after_batch_transfer`` hook calls :func:`finish_on_device`.
    """

    pixels: torch.Tensor
    flip: bool | torch.Tensor


class DeferFlip:
    """Draw the random horizontal flip as ``RandomHorizontalFlip(p)`` does (``torch.rand(1) < p``, one draw at the
    same point of the generator's stream) and return the image unflipped with the decision, as a
    :class:`DeviceImage`."""

    def __init__(self, p: float = 0.5) -> None:
        self.p = float(p)

    def __call__(self, image: torch.Tensor) -> DeviceImage:
        return DeviceImage(image, bool(torch.rand(1) < self.p))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(p={self.p})"


class Contiguous:
    """``tensor.contiguous()``: the cache's images are channels-last views; batches are made of plain tensors."""

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return image.contiguous()

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


def finish_on_device(images: DeviceImage, convert: ToInputSpec) -> torch.Tensor:
    """The float input of a :class:`DeviceImage` batch, computed on its device: the chosen images flipped
    horizontally, then ``convert`` (the same operations, bit for bit, as the flip and conversion in a worker).

    On a GPU the batch is converted in one pass. On the CPU it is converted image by image into the batch's output
    tensor: each image's passes stay in the processor's cache instead of streaming the whole batch through memory
    four times (the same operations on every element, so the same result).
    """
    pixels = images.pixels
    batched = pixels.ndim == 4
    flip = torch.as_tensor(images.flip, dtype=torch.bool)
    if flip.numel() != (pixels.shape[0] if batched else 1):
        raise ValueError(f"DeviceImage: {flip.numel()} flip flags for pixels of shape {tuple(pixels.shape)}")
    convert._check(pixels)
    if pixels.device.type == "cpu":
        out = torch.empty(pixels.shape, dtype=torch.float32)
        if not batched:
            return convert.into(pixels.flip(-1) if bool(flip) else pixels, out)
        for i, flipped in enumerate(flip.cpu().tolist()):
            convert.into(pixels[i].flip(-1) if flipped else pixels[i], out[i])
        return out
    flip = flip.to(pixels.device, non_blocking=True).view((-1, 1, 1, 1) if batched else (1, 1, 1))
    return convert(torch.where(flip, pixels.flip(-1), pixels))


class FinishingCollate:
    """``collate_fn`` followed by :func:`finish_on_device` when the batch's first field is a :class:`DeviceImage`:
    the flip and conversion of the training transforms, done batched into the batch's output tensor where the
    batch is collated (picklable, for DataLoader workers)."""

    def __init__(self, collate_fn: Callable, spec: InputSpec) -> None:
        self.collate_fn = collate_fn
        self.convert = ToInputSpec(spec)

    def __call__(self, items: list) -> object:
        batch = self.collate_fn(items)
        if isinstance(batch, (list, tuple)) and batch and isinstance(batch[0], DeviceImage):
            return [finish_on_device(batch[0], self.convert), *batch[1:]]
        return batch

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.collate_fn!r}, {self.convert.spec})"


def _interpolation(spec: InputSpec) -> InterpolationMode:
    """torchvision's resampling mode for the spec's ``interpolation`` (bilinear, bicubic or nearest)."""
    from torchvision import transforms as T

    return T.InterpolationMode(spec.interpolation)


def default_resize_size(crop_size: int, spec: InputSpec) -> int:
    """The test-time resize for ``crop_size``: the spec's (256) when the crop lies between the spec's crop and
    resize sizes (224 or 227 -> 256, as in the papers), otherwise the spec's ratio (256/224) times the crop."""
    if spec.crop_size <= crop_size <= spec.resize_size:
        return spec.resize_size
    return max(crop_size, int(round(crop_size * spec.resize_size / spec.crop_size)))


def train_transform(
    spec: InputSpec,
    crop_size: int | None = None,
    crop_scale: tuple[float, float] = (0.08, 1.0),
    on_device: bool = False,
) -> Callable:
    """Random resized crop (``crop_scale`` = area range, torchvision's default) + horizontal flip + spec conversion,
    on PIL images. ``on_device``: stop after the crop, returning a :class:`DeviceImage` (uint8 crop + flip decision)."""
    from torchvision import transforms as T

    crop = spec.crop_size if crop_size is None else int(crop_size)
    resized_crop = T.RandomResizedCrop(crop, scale=tuple(crop_scale), interpolation=_interpolation(spec), antialias=True)
    if on_device:
        return T.Compose([resized_crop, T.PILToTensor(), DeferFlip()])
    return T.Compose([resized_crop, T.RandomHorizontalFlip(), T.PILToTensor(), ToInputSpec(spec)])


def tensor_train_transform(
    spec: InputSpec,
    crop_size: int | None = None,
    crop_scale: tuple[float, float] = (0.08, 1.0),
    on_device: bool = False,
) -> Callable:
    """:func:`train_transform` for uint8 ``[C, H, W]`` tensors (the decoded-image cache): torchvision.transforms.v2's
    random resized crop (the same random draws and resampling), horizontal flip and the spec conversion; with
    ``on_device`` it stops after the crop and returns a :class:`DeviceImage`."""
    from torchvision.transforms import v2

    crop = spec.crop_size if crop_size is None else int(crop_size)
    resized_crop = v2.RandomResizedCrop(
        crop, scale=tuple(crop_scale), interpolation=_interpolation(spec), antialias=True
    )
    if on_device:
        return v2.Compose([resized_crop, Contiguous(), DeferFlip()])
    return v2.Compose([resized_crop, Contiguous(), v2.RandomHorizontalFlip(), ToInputSpec(spec)])


def eval_transform(spec: InputSpec, crop_size: int | None = None, resize_size: int | None = None) -> Callable:
    """Resize the shorter side to ``resize_size`` + centre crop ``crop_size`` + spec conversion
    (:class:`lightning_dml.data.pil_eval.PILEvalTransform` is the same without torchvision)."""
    from torchvision import transforms as T

    crop = spec.crop_size if crop_size is None else int(crop_size)
    resize = default_resize_size(crop, spec) if resize_size is None else int(resize_size)
    if resize < crop:
        raise ValueError(f"resize_size ({resize}) must be at least the crop size ({crop})")
    resize_op = T.Resize(resize, interpolation=_interpolation(spec), antialias=True)
    return T.Compose([resize_op, T.CenterCrop(crop), T.PILToTensor(), ToInputSpec(spec)])


def tensor_eval_transform(
    spec: InputSpec, crop_size: int | None = None, resize_size: int | None = None, stored_size: int | None = None
) -> Callable:
    """:func:`eval_transform` for uint8 ``[C, H, W]`` tensors whose shorter side is ``stored_size`` (the
    decoded-image cache's ``cache_size``): the resize is skipped when ``stored_size == resize_size`` (the cache
    resized the image exactly as :func:`eval_transform` does, so the result is the same, bit for bit), otherwise
    the stored image is resized again."""
    from torchvision.transforms import v2

    crop = spec.crop_size if crop_size is None else int(crop_size)
    resize = default_resize_size(crop, spec) if resize_size is None else int(resize_size)
    if resize < crop:
        raise ValueError(f"resize_size ({resize}) must be at least the crop size ({crop})")
    steps: list[Callable] = []
    if stored_size is None or int(stored_size) != resize:
        steps.append(v2.Resize(resize, interpolation=_interpolation(spec), antialias=True))
    return v2.Compose([*steps, v2.CenterCrop(crop), Contiguous(), ToInputSpec(spec)])


__all__ = [
    "Contiguous",
    "DeferFlip",
    "DeviceImage",
    "FinishingCollate",
    "ToInputSpec",
    "default_resize_size",
    "eval_transform",
    "finish_on_device",
    "tensor_eval_transform",
    "tensor_train_transform",
    "train_transform",
]
