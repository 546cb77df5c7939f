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
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tempfile
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


def write_json_atomic(path: Path, data: dict[str, Any]) -> None:
    """Write ``data`` as JSON to ``path`` atomically (a temporary file beside it, renamed into place): a reader of
    a cache index sees the old or the new file, never half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as stream:
            json.dump(data, stream, separators=(",", ":"))
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


__all__ = ["CACHE_ENV", "cache_root", "dataset_cache_dir", "write_json_atomic"]
