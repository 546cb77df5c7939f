"""Where and how the search computes: precision choice per device, the CPU bf16 probe, thread control, tile sizes.

* :func:`resolve_precision`: what ``precision="auto"`` means on a device (see ``docs/metrics.md``).
* :func:`bf16_matmul_is_fast`: runtime probe of the CPU's bf16 matrix units.
* :class:`_Threads`: run a section with a given number of intra-op CPU threads.
* :func:`tile_sizes`: query-block and gallery-chunk sizes from the free memory of the device (or explicit sizes).
"""

from __future__ import annotations

import functools
import math
import time

import torch
from torch import Tensor

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


@functools.lru_cache(maxsize=1)
def bf16_matmul_is_fast() -> bool:
    """Runtime check: does this CPU multiply bfloat16 matrices clearly faster than float32?

    True only when oneDNN reports native bf16 support (AVX512-BF16 / AMX) *and* a small timed product runs
    at least 1.5x faster in bf16 than in fp32. Without native support torch emulates bf16 and is several
    times slower than fp32, so the search falls back to float32.
    """
    try:
        if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return False
    except (AttributeError, RuntimeError):
        return False
    a = torch.randn(1024, 256)
    b = torch.randn(2048, 256)

    def _time(x: Tensor, y: Tensor) -> float:
        x @ y.T
        best = math.inf
        for _ in range(3):
            t0 = time.perf_counter()
            x @ y.T
            best = min(best, time.perf_counter() - t0)
        return best

    return _time(a.bfloat16(), b.bfloat16()) * 1.5 < _time(a, b)


def resolve_precision(precision: str, device: torch.device | str = "cpu") -> str:
    """The precision of the approximate pass on ``device``: ``"fp32"``, ``"tf32"`` or ``"bf16"``.

    ``"auto"``: on CUDA ``"tf32"`` where the GPU has TF32 tensor cores (compute capability >= 8.0), else
    ``"fp32"``; on the CPU ``"bf16"`` when :func:`bf16_matmul_is_fast`, else ``"fp32"``. An explicit choice is
    honoured on every device (``"tf32"`` on the CPU rounds the inputs to TF32 and multiplies in float32: the
    emulation the tests use).
    """
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision != "auto":
        return precision
    device = torch.device(device)
    if device.type == "cuda":
        return "tf32" if torch.cuda.get_device_capability(device)[0] >= 8 else "fp32"
    if device.type == "cpu":
        return "bf16" if bf16_matmul_is_fast() else "fp32"
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
