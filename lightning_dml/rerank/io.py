"""A re-ranker folder: ``reranker.json`` and ``weights.safetensors``, written as one unit, read with one-line errors.

``reranker.json`` holds:

* ``format`` (``"lightning-dml-reranker"``) and ``version`` (:data:`FORMAT_VERSION`);
* ``kind`` (``concat_siamese``, ``feature_distance_siamese``) and ``options`` (the constructor's arguments): the
  model is rebuilt from them, never unpickled;
* ``inputs`` (``"images"`` or ``"embeddings"``), ``embedding_dim`` (width of the base model's embeddings, or
  ``None``), ``input_spec`` (the preprocessing the re-ranker's images need, or ``None``);
* ``base_checkpoint_sha256``: the sha256 of the checkpoint of the base model whose top-n lists the re-ranker was
  trained on (the search refuses a re-ranker of another base model);
* ``weights``: file name, size in bytes and sha256 of the weights file (a truncated or swapped file is refused
  before it is read); ``versions`` (lightning-dml, torch, timm); ``extra``: free JSON data (training record).

The weights are tensors only (``safetensors``; no pickle, so loading a stranger's folder runs no code). The
folder is written through :func:`lightning_dml.index.folder.replacing` (a fresh sibling folder swapped in under a
lock): a reader sees the whole old folder or the whole new one, and a killed writer leaves the old one whole.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from lightning_dml.data.cache_dir import write_json_atomic
from lightning_dml.errors import CorruptFileError, MissingFileError
from lightning_dml.models.input_spec import InputSpec
from lightning_dml.rerank.models import RERANKER_KINDS, PairwiseReranker

__all__ = ["FORMAT", "FORMAT_VERSION", "MANIFEST", "WEIGHTS", "load_reranker", "read_reranker_record",
           "save_reranker"]

FORMAT = "lightning-dml-reranker"
FORMAT_VERSION = 1
MANIFEST = "reranker.json"
WEIGHTS = "weights.safetensors"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _versions() -> dict[str, str]:
    import timm

    from lightning_dml import __version__

    return {"lightning_dml": str(__version__), "torch": torch.__version__, "timm": timm.__version__}


def save_reranker(model: PairwiseReranker, folder: str | os.PathLike, *, base_checkpoint_sha256: str | None,
                  embedding_dim: int | None = None, input_spec: InputSpec | None = None,
                  extra: dict[str, Any] | None = None) -> Path:
    """Write ``model`` into the re-ranker folder ``folder`` (module docstring), replacing a previous one as a whole;
    returns the folder's path.

    Args:
        model: a :class:`PairwiseReranker` (its ``kind`` must be one of :data:`RERANKER_KINDS`).
        folder: the folder to (re)write.
        base_checkpoint_sha256: sha256 of the base model's checkpoint (``checkpoint_record(path)["sha256"]``).
        embedding_dim: width of the base model's embeddings (defaults to ``model.dim`` for embedding re-rankers).
        input_spec: the re-ranker's image preprocessing (defaults to ``model.input_spec`` where it has one).
        extra: further JSON data recorded under ``extra`` (e.g. how it was trained).
    """
    from safetensors.torch import save

    from lightning_dml.index.folder import replacing

    if model.kind not in RERANKER_KINDS or not isinstance(model, RERANKER_KINDS[model.kind]):
        raise TypeError(f"save_reranker needs one of {sorted(RERANKER_KINDS)}, got {type(model).__name__}")
    if embedding_dim is None:
        embedding_dim = getattr(model, "dim", None)
    if input_spec is None:
        input_spec = getattr(model, "input_spec", None)
    state = {name: tensor.detach().to("cpu", copy=True).contiguous() for name, tensor in model.state_dict().items()}
    record: dict[str, Any] = {
        "format": FORMAT, "version": FORMAT_VERSION, "kind": model.kind, "options": model.options(),
        "inputs": model.inputs, "base_checkpoint_sha256": base_checkpoint_sha256,
        "embedding_dim": None if embedding_dim is None else int(embedding_dim),
        "input_spec": None if input_spec is None else asdict(input_spec), "versions": _versions(),
        "extra": dict(extra or {}),
    }
    with replacing(folder, what="a write of the re-ranker") as staged:
        weights = staged / WEIGHTS
        weights.write_bytes(save(state, metadata={"format": FORMAT, "kind": model.kind}))  # an ordinary file's mode
        record["weights"] = {"file": WEIGHTS, "bytes": weights.stat().st_size, "sha256": _sha256(weights)}
        write_json_atomic(staged / MANIFEST, record)
    return Path(folder)


def read_reranker_record(folder: str | os.PathLike) -> dict[str, Any]:
    """The checked ``reranker.json`` of a re-ranker folder, or one :class:`~lightning_dml.errors.UserInputError`:
    :class:`~lightning_dml.errors.MissingFileError` (no folder, no ``reranker.json``) or
    :class:`~lightning_dml.errors.CorruptFileError` (not JSON, another format, version or kind, missing fields)."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise MissingFileError(f"re-ranker folder {folder} does not exist or is not a folder")
    path = folder / MANIFEST
    if not path.is_file():
        raise MissingFileError(f"re-ranker folder {folder} has no {MANIFEST}: not a re-ranker folder (written by "
                               "save_reranker or the re-ranker's fit)")
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise CorruptFileError(f"{path} is not valid JSON ({type(error).__name__}: {error}); the re-ranker folder "
                               "is corrupt") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise CorruptFileError(f"{path} is not a lightning-dml re-ranker record (format "
                               f"{record.get('format') if isinstance(record, dict) else None!r}, want {FORMAT!r})")
    if record.get("version") != FORMAT_VERSION:
        raise CorruptFileError(f"{path} has format version {record.get('version')!r}; this lightning-dml reads "
                               f"version {FORMAT_VERSION}")
    if record.get("kind") not in RERANKER_KINDS:
        raise CorruptFileError(f"{path}: unknown re-ranker kind {record.get('kind')!r} (known: "
                               f"{', '.join(sorted(RERANKER_KINDS))})")
    cls = RERANKER_KINDS[record["kind"]]
    if record.get("inputs") != cls.inputs:
        raise CorruptFileError(f"{path}: a {record['kind']} re-ranker takes {cls.inputs}, the record says "
                               f"{record.get('inputs')!r}")
    weights = record.get("weights")
    if not isinstance(record.get("options"), dict) or not isinstance(weights, dict) or not all(
            key in weights for key in ("file", "bytes", "sha256")):
        raise CorruptFileError(f"{path} lacks its options or its weights entry (file, bytes, sha256)")
    if Path(str(weights["file"])).name != weights["file"]:
        raise CorruptFileError(f"{path}: the weights file {weights['file']!r} must be a plain file name in the folder")
    return record


