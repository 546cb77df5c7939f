"""Pair weights = gradients (GPW claim), degenerate batches, bf16 / autocast, bad input, registry, memory."""

import math

import pytest
import torch

from lightning_dml.losses import (
    LOSSES,
    BinomialDevianceLoss,
    ContrastiveLoss,
    CrossBatchMemory,
    GeneralPairWeightingLoss,
    LiftedStructureLoss,
    MultiSimilarityLoss,
    NPairLoss,
    RankedListLoss,
    TripletLoss,
    TupletMarginLoss,
    build_loss,
    gather_from_other_ranks,
)
from tests import reference_losses as ref


def _masks(y):
    same = y[:, None] == y[None, :]
    return same & ~torch.eye(len(y), dtype=torch.bool), ~same


def _sim(seed=0, b=20, d=8, classes=4):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, d, generator=g, dtype=torch.float64)
    y = torch.arange(b) % classes
    f = torch.nn.functional.normalize(z, dim=1)
    return (f @ f.T).clamp(-1, 1), y


# ------------------------------------------------------------------------------- GPW: weights are the gradient
def test_binomial_gradient_is_ms_eq10_weights():
    sim, y = _sim()
    pos, neg = _masks(y)
    s = sim.clone().requires_grad_(True)
    a, b, lam, B = 2.0, 50.0, 0.5, len(y)
    (grad,) = torch.autograd.grad(BinomialDevianceLoss().pair_loss(s, pos, neg), s)
    expected = torch.zeros_like(sim)
    for i in range(B):
        P, N = pos[i].nonzero().flatten(), neg[i].nonzero().flatten()
        for j in P:  # Eq. 10, w+ enters with a minus sign (pull)
            expected[i, j] = -a * torch.sigmoid(a * (lam - sim[i, j])) / len(P) / B
        for j in N:
            expected[i, j] = b * torch.sigmoid(b * (sim[i, j] - lam)) / len(N) / B
    torch.testing.assert_close(grad, expected)


