"""Issue 29, package B: P2SGrad, PNP, SNR contrastive, SphereFace, TCM, VICReg, MultiSupCon, DCL and SCT against
pytorch-metric-learning (values and gradients, fp64; P2SGrad to pml's 1e-7 weight renormalisation; pml 3.0's losses
through the pml 2.9 loss they reduce to) and against the papers' loop references (tests/reference_losses_part3b.py),
on random and trained-like batches near the margins, with label sets, reference items, ties and degenerate batches;
and each through the CLI.

pml conventions (documented in each loss's docstring): P2SGrad's ``weight [D, C]`` is our ``proxies.T`` and pml
renormalises it in place (its weight gradient has no tangent projection: only value and embedding gradient are
compared with pml, the proxy gradient with the loop reference); PNP's default variant is pml's ``"O"``, ours the
paper's ``"Dq"`` (every variant is compared); SNR contrastive and TCM use pml's defaults.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dml.losses import build_loss
from tests import reference_losses_part3b as ref
from tests.test_losses_trained_like import trained_like_batch

pml_losses = pytest.importorskip("pytorch_metric_learning.losses")


def random_batch(seed: int, b: int = 24, k: int = 4, d: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = (torch.arange(b) // k)[torch.randperm(b, generator=g)]
    y[0] = y.max() + 1  # an anchor without a positive
    return torch.randn(b, d, generator=g, dtype=torch.float64), y


#: random batches, and trained-like clusters at each loss's thresholds (TCM m+ = 0.9 / m- = 0.5, PNP's ties)
BATCHES = {
    "random": lambda: random_batch(0),
    "random_k2": lambda: random_batch(1, b=20, k=2),
    "at_tcm_margins": lambda: trained_like_batch(3, 0.9, 0.5),
    "at_lambda": lambda: trained_like_batch(0, 0.7, 0.45),
    "tight": lambda: trained_like_batch(2, 0.96, 0.8),
}


def value_and_grad(fn, z, y):
    z = z.clone().requires_grad_(True)
    value = fn(z, y)
    (grad,) = torch.autograd.grad(value, z)
    return value.detach(), grad


def assert_same(ours, theirs, z, y, rtol=1e-10):
    v1, g1 = value_and_grad(ours, z, y)
    v2, g2 = value_and_grad(theirs, z, y)
    torch.testing.assert_close(v1, v2, rtol=rtol, atol=1e-12)
    atol = max(1e-12, rtol * float(g2.abs().max()))  # relative to the gradient's scale
    torch.testing.assert_close(g1, g2, rtol=max(rtol, 1e-8), atol=atol)
    assert float(g1.abs().max()) > 0  # the comparison has something to compare


# ------------------------------------------------------------------------------------------------- against pml
@pytest.mark.parametrize("batch", BATCHES)
def test_p2sgrad_matches_pml(batch):
    z, y = BATCHES[batch]()
    classes = int(y.max()) + 1
    torch.manual_seed(0)
    theirs = pml_losses.P2SGradLoss(z.shape[1], classes).double()
    ours = build_loss("p2sgrad", num_classes=classes, embedding_dim=z.shape[1]).double()
    with torch.no_grad():
        ours.proxies.copy_(theirs.weight.T)
    # pml renormalises its weight columns to norm / (norm + 1e-7) (torch.renorm's epsilon) on every call: its
    # cosines are 1e-7 relatively short of the exact ones (ours, and the loop reference's below to 1e-9)
    assert_same(ours, theirs, z, y, rtol=1e-6)


@pytest.mark.parametrize("batch", ["random", "tight"])  # the logits scale with ||x||: every batch is far
@pytest.mark.parametrize("margin,scale", [(4, 1.0), (3, 0.5), (2, 2.0), (1, 1.0)])
def test_sphereface_matches_pml(batch, margin, scale):
    """Raw (not unit) embeddings: the logits scale with their norms; every branch k of psi is visited."""
    z, y = BATCHES[batch]()
    classes = int(y.max()) + 1
    torch.manual_seed(0)
    theirs = pml_losses.SphereFaceLoss(classes, z.shape[1], margin=margin, scale=scale).double()
    ours = build_loss("sphereface", num_classes=classes, embedding_dim=z.shape[1], margin=margin, scale=scale)
    ours = ours.double()
    with torch.no_grad():
        ours.proxies.copy_(theirs.W.T)
    assert_same(ours, theirs, z * torch.linspace(0.5, 2.0, z.shape[0], dtype=z.dtype)[:, None], y)


def test_sphereface_psi_is_the_papers_piecewise_function():
    """psi(theta) = (-1)^k cos(m theta) - 2k on [k pi/m, (k+1) pi/m] (SphereFace Eq. 6), from the angle itself."""
    from lightning_dml.losses.sphereface import angular_margin_psi

    theta = torch.linspace(0.0, torch.pi, 1001, dtype=torch.float64)
    for m in (1, 2, 3, 4):
        k = torch.floor(theta / (torch.pi / m)).clamp(max=m - 1)
        want = (-1.0) ** k * torch.cos(m * theta) - 2 * k
        torch.testing.assert_close(angular_margin_psi(torch.cos(theta), m), want, rtol=0, atol=1e-9)
        assert bool((angular_margin_psi(torch.cos(theta), m).diff() <= 1e-12).all())  # decreasing in theta


@pytest.mark.parametrize("batch", ["random", "at_lambda", "tight"])
@pytest.mark.parametrize("variant", ["O", "Ds", "Dq", "Iu", "Ib"])
def test_pnp_matches_pml(batch, variant):
    z, y = BATCHES[batch]()
    theirs = pml_losses.PNPLoss(variant=variant, anneal=0.05 if batch == "random" else 0.01)
    ours = build_loss("pnp", variant=variant, anneal=theirs.anneal)
    assert_same(ours, theirs, z, y)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("margins", [(0.0, 1.0), (0.05, 0.2)])
def test_snr_contrastive_matches_pml(batch, margins):
    z, y = BATCHES[batch]()
    theirs = pml_losses.SignalToNoiseRatioContrastiveLoss(pos_margin=margins[0], neg_margin=margins[1])
    ours = build_loss("snr_contrastive", pos_margin=margins[0], neg_margin=margins[1])
    assert_same(ours, theirs, z, y)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("margins", [(0.9, 0.5), (0.75, 0.3)])
def test_tcm_matches_pml(batch, margins):
    z, y = BATCHES[batch]()
    kwargs = dict(lambda_plus=0.7, lambda_minus=1.3, margin_plus=margins[0], margin_minus=margins[1])
    theirs = pml_losses.ThresholdConsistentMarginLoss(**kwargs)
    assert_same(build_loss("threshold_consistent_margin", **kwargs), theirs, z, y)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("temperature", [0.1, 0.5])
def test_multi_supcon_is_pml_supcon_for_one_label_per_item(batch, temperature):
    """pml 3's MultiSupConLoss cannot be installed (Python 3.11); with one label per item the Jaccard similarity is
    1 or 0 and it is SupCon, which pml 2.9 has (the batches hold negative pairs: pml's zero-loss special cases do
    not apply)."""
    z, y = BATCHES[batch]()
    theirs = pml_losses.SupConLoss(temperature=temperature)
    assert_same(build_loss("multi_supcon", temperature=temperature), theirs, z, y)


def test_multi_supcon_threshold_is_strict_jaccard():
    """{1, 2, 3} and {1}: J = 1/3, positive for t = 0.3, not for t = 0.4; {1, 2} and {1}: J = 1/2, not for t = 0.5."""
    from lightning_dml.losses.multi_supcon import jaccard_positive_mask

    sets = torch.tensor([[1, 2, 3], [1, -1, -1], [2, 1, -1], [-1, -1, -1], [3, 3, -1]])
    for t, want in ((0.3, [[1, 1, 1, 0, 1], [1, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 0, 1]]),
                    (0.4, [[1, 0, 1, 0, 0], [0, 1, 1, 0, 0], [1, 1, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]]),
                    (0.5, [[1, 0, 1, 0, 0], [0, 1, 0, 0, 0], [1, 0, 1, 0, 0], [0, 0, 0, 0, 0], [0, 0, 0, 0, 1]])):
        assert jaccard_positive_mask(sets, sets, t).tolist() == [[bool(v) for v in row] for row in want], t


@pytest.mark.parametrize("batch", ["random_k2", "at_lambda"])
def test_decoupled_contrastive_is_pml_ntxent_without_the_positive_in_the_denominator(batch):
    """Per positive pair, NT-Xent - DCL = log(1 + e^{s_ip/tau} / sum_n e^{s_in/tau}) (the positive's share of
    NT-Xent's denominator): checked through pml 2.9's NTXentLoss, values and gradients."""
    z, y = BATCHES[batch]()
    tau = 0.2

    def shares(e, t):
        x = torch.nn.functional.normalize(e, dim=1)
        logits = x @ x.T / tau
        same = t[:, None] == t[None, :]
        pos = same & ~torch.eye(len(t), dtype=torch.bool)
        lse_neg = torch.logsumexp(logits.masked_fill(same, -torch.inf), dim=1)
        return torch.nn.functional.softplus(logits - lse_neg[:, None])[pos].mean()

    ours = lambda e, t: build_loss("decoupled_contrastive", temperature=tau)(e, t) + shares(e, t)  # noqa: E731
    assert_same(ours, pml_losses.NTXentLoss(temperature=tau), z, y)


# --------------------------------------------------------------------------------------- against the loop refs
def test_p2sgrad_proxy_gradient_matches_loop_reference():
    z, y = trained_like_batch(0, 0.7, 0.45)
    loss = build_loss("p2sgrad", num_classes=5, embedding_dim=z.shape[1]).double()
    w = loss.proxies.detach().clone().requires_grad_(True)
    z1, z2 = z.clone().requires_grad_(True), z.clone().requires_grad_(True)
    loss(z1, y).backward()
    ref.p2sgrad(z2, w, y).backward()
    torch.testing.assert_close(loss.proxies.grad, w.grad, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(z1.grad, z2.grad, rtol=1e-9, atol=1e-12)


def label_sets(y: torch.Tensor) -> torch.Tensor:
    """Every third item also carries the next class, item 1 carries no label."""
    second = torch.where(torch.arange(y.numel()) % 3 == 0, (y + 1) % (int(y.max()) + 1), -1)
    sets = torch.stack([y, second], dim=1)
    sets[1] = -1
    return sets


PAIR_CASES = {
    "pnp": (ref.pnp, {"variant": "Dq", "anneal": 0.02}),
    "pnp_Ib": (ref.pnp, {"variant": "Ib", "anneal": 0.02, "b": 3.0}),
    "snr_contrastive": (ref.snr_contrastive, {"neg_margin": 0.9}),
    "threshold_consistent_margin": (ref.tcm, {"margin_plus": 0.8, "margin_minus": 0.4}),
    "multi_supcon": (ref.multi_supcon, {"temperature": 0.2}),
    "multi_supcon_t05": (ref.multi_supcon, {"temperature": 0.2, "threshold": 0.5}),
    "decoupled_contrastive": (ref.decoupled_contrastive, {"temperature": 0.1}),
    "decoupled_contrastive_t05": (ref.decoupled_contrastive, {"temperature": 0.5}),
    "selectively_contrastive_triplet": (ref.selectively_contrastive_triplet, {"penalty": 0.7}),
    "selectively_contrastive_triplet_hardest": (ref.selectively_contrastive_triplet,
                                                {"positive": "hardest", "temperature": 0.2}),
}


def registry_name(case: str) -> str:
    return case.split("_Ib")[0].split("_t05")[0].split("_hardest")[0]


@pytest.mark.parametrize("case", PAIR_CASES)
@pytest.mark.parametrize("sets", [False, True])
@pytest.mark.parametrize("with_ref", [False, True])
def test_pair_losses_match_loop_reference(case, sets, with_ref):
    """Labels or label sets, with or without reference items (the DDP / cross-batch-memory path)."""
    fn, kwargs = PAIR_CASES[case]
    z, y = trained_like_batch(1, 0.85, 0.5, classes=4, per_class=3, dim=12)
    labels = label_sets(y) if sets else y
    extra = {}
    if with_ref:
        zr, yr = trained_like_batch(4, 0.85, 0.5, classes=4, per_class=2, dim=12)
        extra = {"ref": zr, "ref_y": label_sets(yr)[:, :1] if sets else yr}
    loss = build_loss(registry_name(case), **kwargs)
    ours = lambda e, t: loss(e, t, extra.get("ref"), extra.get("ref_y"))  # noqa: E731
    theirs = lambda e, t: fn(e, t, **kwargs, **extra)  # noqa: E731
    assert_same(ours, theirs, z, labels)


def test_label_sets_change_the_pair_losses():
    """Control: the second labels matter (otherwise the label-set comparisons above prove nothing)."""
    z, y = trained_like_batch(1, 0.85, 0.5, classes=4, per_class=3, dim=12)
    for case, (_, kwargs) in PAIR_CASES.items():
        loss = build_loss(registry_name(case), **kwargs)
        assert not torch.allclose(loss(z, label_sets(y)), loss(z, y)), case


@pytest.mark.parametrize("name", ["p2sgrad", "sphereface", "vicreg"])
def test_label_sets_rejected_with_the_reason(name):
    loss = build_loss(name, **({} if name == "vicreg" else {"num_classes": 4, "embedding_dim": 8}))
    with pytest.raises(ValueError, match=f"{type(loss).__name__} cannot train on label sets"):
        loss(torch.randn(4, 8), torch.tensor([[0, 1], [1, -1], [2, -1], [3, -1]]))


# ------------------------------------------------------------------------------------------ ties, degenerate
def tie_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Unit vectors with entries +-0.5: cosines exactly in {-1, -0.5, 0, 0.5, 1} (ties, s exactly at m- = 0.5);
    no row constant (SNR's zero-variance anchors are tested on their own)."""
    signs = torch.tensor([[1, -1, -1, -1], [1, 1, 1, -1], [1, 1, -1, -1], [1, -1, 1, -1], [-1, 1, 1, 1],
                          [1, 1, -1, 1], [1, -1, -1, 1], [-1, -1, 1, 1]], dtype=torch.float64)
    return 0.5 * signs, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])


