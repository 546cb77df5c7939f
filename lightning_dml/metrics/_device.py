"""Where and how the search computes: precision choice per device, thread control, tile sizes.

* :func:`resolve_precision`: what ``precision="auto"`` means on a device (see ``docs/metrics.md``).
* :class:`_Threads`: run a section with a given number of intra-op CPU threads.
* :func:`tile_sizes`: query-block and gallery-chunk sizes from the free memory of the device (or explicit sizes).
"""

from __future__ import annotations

import math

import torch

PRECISIONS = ("auto", "fp32", "tf32", "bf16")

#: CPU tile sizes (tuned on a 2-core AVX2 machine: tiles of a few MB stay in cache between the passes).
CPU_QUERY_BLOCK = 2048
CPU_GALLERY_CHUNK = 8192
#: bytes of working memory per entry of a score tile: the float32 tile, a bool mask, and temporaries
#: (comparisons, ``topk`` of the first chunk) of up to two more float32 tiles.
TILE_ENTRY_BYTES = 16
#: at most this much tile memory by default on a GPU (tiles of 16,384 x 16,384 scores): larger tiles gain nothing
#: once the products saturate the GPU, and the budget keeps the metric's peak memory a few GB above the set
GPU_TILE_MEMORY_CAP = 4 * 2**30


def resolve_precision(precision: str, device: torch.device | str = "cpu") -> str:
    """The precision of the approximate pass on ``device``: ``"fp32"``, ``"tf32"`` or ``"bf16"``.

    ``"auto"`` is decided from the device's properties alone (never a timing, a load or free memory): on CUDA
    ``"tf32"`` where the GPU has TF32 tensor cores (compute capability >= 8.0), else ``"fp32"``; on the CPU
    ``"fp32"``. Even on a CPU with native bf16 units (AMX, AVX512-BF16) the whole search is faster in fp32: the
    bf16 bound (about 2^-8 relative) leaves so many ambiguous ranks and candidates to re-score exactly that the
    exact finish costs far more than the faster products save (``docs/benchmarks.md``: 4.5x slower in bf16 at
    20,000 x 512 on an AMX CPU). An explicit choice is honoured on every device (``"tf32"`` on the CPU rounds the
    inputs to TF32 and multiplies in float32: the emulation the tests use). Under DDP the processes agree on one
    precision before the search (:func:`lightning_dml.metrics._ddp.agree_search_settings`). Results are exact
    whatever the precision.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision != "auto":
        return precision
    device = torch.device(device)
    if device.type == "cuda":
        return "tf32" if torch.cuda.get_device_capability(device)[0] >= 8 else "fp32"
    return "fp32"


class _Threads:
    """Run a section with ``n`` intra-op CPU threads (restores the previous setting).

    The search runs its element-wise work (comparisons, counts, gathers on tiles of about 1M entries) on
    one thread and only the matrix products on all of them: splitting such small operations across
    OpenMP threads costs more than it saves, and far more when the CPU is shared with other processes
    (measured here: the whole SOP-like search 3x slower on 2 busy cores with 2 threads everywhere).
    On CUDA the setting only concerns the host threads and changes nothing.
    """

    def __init__(self, n: int = 1) -> None:
        self.n = max(1, int(n))
        self.prev = 0

    def __enter__(self) -> None:
        self.prev = torch.get_num_threads()
        if self.prev != self.n:
            torch.set_num_threads(self.n)

    def __exit__(self, *exc: object) -> None:
        if self.prev != self.n:
            torch.set_num_threads(self.prev)


def tile_sizes(
    device: torch.device,
    n_queries: int,
    n_gallery: int,
    query_block: int | None = None,
    gallery_chunk: int | None = None,
    tile_memory: int | None = None,
) -> tuple[int, int]:
    """``(query_block, gallery_chunk)``: explicit values win; otherwise sized from the memory budget.

    The budget is ``tile_memory`` bytes when given, else on CUDA a quarter of the device's free memory
    (``torch.cuda.mem_get_info``, at most :data:`GPU_TILE_MEMORY_CAP`) and on the CPU the fixed tiles
    :data:`CPU_QUERY_BLOCK` x :data:`CPU_GALLERY_CHUNK` (about 64 MB of scores). A tile holds at most ``budget / TILE_ENTRY_BYTES``
    scores; square tiles serve the symmetric all-vs-all pass. Never an N x N matrix unless it fits the budget.
    The sizes (and so the free memory they may come from) change only the speed and the memory of the search:
    every result is a function of exact scores alone (``tests/test_metrics_determinism.py``).
    """
    if query_block is not None and query_block < 1 or gallery_chunk is not None and gallery_chunk < 1:
        raise ValueError(f"query_block and gallery_chunk must be >= 1, got {query_block} and {gallery_chunk}")
    if tile_memory is not None and tile_memory < TILE_ENTRY_BYTES:
        raise ValueError(f"tile_memory must be at least {TILE_ENTRY_BYTES} bytes, got {tile_memory}")
    if tile_memory is None and device.type == "cpu":
        qb, gc = CPU_QUERY_BLOCK, CPU_GALLERY_CHUNK
    else:
        if tile_memory is None:
            free, _ = torch.cuda.mem_get_info(device) if device.type == "cuda" else (256 * 2**20, 0)
            tile_memory = max(min(free // 4, GPU_TILE_MEMORY_CAP), 64 * 2**20)
        entries = max(1, tile_memory // TILE_ENTRY_BYTES)
        qb = max(1, math.isqrt(entries))
        gc = max(1, entries // qb)
    qb = query_block if query_block is not None else qb
    gc = gallery_chunk if gallery_chunk is not None else gc
    return max(1, min(qb, max(1, n_queries))), max(1, min(gc, max(1, n_gallery)))
