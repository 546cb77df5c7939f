"""MultiSimilarityLoss against the loop reference of MS Eq. 15, pytorch-metric-learning, and its pair weights."""

import pytest
import torch

from lightning_dml.losses import LOSSES, MultiSimilarityLoss, build_loss
from tests import reference_losses as ref

VARIANTS = [
    {},
    {"on_empty": "skip"},
    {"mining": False},
    {"weighting": False},
    {"plus_one": False},
    {"lam": 1.0, "eps": 0.3},
    {"alpha": 10.0, "beta": 2.0, "mining": False, "plus_one": False},
]


def _batch(seed, b, d, classes):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, d, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (b,), generator=g)
    return z, y


def _compare(loss, z, y, kw, device=None, **extra):
    device = torch.device("cpu") if device is None else device
    z32 = z.to(device=device, dtype=torch.float32).requires_grad_(True)
    zr = z.clone().requires_grad_(True)
    expected = ref.multi_similarity(zr, y, **kw, **extra)
    (g_ref,) = torch.autograd.grad(expected, zr)
    extra32 = {k: (v.float() if v.is_floating_point() else v).to(device) for k, v in extra.items()}
    for closed_form in (True, False):
        loss.closed_form = closed_form
        value = loss(z32, y.to(device), **{("ref_embeddings" if k == "ref" else k): v for k, v in extra32.items()})
        (g,) = torch.autograd.grad(value, z32)
        assert value.dtype == torch.float32 and value.ndim == 0
        torch.testing.assert_close(value.double().cpu(), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(g.double().cpu(), g_ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kw", VARIANTS)
@pytest.mark.parametrize("seed,b,d,classes", [(0, 12, 4, 3), (1, 24, 8, 6), (2, 30, 16, 2)])
def test_matches_loop_reference(kw, seed, b, d, classes, device):
    z, y = _batch(seed, b, d, classes)
    _compare(MultiSimilarityLoss(**kw), z, y, kw, device=device)


@pytest.mark.parametrize("kw", [{}, {"on_empty": "skip"}, {"mining": False}])
def test_reference_gallery_matches_loop_reference(kw, device):
    z, y = _batch(3, 10, 8, 3)
    r, ry = _batch(4, 7, 8, 4)
    _compare(MultiSimilarityLoss(**kw), z, y, kw, device=device, ref=r, ref_labels=ry)


@pytest.mark.parametrize("seed,b,k", [(0, 40, 5), (1, 64, 4), (2, 33, 3)])
def test_matches_pytorch_metric_learning(seed, b, k):
    """pml: MultiSimilarityLoss(alpha, beta, base) on the pairs of MultiSimilarityMiner(epsilon).

    Conventions: pml's ``base`` is our ``lam``; its miner keeps a negative if ``S + eps > min_pos`` and a positive
    if ``S - eps < max_neg`` (MS Eqs. 11-12, identical), excludes the diagonal by index, and its loss averages
    over all B anchors with an anchor's empty set contributing 0 - our ``on_empty="keep"`` default. pml does not
    clamp S to [-1, 1]; for normalised vectors this changes nothing beyond rounding.
    """
    pml_losses = pytest.importorskip("pytorch_metric_learning.losses")
    pml_miners = pytest.importorskip("pytorch_metric_learning.miners")
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, 16, generator=g).requires_grad_(True)
    y = torch.arange(b) // k
    y = y[torch.randperm(b, generator=g)]
    pml_loss = pml_losses.MultiSimilarityLoss(alpha=2.0, beta=50.0, base=0.5)
    miner = pml_miners.MultiSimilarityMiner(epsilon=0.1)
    expected = pml_loss(z, y, miner(z, y))
    (g_ref,) = torch.autograd.grad(expected, z)
    value = MultiSimilarityLoss()(z, y)
    (grad,) = torch.autograd.grad(value, z)
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, g_ref, rtol=1e-4, atol=1e-6)