@pytest.mark.parametrize("case", PAIR_CASES)
def test_ties_match_loop_reference(case):
    fn, kwargs = PAIR_CASES[case]
    z, y = tie_batch()
    if case == "threshold_consistent_margin":
        kwargs = {"margin_plus": 0.5, "margin_minus": 0.5}  # pairs exactly at both margins count (pml's <= / >=)
    assert_same(build_loss(registry_name(case), **kwargs), lambda e, t: fn(e, t, **kwargs), z, y)


def test_tcm_counts_pairs_at_the_margin():
    z, y = tie_batch()
    at = build_loss("threshold_consistent_margin", margin_plus=0.5, margin_minus=0.5, lambda_plus=0.0)(z, y)
    x = torch.nn.functional.normalize(z, dim=1)
    s = x @ x.T
    neg = y[:, None] != y[None, :]
    hard = neg & (s >= 0.5)
    assert int((neg & (s == 0.5)).sum()) > 0
    torch.testing.assert_close(at, ((s - 0.5) * hard).sum() / hard.sum())


#: every loss of this package, and those among them with class weights
NAMES = ["p2sgrad", "pnp", "snr_contrastive", "sphereface", "threshold_consistent_margin", "vicreg", "multi_supcon",
         "decoupled_contrastive", "selectively_contrastive_triplet"]
