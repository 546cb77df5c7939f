"""Issue 29, part 3a: the pml 2.x losses DynamicSoftMargin, GeneralizedLiftedStructure, Histogram and
IntraPairVariance against pytorch-metric-learning (values and gradients, fp64, random and trained-like batches
near the margins) and against loop references from their papers (tests/reference_losses_part3a.py), with label
sets, degenerate batches and the CLI.

Convention notes (documented differences from pml, each tested below):
* ``DynamicSoftMarginLoss``: the CDF weight is a constant (the paper's gradient ``Phi(x)``); pml differentiates
  through its histogram, so its gradient is compared with a pml whose histogram update reads detached values.
  Values are equal over several calls (the running histogram). Our histogram has one more node, so a difference
  at or above the top of the range (where pml indexes past its histogram) is counted.
* ``GeneralizedLiftedStructureLoss``: an anchor without positives adds 0 (pml keeps its negative log-sum), so pml
  is compared on batches where every anchor has a positive.
* ``HistogramLoss``: pml computes the bin index from fp32 similarities; in fp64 a similarity within fp32 rounding of
  a node is put in the neighbouring bin, which moves the value by ~1e-8 (the loss is continuous): tolerance 1e-6.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from lightning_dml.losses import LOSSES, build_loss
from tests import reference_losses_part3a as ref

pml_losses = pytest.importorskip("pytorch_metric_learning.losses")
#: pml's HistogramLoss indexes with a list of lists (a torch deprecation warning, not ours)
pytestmark = pytest.mark.filterwarnings("ignore:Using a non-tuple sequence:UserWarning")

NAMES = ["dynamic_soft_margin", "generalized_lifted_structure", "histogram", "intra_pair_variance"]
#: every loss of this part (the CLI test)
ALL_NAMES = [*NAMES, "large_margin_softmax"]
ROOT = Path(__file__).resolve().parents[1]


def random_batch(seed: int, b: int = 24, k: int = 4, d: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = (torch.arange(b) // k)[torch.randperm(b, generator=g)]
    return torch.randn(b, d, generator=g, dtype=torch.float64), y


def trained_like(seed: int, pos_cos: float, neg_cos: float, classes: int = 5, per_class: int = 4,
                 dim: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Clusters whose same-class cosines are about ``pos_cos`` and other-class cosines about ``neg_cos`` (the
    construction of tests/test_losses_trained_like.py), not unit length."""
    g = torch.Generator().manual_seed(seed)
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
    common = unit(torch.randn(dim, generator=g, dtype=torch.float64))
    rho = neg_cos / pos_cos
    own = unit(torch.randn(classes, dim, generator=g, dtype=torch.float64))
    centres = unit(math.sqrt(rho) * common + math.sqrt(1.0 - rho) * own)
    labels = torch.arange(classes).repeat_interleave(per_class)
    noise = unit(torch.randn(classes * per_class, dim, generator=g, dtype=torch.float64))
    z = math.sqrt(pos_cos) * centres[labels] + math.sqrt(1.0 - pos_cos) * noise
    order = torch.randperm(labels.numel(), generator=g)
    return 3.0 * z[order], labels[order]


#: random; trained-like with D_ap - D_an around 0 (DSM's CDF mid-range, GLS's hinge); tight positives
BATCHES = {
    "random": lambda: random_batch(0),
    "random_k3": lambda: random_batch(1, b=30, k=3),
    "near_margin": lambda: trained_like(0, 0.7, 0.45),
    "overlapping": lambda: trained_like(1, 0.6, 0.58),
    "tight": lambda: trained_like(2, 0.96, 0.8),
}


