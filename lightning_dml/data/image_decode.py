"""Reading an image file with PIL and NumPy only (no torch): :func:`load_image` and its steps.

What the data sets (:mod:`lightning_dml.data.image_list`, which re-exports these names), ``lightning-dml search``
and the ONNX runtime (:mod:`lightning_dml.onnx.runtime`, whose import graph must not hold torch) read image files
with: every PIL mode brought to 8 bits (:func:`to_8bit`), then converted to ``"RGB"`` or ``"L"``; JPEGs decoded by
simplejpeg where it is installed (:func:`jpeg_decoder`), to the same pixels.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

__all__ = ["JPEG_DECODER_ENV", "jpeg_decoder", "load_image", "to_8bit"]

#: Modes holding 16-bit unsigned samples (``I;16`` little-endian, ``I;16B`` big-endian, ``I;16L``, ``I;16N``).
_MODES_16BIT = ("I;16", "I;16B", "I;16L", "I;16N")


def to_8bit(image: Image.Image) -> Image.Image:
    """``image`` with 8 bits per sample: the high-bit-depth modes become ``"L"``, every other mode is returned as
    it is (PIL's own conversions of the 8-bit modes are exact).

    The rule, one fixed scale per mode (never per image, so every image of a data set is read alike):

    * ``I;16``, ``I;16B``, ``I;16L``, ``I;16N`` (16-bit grey PNG, TIFF, PGM): the full range [0, 65535] maps to
      [0, 255] by ``v >> 8`` (the high byte). This is what PIL itself does to 16-bit *colour* PNGs and what
      torchvision's ``to_dtype(uint16 -> uint8, scale=True)`` does, and an 8-bit value stored as 16 bits either way
      (``v * 257`` or ``v << 8``) comes back unchanged. PIL's ``convert`` instead clips at 255, which turns nearly
      every pixel white.
    * ``I`` (32-bit integer): PIL opens 16-bit PGM/PPM (rescaled from their ``maxval`` to [0, 65535]) and, in
      Pillow < 10, 16-bit PNGs in this mode, so the same 16-bit range is assumed: ``v >> 8``. Values outside
      [0, 65535] (a genuine 32-bit image) have no agreed scale: ``ValueError`` naming the range found.
    * ``F`` (32-bit float, e.g. a float TIFF): the [0, 1] convention of float images in torchvision
      (``ToTensor``), scikit-image and NumPy pipelines: ``round(v * 255)``, the inverse of ``v / 255``, so an 8-bit
      image saved as ``v / 255`` comes back unchanged. A value that does not round into [0, 255] (outside about
      [-0.002, 1.002]), NaN or infinity is a ``ValueError`` naming the range found: PIL's own ``convert`` assumes
      [0, 255] for ``F`` and would clip a [0, 1] image to black, and no scale can be guessed for other ranges.

    No per-pixel Python: one vectorised NumPy pass over the image.
    """
    mode = image.mode
    if mode not in (*_MODES_16BIT, "I", "F"):
        return image
    values = np.asarray(image)
    if mode == "F":
        scaled = np.rint(values.astype(np.float64) * 255.0)
        if not bool(np.all((scaled >= 0.0) & (scaled <= 255.0))):  # also false for NaN
            finite = values[np.isfinite(values)]
            found = f"[{finite.min():g}, {finite.max():g}]" if finite.size else "no finite value"
            extra = "" if finite.size == values.size else f" and {values.size - finite.size} NaN/infinite values"
            raise ValueError(
                f"a float (mode F) image must hold values in [0, 1] (read as round(v * 255)); this one has {found}"
                f"{extra}: convert it to 8 or 16 bits with the scale you intend"
            )
        return Image.fromarray(scaled.astype(np.uint8), "L")
    if mode == "I":
        low, high = int(values.min()), int(values.max())
        if low < 0 or high > 65535:
            raise ValueError(
                f"a 32-bit integer (mode I) image is read as 16-bit data in [0, 65535] (v >> 8); this one has values "
                f"in [{low}, {high}]: convert it to 8 or 16 bits with the scale you intend"
            )
    return Image.fromarray((values >> 8).astype(np.uint8), "L")


#: Environment variable choosing the JPEG decoder of :func:`load_image`: ``simplejpeg`` or ``pil`` (default: simplejpeg
#: where it is installed, ``pip install lightning-dml[jpeg]``, else PIL).
JPEG_DECODER_ENV = "LIGHTNING_DML_JPEG_DECODER"

_simplejpeg: Any = None


def jpeg_decoder() -> str:
    """The JPEG decoder :func:`load_image` uses: ``"simplejpeg"`` when the package is installed, unless
    ``LIGHTNING_DML_JPEG_DECODER=pil``; else ``"pil"``. ``LIGHTNING_DML_JPEG_DECODER=simplejpeg`` without the package
    is an ``ImportError`` saying how to install it."""
    global _simplejpeg
    choice = os.environ.get(JPEG_DECODER_ENV, "").strip().lower()
    if choice not in ("", "simplejpeg", "pil"):
        raise ValueError(f"{JPEG_DECODER_ENV} must be 'simplejpeg' or 'pil', got {choice!r}")
    if choice == "pil":
        return "pil"
    if _simplejpeg is None:
        try:
            import simplejpeg
        except ImportError as error:
            if choice == "simplejpeg":
                raise ImportError(
                    f"{JPEG_DECODER_ENV}=simplejpeg but simplejpeg is not installed: pip install 'lightning-dml[jpeg]'"
                ) from error
            _simplejpeg = False
        else:
            _simplejpeg = simplejpeg
    return "simplejpeg" if _simplejpeg else "pil"


def _decode_jpeg(path: Path, mode: str) -> Image.Image | None:
    """``path`` decoded by simplejpeg (libjpeg-turbo, 5-17% less CPU per decode than PIL here) when it is an 8-bit
    YCbCr or greyscale JPEG, converted to ``mode`` exactly as PIL converts; ``None`` for anything else (another
    format, CMYK/YCCK, 12-bit, a damaged file), which PIL then reads, so a damaged file fails with PIL's message.

    The pixels are PIL's: both use libjpeg-turbo's default decoding (accurate integer IDCT, fancy upsampling),
    which is exact, and the colour to grey conversion is PIL's own (tests/test_decoded_cache.py compares them)."""
    with open(path, "rb") as handle:
        data = handle.read()
    if data[:3] != b"\xff\xd8\xff":
        return None
    try:
        colorspace = _simplejpeg.decode_jpeg_header(data)[2]
        if colorspace == "Gray":
            pixels = _simplejpeg.decode_jpeg(data, colorspace="GRAY")
            image = Image.fromarray(pixels.reshape(pixels.shape[:2]), "L")
        elif colorspace == "YCbCr":
            image = Image.fromarray(_simplejpeg.decode_jpeg(data, colorspace="RGB"), "RGB")
        else:
            return None
    except (ValueError, RuntimeError, OSError):  # damaged or unsupported: PIL reads it (and names the problem)
        return None
    return image if image.mode == mode else image.convert(mode)


def load_image(path: Path, mode: str = "RGB", box: Sequence[float] | None = None) -> Image.Image:
    """Open ``path`` fully decoded in ``mode`` (``"RGB"`` or ``"L"``), cropped to ``box`` = (left, top, right,
    bottom) in PIL pixel coordinates (clipped to the image) when given.

    Every mode is first brought to 8 bits by :func:`to_8bit` (16-bit, ``I`` and ``F`` images), then converted by
    PIL: grey (``1``, ``L``, the scaled high-bit-depth modes) is replicated into three channels for ``"RGB"``;
    alpha (``LA``, ``RGBA``, ``P`` with transparency) is dropped, keeping the colour the file stores under a
    transparent pixel, as torchvision's ``ImageFolder`` loader does; ``P`` takes its palette colours; ``CMYK``
    uses PIL's conversion ``(255 - c) * (255 - k) / 255``; ``"L"`` from colour is PIL's ITU-R 601-2 luma
    ``(19595 R + 38470 G + 7471 B + 2^15) >> 16``. A palette image with per-entry transparency goes through
    ``RGBA`` (the same pixels, without PIL's warning about it for every such image).

    8-bit YCbCr and greyscale JPEGs are decoded by simplejpeg where it is installed (:func:`jpeg_decoder`), to the
    same pixels; everything else by PIL.
    """
    image = _decode_jpeg(path, mode) if jpeg_decoder() == "simplejpeg" else None
    if image is None:
        with Image.open(path) as handle:
            handle.load()  # a full decode: truncated files fail here, not later
            image = to_8bit(handle)
            if image.mode in ("P", "PA") and "transparency" in image.info:
                image = image.convert("RGBA")
            image = image.convert(mode)  # a copy even in the same mode: nothing refers to the closed file
    if box is not None:
        left, top, right, bottom = (float(v) for v in box)
        left, top = max(0.0, left), max(0.0, top)
        right, bottom = min(float(image.width), right), min(float(image.height), bottom)
        if right - left < 1 or bottom - top < 1:
            raise ValueError(f"bounding box {tuple(box)} is empty inside the {image.width}x{image.height} image")
        image = image.crop((int(left), int(top), int(round(right)), int(round(bottom))))
    return image
