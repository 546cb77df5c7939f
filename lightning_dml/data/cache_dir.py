"""Where the library keeps what it derives from a data set: one user cache folder, one subfolder per data set.

The data sets themselves may sit on read-only or shared storage, so nothing derived is written beside them:

* ``$LIGHTNING_DML_CACHE`` when set, else ``$XDG_CACHE_HOME/lightning-dml``, else ``~/.cache/lightning-dml``
  (:func:`cache_root`);
* ``<cache root>/datasets/<top folder name>-<16 hex digits>/`` per data set (:func:`dataset_cache_dir`), the
  digits being the start of the sha256 of the data set's resolved top folder: two copies of one data set in two
  places never share entries, and the name says which data set the folder belongs to.

Files in a data set's folder are named ``<what>-<variant>.<ext>``: ``verified-header.json`` and
``verified-decode.json`` (:mod:`lightning_dml.data.verify`) today; other derived data (e.g. a decoded-image cache,
``decoded-<split>-<size>.*``) go beside them. Deleting the folder (or the whole cache root) is always safe: each
file is rebuilt when next needed.

Files are written through :func:`atomic_path` (a temporary file beside the target, renamed onto it), which the
report writer (:mod:`lightning_dml.report`) shares: a killed process never leaves a half-written file in place.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: Environment variable naming the cache root (default ``$XDG_CACHE_HOME/lightning-dml``, ``~/.cache/lightning-dml``).
CACHE_ENV = "LIGHTNING_DML_CACHE"


def cache_root() -> Path:
    """The user cache folder of lightning-dml (see the module docstring); not created here."""
    given = os.environ.get(CACHE_ENV)
    if given:
        return Path(given).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "lightning-dml"


def dataset_cache_dir(top: str | os.PathLike) -> Path:
    """The cache folder of the data set whose top folder is ``top``: ``<cache root>/datasets/<name>-<hash>``, the
    hash taken over the resolved absolute path (a relative ``top`` and its absolute form share it); not created."""
    resolved = Path(top).expanduser().resolve()
    digest = hashlib.sha256(str(resolved).encode("utf-8")).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", resolved.name).strip("._") or "dataset"
    return cache_root() / "datasets" / f"{name[:64]}-{digest}"


@contextmanager
def atomic_path(path: str | os.PathLike, *, fsync: bool = False) -> Iterator[Path]:
    """A new temporary file beside ``path`` for the caller to write (by name); when the block ends normally it is
    renamed onto ``path`` (``os.replace``, atomic on POSIX and Windows), when it raises (``KeyboardInterrupt``
    included) it is removed. A reader of ``path`` sees the old file or the new one, never half of one, and a
    process killed mid-write (SIGKILL, power cut with ``fsync``) leaves the old file whole; at most a hidden
    ``.<name>.<hex>.tmp<suffix>`` file stays behind.

    The temporary file ends with ``path``'s suffix (writers that append a missing ``.npz`` write it as named) and
    is created with the permissions an ordinary ``open`` gives (``0o666`` less the umask), not ``mkstemp``'s 0600.

    Args:
        path: the file to write.
        fsync: flush the new file to the disk before the rename (a power cut then also leaves one whole file).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp{path.suffix}")
        try:
            os.close(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            break
        except FileExistsError:  # pragma: no cover - 48 random bits taken
            continue
    try:
        yield temporary
        if fsync:
            handle = os.open(temporary, os.O_RDONLY)
            try:
                os.fsync(handle)
            finally:
                os.close(handle)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_bytes_atomic(path: str | os.PathLike, data: bytes, *, fsync: bool = False) -> None:
    """Write ``data`` to ``path`` through :func:`atomic_path`."""
    with atomic_path(path, fsync=fsync) as temporary:
        temporary.write_bytes(data)


def write_text_atomic(path: str | os.PathLike, text: str, *, fsync: bool = False) -> None:
    """Write ``text`` (UTF-8) to ``path`` through :func:`atomic_path`."""
    write_bytes_atomic(path, text.encode("utf-8"), fsync=fsync)


def write_json_atomic(path: str | os.PathLike, data: dict[str, Any]) -> None:
    """Write ``data`` as compact JSON to ``path`` through :func:`atomic_path`: a reader of a cache index sees the
    old or the new file, never half of one."""
    write_text_atomic(path, json.dumps(data, separators=(",", ":")))


__all__ = [
    "CACHE_ENV",
    "atomic_path",
    "cache_root",
    "dataset_cache_dir",
    "write_bytes_atomic",
    "write_json_atomic",
    "write_text_atomic",
]
