"""Checkpoint files a user names: read with one clear error, compared with the model they load into, recorded.

* :func:`read_checkpoint`: load a Lightning checkpoint file safely (``torch.load(weights_only=True)``), or raise one
  :class:`~lightning_dml.errors.UserInputError` naming the file and what is wrong with it: missing, empty,
  truncated or corrupt, not written by ``torch.save``, holding pickled code objects, not a Lightning checkpoint.
  The advice torch gives for the last cases (``weights_only=False``, which runs any code the file holds) is never
  repeated.
* :func:`read_torch_file`: the same safe load for the library's other ``torch.save`` files (predictions, cv folds).
* :func:`local_checkpoint`: an ``http(s)://`` checkpoint downloaded to the cache (then read like a local file).
* :func:`hparams_disagreements`: the hyper-parameters of a checkpoint that a configuration gives differently (the
  evaluation settings, :data:`EVALUATION_HPARAMS`, may differ).
* :func:`checkpoint_record`: ``{"path", "sha256"}`` of the checkpoint a run's weights came from (``None``: none),
  what ``lightning-dml`` logs as the ``checkpoint`` hyper-parameter and writes into the predictions file.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from lightning_dml.errors import CorruptFileError, MissingFileError, UserInputError

__all__ = [
    "EVALUATION_HPARAMS",
    "CheckpointMismatchError",
    "checkpoint_record",
    "flatten",
    "hparams_disagreements",
    "is_url",
    "local_checkpoint",
    "read_checkpoint",
    "read_torch_file",
    "url_checkpoint_path",
]

#: ``ckpt_path`` values Lightning resolves itself (not file names)
SPECIAL_CKPT_PATHS = ("best", "last", "hpc")


class CheckpointMismatchError(UserInputError, ValueError):
    """A checkpoint does not fit the model it is loaded into (another backbone or width, other hyper-parameters)."""


def is_local_file_path(ckpt_path: str | os.PathLike) -> bool:
    """Whether ``ckpt_path`` names a local file (not ``best``/``last``/``hpc``, a ``registry:`` model, or a URL)."""
    text = str(ckpt_path)
    return text not in SPECIAL_CKPT_PATHS and not text.startswith("registry") and "://" not in text


def _first_sentence(text: str) -> str:
    return text.strip().split("\n", 1)[0].split(". ", 1)[0].rstrip(".")


def _refused_global(error: BaseException) -> str | None:
    """The Python object torch's weights-only unpickler refused to import, if that is why it failed."""
    found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(error))
    return found.group(1) if found else None


