"""The decoded-image cache (``cache="decoded"``): every image of a split decoded once, kept as uint8 pixels.

Decoding a JPEG costs more than everything else the training pipeline does to it (``docs/benchmarks.md``, Data
pipeline), and a run decodes the same images again every epoch. With ``cache="decoded"`` a file data module
decodes each image of a split once, in ``prepare_data``, exactly as the uncached loader does
(:func:`~lightning_dml.data.image_list.load_image`: the 8-bit scaling, the mode conversion and the crop box where
the data module uses one), resizes its shorter side to ``cache_size`` with the resampling of the evaluation
transform (torchvision's ``Resize`` on the PIL image, the input spec's interpolation, antialiased), and appends
the uint8 pixels (height x width x channels) to one file per split. The training and evaluation transforms then
read the pixels through a read-only memory map (:class:`DecodedImages`): no file is opened and nothing is decoded
in the loop, and a worker process holds only the pages it is reading (the operating system's page cache holds
the file once for all processes).

Files, in the data set's folder of the user cache (:func:`~lightning_dml.data.cache_dir.dataset_cache_dir`):

* ``decoded-<split>-<cache_size>-<key>.json``: the index: format version, cache size, mode, interpolation,
  Pillow version, JPEG decoder, every source file with its size and modification time (ns), and per image its
  shape (height, width, channels) and byte offset in the data file; the images that could not be decoded, with
  the reason;
* ``decoded-<split>-<cache_size>-<key>.<build>.u8``: the pixels, one image after the other.

``<key>`` is 16 hex digits of the sha256 of the split's file list (paths relative to the data set's top folder),
its crop boxes, the mode and the interpolation: two configurations of one data set (with and without crop boxes,
an RGB and a grey backbone) keep their own caches. The index is checked at every set-up (a ``stat`` per file):
the cache is rebuilt when a source file's size or mtime changed, when the format version, the Pillow version or
the JPEG decoder (:func:`~lightning_dml.data.image_list.jpeg_decoder`) differs, or when the data file is not the
one the index describes. The build runs under a file lock (``<stem>.lock``, the ``filelock`` package, as the
downloads do), so the processes and nodes of a job build it once and the others wait and then find it; the data
file is written under a temporary name and the index is written last (atomically), so a crash never leaves a
half-written cache that looks complete.

Freshness is path + size + mtime: a file rewritten with the same size and mtime is not seen. ``content_check=True``
(or ``$LIGHTNING_DML_CACHE_CHECK=content``, which the data modules' caches follow) records each source file's sha256
at the build and compares them at every open (a full read of the data set each time).

Concurrent runs: every build has its own data file name, and every process holds the data file of its views (open,
with a shared ``flock``; :class:`_ReaderHold`) from :func:`open_decoded_cache` until its views are gone. A rebuild
removes an older data file only when it can take the exclusive lock, i.e. when no process holds it; one still read
is removed by a later open that finds it unused. A job that opened the cache before another run rebuilt it reads
the build it opened, without error.

An image that fails to decode is recorded with its reason (the file's size and mtime with it): reading it raises
an ``OSError`` naming the reason, which the dataset turns into the same
:class:`~lightning_dml.data.image_list.CorruptImageError` (or, with ``on_corrupt="skip"``, the same replacement)
as an uncached read. Replacing the file (a new mtime) rebuilds the cache; deleting the cache files is always safe.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import torch
from filelock import FileLock
from torchvision.transforms import InterpolationMode
from torchvision.transforms import functional as F

from lightning_dml.data.cache_dir import CACHE_ENV, atomic_path, dataset_cache_dir, write_json_atomic
from lightning_dml.data.image_list import ImageListDataset, jpeg_decoder, load_image
from lightning_dml.errors import NotEnoughDiskSpaceError, UserInputError

try:  # POSIX: readers hold a shared flock on the data file they read
    import fcntl
except ImportError:  # pragma: no cover - Windows: an open file cannot be deleted, the open handle is the hold
    fcntl = None  # type: ignore[assignment]


class CacheFolderError(UserInputError, OSError):
    """The cache folder cannot be created or written (``$LIGHTNING_DML_CACHE`` names another one)."""

#: Version of the cache's file format; a cache of another version is rebuilt.
FORMAT_VERSION = 1

#: The values of the data modules' ``cache`` argument.
CACHE_MODES = ("none", "decoded")

#: ``stat`` signature recorded for a file that could not be ``stat``-ed (missing): it changes when the file appears.
_MISSING = [-1, -1]

#: Environment variable: ``content`` makes every :func:`open_decoded_cache` check the sources' contents (sha256),
#: not only their size and mtime (the data modules' caches included).
CHECK_ENV = "LIGHTNING_DML_CACHE_CHECK"


def cache_mode(value: str | None) -> str | None:
    """``cache`` normalised: ``None`` for ``None``/``"none"``/``False``, ``"decoded"``; anything else a ``ValueError``."""
    if value is None or value is False or value == "none":
        return None
    if value != "decoded":
        raise ValueError(f"cache must be 'none' or 'decoded', got {value!r}")
    return "decoded"


def format_bytes(count: int) -> str:
    """``1.23 GB``, ``45.6 MB``, ``789 kB`` (decimal units)."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6)):
        if count >= scale:
            return f"{count / scale:.2f} {unit}" if unit == "GB" else f"{count / scale:.1f} {unit}"
    return f"{count / 1e3:.0f} kB"


