"""No figure depends on the thread count, the tile sizes or the precision of the approximate pass.

Every result of the search is a function of exact float64 scores (``lightning_dml.metrics._ranks``) and the
k-means of the clustering metrics runs from a fixed seed; so one set evaluated with 1 and 2 intra-op threads and
several tile grids (row pass and symmetric tile pass, tiles that do not divide the set), in every precision of the
approximate pass, must give ``==`` figures.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from lightning_dml.metrics import RetrievalMetrics

#: (query_block, gallery_chunk): the default (one block), the symmetric tile pass (>= 4 blocks), the row pass with
#: chunks that divide nothing
TILES = [(None, None), (128, 300), (700, 97)]


def _clustered(n: int = 1200, d: int = 24, classes: int = 60, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Trained-like data: tight classes of very different spreads, exact duplicates and near-ties."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    spread = torch.exp(torch.randn(classes, 1, generator=g))[y]
    x = torch.randn(classes, d, generator=g)[y] + 0.4 * spread * torch.randn(n, d, generator=g)
    x[50:60] = x[3]  # exact duplicates (ties resolved by index)
    x[60:70] = x[4] + 1e-6 * torch.randn(10, d, generator=g)  # near-ties far below the bf16 rounding
    return x, y


def _evaluate(
    x: torch.Tensor, y: torch.Tensor, threads: int, tiles: tuple, precision: str, clustering: bool = False, **kw
) -> dict[str, float]:
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        m = RetrievalMetrics(
            recall_at=(1, 2, 4, 8, 16), clustering=clustering, kmeans_seeds=2, kmeans_backend="torch",
            precision=precision, query_block=tiles[0], gallery_chunk=tiles[1],
        )
        m.update(x, y, **kw)
        return m.compute()
    finally:
        torch.set_num_threads(prev)


def test_figures_equal_for_any_thread_count_tile_grid_and_precision() -> None:
    x, y = _clustered()
    # the k-means (NMI, F1) depends on neither the tiles nor the search precision: cluster once per thread count
    results = {
        (threads, tiles, precision): _evaluate(x, y, threads, tiles, precision, clustering=tiles == TILES[0])
        for threads, tiles, precision in itertools.product((1, 2), TILES, ("auto", "fp32", "tf32", "bf16"))
    }
    first = results[(1, TILES[0], "auto")]
    assert set(first) >= {"recall@1", "map@r", "r_precision", "nmi", "f1"}
    for setting, got in results.items():
        assert got == {key: first[key] for key in got}, setting


def test_query_gallery_figures_equal_for_any_thread_count_and_tile_grid() -> None:
    x, y = _clustered(seed=1)
    qm = torch.arange(x.shape[0]) % 3 == 0
    results = [
        _evaluate(x, y, threads, tiles, "auto", query_mask=qm, gallery_mask=~qm)
        for threads, tiles in itertools.product((1, 2), TILES)
    ]
    assert all(r == results[0] for r in results[1:])
