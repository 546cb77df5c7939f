"""Every loss against its slow loop reference written from the paper's equation: values and gradients, 1e-5."""

import pytest
import torch

from lightning_dml.losses import (
    BinomialDevianceLoss,
    ContrastiveLoss,
    GeneralPairWeightingLoss,
    LiftedStructureLoss,
    NPairLoss,
    RankedListLoss,
    TripletLoss,
    TupletMarginLoss,
)
from lightning_dml.losses.general_pair_weighting import GPW_PRESETS
from tests import reference_losses as ref

CASES = [
    (ContrastiveLoss, {}, ref.contrastive),
    (ContrastiveLoss, {"squared": True, "neg_margin": 1.0}, ref.contrastive),
    (ContrastiveLoss, {"squared_hinge": True, "pos_margin": 0.2, "reduction": "mean"}, ref.contrastive),
    (ContrastiveLoss, {"reduction": "sum", "neg_margin": 1.2}, ref.contrastive),
    (TripletLoss, {}, ref.triplet),
    (TripletLoss, {"margin": 0.3, "squared": True, "reduction": "mean"}, ref.triplet),
    (TripletLoss, {"mining": "batch_hard", "margin": 0.2}, ref.triplet),
    (TripletLoss, {"mining": "batch_hard", "reduction": "sum", "squared": True}, ref.triplet),
    (LiftedStructureLoss, {}, ref.lifted_structure),
    (LiftedStructureLoss, {"variant": "gpw", "margin": 0.5}, ref.lifted_structure),
    (LiftedStructureLoss, {"variant": "generalized"}, ref.lifted_structure),
    (LiftedStructureLoss, {"variant": "star"}, ref.lifted_structure),
    (BinomialDevianceLoss, {}, ref.binomial_deviance),
    (BinomialDevianceLoss, {"alpha": 5.0, "beta": 10.0, "lam": 0.2}, ref.binomial_deviance),
    (RankedListLoss, {}, ref.ranked_list),
    (RankedListLoss, {"detach_gallery": False, "temperature": 0.0}, ref.ranked_list),
    (RankedListLoss, {"alpha": 1.4, "margin": 1.4, "lam": 0.5}, ref.ranked_list),
    (TupletMarginLoss, {"negatives": "all"}, None),
    (TupletMarginLoss, {"negatives": "all", "detach_mean": True, "slack": 0.3, "scale": 16.0}, None),
    (TupletMarginLoss, {"negatives": "all", "variance_weight": 0.0, "slack": 0.0}, None),
]
GPW_CASES = [
    {"preset": "pair_p"},
    {"preset": "pair_e"},
    {"preset": "triplet_p"},
    {"preset": "triplet_e"},
    {"preset": "pair_p", "p": 1.0, "q": 2.0, "m1": 0.3},
    {"preset": "pair_e", "alpha": 2.0, "beta": 10.0, "normalize": False},
    {"preset": "pair_e", "mining": "ms", "eps": 0.1, "m2": 1.2},
    {"preset": "pair_p", "mining": "batch_hard", "m2": 1.4},
    {"preset": "pair_p", "mining": "triplet_margin", "margin": 0.2, "m2": 1.4},
    {"preset": "custom"},
    {"preset": "triplet_p", "mining": "batch_hard", "margin": 0.5},
    {"preset": "triplet_p", "p": 1.0, "normalize": False},
]
SHAPES = [(0, 12, 4, 3), (1, 20, 8, 5), (2, 16, 16, 2)]


def _batch(seed, b, d, classes):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(b, d, generator=g, dtype=torch.float64), torch.randint(0, classes, (b,), generator=g)


