"""Loss options and states at their edges: Cross-Batch Memory's ring buffer, the margin loss's triplets against
references and its state-dict hook, ArcFace / CosFace initialisation and the ArcFace threshold, the angular loss
with more positives than anchors, GPW's power weights and batch-hard triplets on degenerate batches.

Expected values come from the loop references (``tests/reference_*.py``), the papers' formulas or the documented
contracts (docstrings, ``docs/losses/*.md``).
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dml.checks import check_training_batch
from lightning_dml.losses import (
    AngularLoss,
    ArcFaceLoss,
    ContrastiveLoss,
    CosFaceLoss,
    CrossBatchMemory,
    GeneralPairWeightingLoss,
    MarginLoss,
)
from lightning_dml.losses.arcface import additive_angular_margin
from tests import reference_losses as RL
from tests import reference_pairset_losses as RP

F64 = torch.float64


# ---------------------------------------------------------------------------------------------- cross-batch memory
def test_cross_batch_memory_is_a_first_in_first_out_ring():
    """Batches of 2, 2 and 3 rows into 4 slots: the memory holds the rows in arrival order, then the newest 4
    (the third batch wraps around: its last row overwrites slot 0... of the ring's current start)."""
    xbm = CrossBatchMemory("contrastive", embedding_size=2, memory_size=4)
    rows = torch.arange(14, dtype=torch.float32).reshape(7, 2) + 1
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    xbm(rows[:2], labels[:2])
    xbm(rows[2:4], labels[2:4])
    torch.testing.assert_close(xbm.memory_embeddings, rows[:4])
    assert xbm.memory_labels.tolist() == labels[:4].tolist() and int(xbm.num_filled) == 4
    xbm(rows[4:7], labels[4:7])
    # slots 0..2 take rows 4..6, slot 3 keeps row 3: the newest four rows
    torch.testing.assert_close(xbm.memory_embeddings, torch.cat([rows[4:7], rows[3:4]]))
    assert int(xbm.write_pointer) == 3 and int(xbm.num_filled) == 4
    # the memory is the newest rows: the next call scores against exactly them
    z, y = torch.randn(4, 2), torch.tensor([0, 1, 2, 2])
    expected = ContrastiveLoss()(z, y, ref_embeddings=torch.cat([rows[4:7], rows[3:4]]),
                                 ref_labels=torch.tensor([2, 2, 2, 1]))
    torch.testing.assert_close(xbm(z, y), expected)


def test_cross_batch_memory_defaults_and_anatomy():
    """The documented defaults (docs/losses/cross_batch_memory.md); it holds no learnable parameter (so no optimizer
    group of its own) and declares none."""
    xbm = CrossBatchMemory()
    assert (xbm.memory_size, xbm.start_after, xbm.embedding_size) == (1024, 0, None) and not xbm.is_complete
    assert isinstance(xbm.loss, ContrastiveLoss)
    assert xbm.has_parameters is False and not any(True for _ in xbm.parameters())
    xbm(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]))
    assert xbm.memory_embeddings.shape == (1024, 3) and int(xbm.num_filled) == 4 and xbm.is_complete


# ---------------------------------------------------------------------------------------------------- margin loss
def _all_triplets(y_anchor: torch.Tensor, y_gallery: torch.Tensor) -> list[tuple[int, int, int]]:
    B = len(y_anchor)
    return [(a, p, n) for a in range(B) for p in range(len(y_gallery)) for n in range(len(y_gallery))
            if p != a and y_gallery[p] == y_anchor[a] and y_gallery[n] != y_anchor[a]]


@pytest.mark.parametrize("kw", [{"class_margins": False}, {"num_classes": 4}, {"num_classes": 4, "nu": 0.1}],
                         ids=str)
