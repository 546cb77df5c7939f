"""Error bounds of the approximate pass per precision (fp32, TF32, bf16), emulated on the CPU.

The search is exact only if ``|approx - exact| <= w`` holds for every pair. These tests check the bound on
adversarial data (near-ties packed far below the rounding error, mixed magnitudes, entries placed exactly on
rounding ties) for each precision the code can choose, with TF32 emulated on the CPU by rounding the inputs the
way TF32 does and the CUDA tensor-core accumulation emulated by truncating float32 additions; and that a user's
global matmul settings (``set_float32_matmul_precision``, autocast) change no figure.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dml.metrics import functional as F
from lightning_dml.metrics._scores import _U32, Scorer, matmul_mode, round_to_tf32
from tests.metrics_reference import brute_metrics, brute_scores

PRECISIONS = ("fp32", "tf32", "bf16")


def _tf32_reference(v: float) -> float:
    """Nearest number with 11 significant bits (TF32: 10 explicit mantissa bits), ties to even (Python's round)."""
    if v == 0.0:
        return v
    m, e = math.frexp(v)  # v = m 2^e, 0.5 <= |m| < 1
    return math.ldexp(round(m * 2**11), e - 11)


def test_round_to_tf32_matches_the_definition() -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2000, generator=g) * torch.exp2(torch.randint(-60, 60, (2000,), generator=g).float())
    # exact ties: 11 significant bits plus a half unit in the last place, odd and even
    ties = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, -(1 + 2**-11), 3 + 2**-9, 1025 / 1024 + 2**-11], dtype=torch.float32)
    x = torch.cat([x, ties, torch.zeros(1)])
    got = round_to_tf32(x)
    ref = torch.tensor([_tf32_reference(float(v)) for v in x], dtype=torch.float64)
    assert torch.equal(got.double(), ref)
    assert bool(((got.view(torch.int32) & 0x1FFF) == 0).all())  # the 13 low mantissa bits are zero