def load_reranker(folder: str | os.PathLike, device: str | torch.device = "cpu") -> PairwiseReranker:
    """The re-ranker saved in ``folder``, in eval mode on ``device``.

    The model is rebuilt from the record's kind and options (no pretrained download) and its weights read from the
    safetensors file after its size and sha256 are checked against the record. The returned module carries the
    record's ``base_checkpoint_sha256``, ``embedding_dim``, ``input_spec`` (an :class:`InputSpec` or ``None``) and
    the whole ``record``. Every failure is one :class:`~lightning_dml.errors.UserInputError` naming the folder.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    record = read_reranker_record(folder)
    weights = folder / record["weights"]["file"]
    if not weights.is_file():
        raise MissingFileError(f"re-ranker folder {folder} has no weights file {weights.name}")
    size = weights.stat().st_size
    if size != record["weights"]["bytes"] or _sha256(weights) != record["weights"]["sha256"]:
        raise CorruptFileError(f"re-ranker weights {weights} ({size} bytes) are not the file {MANIFEST} records "
                               f"({record['weights']['bytes']} bytes, sha256 {str(record['weights']['sha256'])[:12]}"
                               "...): truncated, corrupt or replaced")
    cls = RERANKER_KINDS[record["kind"]]
    options = dict(record["options"])
    if cls.inputs == "images":
        options["pretrained"] = False  # the folder's weights replace them; never a download
    try:
        model = cls(**options)
    except (TypeError, ValueError) as error:
        raise CorruptFileError(f"{folder / MANIFEST}: the options {options} do not build a {record['kind']} "
                               f"re-ranker ({error})") from None
    try:
        state = load_file(str(weights))
    except (SafetensorError, OSError, ValueError) as error:
        raise CorruptFileError(f"re-ranker weights {weights} cannot be read as safetensors ({error})") from None
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as error:
        first = str(error).strip().split("\n")[0:2]
        raise CorruptFileError(f"re-ranker weights {weights} do not fit the {record['kind']} model its record "
                               f"describes ({' '.join(line.strip() for line in first)})") from None
    spec = record.get("input_spec")
    try:
        model.input_spec = None if spec is None else InputSpec(**{k: tuple(v) if isinstance(v, list) else v
                                                                   for k, v in spec.items()})
    except (TypeError, ValueError) as error:
        raise CorruptFileError(f"{folder / MANIFEST}: its input_spec {spec} is not valid ({error})") from None
    model.base_checkpoint_sha256 = record.get("base_checkpoint_sha256")
    model.embedding_dim = record.get("embedding_dim")
    model.record = record
    return model.to(device).eval()
