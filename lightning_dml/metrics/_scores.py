"""Stage 1 of the exact search: scores. Approximate tiles with a rigorous error bound per precision, exact pairs.

* ``exact score`` of a (query, gallery) pair: cosine similarity ``<x_q, x_g> / (|x_q| |x_g|)`` of the raw
  embeddings, or the negative squared Euclidean distance ``-|x_q - x_g|^2``, both evaluated in float64
  from the float32 inputs (products of two float32 numbers are exact in float64), summed over D in a fixed
  pairwise order (:func:`tree_sum`), so a pair's score is bit-identical on every device, process and batch shape.
* ``approximate score``: one matrix product of a low-precision representation (fp32, TF32 or bf16), with a
  per-query bound ``w_q >= |approx - exact|`` (:meth:`Scorer.error_bound`).

The bound is derived for the arithmetic the product really uses, which :func:`matmul_mode` pins down for the
duration of each product, whatever the user set globally: ``torch.set_float32_matmul_precision`` ("highest"
for fp32, "high" for TF32 on CUDA; the CUDA ``allow_tf32`` flag follows it), no reduced-precision bf16/fp16
reductions, and autocast off. TF32 and bf16 inputs are rounded *by us* before the product (TF32: 11
significant bits, bf16: 8), so the hardware's own input conversion is exact and the product of two rounded
inputs is exact in float32 (22 or 16 significant bits <= 24): only the float32 accumulation
(``gamma_D = D u / (1 - D u)``, Higham, *Accuracy and Stability of Numerical Algorithms*, Eq. 3.4; with
``2u`` per addition on CUDA tensor cores, which may not round to nearest), the rounding of the bf16 output
(relative ``2^-8``) and float32 underflow (absolute ``2^-149`` per term) remain.

Scale: Euclidean mode divides the set by the power of two near its largest entry (exact), so no float32 square
overflows or underflows at any input scale and no ranking changes (every figure is that of the set scaled down by
one common factor); cosine mode normalises in float64, valid at any float32 scale.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch import Tensor

from lightning_dml.metrics._device import _Threads
from lightning_dml.metrics._task import RetrievalTask
from lightning_dml.scaling import power_of_two_scale

_U32 = 2.0**-24  # unit roundoff of float32
_U16 = 2.0**-8  # unit roundoff of bfloat16 (8 significant bits)
_TINY32 = 2.0**-149  # smallest float32 subnormal: bound on the absolute error of an underflowing product
_PAIR_BLOCK_BYTES = 8 * 2**20  # memory for one batch of gathered pairs (stays in cache)
_CHUNK = 8192  # rows per step of the per-row set-up work


def tree_sum(t: Tensor) -> Tensor:
    """Sum over the last dimension in a fixed pairwise order (zero padding to a power of two).

    Element-wise additions only, so the result of a row never depends on how many rows are summed
    together, on the thread count or on the device: the exact scores are bit-for-bit reproducible.
    """
    d = t.shape[-1]
    p = 1 << max(0, (d - 1).bit_length())
    if p != d:
        t = torch.nn.functional.pad(t, (0, p - d))
    while t.shape[-1] > 1:
        h = t.shape[-1] // 2
        t = t[..., :h] + t[..., h:]
    return t[..., 0]


def _gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): bound on the relative error of an n-term float sum."""
    return n * u / (1.0 - n * u)


def accumulation_unit(device: torch.device, precision: str) -> float:
    """Unit roundoff of the product's float32 additions: tensor cores (TF32, bf16 on CUDA) may truncate instead of
    rounding, 2u per addition; u elsewhere."""
    return 2 * _U32 if device.type == "cuda" and precision != "fp32" else _U32


def round_to_tf32(x: Tensor) -> Tensor:
    """float32 -> the nearest TF32 value (10 explicit mantissa bits, ties to even), kept in float32."""
    b = x.contiguous().view(torch.int32)
    b = (b + 0x0FFF + ((b >> 13) & 1)) & ~0x1FFF
    return b.view(torch.float32)


@contextlib.contextmanager
def matmul_mode(device: torch.device, precision: str) -> Iterator[None]:
    """Pin the matrix-product arithmetic the error bound assumes (restores the user's settings afterwards).

    float32 products in full precision (``"highest"``; ``"high"``, i.e. TF32, only for ``precision="tf32"`` on
    CUDA), no reduced-precision reductions of bf16/fp16 products, autocast off.
    """
    prev = torch.get_float32_matmul_precision()
    want = "high" if precision == "tf32" and device.type == "cuda" else "highest"
    cuda_flags = {}
    if device.type == "cuda":
        m = torch.backends.cuda.matmul
        for name in ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction"):
            if hasattr(m, name):
                cuda_flags[name] = getattr(m, name)
                setattr(m, name, False)
    if prev != want:
        torch.set_float32_matmul_precision(want)
    try:
        with torch.autocast(device_type=device.type, enabled=False):
            yield
    finally:
        if prev != want:
            torch.set_float32_matmul_precision(prev)
        for name, value in cuda_flags.items():
            setattr(torch.backends.cuda.matmul, name, value)