def test_margin_all_triplets_against_references(kw):
    """``sampling="all"`` with references (a ``B x N`` gallery, ``N != B``): every (anchor, positive, negative)
    triplet of the gallery, Wu et al. Eqs. 4-5, divided by the non-zero hinge terms."""
    g = torch.Generator().manual_seed(3)
    z, r = torch.randn(4, 5, generator=g, dtype=F64), torch.randn(5, 5, generator=g, dtype=F64)
    y, ry = torch.tensor([0, 0, 1, 2]), torch.tensor([1, 1, 3, 0, 2])
    loss = MarginLoss(sampling="all", **kw).double()
    with torch.no_grad():  # distinct per-class margins, so that the anchor's own class must be used
        loss.beta.copy_(torch.linspace(0.9, 1.3, loss.beta.numel(), dtype=F64))
    zz = z.clone().requires_grad_(True)
    value = loss(zz, y, ref_embeddings=r, ref_labels=ry)
    (grad,) = torch.autograd.grad(value, zz)
    zr = z.clone().requires_grad_(True)
    beta = loss.beta.detach() if loss.class_margins else loss.beta.detach().expand(4)
    expected = RP.margin(torch.cat([zr, r]), torch.cat([y, ry]), _all_triplets(y, torch.cat([y, ry])), beta,
                         nu=kw.get("nu", 0.0))
    (grad_ref,) = torch.autograd.grad(expected, zr)
    torch.testing.assert_close(value, expected.detach())
    torch.testing.assert_close(grad, grad_ref)


def test_margin_loss_state_dict_hook_and_reset():
    """An incomplete loss loads a state dict without ``beta`` (nothing to size it from) and stays incomplete;
    ``reset_parameters`` of an incomplete loss is a no-op, of a complete one restores ``beta``'s initial value."""
    loss = MarginLoss()
    loss.load_state_dict({}, strict=False)
    assert loss.beta is None and not loss.is_complete
    loss.reset_parameters()
    assert loss.beta is None
    loss.load_state_dict({"beta": torch.tensor([1.0, 1.5, 2.0])})
    assert loss.num_classes == 3 and loss.beta.tolist() == [1.0, 1.5, 2.0]
    loss.reset_parameters()
    torch.testing.assert_close(loss.beta.detach(), torch.full((3,), 1.2))


def test_margin_loss_rejects_labels_outside_its_classes_and_needs_positive_pairs():
    loss = MarginLoss(num_classes=3)
    z = torch.randn(4, 3)
    for bad in ([0, 0, -1, 1], [0, 0, 3, 1]):
        with pytest.raises(ValueError, match="class indices"):
            loss(z, torch.tensor(bad))
    loss(z, torch.tensor([0, 0, 2, 1]))  # the ends of [0, num_classes) are fine
    with pytest.raises(ValueError, match="needs positive pairs"):
        check_training_batch(loss, torch.arange(3))


def test_margin_loss_takes_a_single_class():
    """``num_classes`` is an integer >= 1: one class is accepted (its one margin), zero is not."""
    assert MarginLoss(num_classes=1).beta.shape == (1,)
    assert MarginLoss().complete(num_classes=1).num_classes == 1
    with pytest.raises(ValueError, match="num_classes must be an integer >= 1"):
        MarginLoss().complete(num_classes=0)


# ------------------------------------------------------------------------------------------------ ArcFace, CosFace
@pytest.mark.parametrize(
    "cls,kw,ok",
    [(ArcFaceLoss, {"scale": 0.5, "margin": 0.0}, True), (ArcFaceLoss, {"scale": 0.0}, False),
     (ArcFaceLoss, {"scale": -0.5}, False), (ArcFaceLoss, {"margin": -0.5}, False),
     (ArcFaceLoss, {"margin": 1.2}, True), (ArcFaceLoss, {"margin": math.pi / 2 - 1e-6}, True),
     (ArcFaceLoss, {"margin": math.pi / 2}, False), (ArcFaceLoss, {"margin": 2.0}, False),
     (CosFaceLoss, {"scale": 0.5}, True), (CosFaceLoss, {"scale": 0.0}, False), (CosFaceLoss, {"scale": -0.5}, False)],
    ids=str,
)
def test_arcface_and_cosface_ranges_at_their_bounds(cls, kw, ok):
    """scale > 0; ArcFace's margin in [0, pi/2) radians: the ends, and half a unit beyond."""
    if ok:
        loss = cls(num_classes=3, embedding_dim=4, **kw)
        assert all(getattr(loss, k) == v for k, v in kw.items())
    else:
        with pytest.raises(ValueError):
            cls(num_classes=3, embedding_dim=4, **kw)