class _ReaderHold:
    """This process reads a cache's data file: the file is kept open, with a shared ``flock`` on POSIX, for as long as
    a :class:`DecodedImages` of it lives here (every view and subset of one file shares one hold). A rebuild removes
    an old data file only when it can take the exclusive lock (:func:`_remove_if_unused`); on Windows an open file
    cannot be deleted at all. The memory map is made from this handle, so the file a view was opened on is the
    one it reads, whatever happens to the name."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDONLY | getattr(os, "O_BINARY", 0))
        if fcntl is not None:
            try:
                fcntl.flock(self.fd, fcntl.LOCK_SH)
            except OSError:  # pragma: no cover - a file system without locks: the open handle still reads the file
                pass
        weakref.finalize(self, os.close, self.fd)


#: the holds of this process, by data file (a rebuild in this process never removes a file read here either)
_HOLDS: "weakref.WeakValueDictionary[str, _ReaderHold]" = weakref.WeakValueDictionary()
_HOLDS_LOCK = threading.Lock()


def _hold(path: Path) -> _ReaderHold:
    with _HOLDS_LOCK:
        hold = _HOLDS.get(os.fspath(path))
        if hold is None:
            hold = _HOLDS[os.fspath(path)] = _ReaderHold(path)
        return hold


def _remove_if_unused(path: Path) -> bool:
    """Delete the data file ``path`` unless a process reads it (holds it: :class:`_ReaderHold`); whether it is gone."""
    if os.fspath(path) in _HOLDS:
        return False
    if fcntl is None:  # pragma: no cover - Windows: deleting a file another process has open fails
        try:
            path.unlink(missing_ok=True)
        except OSError:
            return False
        return True
    try:
        fd = os.open(path, os.O_RDWR)  # write access: an exclusive lock over NFS needs it
    except FileNotFoundError:
        return True
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # a reader holds it
        os.close(fd)
        return False
    try:
        path.unlink(missing_ok=True)  # under the exclusive lock: no reader can come in between
    except OSError:
        return False
    finally:
        os.close(fd)
    return True


class DecodedImages:
    """Read access to the decoded images of one split (or a subset of them): item ``i`` is a uint8 tensor
    ``[C, H, W]`` viewing the memory-mapped file (channels-last strides; nothing is copied until a transform
    computes from it).

    The memory map is opened on first access in each process and not pickled: a DataLoader worker receives the
    file name and the small index arrays, never the pixels. From its creation (or, in a worker, its first access)
    a view holds its data file (:class:`_ReaderHold`): a rebuild by another run never deletes a file a live view
    may still map.

    Args:
        data_file: the ``.u8`` file holding the pixels.
        offsets: byte offset of each image in ``data_file``.
        shapes: ``[N, 3]`` (height, width, channels) of each image; ``(0, 0, 0)`` for an image that failed.
        failed: reason of each image that could not be decoded, by position.
    """

    def __init__(self, data_file: str | os.PathLike, offsets: np.ndarray, shapes: np.ndarray, failed: dict[int, str],
                 hold: _ReaderHold | None = None) -> None:
        self.data_file = Path(data_file)
        self.offsets = np.asarray(offsets, dtype=np.int64)
        self.shapes = np.asarray(shapes, dtype=np.int64).reshape(-1, 3)
        if self.offsets.shape != (self.shapes.shape[0],):
            raise ValueError(f"{self.data_file}: {len(self.offsets)} offsets but {len(self.shapes)} shapes")
        self.failed = {int(k): str(v) for k, v in failed.items()}
        self._map: np.ndarray | None = None
        self._hold = hold

    def __len__(self) -> int:
        return len(self.offsets)

    @property
    def nbytes(self) -> int:
        """Bytes of pixels of the images of this view."""
        return int(np.prod(self.shapes, axis=1).sum())

    def _memory_map(self) -> np.ndarray:
        if self._map is None:
            if self._hold is None:
                self._hold = _hold(self.data_file)
            # "c": copy-on-write, so the array (and torch's view of it) is writable without ever writing the file;
            # mapped from the held handle: the file this view was opened on
            with open(self._hold.fd, "rb", closefd=False) as handle:
                self._map = np.memmap(handle, dtype=np.uint8, mode="c")
        return self._map

    def pixels(self, index: int) -> torch.Tensor:
        """Image ``index`` as a uint8 ``[C, H, W]`` view of the memory map; an image that could not be decoded
        when the cache was built raises ``OSError`` with the reason."""
        index = int(index)
        if index in self.failed:
            raise OSError(f"{self.failed[index]} (recorded when the decoded-image cache was built)")
        height, width, channels = (int(v) for v in self.shapes[index])
        start = int(self.offsets[index])
        flat = self._memory_map()[start : start + height * width * channels]
        return torch.from_numpy(flat).view(height, width, channels).permute(2, 0, 1)

    def subset(self, indices: Sequence[int] | np.ndarray) -> "DecodedImages":
        """The images ``indices``, renumbered from 0 (the same file)."""
        idx = np.asarray(indices, dtype=np.int64)
        failed = {}
        if self.failed:
            failed = {new: self.failed[old] for new, old in enumerate(idx.tolist()) if old in self.failed}
        return DecodedImages(self.data_file, self.offsets[idx], self.shapes[idx], failed, self._hold)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_map"] = None  # each process maps the file itself; the pixels are never pickled
        state["_hold"] = None  # and holds it itself (a file handle is no state to pickle)
        return state

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.data_file}, {len(self)} images, {format_bytes(self.nbytes)})"


class DecodedImageListDataset(ImageListDataset):
    """An :class:`~lightning_dml.data.image_list.ImageListDataset` whose images come from the decoded-image cache:
    ``transform`` receives the uint8 ``[C, H, W]`` tensor of :class:`DecodedImages` instead of a PIL image (see
    :func:`~lightning_dml.data.transforms.tensor_train_transform`). Everything else (items, labels, masks,
    ``on_corrupt``, :meth:`subset`) is the wrapped dataset's.

    Build it with :meth:`wrap` from the dataset the data module would use without the cache.
    """

    decoded: DecodedImages

    @classmethod
    def wrap(cls, dataset: ImageListDataset, decoded: DecodedImages) -> "DecodedImageListDataset":
        """``dataset`` (same attributes) reading its images from ``decoded`` (one image per item, in order)."""
        if len(decoded) != len(dataset):
            raise ValueError(f"{dataset.split}: {len(dataset)} items but {len(decoded)} decoded images")
        out = cls.__new__(cls)
        out.__dict__.update(dataset.__dict__)
        out.decoded = decoded
        return out

    def _read(self, index: int) -> Any:
        image = self.decoded.pixels(index)
        return image if self.transform is None else self.transform(image)

    def subset(self, indices: Sequence[int] | np.ndarray, transform: Callable | None, evaluation: bool) -> "DecodedImageListDataset":
        """The items ``indices`` (renumbered from 0) with another transform, still read from the cache."""
        plain = ImageListDataset.subset(self, indices, transform, evaluation)
        return type(self).wrap(plain, self.decoded.subset(indices))


@dataclass
class CacheInfo:
    """What :func:`open_decoded_cache` did: the index file, whether it built the cache, its size and time."""

    index_file: Path
    built: bool
    nbytes: int
    seconds: float
    failed: int


def _relative(paths: Sequence[Path], top: Path) -> list[str]:
    prefix = os.fspath(top).rstrip(os.sep) + os.sep
    out = []
    for p in paths:
        text = os.fspath(p)
        out.append(text[len(prefix) :] if text.startswith(prefix) else os.path.abspath(text))
    return out


def _signature(path: Path) -> list[int]:
    try:
        stat = os.stat(path)
    except OSError:
        return list(_MISSING)
    return [int(stat.st_size), int(stat.st_mtime_ns)]


def _signatures(paths: Sequence[Path]) -> list[list[int]]:
    if len(paths) < 2048:
        return [_signature(p) for p in paths]
    with ThreadPoolExecutor(max_workers=8) as pool:  # many stats on a network file system overlap
        return list(pool.map(_signature, paths, chunksize=256))


def cache_key(relative: Sequence[str], boxes: np.ndarray | None, mode: str, interpolation: str) -> str:
    """16 hex digits naming a split's cache: its files, crop boxes, mode and interpolation (not the sizes/mtimes:
    a changed file rebuilds the same cache)."""
    digest = hashlib.sha256()
    digest.update(json.dumps([mode, interpolation, list(relative)], separators=(",", ":")).encode("utf-8"))
    if boxes is not None:
        digest.update(np.ascontiguousarray(np.asarray(boxes, dtype=np.float64)).tobytes())
    return digest.hexdigest()[:16]


def _read_index(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_fresh(index: dict[str, Any] | None, folder: Path, expected: dict[str, Any], files: list[list[Any]]) -> bool:
    if index is None:
        return False
    if any(index.get(key) != value for key, value in expected.items()):
        return False
    if index.get("files") != files:
        return False
    name = str(index.get("data_file", ""))
    if Path(name).name != name or not name.endswith(".u8"):  # a data file of this folder, nothing elsewhere
        return False
    data_file = folder / name
    try:
        return data_file.is_file() and data_file.stat().st_size == int(index["data_bytes"])
    except (OSError, KeyError, TypeError, ValueError):
        return False


def _view(index: dict[str, Any], folder: Path) -> DecodedImages:
    """The view of an index's data file, holding it (call under the cache's lock: no rebuild can remove it first)."""
    data_file = folder / index["data_file"]
    return DecodedImages(
        data_file,
        np.asarray(index["offsets"], dtype=np.int64),
        np.asarray(index["shapes"], dtype=np.int64).reshape(-1, 3),
        {int(k): v for k, v in index.get("failed", {}).items()},
        _hold(data_file),
    )


def file_sha256(path: Path) -> str:
    """The sha256 of a file's bytes (hex), read in 1 MiB blocks; ``""`` when it cannot be read."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return ""
    return digest.hexdigest()


