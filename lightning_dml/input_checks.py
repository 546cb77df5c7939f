"""Checks of embeddings and labels shared by the losses, the metrics and the training checks.

Every function raises ``ValueError`` with one message naming what is wrong and where: the optional ``where``
(e.g. ``"RetrievalMetrics.update"``) prefixes the message as ``"{where}: ..."``, ``name`` names the argument
(``"embeddings"``, ``"ref_labels"``, ``"training labels"``...). The checks never change their inputs.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "is_integer_tensor",
    "check_embeddings",
    "check_finite",
    "check_labels",
    "check_integer_labels",
    "check_per_row",
    "check_same_device",
]


def _prefix(where: str | None) -> str:
    return f"{where}: " if where else ""


def is_integer_tensor(t: Tensor) -> bool:
    """True for integer dtypes (class ids); False for floating point, complex and bool."""
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def check_embeddings(
    x: object, name: str = "embeddings", *, where: str | None = None, allow_empty: bool = False
) -> None:
    """``x`` must be a floating point tensor of shape ``[N, D]`` with ``D >= 1`` (and ``N >= 1`` unless
    ``allow_empty``). Finiteness is a separate check (:func:`check_finite`: it reads the values)."""
    p = _prefix(where)
    if not isinstance(x, Tensor):
        raise ValueError(f"{p}{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.ndim != 2:
        raise ValueError(f"{p}{name} must be a 2-D tensor [N, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{p}{name} must be a floating point tensor, got dtype {x.dtype}")
    if x.shape[0] == 0 and not allow_empty:
        raise ValueError(f"{p}{name} is empty (N = 0 rows)")
    if x.shape[1] == 0:
        raise ValueError(f"{p}{name} have dimension D = 0")


def check_finite(x: Tensor, name: str = "embeddings", *, where: str | None = None) -> None:
    """No NaN or Inf in ``x`` (``[N, ...]``); the message counts the bad rows and names the first.

    One reduction and one host read when all is well: a NaN or Inf anywhere makes the sum non-finite; only then
    are the rows examined (a finite sum that overflows falls through to the exact test, which then finds nothing).
    """
    if bool(torch.isfinite(x.sum())):
        return
    bad = ~torch.isfinite(x)
    if not bool(bad.any()):
        return
    rows = bad.reshape(bad.shape[0], -1).any(dim=1).nonzero().flatten()
    kinds = [k for k, test in (("NaN", torch.isnan), ("Inf", torch.isinf)) if bool(test(x).any())]
    raise ValueError(
        f"{_prefix(where)}{name} contain non-finite values ({'/'.join(kinds)}) in {rows.numel()} row(s), "
        f"first at row {int(rows[0])}"
    )


def check_integer_labels(labels: Tensor, name: str = "labels", *, where: str | None = None) -> None:
    """``labels`` must have an integer dtype (class ids, not float, complex or bool)."""
    if not is_integer_tensor(labels):
        raise ValueError(f"{_prefix(where)}{name} must be an integer tensor, got dtype {labels.dtype}")


def check_per_row(
    t: object,
    length: int,
    name: str,
    *,
    kind: str = "integer",
    of: str = "embeddings",
    where: str | None = None,
) -> None:
    """``t`` must be a 1-D tensor with one entry per row of ``of`` (``length`` rows) and dtype ``kind``
    (``"integer"`` or ``"bool"``)."""
    p = _prefix(where)
    if not isinstance(t, Tensor):
        kind_of = f"{type(t).__module__}.{type(t).__name__}" if type(t).__module__ != "builtins" else type(t).__name__
        raise ValueError(
            f"{p}{name} must be a 1-D torch.Tensor with one entry per row of {of}, got a {kind_of} "
            "(convert it with torch.as_tensor)"
        )
    if t.ndim != 1:
        raise ValueError(f"{p}{name} must be a 1-D tensor with one entry per row of {of}, got shape {tuple(t.shape)}")
    if t.shape[0] != length:
        raise ValueError(f"{p}{name} has {t.shape[0]} entries but {of} has {length} rows")
    if kind == "integer":
        check_integer_labels(t, name, where=where)
    elif kind == "bool":
        if t.dtype != torch.bool:
            raise ValueError(f"{p}{name} must be a bool tensor, got dtype {t.dtype}")
    else:
        raise ValueError(f"kind must be 'integer' or 'bool', got {kind!r}")


def check_labels(
    labels: object, length: int, name: str = "labels", *, of: str = "embeddings", where: str | None = None
) -> None:
    """``labels`` must be a 1-D integer tensor with one class id per row of ``of`` (``length`` rows)."""
    check_per_row(labels, length, name, kind="integer", of=of, where=where)


def check_same_device(
    t: Tensor, reference: Tensor, name: str, reference_name: str = "embeddings", *, where: str | None = None
) -> None:
    """``t`` must be on the device of ``reference``."""
    if t.device != reference.device:
        raise ValueError(f"{_prefix(where)}{name} are on {t.device} but {reference_name} are on {reference.device}")
