"""Opt-in progress bars for the long loops of evaluation (retrieval tiles, gallery chunks, k-means).

Off by default, so library calls and tests print nothing; :func:`progress_bars` turns them on for the code run
inside it (``RetrievalMetrics(progress=True)`` and ``DMLModule`` when the trainer shows a progress bar).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import TypeVar

T = TypeVar("T")

_ENABLED: ContextVar[bool] = ContextVar("lightning_dml_progress_bars", default=False)


@contextmanager
def progress_bars(enabled: bool = True) -> Iterator[None]:
    """Show (or, with ``enabled=False``, hide) the evaluation progress bars inside the ``with`` block."""
    token = _ENABLED.set(bool(enabled))
    try:
        yield
    finally:
        _ENABLED.reset(token)


def track(iterable: Iterable[T], desc: str, total: int | None = None) -> Iterable[T]:
    """``iterable`` wrapped in a tqdm bar when progress bars are on, unchanged otherwise."""
    if not _ENABLED.get():
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, desc=desc, total=total, leave=False, dynamic_ncols=True)