def _adversarial(n: int = 160, d: int = 256, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Near-ties far below every rounding error, norms over 6 orders of magnitude, entries on rounding ties."""
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(8, d, generator=g)
    y = torch.randint(0, 8, (n,), generator=g)
    # score gaps (about the squared perturbation) far below the fp32/TF32/bf16 error of the approximate pass
    # and far above the float64 rounding of the reference's own formula
    x = base[y] + 1e-3 * torch.randn(n, d, generator=g)  # same-class and other-class items nearly tied
    x[: n // 4] = base[0] + 1e-4 * torch.randn(n // 4, d, generator=g)  # a large near-tied group, mixed labels
    # entries exactly half way between bf16 / TF32 neighbours: the rounding error is maximal
    x[n // 4 : n // 4 + 8] = 1 + 2**-9 + torch.randint(0, 2, (8, d), generator=g) * 2**-8
    x[n // 4 + 8 : n // 4 + 16] = 1 + 2**-11
    x = x * torch.exp2(torch.randint(-10, 10, (n, 1), generator=g).float())
    return x, y


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_error_bound_holds_on_adversarial_near_ties(metric: str, precision: str) -> None:
    x, _ = _adversarial()
    items = torch.arange(x.shape[0])
    sc = Scorer(x, metric, precision)
    a = sc.approx(items, items).double()
    w = sc.error_bound(items, items)
    e = brute_scores(x, metric) * sc.score_scale  # the reference, in the scorer's (scaled) units
    err = (a - e).abs()
    assert bool((err <= w.unsqueeze(1)).all()), float((err - w.unsqueeze(1)).max())
    if precision != "fp32":  # the bound is not vacuous: the rounding really shows
        assert float(err.max()) > float(w.max()) * 1e-3


def _normalisation_rounding_worst(n: int = 400, pool: int = 100_000, seed: int = 0) -> torch.Tensor:
    """2-D vectors near 45 degrees, norms over orders of magnitude, chosen among ``pool`` for the largest rounding of
    their normalised coordinates along themselves: the error of the normalisation then adds up in every product."""
    g = torch.Generator().manual_seed(seed)
    theta = math.pi / 4 + torch.rand(pool, generator=g) * 1e-3
    x = torch.stack([theta.cos(), theta.sin()], 1) * torch.exp(3 * torch.randn(pool, 1, generator=g))
    x64 = x.double()
    unit = x64 / x64.norm(dim=1, keepdim=True)
    along = (unit.float().double() * unit).sum(dim=1) - 1  # relative rounding of the normalised vector along itself
    return x[torch.argsort(along, descending=True)[:n]]


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_error_bound_holds_in_two_dimensions_with_norms_over_orders_of_magnitude(metric: str, precision: str) -> None:
    """D = 2 with norms spread over orders of magnitude: the accumulation term of the bound is tiny, so the rounding
    of the normalised vectors (the ``2 eta`` of the cosine bound) is a large part of the real error. On the chosen
    worst vectors the fp32 error exceeds the bound without that term by about 15%."""
    g = torch.Generator().manual_seed(0)
    for x in (torch.randn(1500, 2, generator=g) * torch.exp(3 * torch.randn(1500, 1, generator=g)),
              _normalisation_rounding_worst()):
        items = torch.arange(x.shape[0])
        sc = Scorer(x, metric, precision)
        err = (sc.approx(items, items).double() - brute_scores(x, metric) * sc.score_scale).abs()
        w = sc.error_bound(items, items).unsqueeze(1)
        assert bool((err <= w).all()), float((err / w).max())
    if metric == "cosine" and precision == "fp32":  # the bound is tight to a small factor on the worst vectors
        assert float((err / w).max()) > 0.5


def _truncating_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b.T with float32 additions rounded towards zero (the worst a tensor core's accumulator may do)."""
    prod = a.double().unsqueeze(1) * b.double().unsqueeze(0)  # exact: TF32 x TF32 fits float64
    s = torch.zeros(a.shape[0], b.shape[0], dtype=torch.float32)
    for i in range(a.shape[1]):
        t = s.double() + prod[..., i]
        f = t.float()
        s = torch.where(f.double().abs() > t.abs(), torch.nextafter(f, torch.zeros_like(f)), f)
    return s


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_tf32_bound_with_cuda_tensor_core_accumulation_emulated(metric: str) -> None:
    """TF32 on CUDA: inputs rounded to TF32 (by us), float32 accumulation that may truncate: bound with 2u."""
    x, _ = _adversarial(n=64, d=128, seed=1)
    sc = Scorer(x, metric, "tf32")
    sc._acc_u = 2 * _U32  # what the scorer uses on CUDA for TF32 / bf16 products
    items = torch.arange(x.shape[0])
    prod = _truncating_matmul(sc.rep, sc.rep)
    if metric == "cosine":
        a = prod.double()
    else:
        a = (2 * prod - sc.sq32.unsqueeze(0) - sc.sq32.unsqueeze(1)).double()
    w = sc.error_bound(items, items)
    e = brute_scores(x, metric) * sc.score_scale
    assert bool(((a - e).abs() <= w.unsqueeze(1)).all())


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_metrics_exact_on_adversarial_near_ties(metric: str, precision: str) -> None:
    x, y = _adversarial(n=200, d=64, seed=2)
    ks = (1, 2, 4, 8, 32)
    ref = brute_metrics(x, y, ks, metric)
    got = F.retrieval_metrics(x, y, recall_at=ks, metric=metric, precision=precision, query_block=48)
    for key, val in ref.items():
        assert got[key] == pytest.approx(val, abs=1e-12), key


def test_global_matmul_settings_and_autocast_change_nothing() -> None:
    """A user's reduced float32 matmul precision or an active autocast are switched off inside the search."""
    x, y = _adversarial(n=150, d=64, seed=3)
    ks = (1, 2, 4, 8)
    ref = brute_metrics(x, y, ks)
    prev = torch.get_float32_matmul_precision()
    try:
        for mode in ("medium", "high"):
            torch.set_float32_matmul_precision(mode)
            got = F.retrieval_metrics(x, y, recall_at=ks, precision="fp32")
            assert torch.get_float32_matmul_precision() == mode  # restored after the search
            for key, val in ref.items():
                assert got[key] == pytest.approx(val, abs=1e-12), (mode, key)
    finally:
        torch.set_float32_matmul_precision(prev)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = F.retrieval_metrics(x, y, recall_at=ks, precision="fp32")
        assert torch.is_autocast_enabled("cpu")
    for key, val in ref.items():
        assert got[key] == pytest.approx(val, abs=1e-12), key


def test_matmul_mode_pins_and_restores() -> None:
    prev = torch.get_float32_matmul_precision()
    try:
        torch.set_float32_matmul_precision("medium")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with matmul_mode(torch.device("cpu"), "fp32"):
                assert torch.get_float32_matmul_precision() == "highest"
                assert not torch.is_autocast_enabled("cpu")
                assert (torch.randn(4, 4) @ torch.randn(4, 4)).dtype == torch.float32
            assert torch.is_autocast_enabled("cpu")
        assert torch.get_float32_matmul_precision() == "medium"
    finally:
        torch.set_float32_matmul_precision(prev)


def test_auto_precision_per_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """"auto": TF32 on CUDA GPUs with TF32 tensor cores (capability >= 8.0), else fp32; fp32 on the CPU. A property
    of the device, never a timing: the answer does not change when a product is slow (issue 19)."""
    import time

    from lightning_dml.metrics._device import resolve_precision

    for capability, expected in (((8, 0), "tf32"), ((9, 0), "tf32"), ((7, 5), "fp32")):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        assert resolve_precision("auto", "cuda") == expected
    def no_timing() -> float:
        raise AssertionError("the precision choice timed something")

    monkeypatch.setattr(time, "perf_counter", no_timing)
    monkeypatch.setattr(time, "time", no_timing)
    assert resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cuda") == "bf16"
    assert resolve_precision("bf16", "cpu") == "bf16"
    with pytest.raises(ValueError, match="precision must be one of"):
        resolve_precision("fp16")
