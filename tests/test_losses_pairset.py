"""Pair and set losses (issue 13): Circle, SupCon, NT-Xent, NCA, Angular, FastAP, Smooth-AP, Margin (with its
distance-weighted sampling) and N-pair's multi-positive variant.

Every loss is checked against a loop reference written from its paper's equation (tests/reference_pairset_losses.py,
float64, values and gradients) on random, trained-like (similarities at the margins) and exact-tie batches, with
and without reference embeddings; against pytorch-metric-learning 2.x where the definitions coincide (values and
gradients to 1e-5); its defaults against the papers' numbers written out; degenerate batches and bad input.

Documented differences from pml (each shown by a test below):
* ``SmoothAPLoss``: pml (like the authors' code) keeps the query in its own gallery and positive set; ours follows
  the paper (the query is not retrieved). pml equals our reference with ``include_query=True``.
* ``AngularLoss``: pml's ``alpha`` is in degrees, ours in radians; pml normalises the anchors and positives but
  not the negatives of ``f_{a,p,n}`` (ours: all unit vectors, as the paper), so the two agree on unit-norm input.
* ``CircleLoss``: pml's defaults are the paper's fine-grained retrieval values (m=0.4, gamma=80), ours the paper's
  face-recognition values (m=0.25, gamma=256) that the issue asks for; same formula.
* ``NTXentLoss``: pml's default temperature is 0.07, ours SimCLR's 0.1; same formula.
* ``NPairLoss(variant="multi_positive")`` (Eq. 9) equals pml's ``NCALoss`` with an unnormalised dot product.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dml.losses import (
    LOSSES,
    AngularLoss,
    CircleLoss,
    FastAPLoss,
    MarginLoss,
    NCALoss,
    NPairLoss,
    NTXentLoss,
    SmoothAPLoss,
    SupConLoss,
    build_loss,
)
from lightning_dml.losses.base import distance_from_similarity, normalize_embeddings, similarity_matrix
from lightning_dml.miners import distance_weighted_log_weights, distance_weighted_sampling
from tests import reference_pairset_losses as R

# ----------------------------------------------------------------------------------------------- batches


def random_batch(seed: int, b: int = 18, k: int = 3, d: int = 16, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    y = (torch.arange(b) // k)[torch.randperm(b, generator=g)]
    return torch.randn(b, d, generator=g, dtype=torch.float64).to(dtype), y


def trained_like_batch(seed: int, pos_cos: float, neg_cos: float, classes: int = 5, per_class: int = 4, d: int = 32):
    """Clusters whose same-class cosines are about ``pos_cos`` and other-class cosines about ``neg_cos`` (shuffled)."""
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(d, generator=g, dtype=torch.float64)
    u = u / u.norm()
    r = neg_cos / pos_cos
    centres = []
    for _ in range(classes):
        v = torch.randn(d, generator=g, dtype=torch.float64)
        v = v - (v @ u) * u
        centres.append(math.sqrt(r) * u + math.sqrt(1 - r) * v / v.norm())
    rows, labels = [], []
    for c, centre in enumerate(centres):
        for _ in range(per_class):
            noise = torch.randn(d, generator=g, dtype=torch.float64)
            rows.append(math.sqrt(pos_cos) * centre + math.sqrt(1 - pos_cos) * noise / noise.norm())
            labels.append(c)
    perm = torch.randperm(len(rows), generator=g)
    return torch.stack(rows)[perm], torch.tensor(labels)[perm]


def tie_batch(seed: int, b: int = 16, classes: int = 4):
    """Rows in {-0.5, 0.5}^4: cosines in {-1, -0.5, 0, 0.5, 1} exactly (ties, duplicates, squared distances 0..4)."""
    g = torch.Generator().manual_seed(seed)
    z = (torch.randint(0, 2, (b, 4), generator=g).double() - 0.5)
    return z, torch.randint(0, classes, (b,), generator=g)


BATCHES = {
    "random": lambda: random_batch(0),
    "random_k2": lambda: random_batch(1, b=16, k=2),
    "uneven": lambda: (random_batch(2, b=17, k=3)[0], torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4, 5, 5, 5, 6, 7])),
    "trained_margins": lambda: trained_like_batch(3, 0.75, 0.25),
    "trained_tight": lambda: trained_like_batch(4, 0.9, 0.6),
    "trained_far": lambda: trained_like_batch(5, 0.5, 0.05),
    "ties": lambda: tie_batch(6),
}

# (id, our loss, reference) - the reference takes (z, y, n_anchors=None)
CASES = [
    ("circle", lambda: CircleLoss(), lambda z, y, **kw: R.circle(z, y, **kw)),
    ("circle_retrieval", lambda: CircleLoss(m=0.4, gamma=80), lambda z, y, **kw: R.circle(z, y, m=0.4, gamma=80.0, **kw)),
    ("supcon", lambda: SupConLoss(), lambda z, y, **kw: R.supcon(z, y, **kw)),
    ("supcon_t07", lambda: SupConLoss(0.07), lambda z, y, **kw: R.supcon(z, y, temperature=0.07, **kw)),
    ("ntxent", lambda: NTXentLoss(), lambda z, y, **kw: R.ntxent(z, y, **kw)),
    ("ntxent_t05", lambda: NTXentLoss(0.5), lambda z, y, **kw: R.ntxent(z, y, temperature=0.5, **kw)),
    ("nca", lambda: NCALoss(), lambda z, y, **kw: R.nca(z, y, **kw)),
    ("nca_expected_s4", lambda: NCALoss(4.0, "expected"), lambda z, y, **kw: R.nca(z, y, 4.0, "expected", **kw)),
    ("angular", lambda: AngularLoss(), lambda z, y, **kw: R.angular(z, y, **kw)),
    ("angular_55", lambda: AngularLoss(math.radians(55)), lambda z, y, **kw: R.angular(z, y, math.radians(55), **kw)),
    ("fastap", lambda: FastAPLoss(), lambda z, y, **kw: R.fastap(z, y, **kw)),
    ("fastap_7", lambda: FastAPLoss(7), lambda z, y, **kw: R.fastap(z, y, 7, **kw)),
    ("smooth_ap", lambda: SmoothAPLoss(), lambda z, y, **kw: R.smooth_ap(z, y, **kw)),
    ("smooth_ap_t1", lambda: SmoothAPLoss(0.1), lambda z, y, **kw: R.smooth_ap(z, y, 0.1, **kw)),
]
CASE_IDS = [c[0] for c in CASES]


def _value_and_grad(fn, z, *args):
    z = z.clone().requires_grad_(True)
    value = fn(z, *args)
    (grad,) = torch.autograd.grad(value, z)
    return value.detach(), grad


def _assert_matches(ours, ref, z, y, rtol=1e-7, atol=1e-9):
    v, g = _value_and_grad(ours, z, y)
    v_ref, g_ref = _value_and_grad(ref, z, y)
    torch.testing.assert_close(v, v_ref, rtol=rtol, atol=atol)
    torch.testing.assert_close(g, g_ref, rtol=rtol, atol=atol)
    return v


# ----------------------------------------------------------------------------------------------- references


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_against_paper_reference(case, batch):
    name, make, ref = case
    z, y = BATCHES[batch]()
    if name.startswith("fastap") and batch == "ties":
        # squared distances 0..4 fall on the kernel's kinks (bin centres): only the value is defined there
        torch.testing.assert_close(make()(z, y), ref(z, y), rtol=1e-7, atol=1e-9)
        return
    _assert_matches(make(), ref, z, y)


@pytest.mark.parametrize("batch", ["random", "trained_margins"])
@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_reference_embeddings(case, batch):
    """The first 7 rows are anchors, the rest references: every anchor is scored against the batch and the
    references (the gradient reaches both)."""
    _, make, ref = case
    z, y = BATCHES[batch]()
    loss = make()
    assert loss.supports_ref
    k = 7
    _assert_matches(lambda e, l: loss(e[:k], l[:k], e[k:], l[k:]), lambda e, l: ref(e, l, n_anchors=k), z, y)


def test_trained_like_batches_are_at_the_margins():
    """The trained-like batches do put the similarities where the losses' margins are (else they prove nothing)."""
    for name, lo_p, hi_n in (("trained_margins", 0.6, 0.4), ("trained_tight", 0.8, 0.7), ("trained_far", 0.35, 0.2)):
        z, y = BATCHES[name]()
        s = similarity_matrix(normalize_embeddings(z), normalize_embeddings(z))
        same = (y[:, None] == y[None, :]) & ~torch.eye(len(y), dtype=torch.bool)
        assert s[same].mean() > lo_p and s[y[:, None] != y[None, :]].mean() < hi_n