CLASSIFICATION = ("p2sgrad", "sphereface")

DEGENERATE = {
    "one_class": (torch.randn(6, 8, dtype=torch.float64), torch.zeros(6, dtype=torch.long)),
    "singletons": (torch.randn(6, 8, dtype=torch.float64), torch.arange(6)),
    "identical": (torch.ones(6, 8, dtype=torch.float64) + torch.arange(8.0, dtype=torch.float64), torch.arange(6) // 2),
}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", DEGENERATE)
def test_degenerate_batches_finite(name, batch):
    z, y = DEGENERATE[batch]
    y = torch.arange(6) // 2 if name == "vicreg" else y  # its batch is pairs of views (more tests below)
    kwargs = {"num_classes": 6, "embedding_dim": 8} if name in CLASSIFICATION else {}
    loss = build_loss(name, **kwargs).double()
    z = z.clone().requires_grad_(True)
    value = loss(z, y)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(z.grad).all()
    if batch == "singletons" and name in ("pnp",):
        assert float(value) == 0.0  # no anchor with a positive
    if batch == "identical" and name == "pnp":
        # every s equal: R = |N_q| / 2 = 2 for each of the (positive, self) pairs; Dq gives 1 - 1/3
        torch.testing.assert_close(value, torch.tensor(2.0 / 3.0, dtype=torch.float64))
    if batch == "one_class" and name == "decoupled_contrastive":
        assert float(value) == 0.0 and float(z.grad.abs().max()) == 0.0  # no negatives: no denominator, no term
    if batch == "identical" and name == "decoupled_contrastive":
        torch.testing.assert_close(value, torch.tensor(4.0, dtype=torch.float64).log())  # log |N_i| = log 4
    if batch == "identical" and name == "selectively_contrastive_triplet":
        torch.testing.assert_close(value, torch.tensor(2.0, dtype=torch.float64).log())  # S_an = S_ap: easy, log 2
    if batch == "identical" and name == "vicreg":
        # invariance and covariance 0, each view's std sqrt(eps): mu (1 - sqrt(eps)) / 2 twice
        torch.testing.assert_close(value, torch.tensor(25.0 * (1 - 1e-2), dtype=torch.float64))
    if batch == "identical" and name == "snr_contrastive":
        # distance 0 everywhere: only the negatives' hinge m2 - 0 = 1 is active
        torch.testing.assert_close(value, torch.tensor(1.0, dtype=torch.float64))


def test_snr_zero_variance_anchor_is_finite():
    z = torch.randn(6, 8, dtype=torch.float64)
    z[0] = 1.0  # all components equal: var(a) = 0
    value = build_loss("snr_contrastive")(z.requires_grad_(True), torch.arange(6) // 2)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(z.grad).all()


# --------------------------------------------------------------------------------------------------- the CLI
@pytest.mark.slow  # a fit each (two training steps, no validation): a few seconds on a quiet machine
@pytest.mark.parametrize("name", NAMES)
def test_fit_by_registry_name(name, tmp_path, monkeypatch):
    from lightning_dml.cli import build_cli
    from lightning_dml.losses import LOSSES
    from tests.test_cli import FAST, GLYPHS

    monkeypatch.chdir(tmp_path)
    quick = ["--trainer.limit_train_batches=2", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0"]
    if name == "vicreg":  # two images of a class are the two views
        quick.append("--data.init_args.samples_per_class=2")
    cli = build_cli(["fit", "--config", str(GLYPHS), *FAST, "--trainer.callbacks=[]", f"--model.loss={name}", *quick])
    assert type(cli.model.loss) is LOSSES[name]
    assert cli.trainer.global_step == 2
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])


def test_sphereface_zero_embedding_gives_uniform_logits():
    loss = build_loss("sphereface", num_classes=5, embedding_dim=8).double()
    z = torch.zeros(3, 8, dtype=torch.float64, requires_grad=True)
    value = loss(z, torch.tensor([0, 1, 4]))
    value.backward()
    torch.testing.assert_close(value, torch.tensor(5.0, dtype=torch.float64).log())
    assert torch.isfinite(z.grad).all()


# ------------------------------------------------------------------------------------------------------ VICReg
def views(seed: int, n: int = 12, d: int = 10, noise: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=g, dtype=torch.float64) * torch.linspace(0.3, 1.5, d, dtype=torch.float64)
    return z, z + noise * torch.randn(n, d, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("seed,noise", [(0, 0.3), (1, 1.0), (2, 0.05)])
@pytest.mark.parametrize("weights", [{}, {"invariance_lambda": 5.0, "variance_mu": 10.0, "covariance_v": 3.0,
                                     "eps": 1e-2}])
def test_vicreg_matches_pml(seed, noise, weights):
    """Both views get their gradient; the per-dimension stds straddle the hinge at 1 (scales 0.3 to 1.5)."""
    z, r = views(seed, noise=noise)
    n = z.shape[0]
    loss = build_loss("vicreg", **weights)
    theirs = pml_losses.VICRegLoss(**weights)
    for view in (0, 1):
        if view == 0:
            ours_fn = lambda e, t: loss(e, t, r, torch.arange(n))  # noqa: E731
        else:
            ours_fn = lambda e, t: loss(z, t, e, torch.arange(n))  # noqa: E731
        their_fn = (lambda e, t: theirs(e, ref_emb=r)) if view == 0 else (lambda e, t: theirs(z, ref_emb=e))
        assert_same(ours_fn, their_fn, z if view == 0 else r, torch.arange(n))


def test_vicreg_pairs_views_by_label_in_any_order():
    """Shuffled, interleaved pairs: the first occurrence of a label is its view in Z (the variance and covariance
    are per view, so swapping one pair's views changes them)."""
    z, r = views(3)
    n = z.shape[0]
    want = build_loss("vicreg")(z, torch.arange(n), r, torch.arange(n))
    g = torch.Generator().manual_seed(0)
    first = torch.rand(n, generator=g, dtype=torch.float64)
    perm = torch.argsort(torch.cat([first, first + torch.rand(n, generator=g, dtype=torch.float64)]))  # z_i before r_i
    items, labels = torch.cat([z, r])[perm], torch.cat([torch.arange(n), torch.arange(n)])[perm] * 7 + 3
    torch.testing.assert_close(build_loss("vicreg")(items, labels), want, rtol=1e-12, atol=1e-12)
    # controls: a different pairing, and the views of one pair swapped, change the value
    assert not torch.allclose(build_loss("vicreg")(items, labels.roll(1)), want)
    swapped = items.clone()
    a, b = (labels == labels[0]).nonzero().flatten()
    swapped[[a, b]] = swapped[[b, a]]
    assert not torch.allclose(build_loss("vicreg")(swapped, labels), want)


@pytest.mark.parametrize("labels", [torch.tensor([0, 0, 1, 1, 1, 2]), torch.tensor([0, 1, 0, 2, 2, 3]),
                                    torch.tensor([5, 5])])
def test_vicreg_rejects_batches_that_are_not_pairs_of_views(labels):
    with pytest.raises(ValueError, match="every label must occur exactly twice"):
        build_loss("vicreg")(torch.randn(labels.numel(), 4), labels)


def test_vicreg_bf16_and_autocast_run_in_fp32():
    z, r = views(4)
    items, labels = torch.cat([z, r]).float(), torch.cat([torch.arange(12), torch.arange(12)])
    want = build_loss("vicreg")(items, labels)
    value = build_loss("vicreg")(items.bfloat16(), labels)
    assert value.dtype == torch.float32
    assert abs(float(value) - float(want)) <= 1e-2 * max(1.0, abs(float(want)))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert build_loss("vicreg")(items, labels).dtype == torch.float32


@pytest.mark.parametrize("positive", ["easiest", "hardest"])
def test_selectively_contrastive_triplet_both_branches(positive):
    """Hard triplets (S_an > S_ap: lambda S_an) and easy ones (the softmax triplet) in one batch: a random one for
    the easiest positives, a trained-like one near the margins for the hardest (4 of 20 anchors hard)."""
    z, y = random_batch(5, b=16, k=4, d=6) if positive == "easiest" else trained_like_batch(1, 0.85, 0.68)
    x = torch.nn.functional.normalize(z, dim=1)
    s = x @ x.T
    same = (y[:, None] == y[None, :]) & ~torch.eye(len(y), dtype=torch.bool)
    s_ap = (s.masked_fill(~same, -9).amax(1) if positive == "easiest" else s.masked_fill(~same, 9).amin(1))
    s_an = s.masked_fill(y[:, None] == y[None, :], -9).amax(1)
    has = same.any(1)
    assert bool(((s_an > s_ap) & has).any()) and bool(((s_an <= s_ap) & has).any())
    kwargs = {"positive": positive, "penalty": 0.5}
    assert_same(build_loss("selectively_contrastive_triplet", **kwargs),
                lambda e, t: ref.selectively_contrastive_triplet(e, t, **kwargs), z, y)
