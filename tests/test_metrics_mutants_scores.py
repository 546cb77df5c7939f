"""Scores, device helpers and evaluation batches of the metrics engine (``_scores.py``, ``_device.py``,
``retrieval.py``): cases the mutation check of issue 26 (docs/testing.md) found untested, each against a float64
reference, the standard model of floating-point arithmetic or the documented contract."""

from __future__ import annotations

import pytest
import torch

from lightning_dml.metrics import _scores
from lightning_dml.metrics._device import _Threads, tile_sizes
from lightning_dml.metrics._scores import Scorer
from tests.metrics_reference import brute_scores

PRECISIONS = ("fp32", "tf32", "bf16")


def _mixed_norms(n: int = 24, d: int = 64, seed: int = 0) -> torch.Tensor:
    """Positive entries (so ``sum |q_i g_i| = <q, g>``: the accumulation's worst case is the full product), a few
    rows scaled down 256 times (a query far smaller than the gallery's largest item)."""
    g = torch.Generator().manual_seed(seed)
    x = 0.5 + 0.5 * torch.rand(n, d, generator=g)
    x[: n // 4] *= 2.0**-8
    return x


def _model_worst_error(sc: Scorer) -> torch.Tensor:
    """The largest ``|approx - exact|`` the standard model allows for every pair (float64, ``(N, N)``).

    Higham (Accuracy and Stability of Numerical Algorithms, Eq. 3.5): a float32 inner product of n terms, in any
    order, is off by at most ``gamma_n sum |a_i b_i|``, ``gamma_n = n u / (1 - n u)`` with the scorer's
    accumulation unit; the low-precision inputs are off by their own rounding (computed here exactly, in float64);
    a bf16 result is rounded once more (relative 2^-8); the Euclidean squared norms are float32 sums of squares and
    the two float32 subtractions round once each. This is what the bound must cover on every device, whatever
    order its kernels sum in, not only the errors this CPU's BLAS happens to make."""
    d = sc.dim
    u = sc._acc_u
    gam = d * u / (1 - d * u)
    gam32 = d * _scores._U32 / (1 - d * _scores._U32)
    x = sc.x.double()
    rep = sc.rep.double()
    rep_dot = rep @ rep.T  # exact products, float64 sum: far below every float32 term
    accumulation = gam * (rep.abs() @ rep.abs().T) + 2 * d * _scores._TINY32
    if sc.precision == "bf16":
        accumulation = accumulation + 2.0**-8 * (rep_dot.abs() + accumulation)
    if sc.metric == "cosine":
        unit = x / sc.norms64.unsqueeze(1)
        return (rep_dot - unit @ unit.T).abs() + accumulation
    sq = (x * x).sum(dim=1)
    norm = sq.sqrt()
    mag = (norm.unsqueeze(1) + norm.unsqueeze(0)) ** 2
    dot_err = (rep_dot - x @ x.T).abs() + accumulation
    return 2 * dot_err + gam32 * (sq.unsqueeze(1) + sq.unsqueeze(0)) + 2 * _scores._U32 * mag * 1.001


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_error_bound_covers_the_worst_case_of_the_standard_model(metric: str, precision: str) -> None:
    """``w_q`` is at least the model's worst error of every pair (q, g), also for a small query against a large
    gallery item and for the largest items against themselves, where the dot product and both squared norms may
    all be off by their full ``gamma_D`` at once."""
    x = _mixed_norms()
    sc = Scorer(x, metric, precision)
    items = torch.arange(x.shape[0])
    w = sc.error_bound(items, items).unsqueeze(1)
    worst = _model_worst_error(sc)
    assert bool((worst <= w).all()), float((worst / w).max())
    # and the real error of this CPU is inside the bound too
    err = (sc.approx(items, items).double() - brute_scores(x, metric) * sc.score_scale).abs()
    assert bool((err <= w).all())


@pytest.mark.parametrize(("metric", "precision"), [("cosine", "tf32"), ("cosine", "bf16"), ("euclidean", "bf16")])
def test_scorer_setup_in_chunks_of_three_rows_is_bit_identical(
    metric: str, precision: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The per-row set-up (norms, normalised rows, low-precision residuals) runs in chunks of ``_CHUNK`` rows:
    chunks of 3 rows (10 rows: a partial last chunk) give bit for bit the set-up of one chunk."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(10, 7, generator=g) * torch.exp2(torch.randint(-4, 4, (10, 1), generator=g).float())
    whole = Scorer(x, metric, precision)
    monkeypatch.setattr(_scores, "_CHUNK", 3)
    chunked = Scorer(x, metric, precision)
    for name in ("x", "norms64", "rep", "resid", "rep_norm"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name
    assert bool((whole.resid > 0).any())  # the residuals are really there (tf32 / bf16 rounding)


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_approx_pairs_in_blocks_of_three_pairs(metric: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``approx_pairs`` works through the pairs in blocks of ``_PAIR_BLOCK_BYTES``: blocks of 3 pairs (11 pairs:
    a partial last block) give the scores of one block, within the error bound of the exact scores."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, 5, generator=g)
    sc = Scorer(x, metric, "bf16")
    q = torch.randint(0, 9, (11,), generator=g)
    gi = torch.randint(0, 9, (11,), generator=g)
    whole = sc.approx_pairs(q, gi)
    monkeypatch.setattr(_scores, "_PAIR_BLOCK_BYTES", 3 * 8 * 5)
    blocks = sc.approx_pairs(q, gi)
    assert torch.equal(blocks, whole)
    exact = (brute_scores(x, metric) * sc.score_scale)[q, gi]
    w = sc.error_bound(torch.arange(9), torch.arange(9))[q]
    assert bool(((blocks.double() - exact).abs() <= w).all())


@pytest.mark.parametrize(("d", "pairs"), [(512, 1500), (2**18, 3)])
def test_exact_pair_batches_hold_two_megabytes(d: int, pairs: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """``exact`` gathers the pairs in batches of at most 2 MB of float64 operands (one pair when a single row is
    larger), and every pair's score is the float64 reference."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(4, d, generator=g)
    sc = Scorer(x, "euclidean", "fp32")
    rows: list[int] = []
    real = _scores.tree_sum

    def recording(t: torch.Tensor) -> torch.Tensor:
        rows.append(t.shape[0])
        return real(t)

    monkeypatch.setattr(_scores, "tree_sum", recording)
    q = torch.randint(0, 4, (pairs,), generator=g)
    gi = torch.randint(0, 4, (pairs,), generator=g)
    got = sc.exact(q, gi)
    assert sum(rows) == pairs and max(rows) * 8 * d <= max(2 * 2**20, 8 * d), max(rows)
    x64 = sc.x.double()
    want = -((x64[q] - x64[gi]) ** 2).sum(dim=1)
    assert torch.allclose(got, want, rtol=1e-13, atol=0)


def test_tile_sizes_honour_explicit_sizes_down_to_one() -> None:
    """Explicit sizes win, also 1 (the smallest tile: one query against one gallery item); a gallery of one item
    gets chunks of one; empty sets get tiles of one."""
    cpu = torch.device("cpu")
    assert tile_sizes(cpu, 5, 7, query_block=1, gallery_chunk=1) == (1, 1)
    assert tile_sizes(cpu, 5, 1) == (5, 1)
    assert tile_sizes(cpu, 1, 9) == (1, 9)
    assert tile_sizes(cpu, 0, 0) == (1, 1)
    assert tile_sizes(cpu, 3, 4, tile_memory=16 * 2) == (1, 2)  # 2 entries: 1 x 2


def test_threads_runs_a_section_with_that_many_threads() -> None:
    """``_Threads(n)`` sets n intra-op threads for the section (the matrix products use all of them) and restores
    the previous count; n < 1 means 1."""
    prev = torch.get_num_threads()
    want = prev + 1
    with _Threads(want):
        assert torch.get_num_threads() == want
    assert torch.get_num_threads() == prev
    assert _Threads(0).n == 1 and _Threads(3).n == 3


def test_evaluation_batches_of_every_documented_length() -> None:
    """(images, labels[, indices[, is_query, is_gallery[, sequence, category]]]): lengths 2, 3, 5 and 7, each entry
    where the docstring puts it; lengths 1, 4 and 6 are refused."""
    from lightning_dml.metrics.retrieval import eval_batch_targets

    t = [torch.full((2,), i) for i in range(7)]
    for n in (2, 3, 5, 7):
        got = eval_batch_targets(tuple(t[:n]))
        assert got["labels"] is t[1]
        assert got["indices"] is (t[2] if n > 2 else None)
        assert got["query_mask"] is (t[3] if n > 3 else None)
        assert got["gallery_mask"] is (t[4] if n > 3 else None)
        assert got["sequence"] is (t[5] if n > 5 else None)
        assert got["category"] is (t[6] if n > 5 else None)
    for n in (1, 4, 6):
        with pytest.raises(ValueError, match="evaluation batch"):
            eval_batch_targets(tuple(t[:n]))


def test_an_embedding_too_wide_for_the_error_bound_is_refused() -> None:
    """Higham's gamma_D = D u / (1 - D u) needs D u < 1: at D = 2^24 (u = 2^-24, float32 on the CPU) it divided by
    zero, past it the bound was negative (every approximate comparison trusted: wrong figures). The scorer refuses
    D u > 1/16 (here D > 2^20) with a message naming the dimension, and accepts D = 2^20."""
    for d in (2**20 + 1, 2**24, 2**24 + 8):
        with pytest.raises(ValueError, match=f"embedding dimension {d} is too large"):
            Scorer(torch.empty(0, d), "cosine", "fp32")
    sc = Scorer(torch.ones(2, 2**20), "cosine", "fp32")
    items = torch.arange(2)
    w = sc.error_bound(items, items)
    assert bool((w > 0).all()) and bool((w < 1).all())
    assert torch.equal(sc.exact(items, items), torch.ones(2, dtype=torch.float64))