def read_torch_file(path: str | os.PathLike, what: str, kind: str = "checkpoint") -> Any:
    """Load the ``torch.save`` file at ``path`` on the CPU with tensors and plain data only (``weights_only=True``;
    memory-mapped when it is a zip archive), or raise one :class:`~lightning_dml.errors.UserInputError` naming it.

    Every failure says which file and why: :class:`~lightning_dml.errors.MissingFileError` (no such file),
    :class:`~lightning_dml.errors.CorruptFileError` (a folder, empty, truncated, not a ``torch.save`` file, or a
    pickle of a Python object other than tensors and plain data: refused, never unpickled, since unpickling it
    would run code from the file). ``what`` names the file in messages (``"--ckpt_path"``), ``kind`` what it should
    be (``"checkpoint"``, ``"predictions file"``).
    """
    path = Path(path)
    if not path.exists():
        raise MissingFileError(f"{what} {path} does not exist")
    if path.is_dir():
        raise CorruptFileError(f"{what} {path} is a folder, not a {kind} file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            magic = handle.read(4)
    except OSError as error:
        raise CorruptFileError(f"{what} {path} cannot be read: {error.strerror or error}") from error
    if size == 0:
        raise CorruptFileError(f"{what} {path} is empty (0 bytes): the run that wrote it was probably interrupted")
    archive = magic == b"PK\x03\x04"  # torch.save's zip archive (every file since torch 1.6)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # e.g. the pickle-protocol note of the weights-only unpickler
            return torch.load(path, map_location="cpu", weights_only=True, mmap=archive)
    except pickle.UnpicklingError as error:
        refused = _refused_global(error)
        if refused is None:  # not a pickle torch.load can read (text, another format)
            raise CorruptFileError(
                f"{what} {path} is not a {kind}: torch.load cannot read it (the file starts with {magic!r}, a "
                f"{kind} with b'PK\\x03\\x04')"
            ) from None
        raise CorruptFileError(
            f"{what} {path} is not a lightning-dml {kind}: it pickles the Python object {refused}, which a "
            f"{kind} of this library never holds and which is not loaded, for safety (loading it would run code "
            "from the file)"
        ) from None
    except RuntimeError as error:
        if archive:
            raise CorruptFileError(
                f"{what} {path} is truncated or corrupt ({size} bytes; the torch.save archive cannot be read: "
                f"{_first_sentence(str(error))}); it was probably cut off while being written or copied"
            ) from None
        raise CorruptFileError(f"{what} {path} is not a {kind}: {_first_sentence(str(error))}") from None
    except Exception as error:  # noqa: BLE001 - any other torch.load failure means "not a torch.save file"
        raise CorruptFileError(
            f"{what} {path} is not a {kind}: torch.load cannot read it ({type(error).__name__}; the file "
            f"starts with {magic!r}, a {kind} with b'PK\\x03\\x04')"
        ) from None


def read_checkpoint(path: str | os.PathLike, what: str = "checkpoint") -> dict[str, Any]:
    """Load the Lightning checkpoint at ``path`` on the CPU (memory-mapped when it is a ``torch.save`` archive).

    Only tensors and plain data are unpickled (``weights_only=True``, :func:`read_torch_file`): a lightning-dml
    checkpoint holds nothing else. Every failure is one :class:`~lightning_dml.errors.UserInputError` naming the
    file: :class:`~lightning_dml.errors.MissingFileError` (no such file) or
    :class:`~lightning_dml.errors.CorruptFileError` (empty, truncated, not a checkpoint, holds code objects).
    """
    checkpoint = read_torch_file(path, what, "checkpoint")
    if not isinstance(checkpoint, Mapping) or not {"state_dict", "pytorch-lightning_version"} <= set(checkpoint):
        if not isinstance(checkpoint, Mapping):
            held = f"a {type(checkpoint).__name__}"
        elif {"state_dict", "embedding_dim", "input_shape"} <= set(checkpoint):
            held = "the embedding model's weights alone, as `python -m lightning_dml.export` writes them"
        elif checkpoint and all(isinstance(v, torch.Tensor) for v in checkpoint.values()):
            held = "weights alone (a state dict)"
        else:
            held = f"a dict with keys {', '.join(map(str, list(checkpoint)[:8]))}"
        raise CorruptFileError(
            f"{what} {path} is not a Lightning checkpoint: it holds {held}, not the 'state_dict' and "
            "'pytorch-lightning_version' a checkpoint written by the Trainer has"
        )
    return dict(checkpoint)


# ------------------------------------------------------------------------------------------------- URLs
def is_url(ckpt_path: str | os.PathLike) -> bool:
    """Whether ``ckpt_path`` is a URL (``scheme://...``) rather than a file name."""
    return "://" in str(ckpt_path)


def url_checkpoint_path(url: str) -> Path:
    """Where a checkpoint downloaded from ``url`` is cached: ``<cache root>/checkpoints/<16 hex digits of the
    URL's sha256>-<file name>`` (:func:`~lightning_dml.data.cache_dir.cache_root`)."""
    from urllib.parse import urlparse

    from lightning_dml.data.cache_dir import cache_root

    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(urlparse(url).path).name).strip("._") or "checkpoint.ckpt"
    digest = hashlib.sha256(url.encode("utf-8")).hexdigest()[:16]
    return cache_root() / "checkpoints" / f"{digest}-{name[:80]}"


def local_checkpoint(ckpt_path: str | os.PathLike, what: str = "--ckpt_path", progress: bool = True) -> Path:
    """The local file of a checkpoint a user names: ``ckpt_path`` itself, or, for an ``http(s)://`` URL, its copy
    in the cache (:func:`url_checkpoint_path`), downloaded first if missing (under a file lock, into a temporary
    file renamed when complete; ``LIGHTNING_DML_OFFLINE=1`` forbids it). Either way the caller then reads it with
    :func:`read_checkpoint`, never with Lightning's URL loader (which unpickles anything). Other URL schemes are
    one :class:`~lightning_dml.errors.UserInputError`. A cached copy is reused: delete it to download again."""
    text = str(ckpt_path)
    if not is_url(text):
        return Path(text)
    scheme = text.split("://", 1)[0].lower()
    if scheme not in ("http", "https"):
        raise UserInputError(
            f"{what} {text}: only local files and http(s):// URLs are read (safely, tensors only); copy a "
            f"{scheme}:// checkpoint to a local file first"
        )
    from lightning_dml.download import fetch_url

    return fetch_url(text, url_checkpoint_path(text), f"{what} {text}", "Or download the file yourself and give "
                     "its local path.", progress=progress)


