"""``verify_images``: every image file of a data set checked at set-up, in parallel, the passes cached.

Two levels, both run by PIL in a thread pool (file reads and PIL's decoders release the GIL):

* ``"header"``: ``Image.open`` identifies the format and parses the header (size, mode; for a JPEG the markers
  before the compressed scan data), then ``Image.verify()``, which for PNG reads every chunk up to ``IEND`` and
  checks its CRC (no decompression) and for the other formats checks nothing more. Found: zero-byte, foreign and
  garbage files, files cut inside their header, damaged or truncated PNGs. **Not found**: a JPEG, WebP, TIFF, GIF
  or BMP whose compressed body is truncated or damaged (it fails only when decoded).
* ``"decode"``: a full decode, as :func:`~lightning_dml.data.image_list.load_image` does in the training loop,
  including the 8-bit scaling of 16-bit, ``I`` and ``F`` images (a float image outside [0, 1] fails). Finds
  everything the loader would fail on (except an empty crop box, a property of the box list, not of the file),
  at the cost of decoding every image once.

Each file that passes is recorded in the data set's cache folder
(:func:`~lightning_dml.data.cache_dir.dataset_cache_dir`), in ``verified-<level>.json``, with its size and
modification time (ns) and the Pillow version. A later check only ``stat``s the files: a file whose size or mtime
changed (or a new Pillow) is checked again. Files that fail are never recorded (a transient read error is not
remembered), so they are checked again every time.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import PIL
from PIL import Image

from lightning_dml.data.cache_dir import CACHE_ENV, dataset_cache_dir, write_json_atomic
from lightning_dml.data.image_list import to_8bit

#: The levels of ``verify_images`` (see the module docstring).
VERIFY_LEVELS = ("header", "decode")

#: Version of the cache file format; a file of another version is ignored (and rewritten).
CACHE_FORMAT = 1


def check_image(path: str | os.PathLike, level: str) -> None:
    """Raise what PIL raises when the file at ``path`` fails the ``level`` check (see the module docstring)."""
    with Image.open(path) as image:
        if level == "header":
            image.verify()
        else:
            image.load()
            to_8bit(image)  # the loader's range checks of I and F images


def verify_level(value: bool | str | None) -> str | None:
    """``verify_images`` normalised: ``None`` (off) for ``False``/``None``/``"none"``, ``"header"`` for ``True``,
    else ``"header"`` or ``"decode"``; anything else is a ``ValueError``."""
    if value is None or value is False or value == "none":
        return None
    if value is True:
        return "header"
    if value not in VERIFY_LEVELS:
        raise ValueError(f"verify_images must be false, true, 'header' or 'decode', got {value!r}")
    return str(value)


@dataclass
class VerifyResult:
    """What :func:`verify_image_files` found: ``failed`` maps the position (in ``paths``) of each file that failed
    to its reason; ``checked`` files were opened, ``cached`` ones were skipped as unchanged since they passed."""

    failed: dict[int, str] = field(default_factory=dict)
    checked: int = 0
    cached: int = 0
    cache_file: Path | None = None


def _cache_file(top: Path, level: str) -> Path:
    return dataset_cache_dir(top) / f"verified-{level}.json"


def _read_cache(path: Path) -> dict[str, list[int]]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    if not isinstance(data, dict) or data.get("format") != CACHE_FORMAT or data.get("pillow") != PIL.__version__:
        return {}
    files = data.get("files")
    return files if isinstance(files, dict) else {}


def _write_cache(path: Path, level: str, files: dict[str, list[int]]) -> None:
    """Write atomically (a temporary file renamed into place): a reader sees the old or the new file, never half."""
    write_json_atomic(path, {"format": CACHE_FORMAT, "level": level, "pillow": PIL.__version__, "files": files})


def verify_image_files(
    paths: Sequence[str | os.PathLike],
    level: str,
    top: str | os.PathLike,
    progress: bool = True,
    description: str = "verify_images",
    workers: int | None = None,
) -> VerifyResult:
    """Check every file of ``paths`` at ``level`` (``"header"`` or ``"decode"``), skipping those recorded in the
    cache of the data set at ``top`` as passed with their current size and mtime; record the new passes.

    Args:
        paths: the image files.
        level: ``"header"`` or ``"decode"`` (see the module docstring).
        top: the data set's top folder: names its cache folder; cache keys are paths relative to it.
        progress: show a tqdm progress bar (the data modules show it on rank 0 only).
        description: the progress bar's label.
        workers: threads; default ``min(32, os.cpu_count() + 4)`` (``ThreadPoolExecutor``'s). The result does
            not depend on it.

    A cache folder that cannot be written is a warning (the check still runs, and runs again next time).
    """
    if level not in VERIFY_LEVELS:
        raise ValueError(f"level must be one of {VERIFY_LEVELS}, got {level!r}")
    paths = [os.fspath(p) for p in paths]
    top_text = os.fspath(top)
    prefix = top_text.rstrip(os.sep) + os.sep
    keys = [p[len(prefix) :] if p.startswith(prefix) else os.path.abspath(p) for p in paths]
    cache_file = _cache_file(Path(top_text), level)
    cached_files = _read_cache(cache_file)
    workers = workers or min(32, (os.cpu_count() or 1) + 4)
    chunk = max(1, min(256, math.ceil(len(paths) / (4 * workers))))

    def run(start: int) -> list[tuple[int, list[int] | None, str | None]]:
        """``(position, [size, mtime_ns] of a new pass or None, reason of a failure or None)`` per file."""
        out = []
        for i in range(start, min(start + chunk, len(paths))):
            try:
                stat = os.stat(paths[i])
                signature = [stat.st_size, stat.st_mtime_ns]
                if cached_files.get(keys[i]) == signature:
                    out.append((i, None, None))
                    continue
                check_image(paths[i], level)
            except Exception as error:  # noqa: BLE001 - every failure is reported with its reason
                reason = " ".join(f"{type(error).__name__}: {error}".split())
                out.append((i, None, reason))
                continue
            out.append((i, signature, None))
        return out

    from tqdm.auto import tqdm

    result = VerifyResult(cache_file=cache_file)
    passed: dict[str, list[int]] = {}
    with ThreadPoolExecutor(max_workers=workers) as pool, tqdm(
        total=len(paths), desc=description, unit="file", disable=not progress, leave=False, dynamic_ncols=True
    ) as bar:
        for rows in pool.map(run, range(0, len(paths), chunk)):
            for i, signature, reason in rows:
                if reason is not None:
                    result.failed[i] = reason
                    result.checked += 1
                elif signature is not None:
                    passed[keys[i]] = signature
                    result.checked += 1
                else:
                    result.cached += 1
            bar.update(len(rows))
    stale = [keys[i] for i in result.failed if keys[i] in cached_files]
    if passed or stale:
        files = {**cached_files, **passed}
        for key in stale:
            files.pop(key, None)
        try:
            _write_cache(cache_file, level, files)
        except OSError as error:
            warnings.warn(
                f"verify_images: cannot write the cache {cache_file} ({type(error).__name__}: {error}); the "
                f"{len(paths):,} files are checked again next time. Set {CACHE_ENV} to a writable folder.",
                RuntimeWarning,
                stacklevel=2,
            )
    return result


__all__ = ["CACHE_FORMAT", "VERIFY_LEVELS", "VerifyResult", "check_image", "verify_image_files", "verify_level"]
