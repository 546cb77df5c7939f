"""The evaluation transform without torchvision (``lightning_dml.data.pil_eval``, what ``search`` and ``serve``
embed queries with) equals torchvision's (``eval_transform``, what the gallery was embedded with) bit for bit."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_dml.data.pil_eval import PILEvalTransform, resized_size
from lightning_dml.data.transforms import eval_transform
from lightning_dml.models import BNINCEPTION, TORCHVISION_IMAGENET, InputSpec

GREY = InputSpec(color="L", mean=(0.5,), std=(0.25,), crop_size=20, resize_size=24)
SIZES = [(20, 20), (21, 20), (37, 53), (53, 37), (64, 25), (24, 200), (301, 199)]


def _image(size: tuple[int, int], mode: str, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    shape = (size[1], size[0]) + ((3,) if mode == "RGB" else ())
    return Image.fromarray(rng.integers(0, 256, shape, dtype=np.uint8), mode)


@pytest.mark.parametrize("interpolation", ["bilinear", "bicubic", "nearest"])
@pytest.mark.parametrize(("spec", "crop", "resize"), [
    (TORCHVISION_IMAGENET, 16, 19), (BNINCEPTION, 17, 17), (GREY, None, None), (TORCHVISION_IMAGENET, 20, None),
], ids=["rgb", "bgr-no-resize-margin", "grey-spec-sizes", "rgb-default-resize"])
def test_the_transform_equals_torchvisions_bit_for_bit(spec, crop, resize, interpolation):
    spec = InputSpec(**{**spec.__dict__, "interpolation": interpolation, "crop_pct": None,
                        "resize_size": spec.resize_size})
    reference = eval_transform(spec, crop, resize)
    ours = PILEvalTransform(spec, crop, resize)
    mode = "L" if spec.color == "L" else "RGB"
    for seed, size in enumerate(SIZES):
        image = _image(size, mode, seed)
        want, got = reference(image), ours(image)
        assert got.dtype == want.dtype and got.shape == want.shape, size
        assert torch.equal(got, want), size


def test_resized_size_keeps_the_shorter_side_and_truncates_the_longer():
    assert resized_size(300, 200, 100) == (150, 100)
    assert resized_size(200, 301, 100) == (100, 150)  # 150.5 truncated, as torchvision's Resize does
    assert resized_size(64, 64, 32) == (32, 32)


def test_a_resize_below_the_crop_is_refused_as_eval_transform_does():
    with pytest.raises(ValueError, match="resize_size"):
        PILEvalTransform(TORCHVISION_IMAGENET, 32, 24)