@pytest.mark.parametrize("cls", [ArcFaceLoss, CosFaceLoss])
def test_class_weights_are_initialised_with_std_001(cls):
    """docs/losses/arcface.md, cosface.md: weights initialised normal with std 0.01 (the ArcFace code's init)."""
    loss = cls(num_classes=200, embedding_dim=64)
    w = loss.proxies.detach()
    assert 0.0095 < float(w.std()) < 0.0105 and abs(float(w.mean())) < 1e-3


@pytest.mark.parametrize("margin", [0.1, 0.5, 1.0])
def test_arcface_target_at_the_threshold_angle_is_cos_theta_plus_m(margin):
    """``cos(theta + m)`` for ``theta <= pi - m`` (the threshold included), the linear ``cos - m sin m`` beyond."""
    cos = torch.tensor([math.cos(math.pi - margin), math.cos(math.pi - margin / 2), 0.3], dtype=F64)
    theta = torch.acos(cos)
    got = additive_angular_margin(cos, margin)
    torch.testing.assert_close(got[0], torch.cos(theta[0] + margin))  # = cos(pi) = -1
    torch.testing.assert_close(got[1], cos[1] - margin * math.sin(margin))
    torch.testing.assert_close(got[2], torch.cos(theta[2] + margin))


# --------------------------------------------------------------------------------------------------------- angular
def test_angular_loss_with_more_positives_than_anchors():
    """Two anchors, each with 5 positives among the references: every (anchor, positive) pair counts (Wang et al.
    Eq. 8 over all ordered positive pairs of the anchors)."""
    g = torch.Generator().manual_seed(4)
    z, r = torch.randn(2, 6, generator=g, dtype=F64), torch.randn(6, 6, generator=g, dtype=F64)
    y, ry = torch.tensor([0, 0]), torch.tensor([0, 0, 0, 0, 1, 2])
    zz = z.clone().requires_grad_(True)
    value = AngularLoss()(zz, y, ref_embeddings=r, ref_labels=ry)
    (grad,) = torch.autograd.grad(value, zz)
    zr = z.clone().requires_grad_(True)
    expected = RP.angular(torch.cat([zr, r]), torch.cat([y, ry]), n_anchors=2)
    (grad_ref,) = torch.autograd.grad(expected, zr)
    torch.testing.assert_close(value, expected.detach())
    torch.testing.assert_close(grad, grad_ref)


# ------------------------------------------------------------------------------------------------------------- GPW
@pytest.mark.parametrize("kw", [{"preset": "pair_p", "m1": 0.2, "p": 0.5, "q": 0.5},
                                {"preset": "pair_p", "m1": 0.2, "p": 1.5, "q": 0.5, "normalize": False}], ids=str)