def _hashes(paths: Sequence[Path], workers: int | None = None) -> list[str]:
    with ThreadPoolExecutor(max_workers=workers or min(32, (os.cpu_count() or 1) + 4)) as pool:
        return list(pool.map(file_sha256, paths, chunksize=64))


def _content_check(value: bool | None) -> bool:
    if value is not None:
        return bool(value)
    given = os.environ.get(CHECK_ENV, "").strip().lower()
    if given not in ("", "stat", "content"):
        raise ValueError(f"{CHECK_ENV} must be 'stat' (the default) or 'content', got {given!r}")
    return given == "content"


def _remove_stale(folder: Path, stem: str, keep: str) -> None:
    """Remove the data files of earlier builds of ``stem`` that no process reads any more, and temporary files of
    builds that were killed (under the cache's lock no build of ``stem`` is running). A data file still read stays
    until a later call finds it unused."""
    for stale in folder.glob(f"{stem}.*.u8"):
        if stale.name != keep:
            _remove_if_unused(stale)
    for temporary in folder.glob(f".{stem}.*.tmp*"):
        temporary.unlink(missing_ok=True)


def decode_resized(path: Path, mode: str, box: Sequence[float] | None, size: int, interpolation: str) -> np.ndarray:
    """The pixels the cache stores for one file: :func:`load_image` (8-bit scaling, ``mode``, crop ``box``), the
    shorter side resized to ``size`` by torchvision's ``Resize`` on the PIL image (as the evaluation transform
    does), as a uint8 ``[H, W, C]`` array."""
    image = load_image(path, mode, box)
    image = F.resize(image, [size], interpolation=InterpolationMode(interpolation), antialias=True)
    array = np.asarray(image, dtype=np.uint8)
    return array[:, :, None] if array.ndim == 2 else array