@pytest.mark.parametrize("variant_batch", ["random", "trained_margins", "uneven"])
@pytest.mark.parametrize("l2_reg", [0.0, 0.005])
def test_npair_multi_positive_against_eq9(variant_batch, l2_reg):
    z, y = BATCHES[variant_batch]()
    z = z * 0.3
    _assert_matches(NPairLoss(l2_reg=l2_reg, variant="multi_positive"), lambda e, l: R.npair_multi_positive(e, l, l2_reg), z, y)


def test_npair_multi_positive_huge_embeddings_stay_exact():
    """Raw inner products of embeddings beyond 2**32 are computed without overflow (as the other variants)."""
    z, y = random_batch(7, b=12, k=3, d=8)
    small = NPairLoss(l2_reg=0.0, variant="multi_positive")(z * 1e-3, y)
    # scaling by 2**40 scales every logit by 2**80: the value is the reference's, computed in fp64 on scaled data
    big = NPairLoss(l2_reg=0.0, variant="multi_positive")(z.float() * 2.0**40, y)
    assert torch.isfinite(small)
    torch.testing.assert_close(big.double(), R.npair_multi_positive(z * 2.0**40, y), rtol=1e-5, atol=0.0)


@pytest.mark.parametrize("sampling", ["distance_weighted", "all"])
@pytest.mark.parametrize("batch", ["random", "trained_far", "trained_margins", "uneven"])
@pytest.mark.parametrize("nu", [0.0, 0.1])
def test_margin_against_reference(sampling, batch, nu):
    z, y = BATCHES[batch]()
    num_classes = int(y.max()) + 1
    loss = MarginLoss(num_classes=num_classes, nu=nu, sampling=sampling).double()
    with torch.no_grad():
        loss.beta.copy_(torch.linspace(1.0, 1.4, num_classes, dtype=torch.float64))
    beta = loss.beta.detach().clone()
    torch.manual_seed(11)
    zz = z.clone().requires_grad_(True)
    value = loss(zz, y)
    g_z, g_beta = torch.autograd.grad(value, [zz, loss.beta])
    if sampling == "all":
        triplets = [(a, p, n) for a in range(len(y)) for p in R._sets(y, a)[0] for n in R._sets(y, a)[1]]
    else:
        torch.manual_seed(11)
        x = normalize_embeddings(z)
        a, p, n = distance_weighted_sampling(distance_from_similarity(similarity_matrix(x, x)), y, dim=z.shape[1])
        triplets = list(zip(a.tolist(), p.tolist(), n.tolist()))
    assert triplets
    beta_ref = beta.clone().requires_grad_(True)
    zr = z.clone().requires_grad_(True)
    expected = R.margin(zr, y, triplets, beta_ref, nu=nu)
    g_zr, g_beta_r = torch.autograd.grad(expected, [zr, beta_ref])
    torch.testing.assert_close(value, expected, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(g_z, g_zr, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(g_beta, g_beta_r, rtol=1e-7, atol=1e-9)


# ----------------------------------------------------------------------------------------------- distance weighting


def test_distance_weighted_sampling_structure():
    z, y = random_batch(8, b=24, k=4, d=32)
    x = normalize_embeddings(z)
    dist = distance_from_similarity(similarity_matrix(x, x))
    a, p, n = distance_weighted_sampling(dist, y, dim=32, generator=torch.Generator().manual_seed(0))
    pairs = sorted(zip(a.tolist(), p.tolist()))
    expected = sorted((i, j) for i in range(24) for j in R._sets(y, i)[0])
    assert pairs == expected  # every ordered positive pair exactly once
    assert bool((y[a] != y[n]).all())
    assert bool((dist[a, n] < 1.4).all())  # every anchor has negatives inside the cut-off here


def test_distance_weighted_sampling_follows_inverse_density():
    """Empirical draw frequencies match q(d)^-1 of Eq. 3, written out: d^(2-n) (1 - d^2/4)^((3-n)/2), clipped at
    d = 0.5, zero beyond 1.4."""
    dim = 8
    g = torch.Generator().manual_seed(3)
    # anchor 0 (class 0) with positive 1; negatives at chosen distances 0.3 .. 1.6 from the anchor
    dists = torch.tensor([0.0, 0.2, 0.3, 0.6, 0.9, 1.2, 1.35, 1.6], dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 2, 3, 4, 5, 6])
    dist = torch.zeros(8, 8, dtype=torch.float64)
    dist[0] = dists
    dist[1:, :] = 1.0
    draws = torch.cat([distance_weighted_sampling(dist, y, dim=dim, generator=g)[2][:1] for _ in range(4000)])
    counts = torch.bincount(draws, minlength=8).double()
    w = torch.zeros(8, dtype=torch.float64)
    for j in range(2, 8):
        d = max(float(dists[j]), 0.5)
        if float(dists[j]) < 1.4:
            w[j] = d ** (2 - dim) * (1 - d * d / 4) ** ((3 - dim) / 2)
    prob = w / w.sum()
    assert counts[7] == 0 and counts[:2].sum() == 0
    sigma = torch.sqrt(4000 * prob * (1 - prob))
    assert bool(((counts - 4000 * prob).abs() <= 4 * sigma + 1).all()), (counts, 4000 * prob)
    # the weight formula itself, against the same written-out expression
    lw = distance_weighted_log_weights(dists[2:7], dim)
    torch.testing.assert_close(torch.exp(lw - lw.max()), w[2:7] / w[2:7].max())


def test_distance_weighted_sampling_no_negatives_and_far_negatives():
    y = torch.tensor([0, 0, 0])
    dist = torch.ones(3, 3, dtype=torch.float64)
    a, p, n = distance_weighted_sampling(dist, y, dim=4)
    assert a.numel() == 0
    # all negatives beyond the cut-off: drawn uniformly from the negatives (never a positive)
    y = torch.tensor([0, 0, 1, 2])
    dist = torch.full((4, 4), 1.9, dtype=torch.float64)
    a, p, n = distance_weighted_sampling(dist, y, dim=4, generator=torch.Generator().manual_seed(0))
    assert bool((y[n] != y[a]).all())
    with pytest.raises(ValueError, match="dimension"):
        distance_weighted_sampling(dist, y)


# ----------------------------------------------------------------------------------------------- pml

pml_losses = pytest.importorskip("pytorch_metric_learning.losses")
pml_distances = pytest.importorskip("pytorch_metric_learning.distances")

PML_BATCHES = ["random", "trained_margins", "trained_tight"]

PML_CASES = [
    ("circle", lambda: CircleLoss(), lambda: pml_losses.CircleLoss(m=0.25, gamma=256)),
    ("circle_pml_defaults", lambda: CircleLoss(m=0.4, gamma=80), lambda: pml_losses.CircleLoss()),
    ("supcon", lambda: SupConLoss(), lambda: pml_losses.SupConLoss(temperature=0.1)),
    ("ntxent", lambda: NTXentLoss(), lambda: pml_losses.NTXentLoss(temperature=0.1)),
    ("ntxent_pml_default", lambda: NTXentLoss(0.07), lambda: pml_losses.NTXentLoss()),
    ("nca", lambda: NCALoss(), lambda: pml_losses.NCALoss()),
    ("nca_scale", lambda: NCALoss(scale=3.0), lambda: pml_losses.NCALoss(softmax_scale=3.0)),
    ("angular_45deg", lambda: AngularLoss(math.radians(45)), lambda: pml_losses.AngularLoss(alpha=45)),  # degrees
    ("angular_pml_default", lambda: AngularLoss(math.radians(40)), lambda: pml_losses.AngularLoss()),
    ("fastap", lambda: FastAPLoss(), lambda: pml_losses.FastAPLoss(num_bins=10)),
    (
        "npair_multi_positive",
        lambda: NPairLoss(l2_reg=0.0, variant="multi_positive"),
        lambda: pml_losses.NCALoss(distance=pml_distances.DotProductSimilarity(normalize_embeddings=False)),
    ),
]


def _compare_pml(ours, theirs, z, y, *params, tangent=False):
    z1 = z.float().clone().requires_grad_(True)
    z2 = z.float().clone().requires_grad_(True)
    expected = theirs(z2, y)
    g_ref = list(torch.autograd.grad(expected, [z2, *params[1::2]]))
    if tangent:
        # unit-norm rows: the gradient through a normalisation is the tangential part g - (g.x) x
        x = z2.detach()
        g_ref[0] = g_ref[0] - (g_ref[0] * x).sum(dim=1, keepdim=True) * x
    value = ours(z1, y)
    g = torch.autograd.grad(value, [z1, *params[0::2]])
    torch.testing.assert_close(value, expected, rtol=1e-5, atol=1e-6)
    for a, b in zip(g, g_ref):
        # 1e-5 relative to the largest gradient entry (Circle's gamma = 256 makes entries of order 10)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * max(1.0, float(b.abs().max())))


@pytest.mark.parametrize("batch", PML_BATCHES)
@pytest.mark.parametrize("case", PML_CASES, ids=[c[0] for c in PML_CASES])
def test_against_pml(case, batch):
    _, make, make_pml = case
    z, y = BATCHES[batch]()
    if case[0] == "npair_multi_positive":
        z = z * 0.5
    if case[0].startswith("angular"):
        # pml normalises the anchors and positives but takes the negatives x_n as they come (raw rows of the
        # batch); the paper (and ours) uses unit vectors throughout, so the two agree on unit-norm input only
        # (their gradient w.r.t. x_n then skips the normalisation: compare its tangential part)
        z = z / z.norm(dim=1, keepdim=True)
    _compare_pml(make(), make_pml(), z, y, tangent=case[0].startswith("angular"))


@pytest.mark.parametrize("batch", PML_BATCHES)
@pytest.mark.parametrize("nu", [0.0, 0.1])
def test_margin_against_pml_all_triplets(batch, nu):
    """pml's MarginLoss with all triplets (DivisorReducer: sum over the non-zero hinge terms) and learnable
    per-class beta = ours with ``sampling="all"``; the gradients w.r.t. beta agree too."""
    z, y = BATCHES[batch]()
    c = int(y.max()) + 1
    ours = MarginLoss(num_classes=c, nu=nu, sampling="all")
    theirs = pml_losses.MarginLoss(margin=0.2, nu=nu, beta=1.2, learn_beta=True, num_classes=c, triplets_per_anchor="all")
    with torch.no_grad():
        ours.beta.copy_(torch.linspace(1.0, 1.4, c))
        theirs.beta.copy_(torch.linspace(1.0, 1.4, c))
    _compare_pml(ours, theirs, z, y, ours.beta, theirs.beta)


def test_margin_against_pml_sampled_triplets():
    """pml's MarginLoss on our distance-weighted triplets (passed as its indices_tuple) = ours."""
    z, y = BATCHES["trained_far"]()
    z = z.float()
    c = int(y.max()) + 1
    ours = MarginLoss(num_classes=c)
    theirs = pml_losses.MarginLoss(margin=0.2, nu=0.0, beta=1.2, learn_beta=True, num_classes=c)
    torch.manual_seed(5)
    value = ours(z, y)
    torch.manual_seed(5)
    x = normalize_embeddings(z)
    triplets = distance_weighted_sampling(distance_from_similarity(similarity_matrix(x, x)), y, dim=z.shape[1])
    torch.testing.assert_close(value, theirs(z, y, triplets), rtol=1e-5, atol=1e-6)


def test_smooth_ap_pml_keeps_the_query_in_its_own_gallery():
    """Documented difference: pml's SmoothAPLoss (the authors' code) = the paper's formula with the query in its
    own gallery and positive set; ours = the paper's formula without it. Equal class counts in label-sorted blocks
    (pml's requirement)."""
    z, y = random_batch(9, b=16, k=4)
    y = torch.sort(y).values
    theirs = pml_losses.SmoothAPLoss(temperature=0.01)
    z32 = z.float().clone().requires_grad_(True)
    v_pml = theirs(z32, y)
    (g_pml,) = torch.autograd.grad(v_pml, z32)
    v_ref, g_ref = _value_and_grad(lambda e, l: R.smooth_ap(e, l, include_query=True), z, y)
    torch.testing.assert_close(v_pml.double(), v_ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g_pml.double(), g_ref, rtol=1e-4, atol=1e-5)
    ours = _assert_matches(SmoothAPLoss(), R.smooth_ap, z, y)
    assert abs(float(ours) - v_pml.item()) > 1e-3


# ----------------------------------------------------------------------------------------------- defaults


def test_defaults_are_the_papers():
    """Each default-built loss against its reference with the papers' numbers written out, on a trained-like batch
    where changing any one of them changes the value."""
    z, y = trained_like_batch(12, 0.75, 0.25)
    checks = [
        (CircleLoss(), lambda e, l: R.circle(e, l, m=0.25, gamma=256.0), CircleLoss(m=0.26)),  # Circle Sec. 4.1 face
        (SupConLoss(), lambda e, l: R.supcon(e, l, temperature=0.1), SupConLoss(0.07)),  # SupCon Sec. 4 tau 0.1
        (NTXentLoss(), lambda e, l: R.ntxent(e, l, temperature=0.1), NTXentLoss(0.07)),  # SimCLR tau 0.1
        (NCALoss(), lambda e, l: R.nca(e, l, scale=1.0), NCALoss(2.0)),
        (AngularLoss(), lambda e, l: R.angular(e, l, alpha=math.radians(45)), AngularLoss(math.radians(40))),
        (FastAPLoss(), lambda e, l: R.fastap(e, l, num_bins=10), FastAPLoss(9)),
        (SmoothAPLoss(), lambda e, l: R.smooth_ap(e, l, temperature=0.01), SmoothAPLoss(0.02)),
    ]
    for loss, ref, changed in checks:
        value = _assert_matches(loss, ref, z, y)
        assert abs(float(changed(z, y)) - float(value)) > 1e-6, type(loss).__name__
    margin = MarginLoss(num_classes=5)
    assert margin.alpha == 0.2 and margin.nu == 0.0 and margin.sampling == "distance_weighted"
    assert margin.cutoff == 0.5 and margin.nonzero_loss_cutoff == 1.4
    torch.testing.assert_close(margin.beta.detach(), torch.full((5,), 1.2))
    # the margin loss with its defaults against the written-out formula on all triplets
    all_trip = MarginLoss(num_classes=5, sampling="all").double()
    triplets = [(a, p, n) for a in range(len(y)) for p in R._sets(y, a)[0] for n in R._sets(y, a)[1]]
    torch.testing.assert_close(all_trip(z, y), R.margin(z, y, triplets, torch.full((5,), 1.2), alpha=0.2, nu=0.0))
    assert NPairLoss(variant="multi_positive").l2_reg == 0.005


# ----------------------------------------------------------------------------------------------- degenerate

ALL_LOSSES = {
    "circle": CircleLoss,
    "supcon": SupConLoss,
    "ntxent": NTXentLoss,
    "nca": NCALoss,
    "angular": AngularLoss,
    "fastap": FastAPLoss,
    "smooth_ap": SmoothAPLoss,
    "margin": lambda: MarginLoss(num_classes=20),
    "npair_multi": lambda: NPairLoss(l2_reg=0.0, variant="multi_positive"),
}

# documented value of a single-class batch (None: the reference's value, which is finite and non-zero)
SINGLE_CLASS = {"circle": 0.0, "supcon": None, "ntxent": 0.0, "nca": 0.0, "angular": 0.0, "fastap": 0.0,
                "smooth_ap": 0.0, "margin": 0.0, "npair_multi": 0.0}


@pytest.mark.parametrize("name", list(ALL_LOSSES))
def test_degenerate_batches(name):
    z, _ = random_batch(13, b=8, k=2, d=8, dtype=torch.float32)
    for y, expected in (
        (torch.arange(8), 0.0),  # no positive pair
        (torch.zeros(8, dtype=torch.long), SINGLE_CLASS[name]),  # one class: no negative
        (torch.zeros(1, dtype=torch.long), 0.0),  # a single sample
    ):
        zz = z[: len(y)].clone().requires_grad_(True)
        value = ALL_LOSSES[name]()(zz, y)
        (grad,) = torch.autograd.grad(value, zz)
        value = value.detach()
        assert torch.isfinite(value) and bool(torch.isfinite(grad).all()), (name, y)
        if expected is None:
            torch.testing.assert_close(value.double(), R.supcon(z[: len(y)].double(), y), rtol=1e-5, atol=1e-6)
            assert float(value) > 0
        elif name in ("fastap", "smooth_ap") and len(y) > 1 and int(y.max()) == 0:
            # AP = 1 up to rounding of the sums (1 - H+/H with H+ = H)
            assert abs(float(value)) < 1e-6, (name, float(value))
        else:
            assert float(value) == expected, (name, y, float(value))
            if expected == 0.0:
                assert float(grad.abs().max()) == 0.0


@pytest.mark.parametrize("name", list(ALL_LOSSES))
def test_autocast_and_dtype(name):
    z, y = random_batch(14, b=12, k=3, d=16, dtype=torch.float32)
    expected = ALL_LOSSES[name]()(z, y)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        value = ALL_LOSSES[name]()(z.bfloat16(), y)
    assert value.dtype == torch.float32
    torch.testing.assert_close(value, expected, rtol=0.1, atol=0.05)


def test_device(device):
    """Every loss runs where its inputs are and returns its value there."""
    z, y = random_batch(15, b=12, k=3, d=16, dtype=torch.float32)
    for name, make in ALL_LOSSES.items():
        loss = make()
        if isinstance(loss, MarginLoss):
            loss = loss.to(device)
        value = loss(z.to(device), y.to(device))
        assert value.device.type == device.type
        if name != "margin":
            torch.testing.assert_close(value.cpu(), make()(z, y), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("name", list(ALL_LOSSES))
def test_bad_input(name):
    loss = ALL_LOSSES[name]()
    z, y = random_batch(16, b=8, k=2, d=8, dtype=torch.float32)
    bad = z.clone()
    bad[3, 1] = float("nan")
    with pytest.raises(ValueError, match=r"non-finite values \(NaN\) in 1 row"):
        loss(bad, y)
    with pytest.raises(ValueError, match="2-D"):
        loss(z[0], y)
    with pytest.raises(ValueError, match="labels has 7 entries but embeddings has 8 rows"):
        loss(z, y[:7])


@pytest.mark.parametrize(
    "make,match",
    [
        (lambda: CircleLoss(m=1.5), "m must be in"),
        (lambda: CircleLoss(gamma=0), "gamma must be > 0"),
        (lambda: SupConLoss(0.0), "temperature must be > 0"),
        (lambda: NTXentLoss(-1.0), "temperature must be > 0"),
        (lambda: NCALoss(objective="sum"), "objective must be one of"),
        (lambda: AngularLoss(45), "radians"),
        (lambda: FastAPLoss(0), "num_bins must be an integer"),
        (lambda: SmoothAPLoss(0), "temperature must be > 0"),
        (lambda: MarginLoss(sampling="hard"), "sampling must be one of"),
        (lambda: MarginLoss(num_classes=0), "num_classes must be an integer"),
        (lambda: NPairLoss(variant="multi"), "variant must be one of"),
    ],
)
def test_bad_parameters(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_margin_labels_and_sizes():
    z, y = random_batch(17, b=8, k=2, d=8, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"class indices in \[0, num_classes=3\)"):
        MarginLoss(num_classes=3)(z, y)
    with pytest.raises(ValueError, match="has no beta yet"):
        MarginLoss()(z, y)
    with pytest.raises(ValueError, match="configured with num_classes=3"):
        MarginLoss(num_classes=3).complete(num_classes=4)
    assert MarginLoss().needs_num_classes and not MarginLoss(class_margins=False).needs_num_classes
    shared = MarginLoss(class_margins=False)
    assert shared.beta.shape == (1,) and torch.isfinite(shared(z, y))
    fixed = MarginLoss(num_classes=4, learn_beta=False)
    assert not list(fixed.parameters()) and "beta" in dict(fixed.named_buffers())


def test_margin_complete_and_state_dict():
    """The module's protocol: sizes left out, filled in by complete(); a checkpoint rebuilds the per-class beta."""
    loss = MarginLoss()
    assert loss.has_parameters and not loss.is_complete
    loss.complete(num_classes=4, embedding_dim=16)
    assert loss.is_complete and loss.beta.shape == (4,) and isinstance(loss.beta, torch.nn.Parameter)
    with torch.no_grad():
        loss.beta.add_(torch.arange(4.0))
    fresh = MarginLoss()
    fresh.load_state_dict(loss.state_dict())
    torch.testing.assert_close(fresh.beta.detach(), loss.beta.detach())


def test_registry():
    names = {"circle": CircleLoss, "supcon": SupConLoss, "ntxent": NTXentLoss, "nca": NCALoss, "angular": AngularLoss,
             "fastap": FastAPLoss, "smooth_ap": SmoothAPLoss, "margin": MarginLoss}
    for name, cls in names.items():
        assert LOSSES[name] is cls
        assert type(build_loss(name)) is cls
    assert build_loss("npair", variant="multi_positive").variant == "multi_positive"


def test_npair_multi_positive_refuses_references():
    z, y = random_batch(18, b=8, k=2, d=8, dtype=torch.float32)
    with pytest.raises(ValueError, match="cannot score against ref_embeddings"):
        NPairLoss(variant="multi_positive")(z, y, z, y)


# ----------------------------------------------------------------------------------------------- size


@pytest.mark.slow
def test_smooth_ap_batch_512_is_bounded():
    """Smooth-AP at B = 512 (K = 4 per class): B x K x N work, finishes and matches a float64 run."""
    z, y = random_batch(19, b=512, k=4, d=64, dtype=torch.float32)
    value = SmoothAPLoss()(z.requires_grad_(True), y)
    value.backward()
    torch.testing.assert_close(value.double(), SmoothAPLoss()(z.detach().double(), y), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["circle", "supcon", "ntxent", "nca", "angular", "fastap", "smooth_ap"])
def test_cross_batch_memory_wraps_the_loss(name):
    """XBM wraps every pair/set loss that scores references: the second batch sees the first as references."""
    from lightning_dml.losses import CrossBatchMemory

    xbm = CrossBatchMemory(loss=name, embedding_size=16, memory_size=64)
    (z1, y1), (z2, y2) = random_batch(20, b=12, k=3, dtype=torch.float32), random_batch(21, b=12, k=3, dtype=torch.float32)
    xbm(z1, y1)
    torch.testing.assert_close(xbm(z2, y2), build_loss(name)(z2, y2, z1, y1))


def test_anatomy_for_checks_and_ddp():
    """What checks.py and DMLModule read: the DDP mode and sampler needs of each loss and option."""
    for cls in (CircleLoss, SupConLoss, NTXentLoss, NCALoss, AngularLoss, FastAPLoss, SmoothAPLoss):
        loss = cls()
        assert loss.gather_mode == "references" and loss.supports_ref and loss.needs_positive_pairs
        assert loss.required_sampler is None and not loss.has_parameters and not loss.needs_num_classes
    assert MarginLoss(num_classes=3).gather_mode == "global_batch"  # random draw: the global batch on every process
    assert MarginLoss(num_classes=3, sampling="all").gather_mode == "references"
    multi = NPairLoss(variant="multi_positive")
    assert (multi.required_sampler, multi.gather_mode) == (None, "global_batch")
    assert (NPairLoss().required_sampler, NPairLoss().gather_mode) == ("npair", None)


def test_margin_seed_makes_the_draw_reproducible():
    z, y = trained_like_batch(22, 0.5, 0.05)
    a, b = MarginLoss(num_classes=5, seed=3).double(), MarginLoss(num_classes=5, seed=3).double()
    torch.manual_seed(0)
    first = a(z, y)
    torch.manual_seed(1)  # the global generator does not matter with a seed
    assert float(b(z, y)) == float(first)
    assert float(a(z, y)) != float(first)  # the loss's generator moves on


def test_margin_loss_in_dml_module_fills_num_classes_and_trains_beta():
    """DMLModule completes num_classes from the data, maps the labels to class indices, gives beta the loss's
    optimizer group (authors' code: beta at a higher learning rate) and steps it; a checkpoint rebuilds it."""
    from tests.test_losses_proxy_module import TRAIN_CLASSES, _fit, _module

    model = _module(loss=MarginLoss(), loss_lr_multiplier=100.0)
    assert model.loss.beta is None
    trainer = _fit(model, steps=3)
    assert model.loss.num_classes == len(TRAIN_CLASSES) and model.loss.beta.shape == (len(TRAIN_CLASSES),)
    assert model.hparams["loss_sizes"]["num_classes"] == len(TRAIN_CLASSES)
    group = {g["name"]: g for g in trainer.optimizers[0].param_groups}["loss"]
    assert any(p is model.loss.beta for p in group["params"])
    assert not torch.equal(model.loss.beta.detach(), torch.full((len(TRAIN_CLASSES),), 1.2))  # beta was stepped
    fresh = _module(loss=MarginLoss())
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(fresh.loss.beta, model.loss.beta)


# ------------------------------------------------------------------------------- hyper-parameter range boundaries
#: (factory, accepted?): each documented range at its ends, just beyond, and half a unit on either side of a bound
RANGE_CASES = [
    (lambda: AngularLoss(math.pi / 3), True), (lambda: AngularLoss(math.pi / 3 + 1e-6), False),
    (lambda: AngularLoss(0.5), True), (lambda: AngularLoss(0.0), False), (lambda: AngularLoss(-0.5), False),
    (lambda: CircleLoss(m=0.0, gamma=0.5), True), (lambda: CircleLoss(m=0.999), True),
    (lambda: CircleLoss(m=1.0), False), (lambda: CircleLoss(m=-0.5), False), (lambda: CircleLoss(gamma=-0.5), False),
    (lambda: MarginLoss(alpha=0.0, nu=0.0, cutoff=0.0), True), (lambda: MarginLoss(alpha=-0.5), False),
    (lambda: MarginLoss(nu=-0.5), False), (lambda: MarginLoss(cutoff=1.39), True),
    (lambda: MarginLoss(cutoff=1.4, nonzero_loss_cutoff=1.4), False), (lambda: MarginLoss(cutoff=-0.5), False),
    (lambda: MarginLoss().complete(num_classes=1), True), (lambda: MarginLoss().complete(num_classes=0), False),
    (lambda: FastAPLoss(1), True), (lambda: FastAPLoss(0), False),
    (lambda: SupConLoss(0.5), True), (lambda: SupConLoss(-0.5), False),
    (lambda: NTXentLoss(0.5), True), (lambda: NTXentLoss(0.0), False),
    (lambda: SmoothAPLoss(0.5), True), (lambda: SmoothAPLoss(-0.5), False),
    (lambda: NCALoss(scale=0.5), True), (lambda: NCALoss(scale=0.0), False), (lambda: NCALoss(scale=-0.5), False),
    (lambda: NPairLoss(variant="multi_positive", l2_reg=0.0), True),
]


@pytest.mark.parametrize("make,ok", RANGE_CASES, ids=[str(i) for i in range(len(RANGE_CASES))])
def test_hyperparameter_ranges_at_their_bounds(make, ok):
    if ok:
        assert isinstance(make(), torch.nn.Module)
    else:
        with pytest.raises(ValueError):
            make()


def test_margin_loss_needs_positive_pairs_in_the_checks():
    """checks.py refuses a batch of distinct labels for the margin loss (its triplets need a positive)."""
    from lightning_dml.checks import check_training_batch

    for loss in (MarginLoss(num_classes=6), MarginLoss(class_margins=False, sampling="all")):
        with pytest.raises(ValueError, match="needs positive pairs"):
            check_training_batch(loss, torch.arange(6))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_few_anchors_with_many_reference_positives(case):
    """Two anchors of one class with six positives each among the references (more positives per anchor than
    anchors): every positive counts, as in the loop reference."""
    _, make, ref = case
    z, _ = random_batch(23, b=14, k=2)
    y = torch.tensor([0, 0, 1] + [0] * 6 + [1, 2, 2, 3, 3])
    _assert_matches(lambda e, l: make()(e[:2], l[:2], e[2:], l[2:]), lambda e, l: ref(e, l, n_anchors=2), z, y)
