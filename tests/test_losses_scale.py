"""Embeddings of huge (and tiny) scale (issue 10, outside checks).

Before the fix, from about 1e19 on the squared norm overflowed fp32 in the L2 normalisation: every normalising loss
returned the value of all-zero embeddings without a word (contrastive: sqrt(2) = 1.41421 for every batch), and
N-pair, whose raw inner products overflow, returned NaN.

* A loss that L2-normalises is scale-invariant by definition: at scale ``s`` it must give the value of the same
  batch at scale 1 and the gradient ``grad(z) / s`` (``L(s z) = L(z)``), on both the closed-form and the autograd
  path, in fp32, bf16 and under autocast.
* N-pair (raw inner products) must give its true value, computed here in fp64 from the paper's equation:
  ``inf`` where that exceeds fp32, never NaN; where the value is finite, the true gradient.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dml.losses import LOSSES, CrossBatchMemory, MultiSimilarityLoss, NPairLoss, PairLoss, build_loss
from lightning_dml.scaling import common_power_of_two_scale, l2_normalize, power_of_two_scale
from tests import reference_losses as ref

SCALES = [1.0, 1e19, 1e30]
#: powers of two near 1e19 and 1e30: exact in bf16 too, so the scaled batch is the same batch
POW2_SCALES = [1.0, 2.0**64, 2.0**100]


#: hyper-parameters for registered losses whose defaults are random or incomplete
SETTINGS = {"tuplet_margin": {"negatives": "all"}, "margin": {"class_margins": False, "sampling": "all"},
            # DSM's running histogram would move between the calls compared below
            "dynamic_soft_margin": {"momentum": 1.0}}
#: further variants of the paper losses: (registry name, hyper-parameters)
VARIANTS = {
    "multi_similarity_no_mining": ("multi_similarity", {"mining": False}),
    "multi_similarity_v2": ("multi_similarity", {"plus_one": False}),
    "contrastive_squared": ("contrastive", {"squared": True}),
    "triplet_batch_hard": ("triplet", {"mining": "batch_hard"}),
    "lifted_structure_generalized": ("lifted_structure", {"variant": "generalized"}),
    "lifted_structure_star": ("lifted_structure", {"variant": "star"}),
    "gpw_triplet_p": ("general_pair_weighting", {"preset": "triplet_p"}),
    "gpw_pair_e_ms": ("general_pair_weighting", {"preset": "pair_e", "mining": "ms"}),
}
#: every registered L2-normalising pair loss (N-pair is not: tested below) and the variants
NORMALISING = {
    **{name: (name, SETTINGS.get(name, {})) for name, cls in LOSSES.items()
       if issubclass(cls, PairLoss) and cls.normalize},
    **VARIANTS,
}
NAMES = sorted(NORMALISING)


def _normalising_loss(name: str):
    registry_name, kw = NORMALISING[name]
    return build_loss(registry_name, **kw)


def _batch(seed: int = 0, b: int = 16, d: int = 8, classes: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, d, generator=g), torch.arange(b) % classes


def _value_and_grad(loss, z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = z.detach().clone().requires_grad_(True)
    value = loss(z, y)
    (g,) = torch.autograd.grad(value, z, allow_unused=True)
    return value.detach(), (torch.zeros_like(z) if g is None else g)


def _paths(loss):
    return (True, False) if loss._has_closed_form() or isinstance(loss, MultiSimilarityLoss) else (True,)


@pytest.mark.parametrize("scale", SCALES[1:])
@pytest.mark.parametrize("name", NAMES)
def test_normalising_losses_are_scale_invariant_fp32(name, scale, device):
    loss = _normalising_loss(name).to(device)
    z, y = _batch()
    z, y = z.to(device), y.to(device)
    for closed_form in _paths(loss):
        loss.closed_form = closed_form
        v1, g1 = _value_and_grad(loss, z, y)
        vs, gs = _value_and_grad(loss, z * scale, y)
        assert torch.isfinite(vs) and torch.isfinite(gs).all(), (name, scale, closed_form)
        torch.testing.assert_close(vs, v1, rtol=1e-5, atol=1e-6)
        # L(s z) = L(z)  =>  grad L(s z) = grad L(z) / s
        torch.testing.assert_close(gs * scale, g1, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", NAMES)
def test_normalising_losses_are_scale_invariant_bf16_and_autocast(name, device):
    loss = _normalising_loss(name).to(device)
    z, y = _batch(1)
    zb, y = z.bfloat16().to(device), y.to(device)
    expected = loss(zb, y)
    for scale in POW2_SCALES[1:]:
        huge = zb * scale  # a power of two: exact in bf16
        value = loss(huge, y)
        assert value.dtype == torch.float32
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
        layer = torch.nn.Linear(8, 8).to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            out = layer(z.to(device))
            small, big = loss(out, y), loss(out * scale, y)
        assert big.dtype == torch.float32
        torch.testing.assert_close(big, small, rtol=1e-5, atol=1e-6)
        big.backward()
        assert torch.isfinite(layer.weight.grad).all()


def test_contrastive_at_1e30_is_its_value_at_scale_1_not_the_zero_embedding_value():
    """The outside check's figure: 1.53427 for its batch at 1e30 (the value at scale 1), not 1.41421 = sqrt(2),
    the value of all-zero embeddings (every pair at D = sqrt(2)); here on our own batch."""
    z, y = _batch(3, b=8, d=4, classes=2)
    at_1, at_1e30 = build_loss("contrastive")(z, y), build_loss("contrastive")(z * 1e30, y)
    zero_value = build_loss("contrastive")(torch.zeros_like(z), y)
    assert float(zero_value) == pytest.approx(math.sqrt(2.0), rel=1e-6)
    assert abs(float(at_1) - math.sqrt(2.0)) > 0.05  # the batch can tell the two apart
    torch.testing.assert_close(at_1e30, at_1, rtol=1e-6, atol=1e-6)
    # against the loop reference from the paper's equation, in fp64 at scale 1
    torch.testing.assert_close(at_1e30.double(), ref.contrastive(z.double(), y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("scale", SCALES)
def test_reference_gallery_and_cross_batch_memory_at_huge_scale(scale, device):
    z, y = _batch(4)
    r, ry = _batch(5, b=12)
    z, y, r, ry = z.to(device), y.to(device), r.to(device), ry.to(device)
    expected = MultiSimilarityLoss()(z, y, ref_embeddings=r, ref_labels=ry)
    torch.testing.assert_close(MultiSimilarityLoss()(z * scale, y, ref_embeddings=r * scale, ref_labels=ry),
                               expected, rtol=1e-5, atol=1e-6)
    xbm = CrossBatchMemory(build_loss("contrastive"), embedding_size=8, memory_size=32).to(device)
    xbm(r * scale, ry)
    torch.testing.assert_close(xbm(z * scale, y), build_loss("contrastive")(z, y, ref_embeddings=r, ref_labels=ry),
                               rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------------------ N-pair
NPAIR_KW = [{}, {"symmetric": True}, {"variant": "ovo"}, {"variant": "ovo", "symmetric": True, "l2_reg": 0.0}]


def _npair_truth(z: torch.Tensor, y: torch.Tensor, scale: float, kw: dict) -> tuple[float, torch.Tensor]:
    """fp64 value and gradient of the paper's equation at ``scale`` (the loop reference, no overflow in fp64)."""
    zz = (z.double() * scale).requires_grad_(True)
    value = ref.npair(zz, y, **kw)
    (g,) = torch.autograd.grad(value, zz)
    return float(value.detach()), g


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("kw", NPAIR_KW, ids=str)
def test_npair_gives_its_true_value_never_nan(kw, scale, device):
    z, y = _batch(6, b=12, d=8, classes=6)
    expected, _ = _npair_truth(z, y, scale, kw)
    zs = (z * scale).to(device).requires_grad_(True)
    value = NPairLoss(**kw)(zs, y.to(device))
    assert value.dtype == torch.float32 and not torch.isnan(value)
    if expected > torch.finfo(torch.float32).max:
        assert value.detach().item() == math.inf  # the true value is beyond fp32
    else:
        assert value.detach().item() == pytest.approx(expected, rel=1e-5, abs=1e-6)