def test_gradient_wrt_similarity_is_the_ms_pair_weights():
    """GPW claim / MS Eqs. 13-14: dL/dS_ij = w-_ij / B on mined negatives, -w+_ij / B on mined positives."""
    z, _ = _batch(5, 20, 8, 4)
    y = torch.arange(20) % 4
    f = torch.nn.functional.normalize(z.float(), dim=1)
    sim = (f @ f.T).clamp(-1, 1).requires_grad_(True)
    loss = MultiSimilarityLoss()
    pos = (y[:, None] == y[None, :]) & ~torch.eye(20, dtype=torch.bool)
    neg = y[:, None] != y[None, :]
    value = loss.pair_loss(sim, pos, neg)
    (grad,) = torch.autograd.grad(value, sim)
    s = sim.detach().double()
    a, b_, lam, eps, B = 2.0, 50.0, 0.5, 0.1, 20
    expected = torch.zeros_like(s)
    for i in range(B):
        P = [j for j in range(B) if pos[i, j]]
        N = [j for j in range(B) if neg[i, j]]
        Pi = [j for j in P if s[i, j] < max(s[i, k] for k in N) + eps]
        Ni = [j for j in N if s[i, j] > min(s[i, k] for k in P) - eps]
        for j in Ni:  # Eq. 13
            expected[i, j] = torch.exp(b_ * (s[i, j] - lam)) / (1 + sum(torch.exp(b_ * (s[i, k] - lam)) for k in Ni)) / B
        for j in Pi:  # Eq. 14 (paper form)
            expected[i, j] = -1.0 / (
                torch.exp(-a * (lam - s[i, j])) + sum(torch.exp(-a * (s[i, k] - s[i, j])) for k in Pi)
            ) / B
    torch.testing.assert_close(grad.double(), expected, rtol=1e-4, atol=1e-7)
    # the closed-form path returns the same weights
    _, weights = loss.pair_loss_and_grad(sim.detach(), pos, neg)
    torch.testing.assert_close(weights.double(), expected, rtol=1e-4, atol=1e-7)


def test_defaults_registry_and_build():
    loss = MultiSimilarityLoss()
    assert (loss.alpha, loss.beta, loss.lam, loss.eps) == (2.0, 50.0, 0.5, 0.1)
    assert loss.mining and loss.weighting and loss.plus_one and loss.on_empty == "keep"
    assert LOSSES["multi_similarity"] is MultiSimilarityLoss
    built = build_loss("multi_similarity", beta=40.0)
    assert isinstance(built, MultiSimilarityLoss) and built.beta == 40.0
    with pytest.raises(ValueError, match="multi_similarity"):
        build_loss("no_such_loss")


@pytest.mark.parametrize("kw", [{"alpha": 0.0}, {"beta": -1.0}, {"eps": -0.1}, {"on_empty": "drop"}])
def test_invalid_hyperparameters(kw):
    with pytest.raises(ValueError):
        MultiSimilarityLoss(**kw)


@pytest.mark.parametrize(
    "kw,ok",
    [({"alpha": 0.5, "beta": 0.5, "eps": 0.0}, True), ({"alpha": -0.5}, False), ({"beta": 0.0}, False),
     ({"beta": -0.5}, False), ({"eps": -0.5}, False)],
)
def test_hyperparameter_ranges_at_their_bounds(kw, ok):
    """alpha > 0, beta > 0, eps >= 0 (MS Eqs. 10-12): the ends and half a unit beyond."""
    if ok:
        loss = MultiSimilarityLoss(**kw)
        assert (loss.alpha, loss.beta, loss.eps) == (kw["alpha"], kw["beta"], kw["eps"])
    else:
        with pytest.raises(ValueError):
            MultiSimilarityLoss(**kw)


@pytest.mark.parametrize(
    "kw", [{"beta": 200.0}, {"alpha": 200.0}, {"beta": 300.0, "plus_one": False}, {"beta": 200.0, "mining": False},
           {"alpha": 300.0, "beta": 300.0, "on_empty": "skip"}],
    ids=str,
)
def test_large_scales_are_finite_and_exact(kw):
    """alpha or beta of 200-300 (exponents of 100-300 for the pairs the mined set leaves out, the self-pair among
    them): the closed form is finite and equals the float64 loop reference (it gave NaN from about 170 on: an
    overflowed exp of a dropped pair times its zero mask)."""
    torch.manual_seed(1)
    z, y = torch.randn(16, 8, dtype=torch.float64), torch.arange(16) % 4
    zz = z.float().requires_grad_(True)
    value = MultiSimilarityLoss(**kw)(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    zr = z.clone().requires_grad_(True)
    expected = ref.multi_similarity(zr, y, **kw)
    (grad_ref,) = torch.autograd.grad(expected, zr)
    assert torch.isfinite(value) and torch.isfinite(grad).all()
    torch.testing.assert_close(value.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), grad_ref, rtol=1e-4, atol=1e-6)
