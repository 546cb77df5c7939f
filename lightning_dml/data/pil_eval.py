"""The evaluation transform (:func:`lightning_dml.data.transforms.eval_transform`) on PIL images, with PIL and
torch only: what ``lightning-dml search`` and ``serve`` embed query images with.

Importing torchvision takes about 2 s (``torchvision.ops`` imports ``torch._dynamo``), paid at every start of
``search``. On a PIL image torchvision's three steps are PIL's own operations, done here the same way
(torchvision 0.29, ``transforms/functional.py``):

* ``Resize(resize_size)``: the shorter side becomes ``resize_size``, the longer ``int(resize_size * long /
  short)`` (``_compute_resized_output_size``), resampled by ``Image.resize`` with the spec's filter (PIL
  antialiases bilinear and bicubic, as torchvision says it does for PIL images); an image of that size already is
  left as it is;
* ``CenterCrop(crop_size)``: ``Image.crop`` at ``int(round((side - crop_size) / 2))`` from the top and the left;
* ``PILToTensor``: the pixel array as a uint8 ``[C, H, W]`` tensor;

then :class:`~lightning_dml.data.transforms.ToInputSpec`. The result equals ``eval_transform``'s bit for bit
(``tests/test_pil_eval.py`` compares them over sizes, modes, filters and specs).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from lightning_dml.data.transforms import ToInputSpec, default_resize_size
from lightning_dml.models.input_spec import InputSpec

__all__ = ["PILEvalTransform", "resized_size"]

#: PIL's filter for each :data:`~lightning_dml.models.input_spec.INTERPOLATIONS` name (torchvision's
#: ``pil_modes_mapping``)
PIL_FILTERS = {
    "bilinear": Image.Resampling.BILINEAR,
    "bicubic": Image.Resampling.BICUBIC,
    "nearest": Image.Resampling.NEAREST,
}


def resized_size(width: int, height: int, shorter: int) -> tuple[int, int]:
    """``(width, height)`` of an image whose shorter side is resized to ``shorter``, the aspect ratio kept as
    torchvision's ``Resize(shorter)`` keeps it (the longer side truncated)."""
    short, long = (width, height) if width <= height else (height, width)
    new_long = int(shorter * long / short)
    return (shorter, new_long) if width <= height else (new_long, shorter)


class PILEvalTransform:
    """``eval_transform(spec, crop_size, resize_size)`` without torchvision: a PIL image (mode ``L`` or ``RGB``,
    as the spec needs) -> the float ``[C, crop, crop]`` input of the backbone."""

    def __init__(self, spec: InputSpec, crop_size: int | None = None, resize_size: int | None = None) -> None:
        self.crop = spec.crop_size if crop_size is None else int(crop_size)
        self.resize = default_resize_size(self.crop, spec) if resize_size is None else int(resize_size)
        if self.resize < self.crop:
            raise ValueError(f"resize_size ({self.resize}) must be at least the crop size ({self.crop})")
        self.filter = PIL_FILTERS[spec.interpolation]
        self.convert = ToInputSpec(spec)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        size = resized_size(image.width, image.height, self.resize)
        if size != image.size:
            image = image.resize(size, self.filter)
        top = int(round((image.height - self.crop) / 2.0))
        left = int(round((image.width - self.crop) / 2.0))
        image = image.crop((left, top, left + self.crop, top + self.crop))
        pixels = torch.as_tensor(np.array(image, copy=True)).view(image.height, image.width, len(image.getbands()))
        return self.convert(pixels.permute(2, 0, 1))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(resize={self.resize}, crop={self.crop}, {self.convert.spec})"
