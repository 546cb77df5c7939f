"""What random batches cannot see: trained-like batches, exact ties at the margins, and the papers' defaults.

Random Gaussian embeddings have cosines around 0 with a spread of ``1/sqrt(D)``: far from lambda = 0.5 (MS,
binomial deviance) and from the distance margins (contrastive 0.8, triplet 0.1), so a wrong mining boundary or
a wrong default moves only pairs whose weights are ~exp(-25) and no comparison notices. Here

* **trained-like** batches put the positive and negative similarities where a trained network has them: clusters
  with positives around 0.7 / 0.85 and negatives around 0.45 / 0.68, i.e. at lambda, at the mining margins of MS
  (Eqs. 11-12) and at the contrastive / GPW thresholds; every loss with a closed-form backward is compared on them
  (both paths, values and gradients) with its loop reference written from the paper;
* **exact ties**: unit vectors with entries +-0.5 have cosines in {-1, -0.5, 0, 0.5, 1} and distances 0, 1, 2
  exactly (in fp32 and fp64), so a triplet sits exactly at the margin (``D_ij + m = D_ik``), which GPW Eq. 19
  keeps (``>=``);
* **defaults**: every loss built without arguments against its reference with the papers' numbers written out,
  on batches where changing any one of those numbers changes the value.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dml.losses import GeneralPairWeightingLoss, MultiSimilarityLoss, build_loss
from lightning_dml.miners import label_masks, triplet_margin_mining, triplet_margin_pair_mining
from tests import reference_losses as ref
from tests.test_losses_reference import CASES, GPW_CASES, check_against_reference, tml_reference


def trained_like_batch(
    seed: int, pos_cos: float, neg_cos: float, classes: int = 5, per_class: int = 4, dim: int = 32
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 clusters whose same-class cosines are about ``pos_cos`` and other-class cosines about ``neg_cos``.

    Class centres share a common direction (centre cosines ``neg_cos / pos_cos``); each item is
    ``sqrt(pos_cos) centre + sqrt(1 - pos_cos) noise`` with unit noise, nearly orthogonal in ``dim`` dimensions, so
    the cosines scatter by about ``0.1`` around their targets. Rows are shuffled (no block structure to rely on).
    """
    g = torch.Generator().manual_seed(seed)

    def unit(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.normalize(x, dim=-1)

    common = unit(torch.randn(dim, generator=g, dtype=torch.float64))
    rho = neg_cos / pos_cos
    own = unit(torch.randn(classes, dim, generator=g, dtype=torch.float64))
    centres = unit(math.sqrt(rho) * common + math.sqrt(1.0 - rho) * own)
    labels = torch.arange(classes).repeat_interleave(per_class)
    noise = unit(torch.randn(classes * per_class, dim, generator=g, dtype=torch.float64))
    z = math.sqrt(pos_cos) * centres[labels] + math.sqrt(1.0 - pos_cos) * noise
    order = torch.randperm(labels.numel(), generator=g)
    return 3.0 * z[order], labels[order]  # not unit length: the losses normalise


#: (seed, positive cosine, negative cosine): at MS/binomial lambda = 0.5 and at the contrastive / GPW m2 = 0.8
#: (D = 0.8 <=> cosine 0.68); the third has positives inside D = 0.3 (cosine 0.955) for the positive thresholds
TRAINED_LIKE = {"at_lambda": (0, 0.7, 0.45), "at_m2": (1, 0.85, 0.68), "tight": (2, 0.96, 0.8)}
#: the loop references are slow: the third batch of the broad sweeps runs with the slow tests
BATCHES = ["at_lambda", "at_m2", pytest.param("tight", marks=pytest.mark.slow)]


def _similarities(z: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    f = torch.nn.functional.normalize(z, dim=1)
    pos, neg = label_masks(y)
    return f @ f.T, pos, neg


def test_trained_like_batches_sit_at_the_margins():
    """The batches are what they claim: MS mining (eps = 0.1) keeps negatives that the flipped rule
    (``min_pos + eps``) would drop, and both similarity populations straddle lambda and the thresholds."""
    sim, pos, neg = _similarities(*trained_like_batch(*TRAINED_LIKE["at_lambda"]))
    hard_pos = sim.masked_fill(~pos, math.inf).amin(1, keepdim=True)
    between = neg & (sim > hard_pos - 0.1) & (sim <= hard_pos + 0.1)
    assert int(between.sum()) >= 10
    assert ((sim[neg] - 0.5).abs() < 0.1).float().mean() > 0.3  # many negatives within 0.1 of lambda
    sim, pos, neg = _similarities(*trained_like_batch(*TRAINED_LIKE["at_m2"]))
    dist = torch.sqrt(2.0 - 2.0 * sim.clamp(max=1.0))
    assert ((dist[neg] - 0.8).abs() < 0.1).float().mean() > 0.3  # negatives at the contrastive margin


MS_CASES = [
    {}, {"mining": False}, {"plus_one": False}, {"on_empty": "skip"}, {"weighting": False},
    {"alpha": 2.0, "beta": 40.0, "lam": 0.6, "eps": 0.05},
]


@pytest.mark.parametrize("batch", sorted(TRAINED_LIKE))
@pytest.mark.parametrize("kw", MS_CASES, ids=str)
def test_multi_similarity_on_trained_like_batches(kw, batch, device):
    z, y = trained_like_batch(*TRAINED_LIKE[batch])
    check_against_reference(MultiSimilarityLoss(**kw), ref.multi_similarity, z, y, kw, device=device)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("cls,kw,reference", CASES, ids=lambda v: getattr(v, "__name__", str(v)))
def test_losses_on_trained_like_batches(cls, kw, reference, batch, device):
    z, y = trained_like_batch(*TRAINED_LIKE[batch])
    check_against_reference(cls(**kw), reference or tml_reference, z, y, kw, device=device)


def _gpw_reference_kw(loss: GeneralPairWeightingLoss) -> dict:
    return dict(form=loss.form, mining=loss.mining, weighting=loss.weighting, m1=loss.m1, m2=loss.m2,
                margin=loss.margin, p=loss.p, q=loss.q, alpha=loss.alpha, beta=loss.beta, eps=loss.eps,
                normalize=loss.normalize_weights)


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("kw", GPW_CASES, ids=str)
def test_gpw_on_trained_like_batches(kw, batch, device):
    z, y = trained_like_batch(*TRAINED_LIKE[batch])
    loss = GeneralPairWeightingLoss(**kw)
    check_against_reference(loss, ref.general_pair_weighting, z, y, _gpw_reference_kw(loss), device=device)


# ------------------------------------------------------------------------------------------------ exact ties
def tie_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Four unit vectors with entries +-0.5 (exact in every float type) and two classes.

    Anchor 0 = (+,+,+,+): positive 1 = (+,+,+,-) at cosine 0.5 (D = 1 exactly), negative 2 = -anchor at
    cosine -1 (D = 2 exactly), negative 3 = (-,-,-,+) at cosine -0.5 (D = sqrt 3). With margin m = 1 the triplet
    (0, 1, 2) is exactly at the margin: ``D_01 + m = D_02``; so are (1, 0, 3), (2, 3, 0) and (3, 2, 1).
    """
    z = 0.5 * torch.tensor([[1, 1, 1, 1], [1, 1, 1, -1], [-1, -1, -1, -1], [-1, -1, -1, 1]], dtype=torch.float64)
    return z, torch.tensor([0, 0, 1, 1])


def test_tie_batch_distances_are_exact():
    z, y = tie_batch()
    sim, _, _ = _similarities(z.float(), y)
    dist = torch.sqrt(2.0 - 2.0 * sim)
    assert dist[0, 1] == 1.0 and dist[0, 2] == 2.0 and dist[0, 1] + 1.0 == dist[0, 2]


def test_triplet_margin_mining_keeps_a_triplet_exactly_at_the_margin():
    """GPW Eq. 19 keeps (i, j, k) when ``D_ij + m >= D_ik``: the tie (0, 1, 2) is kept, as are the pairs in it."""
    z, y = tie_batch()
    for dtype in (torch.float32, torch.float64):
        sim, pos, neg = _similarities(z.to(dtype), y)
        dist = torch.sqrt(torch.clamp(2.0 - 2.0 * sim, min=1e-12))
        index, valid, keep = triplet_margin_mining(dist, pos, neg, margin=1.0)
        assert index[0, 0] == 1 and valid[0, 0]
        assert keep[0, 0].tolist() == [False, False, True, True]  # negative 2 at the margin, 3 inside it
        assert int(keep.sum()) == 8  # every anchor: its one positive with both negatives
        kp, kn = triplet_margin_pair_mining(dist, pos, neg, margin=1.0)
        assert kn[0, 2] and kp[0, 1]


TIE_LOSSES = [
    {"preset": "custom", "form": "triplet", "mining": "margin", "margin": 1.0},  # constant weights, normalised
    {"preset": "triplet_p", "p": 0.0, "margin": 1.0},
    {"preset": "triplet_e", "alpha": 1.0, "margin": 1.0},
    {"preset": "pair_p", "mining": "triplet_margin", "margin": 1.0, "m2": 2.0, "p": 0.0, "q": 0.0},
]


@pytest.mark.parametrize("kw", TIE_LOSSES, ids=str)
def test_gpw_keeps_the_tied_triplet_like_the_paper(kw, device):
    """With normalised weights the kept tie (hinge 0, weight > 0) halves the weight of the live triplet of its
    anchor: dropping it (``>`` instead of ``>=``) changes the value and the gradient."""
    z, y = tie_batch()
    loss = GeneralPairWeightingLoss(**kw)
    check_against_reference(loss, ref.general_pair_weighting, z, y, _gpw_reference_kw(loss), device=device)
    if loss.form == "triplet":
        # per anchor: triplets (tie: hinge 0) and (inside: hinge 2 - sqrt 3), each weight 1/2 for p = 0
        inside = 2.0 - math.sqrt(3.0)
        if loss.weighting != "exp":
            assert loss(z, y).item() == pytest.approx(inside / 2.0, rel=1e-12)


# -------------------------------------------------------------------------------------------- the defaults
#: (registry name, the only arguments given, loop reference, the papers' numbers written out, source): the
#: losses are built by name as the CLI builds them
DEFAULTS = [
    ("multi_similarity", {}, ref.multi_similarity, dict(alpha=2.0, beta=50.0, lam=0.5, eps=0.1),
     "MS paper Sec. 5: alpha = 2, beta = 50, eps = 0.1; lambda = 0.5 from the released code (SPEC 9.1)"),
    ("contrastive", {}, ref.contrastive, dict(pos_margin=0.0, neg_margin=0.8), "GPW baseline: m1 = 0, m2 = 0.8"),
    ("triplet", {}, ref.triplet, dict(margin=0.1), "GPW baseline triplet: m = 0.1, all triplets"),
    ("lifted_structure", {}, ref.lifted_structure, dict(margin=1.0), "Lifted structure paper: alpha = 1"),
    ("binomial_deviance", {}, ref.binomial_deviance, dict(alpha=2.0, beta=50.0, lam=0.5),
     "MS paper's review of binomial deviance: alpha = 2, beta = 50, lambda = 0.5"),
    ("ranked_list", {}, ref.ranked_list, dict(alpha=1.2, margin=0.4, temperature=10.0, lam=1.0),
     "RLL paper: alpha = 1.2, m = 0.4, T = 10, lambda = 1"),
    ("tuplet_margin", {"negatives": "all"}, ref.tuplet_margin_all_negatives,
     dict(scale=64.0, slack=0.1, variance_weight=0.5, variance_eps=0.01),
     "TML paper: s = 64, beta = 0.1 rad; intra-pair variance eps = 0.01, weight 0.5"),
    ("npair", {}, ref.npair, dict(l2_reg=0.005),
     "N-pair-mc (Eq. 7); l2 weight 0.005: the common re-implementation value (SPEC 9.1)"),
    ("general_pair_weighting", {}, ref.general_pair_weighting,
     dict(form="pair", mining="threshold", weighting="exp", m1=0.0, m2=0.8, alpha=0.0, beta=2.0, normalize=True),
     "GPW Tables IV/V pair-e: m1 = 0, m2 = 0.8, alpha = 0, beta = 2, normalised"),
    ("general_pair_weighting", {"mining": "ms"}, ref.general_pair_weighting,
     dict(form="pair", mining="ms", weighting="exp", m1=0.0, m2=0.8, alpha=0.0, beta=2.0, eps=0.1, normalize=True),
     "GPW Eqs. 22-23 (MS mining on distances): eps = 0.1"),
    ("general_pair_weighting", {"preset": "pair_p"}, ref.general_pair_weighting,
     dict(form="pair", mining="threshold", weighting="power", m1=0.0, m2=0.8, p=0.0, q=1.0, normalize=True),
     "GPW pair-p: p = 0, q = 1"),
    ("general_pair_weighting", {"preset": "triplet_p"}, ref.general_pair_weighting,
     dict(form="triplet", mining="margin", weighting="power", margin=0.1, p=5.0, normalize=True),
     "GPW triplet-p: m = 0.1, p = 5"),
    ("general_pair_weighting", {"preset": "triplet_e"}, ref.general_pair_weighting,
     dict(form="triplet", mining="margin", weighting="exp", margin=0.1, alpha=40.0, normalize=True),
     "GPW triplet-e: m = 0.1, alpha = 40"),
]
_IDS = [source.split(":")[0] for *_, source in DEFAULTS]


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [trained_like_batch(*args) for args in TRAINED_LIKE.values()]


@pytest.mark.parametrize("name,given,reference,paper,source", DEFAULTS, ids=_IDS)
def test_defaults_are_the_papers_numbers(name, given, reference, paper, source):
    for z, y in _batches():
        value, expected = build_loss(name, **given)(z, y), reference(z, y, **paper)
        torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-12, msg=source)


@pytest.mark.parametrize("name,given,reference,paper,source", DEFAULTS, ids=_IDS)
def test_every_default_matters_on_these_batches(name, given, reference, paper, source):
    """The comparison above can fail: changing any one written-out number (x 1.25, or 0 -> 0.3) changes the
    reference value on at least one of the batches by far more than its tolerance."""
    values = [build_loss(name, **given)(z, y) for z, y in _batches()]
    for key, number in paper.items():
        if isinstance(number, bool) or not isinstance(number, float):
            continue
        changed = {**paper, key: number * 1.25 if number else 0.3}
        moved = max(abs(float(reference(z, y, **changed)) - float(v)) for (z, y), v in zip(_batches(), values))
        assert moved > 1e-6, f"{source}: {key} = {number} is not tested by these batches"