def open_decoded_cache(
    paths: Sequence[str | os.PathLike],
    top: str | os.PathLike,
    split: str,
    size: int,
    mode: str = "RGB",
    interpolation: str = "bilinear",
    boxes: np.ndarray | None = None,
    progress: bool = True,
    description: str = "decoded-image cache",
    workers: int | None = None,
    log: Callable[[str], None] | None = None,
    content_check: bool | None = None,
) -> tuple[DecodedImages, CacheInfo]:
    """The decoded images of ``paths`` (in order), from the cache of the data set at ``top``; built (or rebuilt)
    first, under the cache's file lock, when it is missing or stale (see the module docstring).

    Args:
        paths: the split's image files; ``boxes`` their crop boxes (``[N, 4]``, PIL coordinates) or ``None``.
        top: the data set's top folder: names the cache folder; the index records paths relative to it.
        split: ``"train"`` or ``"test"`` (part of the file names).
        size: the shorter side of the stored images (``cache_size``).
        mode: ``"RGB"`` or ``"L"``; interpolation: torchvision's name of the resampling (``"bilinear"``, ...).
        progress: show a tqdm progress bar while building.
        workers: decoding threads; default ``min(32, os.cpu_count() + 4)``. The result does not depend on it.
        log: called with one line saying what was built (or found) and its size.
        content_check: also compare every source file's sha256 with the one recorded at the build (rebuilt on a
            difference; a cache built without them is rebuilt once): catches a file replaced with the same size
            and mtime, at the cost of reading every file at each set-up. None: ``$LIGHTNING_DML_CACHE_CHECK``
            (``content``; default ``stat``: size and mtime only).
    """
    if size < 1:
        raise ValueError(f"cache_size must be at least 1, got {size}")
    check_content = _content_check(content_check)
    paths = [Path(p) for p in paths]
    top = Path(top)
    if boxes is not None:
        boxes = np.asarray(boxes, dtype=np.float64)
        if boxes.shape != (len(paths), 4):
            raise ValueError(f"boxes must have shape ({len(paths)}, 4), got {boxes.shape}")
    relative = _relative(paths, top)
    folder = dataset_cache_dir(top)
    stem = f"decoded-{split}-{int(size)}-{cache_key(relative, boxes, mode, interpolation)}"
    index_file = folder / f"{stem}.json"
    expected = {
        "format": FORMAT_VERSION,
        "size": int(size),
        "mode": mode,
        "interpolation": interpolation,
        "pillow": PIL.__version__,
        "jpeg_decoder": jpeg_decoder(),
    }
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise CacheFolderError(
            f"{description}: cannot create the cache folder {folder} ({type(error).__name__}: {error}); set "
            f"{CACHE_ENV} to a writable folder"
        ) from error
    began = time.perf_counter()
    with FileLock(str(folder / f"{stem}.lock")):
        signatures = _signatures(paths)
        files = [[name, *signature] for name, signature in zip(relative, signatures)]
        index = _read_index(index_file)
        hashes = None
        fresh = _is_fresh(index, folder, expected, files)
        if fresh and check_content:
            hashes = _hashes(paths, workers)
            fresh = index.get("sha256") == hashes
        built = False
        if not fresh:
            if check_content and hashes is None:
                hashes = _hashes(paths, workers)
            index = _build(paths, boxes, signatures, files, expected, folder, stem, progress, description, workers)
            if hashes is not None:
                index["sha256"] = hashes
            write_json_atomic(index_file, index)
            built = True
        view = _view(index, folder)  # held before the lock is released: no other build can remove it now
        _remove_stale(folder, stem, index["data_file"])
    info = CacheInfo(index_file, built, int(index["data_bytes"]), time.perf_counter() - began, len(view.failed))
    if log is not None:
        what = "built" if built else "found"
        failed = f", {info.failed:,} not decodable" if info.failed else ""
        log(
            f"{description}: {what} {len(paths):,} images at {size} px ({mode}, {interpolation}{failed}), "
            f"{format_bytes(info.nbytes)} in {folder / index['data_file']}"
            + (f", in {info.seconds:.1f} s" if built else "")
        )
    return view, info