def test_gpw_fractional_power_weights(kw):
    """GPW Eqs. 26-27 with non-integer powers: pairs outside the mined set (``D < m1`` or ``D > m2``) have a negative
    hinge argument and must get weight 0, not ``negative ** 0.5`` = NaN."""
    g = torch.Generator().manual_seed(6)
    z, y = torch.randn(10, 4, generator=g, dtype=F64), torch.arange(10) % 3
    loss = GeneralPairWeightingLoss(**kw)
    zz = z.clone().requires_grad_(True)
    value = loss(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    ref_kw = dict(form=loss.form, mining=loss.mining, weighting=loss.weighting, m1=loss.m1, m2=loss.m2, p=loss.p,
                  q=loss.q, normalize=loss.normalize_weights)
    zr = z.clone().requires_grad_(True)
    expected = RL.general_pair_weighting(zr, y, **ref_kw)
    (grad_ref,) = torch.autograd.grad(expected, zr)
    torch.testing.assert_close(value, expected.detach())
    torch.testing.assert_close(grad, grad_ref)


@pytest.mark.parametrize("kw", [{"weighting": "constant"}, {"weighting": "power", "p": 2.0},
                                {"weighting": "exp", "alpha": 5.0, "normalize": False}], ids=str)
def test_gpw_batch_hard_triplets_need_a_positive_and_a_negative(kw):
    """GPW Eq. 20: an anchor without a positive or without a negative has no triplet, ``L_i = 0`` - a one-class
    batch gives 0; a singleton anchor near a negative adds nothing (as the loop reference)."""
    loss = GeneralPairWeightingLoss("custom", form="triplet", mining="batch_hard", margin=0.5, **kw)
    g = torch.Generator().manual_seed(7)
    z = torch.randn(5, 3, generator=g, dtype=F64)
    assert float(loss(z, torch.zeros(5, dtype=torch.long))) == 0.0
    # anchor 4 (a singleton) sits next to anchor 0: D < margin, so its "triplet" would have t = m - D > 0
    z2 = torch.cat([z[:4], z[:1] + 0.01])
    y2 = torch.tensor([0, 0, 1, 1, 2])
    ref_kw = {k: v for k, v in kw.items()}
    expected = RL.general_pair_weighting(z2, y2, form="triplet", mining="batch_hard", margin=0.5, **ref_kw)
    torch.testing.assert_close(loss(z2, y2), expected)


def _beyond_one_batch(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A row, two duplicates (same class, other class) and its opposite, whose normalised products round beyond
    +-1, and three other rows (as in tests/test_losses_properties.py)."""
    from lightning_dml.losses.base import normalize_embeddings

    g = torch.Generator().manual_seed(0)
    for _ in range(10_000):
        x = torch.randn(4, 8, generator=g, dtype=dtype)
        z = torch.cat([x[:1], x[:1], x[:1], -x[:1], x[1:]])
        u = normalize_embeddings(z)
        raw = u @ u.T
        raw.diagonal().fill_(0.0)
        if float(raw.max()) > 1.0 and float(raw.min()) < -1.0:
            return z, torch.tensor([0, 0, 1, 2, 1, 2, 0])
    raise AssertionError("no batch rounds beyond +-1")


@pytest.mark.parametrize("alpha", [math.pi / 4, math.radians(55)])
@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_angular_loss_where_cosines_round_beyond_one(dtype, alpha):
    """Duplicates and an opposite whose cosines round beyond +-1 (the loss's clamp branch): the value and gradient
    of Wang et al. Eq. 8 (the loop reference, no clamp: the difference is rounding along the rows themselves)."""
    z, y = _beyond_one_batch(dtype)
    zz = z.clone().requires_grad_(True)
    value = AngularLoss(alpha)(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    zr = z.double().requires_grad_(True)
    expected = RP.angular(zr, y, alpha)
    (grad_ref,) = torch.autograd.grad(expected, zr)
    torch.testing.assert_close(value.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), grad_ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("weighting", ["power", "exp"])
def test_gpw_custom_weightings_without_their_parameters_are_constant_on_mined_negatives(weighting):
    """``preset="custom"`` with power or exponential weights but no p, q, alpha, beta: the neutral exponents
    (``x^0 = 1``, ``exp(0 x) = 1``) give the constant weights of Eqs. 24-25, on a batch whose mined positives AND
    negatives (two classes close together: every negative has D <= m2 = 0.8) are all non-empty."""
    g = torch.Generator().manual_seed(13)
    centre = torch.randn(1, 6, generator=g, dtype=F64)
    z = torch.cat([centre + 0.25 * torch.randn(4, 6, generator=g, dtype=F64),
                   centre + 0.25 * torch.randn(4, 6, generator=g, dtype=F64)])
    y = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    u = torch.nn.functional.normalize(z, dim=1)
    d = (2 - 2 * u @ u.T).clamp(min=0).sqrt()
    assert (d[y[:, None] != y[None, :]] <= 0.8).all()
    constant = GeneralPairWeightingLoss("custom")
    expected = RL.general_pair_weighting(z, y)  # constant weights, m1 = 0, m2 = 0.8 (GPW Eqs. 16-18, 24-25)
    torch.testing.assert_close(constant(z, y), expected)
    torch.testing.assert_close(GeneralPairWeightingLoss("custom", weighting=weighting)(z, y), expected)