def _row_norms(x: Tensor) -> Tensor:
    """float64 Euclidean norms of the rows in the fixed :func:`tree_sum` order, chunked (no float64 copy of the
    whole matrix): the norms of the exact scores, bit-identical on every device and process."""
    out = torch.empty(x.shape[0], dtype=torch.float64, device=x.device)
    for s in range(0, x.shape[0], _CHUNK):
        out[s : s + _CHUNK] = torch.sqrt(tree_sum(x[s : s + _CHUNK].double().square_()))
    return out


class Scorer:
    """Approximate block scores with a per-query error bound, and exact float64 pair scores.

    Args:
        x: raw embeddings ``(N, D)``, float32, on the device the search runs on.
        metric: ``"cosine"`` or ``"euclidean"``.
        precision: ``"fp32"``, ``"tf32"`` or ``"bf16"`` for the approximate pass.

    Attributes:
        score_scale: exact scores are those of the raw embeddings times ``score_scale`` (Euclidean mode: the
            square of the power of two the set was divided by; 1 in cosine mode).
    """

    def __init__(self, x: Tensor, metric: str, precision: str) -> None:
        if metric not in ("cosine", "euclidean"):
            raise ValueError(f"metric must be 'cosine' or 'euclidean', got {metric!r}")
        if precision not in ("fp32", "tf32", "bf16"):
            raise ValueError(f"precision must be 'fp32', 'tf32' or 'bf16', got {precision!r}")
        d = x.shape[1]
        if d * accumulation_unit(x.device, precision) > 1 / 16:
            # Higham's gamma_D needs D u < 1; past D u = 1/16 the bound is over 6% of |q| |g| (useless) and the
            # safety factor of error_bound no longer covers every term
            raise ValueError(
                f"embedding dimension {d} is too large for the exact search in {precision} on {x.device.type}: at most "
                f"{math.floor(1 / (16 * accumulation_unit(x.device, precision)))} (D u <= 1/16 for the error bound)"
            )
        self.device = x.device
        self.threads = torch.get_num_threads()  # for the matrix products; the rest runs on one thread
        self.metric = metric
        self.precision = precision
        with _Threads(1):  # the set-up is element-wise work on the whole set: one thread (_device._Threads)
            self._setup(x)

    def _setup(self, x: Tensor) -> None:
        """Scaled copy, float64 norms, the low-precision representation and its residuals (see the class)."""
        metric, precision = self.metric, self.precision
        n, d = x.shape
        self.dim = d
        x = x.contiguous()
        self.score_scale = 1.0
        if metric == "euclidean" and n > 0:
            # divide by the power of two near the largest entry: exact (except entries that underflow), no
            # float32 square can overflow, the ranking is that of the raw set
            scale = power_of_two_scale(x)
            x = x / scale
            self.score_scale = float(scale) ** -2
        norms64 = _row_norms(x)
        self.x = x
        self.norms64 = norms64
        if metric == "cosine":
            rep = torch.empty_like(x)
            for s in range(0, n, _CHUNK):
                rep[s : s + _CHUNK] = (x[s : s + _CHUNK].double() / norms64[s : s + _CHUNK].unsqueeze(1)).float()
            # each normalised coordinate is rounded once from float64: relative error <= u32 (+ fp64 noise)
            self._eta = _U32 * (1 + 1e-6)
        else:
            rep = x
            self._eta = 0.0
        if precision == "fp32":
            low = rep
        elif precision == "tf32":
            low = round_to_tf32(rep)
        else:
            low = rep.to(torch.bfloat16)
        resid = torch.zeros(n, dtype=torch.float64, device=self.device)
        if precision != "fp32":
            for s in range(0, n, _CHUNK):
                resid[s : s + _CHUNK] = torch.sqrt(
                    tree_sum((rep[s : s + _CHUNK].double() - low[s : s + _CHUNK].double()).square())
                )
        self.rep = low.contiguous()
        self.resid = resid
        # an input of the bound only: any float64 summation order will do (its error is covered by the margin)
        # in chunks: a float64 copy of the whole gallery at once would double its memory (1M x 512: 4 GB more)
        self.rep_norm = torch.cat([torch.linalg.vector_norm(self.rep[s : s + _CHUNK], dim=1, dtype=torch.float64)
                                   for s in range(0, max(len(self.rep), 1), _CHUNK)])
        self._acc_u = accumulation_unit(self.device, precision)
        if metric == "euclidean":
            self.sq32 = (x * x).sum(dim=1)  # float32 squared norms used by the approximate pass

    # ---------------------------------------------------------------- approximate
    def approx(self, q_items: Tensor, g_items: Tensor) -> Tensor:
        """Approximate scores ``(len(q_items), len(g_items))`` in float32."""
        with _Threads(self.threads), matmul_mode(self.device, self.precision):
            prod = self._rows(q_items) @ self._rows(g_items).T
        prod = prod.float()
        if self.metric == "cosine":
            return prod
        return prod.mul_(2.0).sub_(self.sq32[g_items].unsqueeze(0)).sub_(self.sq32[q_items].unsqueeze(1))

    def _rows(self, items: Tensor) -> Tensor:
        """Rows ``items`` of the approximate representation: a view when they are consecutive positions (on the
        CPU, where the check costs no device synchronisation), else ``index_select`` (six times faster than
        ``rep[items]`` on the CPU: 0.14 against 0.9 ms per 2048 x 512 block)."""
        n = items.numel()
        if items.device.type == "cpu" and n > 1:
            first = int(items[0])
            if int(items[-1]) - first == n - 1 and bool((items.diff() == 1).all()):
                return self.rep[first : first + n]
        return self.rep.index_select(0, items)

    def error_bound(self, q_items: Tensor, g_items: Tensor) -> Tensor:
        """Per-query bound ``w_q >= |approx(q, g) - exact(q, g)|`` for every gallery item g (float64)."""
        d = self.dim
        gam = _gamma(d, self._acc_u)
        g_norm = float(self.rep_norm[g_items].max())
        g_res = float(self.resid[g_items].max())
        q_norm = self.rep_norm[q_items]
        q_res = self.resid[q_items]
        # |<q_hat, g_hat> - <q_rep, g_rep>| + float32 accumulation of <q_rep, g_rep> + underflow of the terms
        dot_err = q_res * (g_norm + g_res) + q_norm * g_res + gam * q_norm * g_norm + 2 * d * _TINY32
        if self.precision == "bf16":
            # the bf16 product's result is rounded to bf16: relative 2^-8 of a value at most |q| |g| (1 + gam)
            dot_err = dot_err + _U16 * q_norm * g_norm * (1 + 2**-6)
        if self.metric == "cosine":
            eta = self._eta
            # each normalised vector is the exact unit vector times (1 + eps_i), |eps_i| <= eta
            w = dot_err + 2 * eta + eta * eta
        else:
            g_raw = float(torch.sqrt(self.sq32[g_items].double().max()))
            q_raw = torch.sqrt(self.sq32[q_items].double())
            mag = 2 * q_raw * g_raw + g_raw**2 + q_raw**2
            w = 2 * dot_err + gam * (g_raw**2 + q_raw**2) * 1.01 + 4 * _U32 * mag + 4 * d * _TINY32
        # fp64 evaluation of the exact score (relative gamma_D in double), plus a small safety factor
        return w * 1.125 + 1e-12 * (1.0 + (0.0 if self.metric == "cosine" else mag))

    # ---------------------------------------------------------------- exact
    def exact(self, q_items: Tensor, g_items: Tensor) -> Tensor:
        """Exact float64 scores of the pairs ``(q_items[i], g_items[i])`` (1-D tensors of equal length)."""
        out = torch.empty(q_items.numel(), dtype=torch.float64, device=self.device)
        step = max(1, (2 * 2**20) // (8 * self.dim))  # 2 MB operands: the pair batch stays in cache
        for s in range(0, q_items.numel(), step):
            qi = q_items[s : s + step]
            gi = g_items[s : s + step]
            a = self.x.index_select(0, qi).double()
            b = self.x.index_select(0, gi).double()
            if self.metric == "cosine":
                out[s : s + step] = tree_sum(a.mul_(b)) / (self.norms64[qi] * self.norms64[gi])
            else:
                out[s : s + step] = -tree_sum(a.sub_(b).square_())
        return out

    def approx_pairs(self, q_items: Tensor, g_items: Tensor) -> Tensor:
        """Approximate scores of pairs (float32 sums of the approximate representation; error <= w_q)."""
        out = torch.empty(q_items.numel(), dtype=torch.float32, device=self.device)
        step = max(1, _PAIR_BLOCK_BYTES // (8 * self.dim))
        for s in range(0, q_items.numel(), step):
            qi = q_items[s : s + step]
            gi = g_items[s : s + step]
            dot = (self.rep.index_select(0, qi).float() * self.rep.index_select(0, gi).float()).sum(dim=1)
            if self.metric == "cosine":
                out[s : s + step] = dot
            else:
                out[s : s + step] = 2 * dot - self.sq32[gi] - self.sq32[qi]
        return out


def score_tile(scorer: Scorer, task: RetrievalTask, rows: Tensor, c0: int, c1: int) -> Tensor:
    """Approximate scores ``(len(rows), c1 - c0)`` of query rows ``rows`` against gallery positions ``[c0, c1)``,
    with the task's excluded pairs (the query itself, its sequence) set to ``-inf``: they never enter a count or a
    candidate list."""
    a = scorer.approx(task.q_items[rows], task.g_items[c0:c1])
    r, c = task.excluded_in(rows, c0, c1)
    if r.numel():
        a[r, c] = -math.inf
    return a