@pytest.mark.parametrize("scale", SCALES)
@pytest.mark.parametrize("kw", NPAIR_KW, ids=str)
def test_npair_trained_like_batch_finite_value_and_true_gradient_at_huge_scale(kw, scale, device):
    """Pairs far closer to each other than to other classes: the softmax terms vanish and the value stays finite
    (the regulariser ~ l2_reg s^2 |f|^2 stays below fp32's max at 1e19; at 1e30 it is switched off), and so must
    the gradient, which is compared with the fp64 gradient of the paper's equation."""
    if scale > 1e20:
        kw = {**kw, "l2_reg": 0.0}
    g = torch.Generator().manual_seed(7)
    centres = torch.nn.functional.normalize(torch.randn(6, 8, generator=g), dim=1) * 0.5
    z = centres.repeat_interleave(2, 0) + 0.01 * torch.randn(12, 8, generator=g)
    y = torch.arange(12) // 2
    expected, g_true = _npair_truth(z, y, scale, kw)
    assert math.isfinite(expected) and expected < torch.finfo(torch.float32).max
    zs = (z * scale).to(device).requires_grad_(True)
    value = NPairLoss(**kw)(zs, y.to(device))
    (grad,) = torch.autograd.grad(value, zs)
    assert float(value.detach()) == pytest.approx(expected, rel=1e-5, abs=1e-6)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(grad.double().cpu(), g_true, rtol=1e-4, atol=1e-6 * scale)