@pytest.mark.parametrize("preset", ["pair_p", "pair_e", "triplet_p", "triplet_e"])
def test_gpw_gradient_wrt_distance_is_the_normalised_weights(preset):
    """GPW Eq. 4: dL/dD_ij = w_ij (held constant) on mined pairs; computed here from Eqs. 16-34 directly."""
    sim, y = _sim(1, 16, 8, 4)
    pos, neg = _masks(y)
    loss = GeneralPairWeightingLoss(preset)
    D = torch.sqrt((2 - 2 * sim).clamp(min=1e-12)).requires_grad_(True)
    value = loss._pair_form(D, pos, neg) if loss.form == "pair" else loss._triplet_form(D, pos, neg)
    (grad,) = torch.autograd.grad(value, D)
    Dd, B = D.detach(), len(y)
    expected = torch.zeros_like(Dd)
    for i in range(B):
        if loss.form == "pair":
            P = [j for j in range(B) if pos[i, j] and Dd[i, j] >= loss.m1]
            N = [k for k in range(B) if neg[i, k] and Dd[i, k] <= loss.m2]
            if loss.weighting == "power":
                wp = {j: float(Dd[i, j] - loss.m1) ** loss.p for j in P}
                wn = {k: float(loss.m2 - Dd[i, k]) ** loss.q for k in N}
            else:
                wp = {j: math.exp(loss.alpha * float(Dd[i, j] - loss.m1)) for j in P}
                wn = {k: math.exp(loss.beta * float(loss.m2 - Dd[i, k])) for k in N}
            for j in P:
                expected[i, j] += wp[j] / sum(wp.values()) / B * (float(Dd[i, j]) > loss.m1)
            for k in N:
                expected[i, k] -= wn[k] / sum(wn.values()) / B * (float(Dd[i, k]) < loss.m2)
        else:
            T = {(j, k): float(Dd[i, j] - Dd[i, k]) + loss.margin for j in range(B) for k in range(B)
                 if pos[i, j] and neg[i, k] and float(Dd[i, j] - Dd[i, k]) + loss.margin >= 0}
            w = {t: (v ** loss.p if loss.weighting == "power" else math.exp(loss.alpha * v)) for t, v in T.items()}
            s = sum(w.values())
            for (j, k), v in w.items():  # a triplet gives the same weight to its positive and negative pair
                expected[i, j] += v / s / B
                expected[i, k] -= v / s / B
    torch.testing.assert_close(grad, expected, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize(
    "loss",
    [MultiSimilarityLoss(), MultiSimilarityLoss(weighting=False), MultiSimilarityLoss(plus_one=False),
     ContrastiveLoss(), ContrastiveLoss(squared=True, squared_hinge=True), TripletLoss(),
     TripletLoss(mining="batch_hard", squared=True),
     # margins and reductions other than the defaults (the defaults hide a dropped margin or count)
     ContrastiveLoss(pos_margin=0.3, neg_margin=1.1), ContrastiveLoss(pos_margin=0.2, reduction="mean"),
     ContrastiveLoss(pos_margin=0.2, squared=True, reduction="sum"), TripletLoss(reduction="mean"),
     TripletLoss(margin=0.3, reduction="sum"), TripletLoss(mining="batch_hard", reduction="mean"),
     MultiSimilarityLoss(on_empty="skip", lam=0.8)],
    ids=repr,
)
def test_closed_form_weights_equal_autograd_wrt_similarity(loss):
    """The custom backward's W is dL/dS: compare it with autograd through the plain composition."""
    sim, y = _sim(2, 24, 8, 6)
    pos, neg = _masks(y)
    s = sim.clone().requires_grad_(True)
    (expected,) = torch.autograd.grad(loss.pair_loss(s, pos, neg), s)
    value, weights = loss.pair_loss_and_grad(sim, pos, neg)
    torch.testing.assert_close(value, loss.pair_loss(sim, pos, neg))
    torch.testing.assert_close(weights, expected)


def test_contrastive_pair_weights_are_constant_on_mined_pairs():
    """GPW Eq. 11: every mined pair has weight 1 (times 1/count of the reduction) w.r.t. D."""
    sim, y = _sim(3, 20, 8, 4)
    pos, neg = _masks(y)
    D = torch.sqrt((2 - 2 * sim).clamp(min=1e-12))
    loss = ContrastiveLoss(reduction="sum")
    _, w_sim = loss.pair_loss_and_grad(sim, pos, neg)
    w_dist = w_sim * (-D)  # dL/dD = dL/dS * dS/dD, dS/dD = -D
    expected = pos.double() - (neg & (D < 0.8)).double()
    torch.testing.assert_close(w_dist, expected)


# --------------------------------------------------------------------------------------- degenerate batches
def _all_losses():
    return [
        MultiSimilarityLoss(), MultiSimilarityLoss(on_empty="skip"), MultiSimilarityLoss(mining=False),
        MultiSimilarityLoss(plus_one=False), MultiSimilarityLoss(weighting=False),
        ContrastiveLoss(), ContrastiveLoss(squared=True), TripletLoss(), TripletLoss(mining="batch_hard"),
        LiftedStructureLoss(), LiftedStructureLoss(variant="gpw"), LiftedStructureLoss(variant="generalized"),
        LiftedStructureLoss(variant="star"), BinomialDevianceLoss(), NPairLoss(), NPairLoss(variant="ovo"),
        RankedListLoss(), TupletMarginLoss(), TupletMarginLoss(negatives="all"),
        GeneralPairWeightingLoss("pair_p"), GeneralPairWeightingLoss("pair_e"),
        GeneralPairWeightingLoss("triplet_p"), GeneralPairWeightingLoss("triplet_e", alpha=60.0),
        GeneralPairWeightingLoss("triplet_p", mining="batch_hard"), GeneralPairWeightingLoss("pair_e", mining="ms"),
    ]


def _finite(loss, z, y):
    z = z.clone().requires_grad_(True)
    for closed_form in (True, False):
        loss.closed_form = closed_form
        value = loss(z, y)
        (g,) = torch.autograd.grad(value, z, allow_unused=True)
        assert torch.isfinite(value), (loss, value)
        assert g is None or torch.isfinite(g).all(), loss
    return value


DEGENERATE = {
    "one_sample_classes": (torch.randn(6, 8), torch.tensor([0, 1, 2, 3, 4, 5])),
    "one_class": (torch.randn(6, 8), torch.zeros(6, dtype=torch.long)),
    "singleton_plus_pairs": (torch.randn(7, 8), torch.tensor([0, 0, 1, 1, 2, 2, 3])),
    "duplicates": (torch.randn(3, 8).repeat(4, 1), torch.tensor([0, 1, 2] * 4)),
    "duplicates_across_classes": (torch.randn(1, 8).repeat(6, 1), torch.tensor([0, 0, 1, 1, 2, 2])),
    "single_item": (torch.randn(1, 8), torch.tensor([3])),
    "large_norm": (1e4 * torch.randn(8, 8), torch.arange(8) % 2),
    "zero_vectors": (torch.zeros(4, 8), torch.tensor([0, 0, 1, 1])),
}


@pytest.mark.parametrize("case", sorted(DEGENERATE))
def test_degenerate_batches_give_finite_loss_and_gradients(case):
    z, y = DEGENERATE[case]
    for loss in _all_losses():
        if case == "large_norm" and isinstance(loss, NPairLoss):
            continue  # raw inner products of norm-1e4 vectors: finite, but N-pair is scale dependent by design
        _finite(loss, z, y)


@pytest.mark.parametrize("scale_case", ["ms_beta50", "tml_s64", "gpw_alpha60", "rll_T50"])
def test_very_large_scales_are_finite_and_exact(scale_case):
    torch.manual_seed(1)
    z, y = torch.randn(16, 8, dtype=torch.float64), torch.arange(16) % 4
    z[1] = z[0] + 1e-9  # a near-duplicate positive pair: S ~ 1
    if scale_case == "ms_beta50":
        loss, expected = MultiSimilarityLoss(beta=50.0, mining=False), ref.multi_similarity(z, y, mining=False)
    elif scale_case == "tml_s64":
        loss = TupletMarginLoss(scale=64.0, negatives="all")
        expected = ref.tuplet_margin_all_negatives(z, y)
    elif scale_case == "gpw_alpha60":
        loss = GeneralPairWeightingLoss("triplet_e", alpha=60.0, margin=0.5)
        expected = ref.general_pair_weighting(z, y, form="triplet", mining="margin", weighting="exp", margin=0.5,
                                              alpha=60.0)
    else:
        loss, expected = RankedListLoss(temperature=50.0), ref.ranked_list(z, y, temperature=50.0)
    value = _finite(loss, z.float(), y)
    assert abs(value.detach().item() - expected.item()) <= 1e-4 * max(1.0, abs(expected.item()))


def test_documented_degenerate_values():
    z = torch.randn(6, 8)
    one_class = torch.zeros(6, dtype=torch.long)
    singletons = torch.arange(6)
    for loss in (MultiSimilarityLoss(), TripletLoss(), TripletLoss(mining="batch_hard"), RankedListLoss(alpha=1.2,
                 margin=1.2)):
        # one class: no negative -> MS mines nothing, no triplet, RLL with m = alpha keeps no positive beyond 0
        assert float(loss(z, one_class)) == 0.0 or isinstance(loss, RankedListLoss)
    assert float(MultiSimilarityLoss()(z, singletons)) == 0.0  # no positive -> no mined negative (Eq. 11)
    assert float(NPairLoss(l2_reg=0.0)(z, singletons)) == 0.0  # no pair
    assert float(LiftedStructureLoss()(z, singletons)) == 0.0  # no positive pair
    assert float(ContrastiveLoss()(torch.eye(6, 8), singletons)) == 0.0  # all negatives at D = sqrt(2) > 0.8
    # MS keeps the other term of an anchor with one empty mined set; "skip" drops the anchor
    z2, y2 = torch.randn(12, 8), torch.arange(12) % 3
    keep, skip = MultiSimilarityLoss()(z2, y2), MultiSimilarityLoss(on_empty="skip")(z2, y2)
    assert float(skip) <= float(keep) + 1e-7


# ----------------------------------------------------------------------------------- bf16 and autocast
#: the pair losses buildable without arguments (the proxy losses, which need num_classes, are tested in
#: tests/test_losses_proxy.py)
# vicreg pairs two views per label (its bf16 / autocast tests: tests/test_losses_pml_part3b.py)
PAIR_LOSSES = sorted(n for n, c in LOSSES.items()
                     if n not in ("cross_batch_memory", "vicreg") and not getattr(c, "needs_num_classes", False))


@pytest.mark.parametrize("name", PAIR_LOSSES)
def test_bfloat16_within_1e2_of_fp32(name):
    torch.manual_seed(0)
    z, y = torch.randn(32, 16), torch.arange(32) % 8
    kw = {"seed": 0} if name == "tuplet_margin" else {}
    expected = build_loss(name, **kw)(z, y)
    value = build_loss(name, **kw)(z.bfloat16(), y)
    assert value.dtype == torch.float32
    assert abs(float(value) - float(expected)) <= 1e-2 * max(1.0, abs(float(expected)))


@pytest.mark.parametrize("name", PAIR_LOSSES)
def test_autocast_returns_fp32_and_matches(name):
    """Under autocast the loss runs in fp32: equal to the fp32 loss of the same (bf16) embeddings, and within
    1e-2 of the loss of a full fp32 network. TML's scale s = 64 amplifies the bf16 rounding of the network output
    (cosines off by ~4e-3 -> logits off by ~0.25), so for it only the first check applies."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 16)
    x, y = torch.randn(32, 16), torch.arange(32) % 8
    kw = {"seed": 1} if name == "tuplet_margin" else {}
    full_fp32 = build_loss(name, **kw)(layer(x), y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        emb = layer(x)
        assert emb.dtype == torch.bfloat16
        value = build_loss(name, **kw)(emb, y)
    assert value.dtype == torch.float32
    same_input = build_loss(name, **kw)(emb.float(), y)
    torch.testing.assert_close(value, same_input)
    value.backward()
    assert torch.isfinite(layer.weight.grad).all()
    if name != "tuplet_margin":
        assert abs(float(value) - float(full_fp32)) <= 1e-2 * max(1.0, abs(float(full_fp32)))


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "args,match",
    [
        ((torch.randn(8), torch.zeros(8, dtype=torch.long)), "shape"),
        ((torch.randn(8, 4), torch.zeros(7, dtype=torch.long)), "7 entries"),
        ((torch.randn(8, 4), torch.zeros(8)), "integer"),
        ((torch.randn(8, 4).long(), torch.zeros(8, dtype=torch.long)), "floating"),
        ((torch.randn(0, 4), torch.zeros(0, dtype=torch.long)), "empty"),
        ((torch.randn(8, 4), torch.zeros(8, 1, 2, dtype=torch.long)), "shape"),  # [8, 1] is a label set (issue 20)
        ((torch.randn(8, 4), torch.zeros(8, dtype=torch.long, device="meta")), "device|on meta"),
    ],
)
def test_bad_shapes_dtypes_devices(args, match):
    with pytest.raises(ValueError, match=match):
        MultiSimilarityLoss()(*args)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_nan_inf_rejected(bad):
    z = torch.randn(8, 4)
    z[3, 1] = bad
    for loss in (MultiSimilarityLoss(), NPairLoss(), TupletMarginLoss()):
        with pytest.raises(ValueError, match="row 3"):
            loss(z, torch.arange(8) % 2)
    with pytest.raises(ValueError, match="ref_embeddings contain"):
        MultiSimilarityLoss()(torch.randn(4, 4), torch.arange(4), ref_embeddings=z, ref_labels=torch.arange(8))


def test_bad_reference_arguments():
    z, y = torch.randn(8, 4), torch.arange(8) % 2
    with pytest.raises(ValueError, match="together"):
        MultiSimilarityLoss()(z, y, ref_embeddings=z)
    with pytest.raises(ValueError, match="dim"):
        MultiSimilarityLoss()(z, y, ref_embeddings=torch.randn(3, 5), ref_labels=torch.arange(3))
    with pytest.raises(ValueError, match="dtype"):
        MultiSimilarityLoss()(z, y, ref_embeddings=torch.randn(3, 4).double(), ref_labels=torch.arange(3))
    with pytest.raises(ValueError, match="3 entries"):
        MultiSimilarityLoss()(z, y, ref_embeddings=torch.randn(4, 4), ref_labels=torch.arange(3))
    for loss in (NPairLoss(), LiftedStructureLoss(), LiftedStructureLoss(variant="gpw")):
        with pytest.raises(ValueError, match="ref_embeddings"):
            loss(z, y, ref_embeddings=z, ref_labels=y)


@pytest.mark.parametrize(
    "cls,kw",
    [
        (ContrastiveLoss, {"neg_margin": -1.0}), (ContrastiveLoss, {"reduction": "avg"}),
        (TripletLoss, {"mining": "semihard"}), (TripletLoss, {"margin": -0.1}),
        (LiftedStructureLoss, {"variant": "other"}), (BinomialDevianceLoss, {"alpha": 0.0}),
        (NPairLoss, {"variant": "nca"}), (NPairLoss, {"l2_reg": -1.0}), (RankedListLoss, {"margin": 2.0}),
        (RankedListLoss, {"temperature": -1.0}), (TupletMarginLoss, {"scale": 0.0}),
        (TupletMarginLoss, {"negatives": "hard"}), (GeneralPairWeightingLoss, {"preset": "pair_x"}),
        (GeneralPairWeightingLoss, {"m1": 1.0, "m2": 0.5}), (GeneralPairWeightingLoss, {"mining": "margin"}),
        (GeneralPairWeightingLoss, {"preset": "triplet_p", "mining": "ms"}),
        (GeneralPairWeightingLoss, {"weighting": "linear"}),
        (CrossBatchMemory, {"memory_size": 0}), (CrossBatchMemory, {"loss": "npair"}),
    ],
)
def test_impossible_hyperparameters_raise(cls, kw):
    with pytest.raises(ValueError):
        cls(**kw)


# ------------------------------------------------------------------------------------------------ registry
def test_registry_defaults_of_spec_9_1():
    assert {n for n, c in LOSSES.items() if not getattr(c, "needs_num_classes", False)} == {"contrastive", "triplet", "lifted_structure", "binomial_deviance", "npair",
                           "multi_similarity", "ranked_list", "tuplet_margin", "general_pair_weighting",
                           "cross_batch_memory", "circle", "supcon", "ntxent", "nca", "angular", "fastap",
                           "smooth_ap",
                           # issue 29 (part 3)
                           "decoupled_contrastive", "dynamic_soft_margin", "generalized_lifted_structure",
                           "histogram", "intra_pair_variance", "multi_supcon", "pnp",
                           "selectively_contrastive_triplet", "snr_contrastive", "threshold_consistent_margin",
                           "vicreg",
                           "hyp_vit",
                           "instance", "self_supervised",
                           "matryoshka"}  # issue 31
    r = build_loss("ranked_list")
    assert (r.alpha, r.margin, r.temperature, r.lam, r.detach_gallery) == (1.2, 0.4, 10.0, 1.0, True)
    t = build_loss("tuplet_margin")
    assert (t.scale, t.slack, t.variance_weight, t.variance_eps) == (64.0, 0.1, 0.5, 0.01)
    n = build_loss("npair")
    assert (n.l2_reg, n.symmetric, n.variant) == (0.005, False, "mc")
    c = build_loss("contrastive")
    assert (c.pos_margin, c.neg_margin, c.squared) == (0.0, 0.8, False)
    tr = build_loss("triplet")
    assert (tr.margin, tr.mining, tr.squared) == (0.1, "all", False)
    lf = build_loss("lifted_structure")
    assert (lf.margin, lf.variant, lf.alpha, lf.beta) == (1.0, "original", 2.0, 50.0)
    b = build_loss("binomial_deviance")
    assert (b.alpha, b.beta, b.lam) == (2.0, 50.0, 0.5)
    with pytest.raises(ValueError, match="valid names: angular, arcface, binomial_deviance, circle, contrastive"):
        build_loss("softmax")


def test_jsonargparse_builds_every_loss_from_class_path():
    jsonargparse = pytest.importorskip("jsonargparse")
    for cls in set(LOSSES.values()):
        parser = jsonargparse.ArgumentParser(exit_on_error=False)
        parser.add_argument("--loss", type=torch.nn.Module)
        cfg = parser.parse_object({"loss": {"class_path": f"lightning_dml.losses.{cls.__name__}", "init_args": {}}})
        loss = parser.instantiate_classes(cfg).loss
        assert type(loss) is cls


# -------------------------------------------------------------------------------------- cross-batch memory
def test_cross_batch_memory_scores_against_earlier_batches():
    torch.manual_seed(0)
    xbm = CrossBatchMemory(MultiSimilarityLoss(), embedding_size=8, memory_size=10)
    b1, y1 = torch.randn(6, 8), torch.arange(6) % 3
    b2, y2 = torch.randn(6, 8, dtype=torch.float64), torch.arange(6) % 2
    first = xbm(b1, y1)
    torch.testing.assert_close(first, MultiSimilarityLoss()(b1, y1))
    second = xbm(b2.float(), y2)
    expected = ref.multi_similarity(b2, y2, ref=b1.double(), ref_labels=y1)
    torch.testing.assert_close(second.double(), expected, rtol=1e-5, atol=1e-6)
    # ring buffer: 12 rows written into 10 slots, the newest 10 kept
    assert int(xbm.num_filled) == 10
    kept = set(map(tuple, xbm.memory_embeddings.tolist()))
    assert tuple(b2[-1].float().tolist()) in kept and tuple(b1[0].tolist()) not in kept
    xbm.eval()
    xbm(torch.randn(6, 8), y1)
    assert int(xbm.write_pointer) == 2  # eval does not enqueue
    xbm.reset()
    assert int(xbm.num_filled) == 0


def test_cross_batch_memory_warmup_and_gradient_only_through_batch():
    xbm = CrossBatchMemory("contrastive", embedding_size=4, memory_size=16, start_after=1)
    z1 = torch.randn(4, 4)
    y = torch.tensor([0, 0, 1, 1])
    torch.testing.assert_close(xbm(z1, y), ContrastiveLoss()(z1, y))
    z2 = torch.randn(4, 4, requires_grad=True)
    value = xbm(z2, y)
    torch.testing.assert_close(value, ContrastiveLoss()(z2, y, ref_embeddings=z1, ref_labels=y))
    value.backward()
    assert torch.isfinite(z2.grad).all() and not xbm.memory_embeddings.requires_grad


def test_gather_is_empty_without_distributed():
    z, y = torch.randn(5, 3), torch.arange(5)
    r, ry = gather_from_other_ranks(z, y)
    assert r.shape == (0, 3) and ry.shape == (0,)
    # an empty reference gallery changes nothing
    torch.testing.assert_close(MultiSimilarityLoss()(z, y % 2, ref_embeddings=r, ref_labels=ry),
                               MultiSimilarityLoss()(z, y % 2))


# ------------------------------------------------------------------------------- hyper-parameter range boundaries
#: (loss class, keyword arguments, accepted?): each documented range at its ends, just beyond, and half a unit on
#: either side of a bound (so that a bound moved by one, or a ``<`` turned ``<=``, is caught)
RANGE_CASES = [
    (BinomialDevianceLoss, {"alpha": 0.5}, True), (BinomialDevianceLoss, {"beta": 0.5}, True),
    (BinomialDevianceLoss, {"alpha": -0.5}, False), (BinomialDevianceLoss, {"beta": -0.5}, False),
    (BinomialDevianceLoss, {"beta": 0.0}, False),
    (ContrastiveLoss, {"pos_margin": 0.0, "neg_margin": 0.0}, True), (ContrastiveLoss, {"pos_margin": -0.5}, False),
    (ContrastiveLoss, {"neg_margin": -0.5}, False),
    (LiftedStructureLoss, {"alpha": 0.5, "beta": 0.5}, True), (LiftedStructureLoss, {"alpha": 0.0}, False),
    (LiftedStructureLoss, {"alpha": -0.5}, False), (LiftedStructureLoss, {"beta": 0.0}, False),
    (LiftedStructureLoss, {"beta": -0.5}, False),
    (RankedListLoss, {"alpha": 0.5, "margin": 0.0}, True), (RankedListLoss, {"alpha": 0.5, "margin": 0.5}, True),
    (RankedListLoss, {"alpha": 0.0, "margin": 0.0}, False), (RankedListLoss, {"alpha": -0.5, "margin": 0.0}, False),
    (RankedListLoss, {"margin": -0.5}, False), (RankedListLoss, {"alpha": 0.5, "margin": 0.6}, False),
    (RankedListLoss, {"temperature": 0.0, "lam": 0.0}, True), (RankedListLoss, {"temperature": -0.5}, False),
    (RankedListLoss, {"lam": -0.5}, False),
    (TripletLoss, {"margin": 0.0}, True), (TripletLoss, {"margin": -0.5}, False),
    (TupletMarginLoss, {"scale": 0.5, "slack": 0.0, "variance_weight": 0.0, "variance_eps": 0.0}, True),
    (TupletMarginLoss, {"scale": -0.5}, False), (TupletMarginLoss, {"slack": math.pi - 1e-6}, True),
    (TupletMarginLoss, {"slack": math.pi}, False), (TupletMarginLoss, {"slack": -0.5}, False),
    (TupletMarginLoss, {"variance_weight": -0.5}, False), (TupletMarginLoss, {"variance_eps": -0.5}, False),
    (NPairLoss, {"l2_reg": 0.0}, True), (NPairLoss, {"l2_reg": -0.5}, False),
    (GeneralPairWeightingLoss, {"m1": 0.0, "m2": 0.0}, True), (GeneralPairWeightingLoss, {"m1": 0.5, "m2": 0.5}, True),
    (GeneralPairWeightingLoss, {"m1": -0.5, "m2": 0.5}, False),
    (GeneralPairWeightingLoss, {"margin": 0.0, "p": 0.0, "q": 0.0, "eps": 0.0}, True),
    (GeneralPairWeightingLoss, {"margin": -0.5}, False), (GeneralPairWeightingLoss, {"p": -0.5}, False),
    (GeneralPairWeightingLoss, {"q": -0.5}, False), (GeneralPairWeightingLoss, {"eps": -0.5}, False),
    (CrossBatchMemory, {"embedding_size": 1, "memory_size": 1, "start_after": 0}, True),
    (CrossBatchMemory, {"embedding_size": 0}, False), (CrossBatchMemory, {"start_after": -1}, False),
]


@pytest.mark.parametrize("cls,kw,ok", RANGE_CASES, ids=[f"{c.__name__}-{kw}-{ok}" for c, kw, ok in RANGE_CASES])
def test_hyperparameter_ranges_at_their_bounds(cls, kw, ok):
    if ok:
        loss = cls(**kw)
        for name, value in kw.items():
            assert getattr(loss, name, value) == value
    else:
        with pytest.raises(ValueError):
            cls(**kw)


def test_cross_batch_memory_starts_after_the_given_number_of_training_calls():
    """``start_after=2``: the first two training calls score the batch alone, the third also against the memory
    (which then holds both earlier batches); a memory of a single row is used too."""
    torch.manual_seed(3)
    xbm = CrossBatchMemory("contrastive", embedding_size=4, memory_size=16, start_after=2)
    y = torch.tensor([0, 0, 1, 1])
    z1, z2, z3 = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    torch.testing.assert_close(xbm(z1, y), ContrastiveLoss()(z1, y))
    torch.testing.assert_close(xbm(z2, y), ContrastiveLoss()(z2, y))
    expected = ContrastiveLoss()(z3, y, ref_embeddings=torch.cat([z1, z2]), ref_labels=torch.cat([y, y]))
    torch.testing.assert_close(xbm(z3, y), expected)

    single = CrossBatchMemory("contrastive", embedding_size=4, memory_size=16)
    first = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    single(first, torch.tensor([0]))  # one row in the memory
    z, labels = torch.tensor([[0.9, 0.1, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0]]), torch.tensor([0, 1])
    torch.testing.assert_close(single(z, labels), ContrastiveLoss()(z, labels, first, torch.tensor([0])))


def test_losses_that_need_positive_pairs_are_rejected_on_batches_without_one():
    """``needs_positive_pairs`` as checks.py reads it: a batch of distinct labels is refused for the memory-wrapped
    loss too."""
    from lightning_dml.checks import check_training_batch

    for loss in (CrossBatchMemory("contrastive", embedding_size=4), ContrastiveLoss(), MultiSimilarityLoss()):
        with pytest.raises(ValueError, match="needs positive pairs"):
            check_training_batch(loss, torch.arange(6))
        check_training_batch(loss, torch.tensor([0, 0, 1, 2]))  # one positive pair is enough


# ------------------------------------------------------------------------------- cosines rounded beyond +-1
def _beyond_one_batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A row, its duplicate in the same class, its duplicate in another class and its opposite, whose normalised
    products round beyond +-1 (the clamps of ``similarity_matrix`` and the closed forms' masks decide these
    entries), and three other rows."""
    from lightning_dml.losses.base import normalize_embeddings

    g = torch.Generator().manual_seed(0)
    for _ in range(10_000):
        x = torch.randn(4, 8, generator=g, dtype=dtype)
        z = torch.cat([x[:1], x[:1], x[:1], -x[:1], x[1:]])
        u = normalize_embeddings(z)
        raw = u @ u.T
        if float(raw.max()) > 1.0 and float(raw.min()) < -1.0:
            return z, torch.tensor([0, 0, 1, 2, 1, 2, 0])
    raise AssertionError("no batch rounds beyond +-1")


def _pair_losses_with_both_paths():
    from lightning_dml.losses import AngularLoss, CircleLoss, FastAPLoss, MarginLoss, NCALoss, NTXentLoss
    from lightning_dml.losses import SmoothAPLoss, SupConLoss

    return _all_losses() + [
        ContrastiveLoss(squared=True, squared_hinge=True), ContrastiveLoss(pos_margin=0.3, neg_margin=1.1),
        ContrastiveLoss(pos_margin=0.2, reduction="mean", squared=True), ContrastiveLoss(reduction="sum"),
        ContrastiveLoss(neg_margin=0.0), TripletLoss(squared=True), TripletLoss(margin=0.0, reduction="mean"),
        TripletLoss(mining="batch_hard", squared=True, reduction="sum"), TupletMarginLoss(negatives="all"),
        TupletMarginLoss(negatives="all", slack=0.0, variance_weight=0.0), CircleLoss(), CircleLoss(m=0.4, gamma=80),
        SupConLoss(), NTXentLoss(), NCALoss(), NCALoss(4.0, "expected"), AngularLoss(), FastAPLoss(), SmoothAPLoss(),
        MarginLoss(class_margins=False, sampling="all"), MarginLoss(class_margins=False, sampling="all", nu=0.1),
        NPairLoss(variant="multi_positive"), NPairLoss(variant="multi_positive", l2_reg=0.0),
        MultiSimilarityLoss(plus_one=False, on_empty="skip"), MultiSimilarityLoss(lam=1.0, eps=0.0),
        LiftedStructureLoss(variant="generalized", alpha=10.0, beta=10.0), RankedListLoss(temperature=0.0),
        GeneralPairWeightingLoss("pair_p", normalize=False), GeneralPairWeightingLoss("triplet_p", normalize=False),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_closed_forms_equal_autograd_where_cosines_round_beyond_one(dtype):
    """Duplicates and opposites whose cosines round to just above 1 or below -1: every closed-form path gives the
    value and gradient of autograd through the clamps of the plain composition (zero gradient through a clamped
    entry, the derivative at the clamp's edge)."""
    z, y = _beyond_one_batch(dtype)
    for loss in _pair_losses_with_both_paths():
        results = []
        for closed_form in (True, False):
            loss.closed_form = closed_form
            torch.manual_seed(0)  # the same random draws (TupletMargin's negatives, Margin's sampling) on both paths
            zz = z.clone().requires_grad_(True)
            value = loss(zz, y)
            (grad,) = torch.autograd.grad(value, zz)
            results.append((value.detach(), grad))
        (v_closed, g_closed), (v_auto, g_auto) = results
        torch.testing.assert_close(v_closed, v_auto, rtol=1e-5, atol=1e-6, msg=lambda m, loss=loss: f"{loss}: {m}")
        torch.testing.assert_close(g_closed, g_auto, rtol=1e-4, atol=1e-6, msg=lambda m, loss=loss: f"{loss}: {m}")


def _degenerate(case: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The batches of ``DEGENERATE`` drawn from a fixed generator (that dict is drawn at import)."""
    g = torch.Generator().manual_seed(1)
    randn = lambda *shape: torch.randn(*shape, generator=g)  # noqa: E731
    return {
        "one_sample_classes": lambda: (randn(6, 8), torch.tensor([0, 1, 2, 3, 4, 5])),
        "one_class": lambda: (randn(6, 8), torch.zeros(6, dtype=torch.long)),
        "singleton_plus_pairs": lambda: (randn(7, 8), torch.tensor([0, 0, 1, 1, 2, 2, 3])),
        "duplicates": lambda: (randn(3, 8).repeat(4, 1), torch.tensor([0, 1, 2] * 4)),
        "duplicates_across_classes": lambda: (randn(1, 8).repeat(6, 1), torch.tensor([0, 0, 1, 1, 2, 2])),
        "single_item": lambda: (randn(1, 8), torch.tensor([3])),
        "large_norm": lambda: (1e4 * randn(8, 8), torch.arange(8) % 2),
        "zero_vectors": lambda: (torch.zeros(4, 8), torch.tensor([0, 0, 1, 1])),
    }[case]()


@pytest.mark.parametrize("case", sorted(DEGENERATE))
def test_closed_forms_equal_autograd_on_degenerate_batches(case):
    """Singletons, one class, duplicates, zero rows, large norms: the closed-form path and autograd through the
    plain composition give one value and one gradient (empty sets give exactly the documented 0 on both). A pair of
    duplicates sits at a distance of rounding size, where dD/dS = -1/D is ~1e4: the two paths' roundings of the
    same products then differ by up to ~1e-4 in the gradient, so duplicates are held to 1e-3 there."""
    z, y = _degenerate(case)
    grad_atol = 1e-3 if case.startswith("duplicates") else 1e-5
    for loss in _pair_losses_with_both_paths():
        if case == "large_norm" and isinstance(loss, NPairLoss) and loss.variant != "multi_positive":
            continue  # raw inner products of norm-1e4 vectors: scale dependent by design
        results = []
        for closed_form in (True, False):
            loss.closed_form = closed_form
            torch.manual_seed(0)
            zz = z.clone().requires_grad_(True)
            value = loss(zz, y)
            (grad,) = torch.autograd.grad(value, zz, allow_unused=True)
            results.append((value.detach(), torch.zeros_like(z) if grad is None else grad))
        (v_closed, g_closed), (v_auto, g_auto) = results
        torch.testing.assert_close(v_closed, v_auto, rtol=1e-5, atol=1e-6, msg=lambda m, loss=loss: f"{loss}: {m}")
        torch.testing.assert_close(g_closed, g_auto, rtol=1e-4, atol=grad_atol, msg=lambda m, loss=loss: f"{loss}: {m}")


def test_gpw_custom_preset_starts_from_constant_threshold_mining():
    """``preset="custom"`` (docstring): threshold mining with m1 = 0, m2 = 0.8 and constant weights; the power and
    exponential weightings given without their parameters (p = q = 0, alpha = beta = 0) are constant too."""
    custom = GeneralPairWeightingLoss("custom")
    assert (custom.form, custom.mining, custom.weighting, custom.m1, custom.m2) == ("pair", "threshold", "constant",
                                                                                   0.0, 0.8)
    assert (custom.margin, custom.eps, custom.normalize_weights) == (0.1, 0.1, True)
    torch.manual_seed(4)
    z, y = torch.randn(16, 8, dtype=torch.float64), torch.arange(16) % 4
    expected = custom(z, y)
    for weighting in ("power", "exp"):
        torch.testing.assert_close(GeneralPairWeightingLoss("custom", weighting=weighting)(z, y), expected)


def test_registry_refuses_a_second_class_under_a_taken_name_and_suggests_three_names():
    from lightning_dml.losses.registry import register_loss

    class Other(torch.nn.Module):
        pass

    with pytest.raises(ValueError, match="already registered to ContrastiveLoss"):
        register_loss("contrastive")(Other)
    assert LOSSES["contrastive"] is ContrastiveLoss
    assert register_loss("contrastive")(ContrastiveLoss) is ContrastiveLoss  # the same class again: no error
    with pytest.raises(ValueError, match=r"Did you mean 'cosface' or 'contrastive' or 'arcface'\?"):
        build_loss("contrface")  # four names are close (subcenter_arcface too): the three closest are given
