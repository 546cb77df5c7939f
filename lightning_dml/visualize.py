"""A retrieval grid: queries in rows, their nearest neighbours to the right, correct ones framed green.

:func:`retrieval_grid` draws with numpy only (no matplotlib), so callbacks can log the image from any process
without touching a plotting backend; :class:`~lightning_dml.callbacks.RetrievalGridLogger` logs one per
validation.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from lightning_dml.metrics.functional import knn

#: Frame colours (RGB): neighbour of the query's class, of another class, the query itself, the background.
CORRECT = (0, 200, 0)
WRONG = (220, 0, 0)
QUERY = (40, 40, 40)
BACKGROUND = (255, 255, 255)


def _as_tensor(values) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        return values.detach().cpu()
    return torch.as_tensor(np.asarray(values))


def to_display(images: torch.Tensor | np.ndarray) -> np.ndarray:
    """Images ``[N, C, H, W]`` (any normalisation, C = 1 or 3) as uint8 ``[N, H, W, 3]``.

    Each image is min-max scaled to [0, 255] on its own (a constant image becomes mid-grey), which undoes any
    mean/std normalisation up to contrast; grey images are repeated to three channels.
    """
    x = _as_tensor(images).float()
    if x.ndim != 4 or x.shape[1] not in (1, 3):
        raise ValueError(f"images must be [N, C, H, W] with C = 1 or 3, got shape {tuple(x.shape)}")
    flat = x.flatten(1)
    low, high = flat.min(dim=1).values, flat.max(dim=1).values
    span = (high - low).clamp_min(1e-12)[:, None, None, None]
    scaled = (x - low[:, None, None, None]) / span
    scaled[(high - low) <= 1e-12] = 0.5
    if x.shape[1] == 1:
        scaled = scaled.expand(-1, 3, -1, -1)
    return (scaled * 255).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy()


def nearest_neighbours(embeddings: torch.Tensor | np.ndarray, queries: Sequence[int], top_k: int) -> np.ndarray:
    """Indices ``[len(queries), top_k]`` of the ``top_k`` most cosine-similar items of each query, itself excluded
    (exact, ties to the lower index: :func:`lightning_dml.metrics.functional.knn`, on the embeddings' device)."""
    e = embeddings.detach() if isinstance(embeddings, torch.Tensor) else torch.as_tensor(np.asarray(embeddings))
    q = torch.as_tensor(list(queries), dtype=torch.long, device=e.device)
    # one neighbour more than asked: the query itself is among them and is dropped by index
    _, idx = knn(e[q].float(), e.float(), k=top_k + 1)
    is_self = idx == q.unsqueeze(1)
    order = torch.argsort(is_self.to(torch.uint8), dim=1, stable=True)
    return idx.gather(1, order)[:, :top_k].cpu().numpy()


def retrieval_grid(
    images: torch.Tensor | np.ndarray,
    labels: torch.Tensor | np.ndarray | Sequence[int],
    embeddings: torch.Tensor | np.ndarray,
    num_queries: int = 8,
    top_k: int = 5,
    query_indices: Sequence[int] | None = None,
    seed: int = 0,
    border: int = 2,
    gap: int = 2,
) -> np.ndarray:
    """A retrieval grid image, uint8 ``[H, W, 3]``.

    Row ``r`` shows query ``r`` (dark frame) and, to its right after a wider gap, its ``top_k`` nearest
    neighbours among all other items by cosine similarity of the L2-normalised ``embeddings``, best first; a
    neighbour is framed green (:data:`CORRECT`) when its label equals the query's, red (:data:`WRONG`) otherwise.

    Layout (for tests and readers): each tile is ``border + H + border`` square-ish, tiles are ``gap`` apart,
    the grid has a ``gap`` margin, and an extra ``2 * gap`` separates the query column from the neighbours; tile
    ``(r, c)`` (``c = 0`` the query) starts at row ``gap + r * (tile_h + gap)`` and column
    ``gap + c * (tile_w + gap) + (2 * gap if c > 0 else 0)``.

    Args:
        images: ``[N, C, H, W]`` (C = 1 or 3), any normalisation (see :func:`to_display`).
        labels: ``[N]`` class labels.
        embeddings: ``[N, D]`` embeddings of the same items.
        num_queries: number of rows when ``query_indices`` is not given (a seeded random choice).
        top_k: neighbours per query.
        query_indices: the queries, by position in ``images``.
        seed: seed of the query choice.
        border: frame width in pixels.
        gap: spacing in pixels.
    """
    labels_t = _as_tensor(labels).long().reshape(-1)
    emb = _as_tensor(embeddings)
    n = len(labels_t)
    if emb.ndim != 2 or emb.shape[0] != n:
        raise ValueError(f"embeddings must be [N, D] with N = {n} labels, got shape {tuple(emb.shape)}")
    if top_k < 1 or top_k > n - 1:
        raise ValueError(f"top_k must be between 1 and {n - 1} (the other items), got {top_k}")
    if border < 0 or gap < 0:
        raise ValueError(f"border and gap must be >= 0, got {border} and {gap}")
    tiles = to_display(images)
    if tiles.shape[0] != n:
        raise ValueError(f"{tiles.shape[0]} images but {n} labels")
    if query_indices is None:
        if num_queries < 1 or num_queries > n:
            raise ValueError(f"num_queries must be between 1 and {n}, got {num_queries}")
        query_indices = np.sort(np.random.default_rng(seed).choice(n, size=num_queries, replace=False)).tolist()
    queries = [int(q) for q in query_indices]
    if not queries or any(q < 0 or q >= n for q in queries):
        raise ValueError(f"query_indices must be a non-empty list of positions in [0, {n}), got {queries}")
    neighbours = nearest_neighbours(emb, queries, top_k)

    h, w = tiles.shape[1:3]
    tile_h, tile_w = h + 2 * border, w + 2 * border
    rows, cols = len(queries), top_k + 1
    height = gap + rows * (tile_h + gap)
    width = gap + cols * (tile_w + gap) + 2 * gap
    grid = np.empty((height, width, 3), dtype=np.uint8)
    grid[:] = BACKGROUND
    for r, q in enumerate(queries):
        items = [(q, QUERY)] + [
            (int(j), CORRECT if labels_t[j] == labels_t[q] else WRONG) for j in neighbours[r]
        ]
        for c, (item, colour) in enumerate(items):
            top = gap + r * (tile_h + gap)
            left = gap + c * (tile_w + gap) + (2 * gap if c > 0 else 0)
            grid[top : top + tile_h, left : left + tile_w] = colour
            grid[top + border : top + border + h, left + border : left + border + w] = tiles[item]
    return grid


__all__ = ["CORRECT", "QUERY", "WRONG", "nearest_neighbours", "retrieval_grid", "to_display"]