def check_against_reference(loss, reference, z, y, ref_kw, call_kw=None, device=None):
    """fp64 inputs: 1e-5 relative to the fp64 loop reference; fp32 inputs (the training path): 1e-4.

    The loss runs on ``device`` (default CPU); the reference always on the CPU in fp64."""
    call_kw = call_kw or {}
    device = torch.device("cpu") if device is None else device
    zr = z.clone().requires_grad_(True)
    expected = reference(zr, y, **ref_kw, **{k: v for k, v in call_kw.items()})
    (g_ref,) = torch.autograd.grad(expected, zr) if expected.requires_grad else (torch.zeros_like(z),)
    paths = (True, False) if loss._has_closed_form() else (False,)
    for closed_form in paths:
        for dtype, rtol, atol in ((torch.float64, 1e-5, 1e-8), (torch.float32, 1e-4, 1e-5)):
            loss.closed_form = closed_form
            zz = z.to(device=device, dtype=dtype).requires_grad_(True)
            kw = {}
            if "ref" in call_kw:
                kw = {"ref_embeddings": call_kw["ref"].to(device=device, dtype=dtype),
                      "ref_labels": call_kw["ref_labels"].to(device)}
            value = loss(zz, y.to(device), **kw)
            (g,) = torch.autograd.grad(value, zz, allow_unused=True)
            g = torch.zeros_like(zz) if g is None else g
            assert value.dtype == dtype and value.ndim == 0 and value.device.type == device.type
            torch.testing.assert_close(value.double().cpu(), expected.detach(), rtol=rtol, atol=atol)
            torch.testing.assert_close(g.double().cpu(), g_ref, rtol=rtol, atol=atol)


def tml_reference(z, y, **kw):
    kw = {k: v for k, v in kw.items() if k != "negatives"}
    return ref.tuplet_margin_all_negatives(z, y, **kw)