def value_and_grad(fn, z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    z = z.detach().clone().requires_grad_(True)
    value = fn(z, y)
    (g,) = torch.autograd.grad(value, z, allow_unused=True)
    return value.detach(), (torch.zeros_like(z) if g is None else g)


def assert_same(ours, theirs, z, y, rtol=1e-10, atol=1e-12, power=True):
    v1, g1 = value_and_grad(ours, z, y)
    v2, g2 = value_and_grad(theirs, z, y)
    torch.testing.assert_close(v1, v2.to(v1.dtype), rtol=rtol, atol=atol)
    torch.testing.assert_close(g1, g2, rtol=rtol, atol=atol)
    if power:
        assert g2.abs().max() > 0  # the comparison has power


class DetachedHistogramDSM(pml_losses.DynamicSoftMarginLoss):
    """pml's DSM with its histogram updated from detached values: its gradient is then the paper's (and ours)."""

    def update_histogram(self, data):
        return super().update_histogram(data.detach())


# ---------------------------------------------------------------------------------------------- against pml
@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_dynamic_soft_margin_equals_pml_over_several_calls(batch):
    ours, theirs = build_loss("dynamic_soft_margin", histogram_update="pml").double(), DetachedHistogramDSM()
    z, y = BATCHES[batch]()
    for step in range(3):  # the running histogram: first call momentum 1, then 0.01
        zs = z + 0.05 * step * torch.randn(z.shape, generator=torch.Generator().manual_seed(step), dtype=z.dtype)
        assert_same(ours, theirs, zs, y)
    torch.testing.assert_close(ours.histogram[:-1], theirs.hist_.detach())
    assert ours.histogram[-1] == 0


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("pos_margin,neg_margin", [(0.0, 1.0), (0.1, 0.8), (0.0, -3.6)])
def test_generalized_lifted_structure_equals_pml(batch, pos_margin, neg_margin):
    z, y = BATCHES[batch]()
    theirs = pml_losses.GeneralizedLiftedStructureLoss(neg_margin=neg_margin, pos_margin=pos_margin)
    assert_same(build_loss("generalized_lifted_structure", neg_margin=neg_margin, pos_margin=pos_margin), theirs, z, y)


def test_generalized_lifted_structure_hinge_is_active_somewhere():
    """Control for the batches above: with m- = -3.6 (the per-anchor log-sums of these batches lie in 3.4 .. 4.4)
    some anchors of the trained-like batches are inside the hinge (0) and some outside, so the comparisons with
    pml see both sides of it."""
    for batch in ("near_margin", "tight"):
        z, y = BATCHES[batch]()
        inside = [float(ref.generalized_lifted_structure(z, ref.same_label(y), neg_margin=-3.6, anchors=[i])) == 0.0
                  for i in range(len(y))]
        assert any(inside) and not all(inside), batch


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("n_bins", [100, 25])
def test_histogram_equals_pml(batch, n_bins):
    z, y = BATCHES[batch]()
    # the tight batch's positive and negative similarities do not overlap: loss and gradient 0
    assert_same(build_loss("histogram", n_bins=n_bins), pml_losses.HistogramLoss(n_bins=n_bins), z, y, rtol=1e-6,
                atol=1e-6, power=batch != "tight")


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("eps", [(0.01, 0.01), (0.2, 0.05)])
def test_intra_pair_variance_equals_pml(batch, eps):
    z, y = BATCHES[batch]()
    theirs = pml_losses.IntraPairVarianceLoss(pos_eps=eps[0], neg_eps=eps[1])
    assert_same(build_loss("intra_pair_variance", pos_eps=eps[0], neg_eps=eps[1]), theirs, z, y)


# ------------------------------------------------------------------------------- against the papers' loops
def _label_sets(y: torch.Tensor) -> torch.Tensor:
    """Every item its class; every third item also the next class; one item no label (padded with -1)."""
    second = torch.where(torch.arange(y.numel()) % 3 == 0, (y + 1) % (int(y.max()) + 1), -1)
    sets = torch.stack([y, second], dim=1)
    sets[5] = -1
    return sets


CASES = {
    "generalized_lifted_structure": (ref.generalized_lifted_structure, {"neg_margin": 0.6, "pos_margin": 0.05}),
    "histogram": (ref.histogram, {"delta": 0.1}),
    "intra_pair_variance": (ref.intra_pair_variance, {"pos_eps": 0.05, "neg_eps": 0.02}),
}


@pytest.mark.parametrize("sets", [False, True], ids=["labels", "label_sets"])
@pytest.mark.parametrize("batch", ["random", "near_margin"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_against_the_paper_loop(name, batch, sets):
    reference, kw = CASES[name]
    z, y = BATCHES[batch]()
    y = _label_sets(y) if sets else y
    loss = build_loss(name, **kw)
    assert_same(loss, lambda zz, yy: reference(zz, ref.same_label(yy), **kw), z, y)


@pytest.mark.parametrize("update", ["authors", "pml"])
@pytest.mark.parametrize("sets", [False, True], ids=["labels", "label_sets"])
def test_dynamic_soft_margin_against_the_paper_loop(sets, update):
    z, y = random_batch(3, b=12, k=3, d=8)
    y = _label_sets(y) if sets else y
    kw = {"min_val": -1.0, "num_bins": 8, "momentum": 0.3}
    ours = build_loss("dynamic_soft_margin", histogram_update=update, **kw).double()
    theirs = ref.DynamicSoftMargin(update=update, **kw)
    for step in range(2):
        zs = z + 0.3 * step
        assert_same(ours, lambda zz, yy: theirs(zz, ref.same_label(yy)), zs, y)
    # eval mode reads the stored histogram and leaves it alone
    ours.eval()
    stored = ours.histogram.clone()
    assert_same(ours, lambda zz, yy: theirs(zz, ref.same_label(yy), train=False), z * 2 + 1, y)
    assert torch.equal(ours.histogram, stored)


def test_dynamic_soft_margin_update_rules_differ_after_the_first_batch():
    """Control: the two update rules agree on the first batch (momentum 1) and differ after it."""
    z, y = random_batch(5)
    losses = [build_loss("dynamic_soft_margin", histogram_update=u).double() for u in ("authors", "pml")]
    first = [float(loss(z, y)) for loss in losses]
    assert first[0] == pytest.approx(first[1], rel=1e-14)
    second = [float(loss(z * 0.5 + 0.3, y)) for loss in losses]
    assert second[0] != second[1] and not torch.allclose(losses[0].histogram, losses[1].histogram)


def test_dynamic_soft_margin_counts_differences_at_the_top_of_the_range():
    """min_val = -0.5: the differences reach beyond 0.5 (pml indexes past its histogram there); they are counted
    in the top node, as the reference does."""
    z, y = random_batch(4, b=12, k=3, d=8)
    loss, theirs = build_loss("dynamic_soft_margin", min_val=-0.5, num_bins=4).double(), \
        ref.DynamicSoftMargin(min_val=-0.5, num_bins=4)
    for step in range(2):
        assert_same(loss, lambda zz, yy: theirs(zz, ref.same_label(yy)), z + step, y)
    assert loss.histogram[-1] > 0 and loss.histogram[0] > 0
    with pytest.raises(RuntimeError):  # pml fails on the same batch
        pml_losses.DynamicSoftMarginLoss(min_val=-0.5, num_bins=4)(z, y)


def test_histogram_rejects_inconsistent_bins():
    with pytest.raises(ValueError, match="delta = 2 / n_bins"):
        build_loss("histogram", n_bins=10, delta=0.1)
    with pytest.raises(ValueError, match="delta must be 2 / n"):
        build_loss("histogram", delta=0.3)
    assert build_loss("histogram", delta=0.1).n_bins == 20


def test_label_sets_change_the_losses():
    """Control: the second labels matter (a loss reading only the first column would pass the loops above)."""
    z, y = BATCHES["near_margin"]()
    sets = _label_sets(y)
    first_only = torch.stack([sets[:, 0], torch.full_like(y, -1)], dim=1)
    for name in NAMES:
        assert LOSSES[name].supports_label_sets
        assert not torch.allclose(build_loss(name)(z, sets), build_loss(name)(z, first_only)), name


# ------------------------------------------------------------------------------------------------ degenerate
DEGENERATE = {
    "one_class": (lambda: (torch.randn(8, 6, dtype=torch.float64), torch.zeros(8, dtype=torch.long))),
    "singletons": (lambda: (torch.randn(8, 6, dtype=torch.float64), torch.arange(8))),
    "identical": (lambda: (torch.ones(8, 6, dtype=torch.float64), torch.arange(8) // 2)),
}
#: documented values: no triplet / pair set -> 0; identical embeddings: DSM x = 0, IPV no spread -> 0, Histogram
#: every pair at cosine 1 -> 1 (all negatives as similar as all positives), GLS (D = 1e-6 everywhere, the SPEC
#: floor) log(K-1) + 1e-6 + log(B-K) + m- - 1e-6
#: IPV keeps its non-empty set's term (one class: positives only; singletons: negatives only): its loop reference
EXPECTED = {
    ("one_class", "intra_pair_variance"): ref.intra_pair_variance,
    ("singletons", "intra_pair_variance"): ref.intra_pair_variance,
    ("identical", "histogram"): 1.0,
    ("identical", "generalized_lifted_structure"): math.log(1) + math.log(6) + 1.0,
}


@pytest.mark.parametrize("case", sorted(DEGENERATE))
@pytest.mark.parametrize("name", NAMES)
def test_degenerate_batches_are_finite_and_documented(name, case):
    torch.manual_seed(0)
    z, y = DEGENERATE[case]()
    value, grad = value_and_grad(build_loss(name), z, y)
    assert torch.isfinite(value) and torch.isfinite(grad).all()
    expected = EXPECTED.get((case, name), 0.0)
    if callable(expected):
        assert_same(build_loss(name), lambda zz, yy: expected(zz, ref.same_label(yy)), z, y)
        return
    assert float(value) == pytest.approx(expected, abs=1e-9)
    if expected == 0.0:
        assert float(grad.abs().max()) == 0.0


@pytest.mark.parametrize("name", NAMES)
def test_fp32_and_bf16_inputs(name):
    z, y = BATCHES["near_margin"]()
    want = build_loss(name)(z, y)
    for dtype in (torch.float32, torch.bfloat16):
        got = build_loss(name)(z.to(dtype), y)
        assert got.dtype == torch.float32
        assert float(got) == pytest.approx(float(want), rel=2e-2, abs=2e-3)


def test_dynamic_soft_margin_histogram_is_saved_with_the_state():
    loss = build_loss("dynamic_soft_margin")
    loss(*BATCHES["random"]())
    state = loss.state_dict()
    assert state["histogram"].sum() == pytest.approx(1.0)
    fresh = build_loss("dynamic_soft_margin")
    fresh.load_state_dict(state)
    assert torch.equal(fresh.histogram, loss.histogram)


def test_bad_hyperparameters_are_rejected():
    for name, kw in [("dynamic_soft_margin", {"min_val": 0.5}), ("dynamic_soft_margin", {"num_bins": 0}),
                     ("dynamic_soft_margin", {"momentum": 0.0}), ("intra_pair_variance", {"pos_eps": -1}),
                     ("dynamic_soft_margin", {"histogram_update": "mean"}),
                     ("histogram", {"n_bins": 0})]:
        with pytest.raises(ValueError):
            build_loss(name, **kw)


# ------------------------------------------------------------------------------------------------ CLI
FAST = ["--trainer.max_epochs=1", "--trainer.limit_train_batches=1", "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--model.backbone.init_args.width=8", "--model.embedding_dim=16", "--model.clustering=false",
        "--data.init_args.image_size=16", "--trainer.callbacks=[]", "--trainer.logger=false"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL_NAMES)
def test_fit_by_registry_name(name, tmp_path, monkeypatch):
    """``lightning-dml fit --model.loss <name>``: one training step on the Glyphs slice of tests/test_cli.py, a
    finite training loss."""
    from lightning_dml.cli import build_cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    cli = build_cli(["fit", "--config", str(ROOT / "configs" / "glyphs.yaml"), *FAST, f"--model.loss={name}"])
    assert type(cli.model.loss) is LOSSES[name]
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])


# ------------------------------------------------------------------------------------ Large-Margin Softmax
def _lsoftmax_pair(num_classes: int, dim: int, margin: int, scale: float, seed: int = 0):
    """Ours and pml's with the same weights (pml stores W transposed), both fp64."""
    torch.manual_seed(seed)
    ours = build_loss("large_margin_softmax", num_classes=num_classes, embedding_dim=dim, margin=margin,
                      scale=scale).double()
    theirs = pml_losses.LargeMarginSoftmaxLoss(num_classes, dim, margin=margin, scale=scale)
    with torch.no_grad():
        theirs.W.copy_(ours.proxies.detach().T.float())
    return ours, theirs.double()


def _angled_batch(proxies: torch.Tensor, labels: torch.Tensor, angles: torch.Tensor, norm: float = 2.0):
    """Embeddings at the given angles from their class's weight vector (a random orthogonal direction each)."""
    g = torch.Generator().manual_seed(1)
    w = torch.nn.functional.normalize(proxies[labels], dim=1)
    r = torch.randn(w.shape, generator=g, dtype=w.dtype)
    r = torch.nn.functional.normalize(r - (r * w).sum(1, keepdim=True) * w, dim=1)
    return norm * (torch.cos(angles)[:, None] * w + torch.sin(angles)[:, None] * r)


@pytest.mark.parametrize("margin", [1, 2, 3, 4])
@pytest.mark.parametrize("scale", [1.0, 2.5])
@pytest.mark.parametrize("batch", ["random", "boundaries"])
def test_large_margin_softmax_equals_pml(margin, scale, batch):
    """Values and gradients (embeddings and weights) in fp64; "boundaries": target angles just below and above
    every k pi / m, where psi changes branch."""
    ours, theirs = _lsoftmax_pair(5, 8, margin, scale)
    if batch == "random":
        g = torch.Generator().manual_seed(margin)
        z, y = torch.randn(20, 8, generator=g, dtype=torch.float64), torch.randint(0, 5, (20,), generator=g)
    else:
        ks = torch.arange(1, margin).repeat_interleave(2).double()
        angles = torch.cat([ks * math.pi / margin + torch.tensor([-1e-3, 1e-3]).repeat(margin - 1),
                            torch.tensor([0.05, math.pi - 0.05], dtype=torch.float64)])
        y = torch.arange(angles.numel()) % 5
        z = _angled_batch(ours.proxies.detach(), y, angles)
    z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    v1, v2 = ours(z1, y), theirs(z2, y)
    v1.backward()
    v2.backward()
    torch.testing.assert_close(v1, v2, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(ours.proxies.grad, theirs.W.grad.T, rtol=1e-10, atol=1e-12)


def test_large_margin_cosine_is_the_papers_psi():
    """psi(theta) = (-1)^k cos(m theta) - 2k on a grid of angles (closed form with cos(m theta) itself), monotone
    decreasing (L-Softmax Sec. 3.2), and the plain cosine for m = 1."""
    from lightning_dml.losses.large_margin_softmax import large_margin_cosine

    theta = torch.linspace(0.0, math.pi, 721, dtype=torch.float64)
    for m in (1, 2, 3, 4, 6):
        k = torch.floor(theta / (math.pi / m)).clamp(max=m - 1)
        want = (-1.0) ** k * torch.cos(m * theta) - 2 * k
        got = large_margin_cosine(torch.cos(theta), m)
        inner = theta < math.pi  # at theta = pi, k = m (the paper's interval is closed): the same value
        torch.testing.assert_close(got[inner], want[inner], rtol=1e-9, atol=1e-9)
        assert (got[1:] <= got[:-1] + 1e-9).all()
    torch.testing.assert_close(large_margin_cosine(torch.cos(theta), 1), torch.cos(theta))


def test_large_margin_softmax_contract():
    loss = build_loss("large_margin_softmax", num_classes=4, embedding_dim=6)
    assert loss.gather_mode is None and not loss.supports_label_sets and not loss.needs_positive_pairs
    z, y = torch.randn(8, 6), torch.arange(8) % 4
    value = loss(z, y)
    assert value.dtype == torch.float32 and torch.isfinite(value)
    with pytest.raises(ValueError, match="cannot train on label sets"):
        loss(z, torch.stack([y, y], dim=1))
    with pytest.raises(ValueError, match="class indices"):
        loss(z, y + 4)
    for kw in ({"margin": 0}, {"margin": 2.5}, {"scale": 0.0}):
        with pytest.raises(ValueError):
            build_loss("large_margin_softmax", num_classes=4, embedding_dim=6, **kw)


def test_large_margin_softmax_degenerate_batches():
    """One class, identical embeddings: finite value and gradient; a zero embedding: all logits 0, the loss
    log C."""
    loss = build_loss("large_margin_softmax", num_classes=4, embedding_dim=6).double()
    for z, y in [(torch.randn(6, 6, dtype=torch.float64), torch.zeros(6, dtype=torch.long)),
                 (torch.ones(6, 6, dtype=torch.float64), torch.arange(6) % 4)]:
        value, grad = value_and_grad(loss, z, y)
        assert torch.isfinite(value) and torch.isfinite(grad).all()
    z = torch.zeros(2, 6, dtype=torch.float64)
    value = loss(z, torch.tensor([0, 1])).detach()
    assert float(value) == pytest.approx(math.log(4))


@pytest.mark.parametrize("batch", ["random", "near_margin", "tight"])
@pytest.mark.parametrize("neg_margin", [1.0, -3.6])
def test_generalized_lifted_structure_closed_form_equals_autograd_and_the_loop(batch, neg_margin):
    """The closed-form ``dL/dS`` (the default path) against autograd through ``pair_loss`` and the paper loop, with
    an anchor without positives (its term is 0 on both paths) and a reference item."""
    z, y = BATCHES[batch]()
    y = y.clone()
    y[0] = 99  # a singleton anchor
    kw = {"neg_margin": neg_margin, "pos_margin": 0.05}
    fast, plain = build_loss("generalized_lifted_structure", **kw), build_loss("generalized_lifted_structure", **kw)
    plain.closed_form = False
    assert fast._has_closed_form()
    power = neg_margin > 0  # at -3.6 every anchor of the tight batch is inside the hinge once item 0 is a singleton
    assert_same(fast, plain, z, y, power=power)
    assert_same(fast, lambda zz, yy: ref.generalized_lifted_structure(zz, ref.same_label(yy), **kw), z, y,
                power=power)
    r, ry = z[:3] * 1.1, y[:3]
    v1, v2 = fast(z, y, r, ry), plain(z, y, r, ry)
    torch.testing.assert_close(v1, v2)


@pytest.mark.parametrize("batch", ["random", "near_margin", "overlapping"])
def test_intra_pair_variance_closed_form_equals_autograd(batch):
    """The closed-form ``dL/dS`` (the default path) against autograd through ``pair_loss``, with references and
    a singleton (label sets: an item with an empty set)."""
    z, y = BATCHES[batch]()
    kw = {"pos_eps": 0.05, "neg_eps": 0.02}
    fast, plain = build_loss("intra_pair_variance", **kw), build_loss("intra_pair_variance", **kw)
    plain.closed_form = False
    assert fast._has_closed_form()
    assert_same(fast, plain, z, y)
    sets = _label_sets(y)
    assert_same(fast, plain, z, sets)
    r, ry = z[:4] * 0.9, y[:4]
    torch.testing.assert_close(fast(z, y, r, ry), plain(z, y, r, ry))
