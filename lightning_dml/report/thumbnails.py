"""The report's images: where an item's image comes from (:class:`ImageSource`) and its thumbnail, a small file
written once (:class:`ThumbnailWriter`).

Thumbnails are content-addressed: an image file's thumbnail is named by a hash of the file's absolute path, size
and modification time (and the thumbnail's size and format), so a rerun of the report over the same folder reuses
every thumbnail without opening the image again, and a changed file gets a new one. An in-memory image (Glyphs, or
any dataset without image files) is named by a hash of its pixels.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps

from lightning_dml.data.cache_dir import atomic_path

__all__ = ["DatasetImages", "ImageSource", "PathImages", "ThumbnailWriter", "image_source"]

#: thumbnail formats: name -> (PIL format, file suffix)
FORMATS = {"webp": ("WEBP", ".webp"), "jpeg": ("JPEG", ".jpg"), "png": ("PNG", ".png")}


def _to_pil(image: Any) -> Image.Image:
    """A PIL image of an item's image: a PIL image as it is, a ``[C, H, W]`` tensor or array (uint8 as it is, any
    other dtype min-max scaled on its own, as :func:`lightning_dml.visualize.to_display` does), C = 1 or 3."""
    if isinstance(image, Image.Image):
        return image
    t = torch.as_tensor(np.asarray(image)) if not isinstance(image, torch.Tensor) else image.detach().cpu()
    if t.ndim == 2:
        t = t.unsqueeze(0)
    if t.ndim != 3 or t.shape[0] not in (1, 3):
        raise ValueError(
            f"an image must be a PIL image or a [C, H, W] tensor with C = 1 or 3, got shape {tuple(t.shape)}"
        )
    if t.dtype == torch.uint8:
        pixels = t.permute(1, 2, 0).numpy()
    else:
        from lightning_dml.visualize import to_display

        pixels = to_display(t.unsqueeze(0))[0]
        if t.shape[0] == 1:
            pixels = pixels[..., :1]
    return Image.fromarray(pixels[..., 0] if pixels.shape[-1] == 1 else pixels)


class ImageSource:
    """The images of the evaluated items, by split index (the ``index`` of :class:`~lightning_dml.retrieval.
    RetrievalResults`). Subclasses implement :meth:`load`, and :meth:`key` where a cheap key exists."""

    #: whether :meth:`load` may run in threads (file decoding does; a dataset's ``__getitem__`` may not)
    threaded = False

    def name(self, index: int) -> str:
        """What the page shows on hover: the file name, or ``item <index>``."""
        return f"item {index}"

    def key(self, index: int) -> str | None:
        """A key that changes when the image does, without reading it (None: the pixels are hashed)."""
        return None

    def load(self, index: int) -> Image.Image:
        raise NotImplementedError


class PathImages(ImageSource):
    """Image files, ``paths[i]`` the file of item ``indices[i]``."""

    threaded = True

    def __init__(self, indices: Iterable[int], paths: Sequence[str | os.PathLike]) -> None:
        indices = [int(i) for i in indices]
        if len(indices) != len(paths):
            raise ValueError(f"PathImages: {len(paths)} paths for {len(indices)} items")
        self.paths = dict(zip(indices, (Path(p) for p in paths)))

    def path(self, index: int) -> Path:
        return self.paths[int(index)]

    def name(self, index: int) -> str:
        return self.path(index).name

    def key(self, index: int) -> str | None:
        path = self.path(index).absolute()
        stat = path.stat()  # a missing file: OSError, reported with the item
        return f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}"

    def load(self, index: int) -> Image.Image:
        return Image.open(self.path(index))


class DatasetImages(ImageSource):
    """The images of a dataset, by index: its image files when it has ``paths``, its raw uint8 pixels when it holds
    them as ``images`` (``[N, C, H, W]``, e.g. Glyphs' :class:`~lightning_dml.data.base.TensorImageDataset`),
    else the image tensor of ``dataset[index]`` (min-max scaled for display)."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset
        paths = getattr(dataset, "paths", None)
        self.files = PathImages(range(len(paths)), paths) if paths is not None else None
        images = getattr(dataset, "images", None)
        ok = isinstance(images, torch.Tensor) and images.dtype == torch.uint8 and images.ndim == 4
        self.pixels = images if ok and self.files is None else None
        self.threaded = self.files is not None

    def name(self, index: int) -> str:
        return self.files.name(index) if self.files is not None else f"item {index}"

    def key(self, index: int) -> str | None:
        return self.files.key(index) if self.files is not None else None

    def load(self, index: int) -> Image.Image:
        if self.files is not None:
            return self.files.load(index)
        if self.pixels is not None:
            return _to_pil(self.pixels[int(index)])
        item = self.dataset[int(index)]
        return _to_pil(item[0] if isinstance(item, (tuple, list)) else item)


def image_source(paths: Sequence[str] | None = None, indices: Iterable[int] | None = None, dataset: Any = None
                 ) -> ImageSource | None:
    """The images of a report: the dataset's when one is given, else the files ``paths`` of items ``indices``,
    else None (the page then shows each item's label in place of its image)."""
    if dataset is not None:
        return DatasetImages(dataset)
    if paths is not None:
        return PathImages(indices if indices is not None else range(len(paths)), paths)
    return None


class ThumbnailWriter:
    """Writes each image's thumbnail once into ``folder`` (``<folder>/<2 hex>/<hash><suffix>``).

    Args:
        folder: where the thumbnails go (the report's ``thumbs/``).
        size: the longer side in pixels (images smaller than that keep their size; the page scales them).
        fmt: ``"webp"``, ``"jpeg"`` or ``"png"``.
        quality: the WebP/JPEG quality.
        workers: threads decoding image files (0: one per CPU core, at most 8).
    """

    def __init__(self, folder: str | os.PathLike, size: int = 96, fmt: str = "webp", quality: int = 80,
                 workers: int = 0) -> None:
        if fmt not in FORMATS:
            raise ValueError(f"thumbnail format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        if int(size) < 8:
            raise ValueError(f"thumbnail size must be >= 8 pixels, got {size}")
        self.folder = Path(folder)
        self.size = int(size)
        self.fmt = fmt
        self.quality = int(quality)
        self.workers = int(workers) or min(8, os.cpu_count() or 1)
        #: per call of :meth:`write`: thumbnails written, reused, and (index, message) of unreadable images
        self.written = 0
        self.reused = 0
        self.failed: list[tuple[int, str]] = []

    def _file(self, digest: str) -> Path:
        return self.folder / digest[:2] / f"{digest}{FORMATS[self.fmt][1]}"

    def _digest(self, content: bytes) -> str:
        spec = f"\0{self.size}\0{self.fmt}\0{self.quality}".encode()
        return hashlib.sha256(content + spec).hexdigest()[:32]

    def _thumbnail(self, image: Image.Image) -> Image.Image:
        if image.format == "JPEG":
            image.draft("RGB", (2 * self.size, 2 * self.size))  # decode at a reduced scale: much faster
        image = ImageOps.exif_transpose(image)
        if image.mode not in ("RGB", "L"):
            image = image.convert("RGBA") if "A" in image.getbands() or image.mode == "P" else image.convert("RGB")
            if image.mode == "RGBA":  # transparency over white
                background = Image.new("RGB", image.size, (255, 255, 255))
                background.paste(image, mask=image.getchannel("A"))
                image = background
        image = image.copy() if image.size[0] <= self.size and image.size[1] <= self.size else image
        image.thumbnail((self.size, self.size), Image.Resampling.LANCZOS)
        return image

    def _save(self, image: Image.Image, path: Path) -> None:
        options = {"quality": self.quality} if self.fmt in ("webp", "jpeg") else {}
        with atomic_path(path) as temporary:  # a killed run never leaves a truncated thumbnail to be reused
            image.save(temporary, FORMATS[self.fmt][0], **options)

    def _one(self, source: ImageSource, index: int) -> tuple[str | None, bool, str | None]:
        """(file relative to the folder's parent, reused, error message) of one item."""
        try:
            key = source.key(index)
            if key is not None:
                path = self._file(self._digest(key.encode()))
                if path.is_file():
                    return path, True, None
                with source.load(index) as image:
                    self._save(self._thumbnail(image), path)
                return path, False, None
            image = self._thumbnail(source.load(index))
            raw = image.tobytes() + f"{image.mode}{image.size}".encode()
            path = self._file(self._digest(raw))
            if path.is_file():
                return path, True, None
            self._save(image, path)
            return path, False, None
        except Exception as error:  # noqa: BLE001 - any unreadable image is reported by name, the report goes on
            return None, False, f"{type(error).__name__}: {' '.join(str(error).split())}"

    def write(self, source: ImageSource, indices: Iterable[int]) -> dict[int, Path | None]:
        """The thumbnail file of every item ``indices`` (None for an image that cannot be read: the count and the
        first ones are in :attr:`failed` and one warning names them)."""
        todo = list(dict.fromkeys(int(i) for i in indices))
        self.written = self.reused = 0
        self.failed = []
        if source.threaded and self.workers > 1 and len(todo) > 1:
            with ThreadPoolExecutor(self.workers) as pool:
                done = list(pool.map(lambda i: self._one(source, i), todo))
        else:
            done = [self._one(source, i) for i in todo]
        out: dict[int, Path | None] = {}
        for index, (path, reused, error) in zip(todo, done):
            out[index] = path
            if error is not None:
                self.failed.append((index, f"{source.name(index)}: {error}"))
            elif reused:
                self.reused += 1
            else:
                self.written += 1
        if self.failed:
            shown = "; ".join(f"item {i} ({what})" for i, what in self.failed[:3])
            warnings.warn(f"{len(self.failed)} image(s) could not be read and are shown by their label: {shown}",
                          RuntimeWarning, stacklevel=2)
        return out