def _build(
    paths: list[Path],
    boxes: np.ndarray | None,
    signatures: list[list[int]],
    files: list[list[Any]],
    expected: dict[str, Any],
    folder: Path,
    stem: str,
    progress: bool,
    description: str,
    workers: int | None,
) -> dict[str, Any]:
    """Decode every image into a new data file; return its index (not yet written)."""
    from tqdm.auto import tqdm

    size, mode, interpolation = expected["size"], expected["mode"], expected["interpolation"]
    count = len(paths)
    workers = workers or min(32, (os.cpu_count() or 1) + 4)
    window = 4 * workers  # decoded images held at most while they wait to be written

    def decode(i: int) -> tuple[int, np.ndarray | None, str | None]:
        try:
            box = None if boxes is None else boxes[i]
            return i, decode_resized(paths[i], mode, box, size, interpolation), None
        except Exception as error:  # noqa: BLE001 - every failure is recorded with its reason
            return i, None, " ".join(f"{type(error).__name__}: {error}".split())

    data_name = f"{stem}.{uuid.uuid4().hex[:12]}.u8"  # a new name per build: readers of older builds keep theirs
    offsets = np.zeros(count, dtype=np.int64)
    shapes = np.zeros((count, 3), dtype=np.int64)
    failed: dict[str, str] = {}
    written = 0
    space_checks = {1, min(count, 256)}  # decoded images after which the space needed is estimated and checked
    try:
        with atomic_path(folder / data_name) as temporary, open(temporary, "wb") as out, ThreadPoolExecutor(
            max_workers=workers
        ) as pool, tqdm(
            total=count, desc=description, unit="image", disable=not progress, leave=False, dynamic_ncols=True
        ) as bar:
            pending: deque = deque()
            submitted = 0
            decoded = 0
            while submitted < count or pending:
                while submitted < count and len(pending) < window:
                    pending.append(pool.submit(decode, submitted))
                    submitted += 1
                i, array, reason = pending.popleft().result()
                offsets[i] = written
                if array is None:
                    failed[str(i)] = reason or "unknown error"
                else:
                    shapes[i] = array.shape
                    out.write(np.ascontiguousarray(array).data)
                    written += array.nbytes
                    decoded += 1
                    if decoded in space_checks:
                        # the images so far tell the size of the split: fail now rather than when the disk is full
                        estimate = written * (count - len(failed)) // decoded
                        _check_space(folder, estimate - written, estimate, description)
                bar.update(1)
    except OSError as error:
        if error.errno == errno.ENOSPC:
            raise NotEnoughDiskSpaceError(
                f"{description}: the disk holding {folder} is full ({written / 1e9:.2f} GB written); free some "
                f"space or set {CACHE_ENV} to a folder on a larger disk"
            ) from error
        raise
    return {
        **expected,
        "count": count,
        "data_file": data_name,
        "data_bytes": written,
        "files": files,
        "offsets": offsets.tolist(),
        "shapes": shapes.tolist(),
        "failed": failed,
    }


def _check_space(folder: Path, needed: int, total: int, description: str) -> None:
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise NotEnoughDiskSpaceError(
            f"{description} needs about {format_bytes(total)} in {folder}, which has {format_bytes(free)} free; free "
            f"some space, lower cache_size, or set {CACHE_ENV} to a folder on a larger disk"
        )


__all__ = [
    "CACHE_MODES",
    "CHECK_ENV",
    "FORMAT_VERSION",
    "CacheFolderError",
    "CacheInfo",
    "DecodedImageListDataset",
    "DecodedImages",
    "cache_key",
    "cache_mode",
    "decode_resized",
    "file_sha256",
    "format_bytes",
    "open_decoded_cache",
]
