"""Nested widths (Matryoshka embeddings, Kusupati et al., NeurIPS 2022): the leading ``d`` dimensions of an
embedding used as an embedding of their own.

One place for what every user of a width shares: checking a list of widths (:func:`check_widths`), cutting
embeddings (:func:`cut`, refusing a width beyond ``D``), and the metric keys of a width (:func:`width_key`:
``w64/recall@1``, split back by :func:`split_widths`). Used by :class:`~lightning_dml.losses.MatryoshkaLoss`,
:class:`~lightning_dml.metrics.RetrievalMetrics` (``widths``) and ``lightning-dml index build --width``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from torch import Tensor, nn

from lightning_dml.errors import UserInputError

__all__ = ["LeadingDims", "WidthError", "check_width_fits", "check_widths", "cut", "split_widths", "width_key"]

_KEY = re.compile(r"^w([0-9]+)/(.+)$")


class WidthError(UserInputError, ValueError):
    """A width that is not a positive integer, widths out of order, or a width beyond the embedding's."""


def check_widths(widths: object, where: str) -> list[int]:
    """``widths`` as a list of strictly increasing integers ``>= 1`` (``d_1 < d_2 < ...``); :class:`WidthError`
    naming ``where`` and what is wrong."""
    if isinstance(widths, (str, bytes)) or not isinstance(widths, Sequence) or len(widths) == 0:
        raise WidthError(f"{where}: widths must be a non-empty list of integers, got {widths!r}")
    out = []
    for w in widths:
        if isinstance(w, bool) or not isinstance(w, int) or w < 1:
            raise WidthError(f"{where}: every width must be an integer >= 1, got {w!r} in {list(widths)}")
        out.append(int(w))
    if any(b <= a for a, b in zip(out, out[1:])):
        raise WidthError(f"{where}: widths must be strictly increasing (d1 < d2 < ...), got {out}")
    return out


def check_width_fits(width: int, dim: int, where: str) -> None:
    """:class:`WidthError` when ``width`` exceeds the embedding width ``dim``."""
    if width > dim:
        raise WidthError(f"{where}: width {width} exceeds the embedding width D = {dim}; give a width <= {dim}")


def cut(embeddings: Tensor, width: int | None, where: str) -> Tensor:
    """The leading ``width`` dimensions of ``embeddings [N, D]`` (all of them for ``None``), a view; the caller
    normalises where its metric does (a cut of a unit vector is not a unit vector)."""
    if width is None:
        return embeddings
    check_width_fits(width, embeddings.shape[-1], where)
    return embeddings[..., :width]


def width_key(width: int, key: str) -> str:
    """The key of metric ``key`` at width ``width``: ``width_key(64, "recall@1") == "w64/recall@1"`` (a prefix, as
    the per-category keys: the last part stays the metric's name)."""
    return f"w{int(width)}/{key}"


def split_widths(values: dict[str, float]) -> tuple[dict[str, float], dict[int, dict[str, float]]]:
    """``(values of the full embedding, {width: {metric: value}})`` from keys made by :func:`width_key`."""
    plain: dict[str, float] = {}
    by_width: dict[int, dict[str, float]] = {}
    for key, value in values.items():
        m = _KEY.match(key)
        if m is None:
            plain[key] = value
        else:
            by_width.setdefault(int(m.group(1)), {})[m.group(2)] = value
    return plain, dict(sorted(by_width.items()))


class LeadingDims(nn.Module):
    """``model``'s output cut to its leading ``width`` dimensions: the embedder of an index built with
    ``lightning-dml index build --width`` (every query is embedded, then cut, as the gallery was)."""

    def __init__(self, model: nn.Module, width: int) -> None:
        super().__init__()
        self.model, self.width = model, int(width)

    def forward(self, x: Tensor) -> Tensor:
        return cut(self.model(x), self.width, "the index's model (index build --width)")