# ------------------------------------------------------------------------------------------------- hyper-parameters
def _plain(value: Any) -> Any:
    """``value`` with tuples as lists and mappings as dicts, so a config's and a checkpoint's values compare."""
    if isinstance(value, Mapping) or hasattr(value, "as_dict"):
        items = value.as_dict() if hasattr(value, "as_dict") else value
        return {str(k): _plain(v) for k, v in items.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    return value


def flatten(values: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Dotted keys to leaf values (``{"a": {"b": 1}}`` -> ``{"a.b": 1}``); lists are leaves."""
    out: dict[str, Any] = {}
    for key, value in _plain(values).items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, f"{name}."))
        else:
            out[name] = value
    return out


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b if isinstance(a, bool) and isinstance(b, bool) else False
    return a == b


#: The model's evaluation settings (:class:`~lightning_dml.module.DMLModule`'s arguments that only choose what
#: validation and test compute): not the model, so they may differ from the checkpoint's
#: (``test --ckpt_path X --model.metrics "[mrr, ndcg@5]"``). Every other hyper-parameter (architecture, loss,
#: optimisation) must equal the checkpoint's.
EVALUATION_HPARAMS = ("recall_at", "clustering", "metrics", "metric_widths")


def hparams_disagreements(
    checkpoint_hparams: Mapping[str, Any],
    given: Mapping[str, Any],
    keys: Iterable[str] | None = None,
    evaluation: bool = False,
) -> list[tuple[str, Any, Any]]:
    """``(key, given value, checkpoint value)`` for every dotted key present in both that differs.

    Keys starting with ``_`` (Lightning's ``_instantiator``, ``_class_path``) are not hyper-parameters and are left
    out, and so are the evaluation settings (:data:`EVALUATION_HPARAMS`) unless ``evaluation``; ``keys`` restricts
    the comparison (default: all). Tuples and lists compare equal element by element.
    """
    ckpt = {k: v for k, v in flatten(checkpoint_hparams).items() if not k.split(".")[0].startswith("_")}
    mine = flatten(given)
    wanted = set(keys) if keys is not None else None
    out = []
    for key in sorted(set(ckpt) & set(mine)):
        if wanted is not None and key.split(".")[0] not in wanted:
            continue
        if not evaluation and key.split(".")[0] in EVALUATION_HPARAMS:
            continue
        if not _equal(mine[key], ckpt[key]):
            out.append((key, mine[key], ckpt[key]))
    return out


# ------------------------------------------------------------------------------------------------- record
_SHA256: dict[tuple[str, int, int, int], str] = {}


def _sha256(path: Path) -> str:
    stat = path.stat()
    # the change time too: a rewrite of the same size whose modification time was put back (os.utime, cp -p)
    # changes it, so the cache never answers the old digest for new content
    key = (str(path), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if key not in _SHA256:
        digest = hashlib.sha256()
        with open(path, "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        _SHA256[key] = digest.hexdigest()
    return _SHA256[key]


def checkpoint_record(ckpt_path: str | os.PathLike | None) -> dict[str, str] | None:
    """``{"path": absolute path, "sha256": hex digest}`` of a checkpoint file, ``{"path": ...}`` alone for a URL or
    a folder (a sharded checkpoint), ``None`` when no checkpoint was loaded (the model's initial weights).

    The digest (one read of the file, cached by path, size, modification and change time) identifies the weights even
    after ``last.ckpt`` has been overwritten by a later run.
    """
    if ckpt_path is None or str(ckpt_path) == "":
        return None
    if not is_local_file_path(ckpt_path):
        return {"path": str(ckpt_path)}
    path = Path(ckpt_path).expanduser().resolve()
    if not path.is_file():
        return {"path": str(path)}
    return {"path": str(path), "sha256": _sha256(path)}