@pytest.mark.parametrize("cls,kw,reference", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
@pytest.mark.parametrize("shape", SHAPES)
def test_loss_matches_loop_reference(cls, kw, reference, shape, device):
    z, y = _batch(*shape)
    check_against_reference(cls(**kw), reference or tml_reference, z, y, kw, device=device)


@pytest.mark.parametrize("kw", GPW_CASES, ids=str)
@pytest.mark.parametrize("shape", SHAPES)
def test_gpw_matches_loop_reference(kw, shape, device):
    z, y = _batch(*shape)
    loss = GeneralPairWeightingLoss(**kw)
    cfg = dict(form=loss.form, mining=loss.mining, weighting=loss.weighting, m1=loss.m1, m2=loss.m2,
               margin=loss.margin, p=loss.p, q=loss.q, alpha=loss.alpha, beta=loss.beta, eps=loss.eps,
               normalize=loss.normalize_weights)
    check_against_reference(loss, ref.general_pair_weighting, z, y, cfg, device=device)


@pytest.mark.parametrize(
    "kw",
    [{}, {"symmetric": True}, {"variant": "ovo"}, {"variant": "ovo", "symmetric": True, "l2_reg": 0.0}],
    ids=str,
)
@pytest.mark.parametrize("seed,n_classes,extra", [(0, 6, 0), (1, 10, 3), (2, 3, 1)])
def test_npair_matches_loop_reference(kw, seed, n_classes, extra, device):
    g = torch.Generator().manual_seed(seed)
    y = torch.cat([torch.arange(n_classes).repeat(2), torch.randint(0, n_classes + 2, (extra,), generator=g)])
    y = y[torch.randperm(len(y), generator=g)]
    z = torch.randn(len(y), 8, generator=g, dtype=torch.float64)
    check_against_reference(NPairLoss(**kw), ref.npair, z, y, kw, device=device)


@pytest.mark.parametrize(
    "cls,kw,reference",
    [
        (ContrastiveLoss, {}, ref.contrastive),
        (TripletLoss, {}, ref.triplet),
        (TripletLoss, {"mining": "batch_hard"}, ref.triplet),
        (LiftedStructureLoss, {"variant": "star"}, ref.lifted_structure),
        (LiftedStructureLoss, {"variant": "generalized"}, ref.lifted_structure),
        (BinomialDevianceLoss, {}, ref.binomial_deviance),
        (RankedListLoss, {}, ref.ranked_list),
        (RankedListLoss, {"detach_gallery": False}, ref.ranked_list),
        (TupletMarginLoss, {"negatives": "all"}, None),
        (GeneralPairWeightingLoss, {"preset": "custom", "weighting": "power", "p": 1.0, "q": 1.0}, None),
        (GeneralPairWeightingLoss, {"preset": "triplet_e"}, None),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_reference_gallery_matches_loop_reference(cls, kw, reference, device):
    z, y = _batch(7, 10, 8, 3)
    r, ry = _batch(8, 9, 8, 4)
    loss = cls(**kw)
    if cls is GeneralPairWeightingLoss:
        kw = dict(form=loss.form, mining=loss.mining, weighting=loss.weighting, m1=loss.m1, m2=loss.m2,
                  margin=loss.margin, p=loss.p, q=loss.q, alpha=loss.alpha, beta=loss.beta, normalize=True)
        reference = ref.general_pair_weighting
    check_against_reference(loss, reference or tml_reference, z, y, kw, {"ref": r, "ref_labels": ry}, device=device)


def test_gpw_presets_are_the_paper_values():
    assert GeneralPairWeightingLoss().weighting == "exp"
    e = GeneralPairWeightingLoss("pair_e")
    assert (e.m1, e.m2, e.alpha, e.beta, e.normalize_weights) == (0.0, 0.8, 0.0, 2.0, True)
    p = GeneralPairWeightingLoss("pair_p")
    assert (p.p, p.q, p.weighting) == (0.0, 1.0, "power")
    tp, te = GeneralPairWeightingLoss("triplet_p"), GeneralPairWeightingLoss("triplet_e")
    assert (tp.form, tp.margin, tp.p) == ("triplet", 0.1, 5.0) and (te.alpha, te.weighting) == (40.0, "exp")
    assert set(GPW_PRESETS) == {"pair_p", "pair_e", "triplet_p", "triplet_e"}


def test_gpw_power_zero_normalised_is_mean_of_hinges():
    """SPEC 8: power weighting with p = q = 0 and normalisation equals the mean of the hinges per anchor."""
    z, y = _batch(3, 20, 8, 4)
    f = torch.nn.functional.normalize(z, dim=1)
    D = torch.cdist(f, f)
    loss = GeneralPairWeightingLoss("pair_p", p=0.0, q=0.0, m1=0.0, m2=0.8)(z.float(), y)
    total = 0.0
    for i in range(20):
        pos = [j for j in range(20) if j != i and y[j] == y[i]]
        neg = [k for k in range(20) if y[k] != y[i] and D[i, k] <= 0.8]
        if pos:
            total += sum(float(D[i, j]) for j in pos) / len(pos)
        if neg:
            total += sum(0.8 - float(D[i, k]) for k in neg) / len(neg)
    assert abs(float(loss) - total / 20) < 1e-5


def test_rll_zero_temperature_is_uniform_and_m_equal_alpha_pulls_every_positive():
    z, y = _batch(4, 18, 8, 3)
    zero_t = RankedListLoss(temperature=0.0)(z.float(), y)
    f = torch.nn.functional.normalize(z, dim=1)
    D = torch.cdist(f, f)
    total = 0.0
    for i in range(18):
        pos = [j for j in range(18) if j != i and y[j] == y[i] and D[i, j] > 0.8]
        neg = [k for k in range(18) if y[k] != y[i] and D[i, k] < 1.2]
        total += sum(float(D[i, j]) - 0.8 for j in pos) / max(len(pos), 1)
        total += sum(1.2 - float(D[i, k]) for k in neg) / max(len(neg), 1)
    assert abs(float(zero_t) - total / 18) < 1e-5
    no_mining = RankedListLoss(alpha=1.2, margin=1.2)
    pos = (y[:, None] == y[None, :]) & ~torch.eye(18, dtype=torch.bool)
    expected_lp = sum(float(D[i][pos[i]].mean()) for i in range(18) if pos[i].any()) / 18
    neg_only = RankedListLoss(alpha=1.2, margin=1.2, lam=0.0)(z.float(), y)
    assert abs(float(neg_only) - expected_lp) < 1e-5
    assert torch.isfinite(no_mining(z.float(), y))


def test_tml_without_slack_and_variance_is_eq7():
    """SPEC 8: TML with beta = 0 and lambda = 0 reduces to the scaled cosine tuplet loss (TML Eq. 7)."""
    z, y = _batch(5, 16, 8, 4)
    f = torch.nn.functional.normalize(z, dim=1)
    S = f @ f.T
    value = TupletMarginLoss(slack=0.0, variance_weight=0.0, negatives="all", scale=8.0)(z.float(), y)
    terms = []
    for a in range(16):
        for p in range(16):
            if p != a and y[p] == y[a]:
                negs = [n for n in range(16) if y[n] != y[a]]
                terms.append(torch.log1p(sum(torch.exp(8.0 * (S[a, n] - S[a, p])) for n in negs)))
    assert abs(float(value) - float(sum(terms) / len(terms))) < 1e-4


def test_tml_random_negatives_pick_one_per_other_class():
    from lightning_dml.losses.tuplet_margin import _one_negative_per_class

    labels = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3])
    candidates = labels[None, :].repeat(5, 1) != 0
    chosen = _one_negative_per_class(candidates, labels, torch.Generator().manual_seed(0))
    for row in chosen:
        picked = labels[row]
        assert sorted(picked.tolist()) == [1, 2, 3]
    loss = TupletMarginLoss(seed=3)
    z = torch.randn(8, 4)
    a, b = loss(z, labels), TupletMarginLoss(seed=3)(z, labels)
    assert torch.equal(a, b) and torch.isfinite(a)


def test_tml_positive_pairs_at_angle_zero_and_pi_have_a_finite_gradient():
    """Exact duplicates (cosine 1) and opposites (cosine -1) among the positive pairs: TML clamps the cosine to
    ``[-1 + 1e-7, 1 - 1e-7]`` before ``acos`` (whose derivative is infinite at +-1), so value and gradient are the
    loop reference's, finite."""
    e = torch.eye(4, dtype=torch.float64)
    z = torch.stack([e[0], e[0], -e[0], e[1], e[1] + 0.5 * e[2], e[2], e[3], -e[2]])
    y = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2])
    for kw in ({"negatives": "all"}, {"negatives": "all", "slack": 0.0, "variance_weight": 0.0}):
        zz = z.clone().requires_grad_(True)
        value = TupletMarginLoss(**kw)(zz, y)
        (grad,) = torch.autograd.grad(value, zz)
        zr = z.clone().requires_grad_(True)
        expected = ref.tuplet_margin_all_negatives(zr, y, **{k: v for k, v in kw.items() if k != "negatives"})
        (grad_ref,) = torch.autograd.grad(expected, zr)
        assert torch.isfinite(value) and torch.isfinite(grad).all()
        torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grad, grad_ref, rtol=1e-5, atol=1e-7)