@pytest.mark.parametrize("scale", POW2_SCALES)
def test_npair_bf16_and_autocast_equal_fp32_of_the_same_embeddings(scale, device):
    z, y = _batch(9, b=12, d=8, classes=6)
    zb, y = (z.bfloat16() * scale).to(device), y.to(device)  # a power of two: exact in bf16
    expected = NPairLoss()(zb.float(), y)
    value = NPairLoss()(zb, y)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        under_autocast = NPairLoss()(zb, y)
    for v in (value, under_autocast):
        assert v.dtype == torch.float32 and not torch.isnan(v)
        torch.testing.assert_close(v, expected)


def test_npair_tiny_scale_is_the_limit_value():
    """At scale 1e-30 all logits vanish: the mc loss is log(N) (every class equally likely)."""
    z, y = _batch(8, b=12, d=8, classes=6)
    value = NPairLoss(l2_reg=0.0)(z * 1e-30, y)
    assert float(value) == pytest.approx(math.log(6), rel=1e-6)


# ---------------------------------------------------------------------------------------------- the helpers
def test_l2_normalize_any_magnitude_and_zero_rows():
    z = torch.randn(5, 8, dtype=torch.float64)
    expected = torch.nn.functional.normalize(z, dim=1)
    for dtype in (torch.float32, torch.float64):
        for scale in (1.0, 1e-30, 1e19, 1e30, 1e38):
            torch.testing.assert_close(l2_normalize((z * scale).to(dtype)), expected.to(dtype))
    assert l2_normalize(torch.zeros(2, 3)).eq(0).all()
    # the plain F.normalize is what failed: the squared norm overflows to Inf and the row becomes 0
    assert torch.nn.functional.normalize(z.float() * 1e30, dim=1).eq(0).all()


def test_l2_normalize_gradient_is_that_of_f_normalize():
    """Its analytic backward: gradcheck in fp64 along both dims, the same gradient as ``F.normalize`` at scale 1
    (zero rows included: ``g / eps``), and that gradient divided by the scale at 1e30."""
    torch.manual_seed(0)
    x = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(l2_normalize, (x,))
    assert torch.autograd.gradcheck(lambda t: l2_normalize(t, dim=0), (x,))
    z = torch.cat([torch.randn(5, 8), torch.zeros(1, 8)])
    g = torch.randn(6, 8)
    for scale in (1.0, 1e30):
        ours, plain = (z * scale).requires_grad_(True), z.clone().requires_grad_(True)
        l2_normalize(ours).backward(g)
        torch.nn.functional.normalize(plain, dim=1).backward(g)
        torch.testing.assert_close(ours.grad[:5] * scale, plain.grad[:5])
    torch.testing.assert_close(ours.grad[5], g[5] / 1e-12)  # a zero row, as F.normalize


def test_power_of_two_scales_are_exact_powers_near_the_largest_entry():
    x = torch.tensor([[3.0, -5.0], [0.0, 0.0], [1e30, 1.0]])
    s = power_of_two_scale(x, dim=1).flatten()
    assert s.tolist() == [8.0, 1.0, 2.0**100]
    assert float(common_power_of_two_scale(x, torch.zeros(0, 2))) == 2.0**100
    assert torch.equal(torch.frexp(s)[0], torch.full((3,), 0.5))  # powers of two
