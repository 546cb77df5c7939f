"""The worst queries as one image: a row per query, the query then its top-k neighbours framed green (relevant) or
red (irrelevant), with the colours and layout of :func:`lightning_dml.visualize.retrieval_grid`, but from a
:class:`~lightning_dml.retrieval.RetrievalResults` (the exact engine's neighbours and relevance, query/gallery
modes, sequences and label sets) instead of a search of its own. For TensorBoard's ``add_image`` and W&B."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from PIL import Image

from lightning_dml.report.thumbnails import ImageSource
from lightning_dml.retrieval import RetrievalResults
from lightning_dml.visualize import BACKGROUND, CORRECT, QUERY, WRONG

__all__ = ["results_grid", "tile_image"]

#: the frame of a missing image (no image source, an unreadable file, a padded neighbour)
MISSING = (200, 200, 200)


def tile_image(images: ImageSource | None, index: int, size: int) -> Image.Image:
    """The item's image fitted into a ``size`` x ``size`` RGB square (light grey when there is none)."""
    tile = Image.new("RGB", (size, size), MISSING)
    if images is None or index < 0:
        return tile
    try:
        with images.load(int(index)) as image:
            image = image.convert("RGB")
            image.thumbnail((size, size), Image.Resampling.LANCZOS)
            tile.paste(image, ((size - image.size[0]) // 2, (size - image.size[1]) // 2))
    except OSError:  # an unreadable file stays grey (the report names it)
        pass
    return tile


def results_grid(
    results: RetrievalResults, rows: Sequence[int], images: ImageSource | None, size: int = 48, border: int = 2,
    gap: int = 2, top_k: int | None = None,
) -> np.ndarray:
    """uint8 ``[H, W, 3]``: row ``r`` is query ``results.query[rows[r]]`` (dark frame), then after a wider gap its
    top ``top_k`` neighbours (default all kept), best first, framed green when relevant and red when not.
    Tile ``(r, c)`` starts at ``gap + r * (size + 2 * border + gap)`` down and
    ``gap + c * (size + 2 * border + gap) + (2 * gap if c > 0 else 0)`` across (``c = 0``: the query)."""
    k = results.neighbors.shape[1] if top_k is None else min(int(top_k), results.neighbors.shape[1])
    step = size + 2 * border + gap
    height = gap + max(1, len(rows)) * step
    width = gap + (k + 1) * step + 2 * gap
    canvas = Image.new("RGB", (width, height), BACKGROUND)
    for r, row in enumerate(rows):
        tiles = [(int(results.query[row]), QUERY)]
        tiles += [(int(nb), CORRECT if rel else WRONG)
                  for nb, rel in zip(results.neighbors[row, :k], results.relevant[row, :k])]
        for c, (index, colour) in enumerate(tiles):
            if index < 0:
                continue
            x = gap + c * step + (2 * gap if c > 0 else 0)
            y = gap + r * step
            canvas.paste(Image.new("RGB", (size + 2 * border, size + 2 * border), colour), (x, y))
            canvas.paste(tile_image(images, index, size), (x + border, y + border))
    return np.asarray(canvas)