def test_tml_random_negatives_keep_one_candidate_of_every_class_that_has_one():
    """Candidates that leave out part of a class (an anchor's own class, or masked columns): every class with a
    candidate keeps exactly one of its candidates and a class without one keeps none, over many draws."""
    from lightning_dml.losses.tuplet_margin import _one_negative_per_class

    labels = torch.tensor([0, 0, 1, 1, 1, 2, 2, 3, 3])
    candidates = torch.tensor([
        [False, False, True, False, True, True, True, False, False],  # class 1 partly, class 2 wholly, not 3
        [True, False, False, True, False, False, True, True, True],
        [False, True, True, True, True, False, False, False, True],
    ])
    generator = torch.Generator().manual_seed(0)
    for _ in range(50):
        chosen = _one_negative_per_class(candidates, labels, generator)
        assert not (chosen & ~candidates).any()
        for row in range(3):
            for c in range(4):
                wanted = int(bool((candidates[row] & (labels == c)).any()))
                assert int((chosen[row] & (labels == c)).sum()) == wanted


def test_tml_seeded_draws_move_on_from_call_to_call():
    """``seed``: two losses with one seed draw the same negatives; one loss's generator moves on between calls."""
    torch.manual_seed(0)
    z, y = torch.randn(24, 6), torch.arange(24) % 6
    a, b = TupletMarginLoss(seed=3), TupletMarginLoss(seed=3)
    first = a(z, y)
    assert torch.equal(first, b(z, y))
    assert not torch.equal(a(z, y), first)
