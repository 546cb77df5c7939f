"""Pair and set losses (SupCon, NCA, triplet, N-pair) at edges the other loss tests leave out.

Reference embeddings on the autograd path (a ``B x N`` gallery, not square) with an anchor that has no positive,
batch-hard triplets of an anchor without positives, the closed form's divisor with references, NCA at an extreme
scale, N-pair at tiny and at huge magnitudes. Expected values come from the loop references
(``tests/reference_pairset_losses.py``, ``tests/reference_losses.py``), from the other path of the same loss, or
(N-pair Eqs. 7-8 up to fp64's edge) from an mpmath reference (``_mp_npair``).
"""

from __future__ import annotations

import math

import pytest
import torch

import lightning_dml.losses.softmax_pairs as softmax_pairs
from lightning_dml.losses import NCALoss, NPairLoss, SupConLoss, TripletLoss
from lightning_dml.miners.pairs import label_masks
from tests import reference_losses as RL
from tests import reference_pairset_losses as R


def _batch_with_references():
    """8 anchors (one, label 9, without any positive) and 6 references; fp64."""
    g = torch.Generator().manual_seed(11)
    z = torch.randn(14, 6, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1, 2, 3, 3, 9, 0, 1, 2, 4, 4, 3])
    return z, y


def _value_and_grad(fn, z):
    z = z.clone().requires_grad_(True)
    value = fn(z)
    (grad,) = torch.autograd.grad(value, z)
    return value.detach(), grad


@pytest.mark.parametrize("closed_form", [True, False])
@pytest.mark.parametrize("name", ["supcon", "nca", "nca_expected"])
def test_references_and_an_anchor_without_positives_on_both_paths(name, closed_form):
    """``B = 8`` anchors against ``N = 14`` gallery items: both paths give the loop reference (the anchor without a
    positive has no term, and a finite, here zero, gradient)."""
    z, y = _batch_with_references()
    b = 8
    if name == "supcon":
        loss, ref = SupConLoss(0.2), lambda e: R.supcon(e, y, temperature=0.2, n_anchors=b)
    else:
        objective = "expected" if name == "nca_expected" else "log"
        loss, ref = NCALoss(2.0, objective), lambda e: R.nca(e, y, 2.0, objective, n_anchors=b)
    loss.closed_form = closed_form
    value, grad = _value_and_grad(lambda e: loss(e[:b], y[:b], e[b:], y[b:]), z)
    want, want_grad = _value_and_grad(ref, z)
    assert torch.isfinite(grad).all()
    torch.testing.assert_close(value, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grad, want_grad, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("closed_form", [True, False])
def test_supcon_anchors_with_one_positive_are_not_halved(closed_form):
    """Every anchor has exactly one positive: its term is ``lse - l_ip`` (divided by ``|P(i)| = 1``)."""
    z, _ = _batch_with_references()
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3])
    loss = SupConLoss(0.5)
    loss.closed_form = closed_form
    value, grad = _value_and_grad(lambda e: loss(e, y), z[:7])
    want, want_grad = _value_and_grad(lambda e: R.supcon(e, y, temperature=0.5), z[:7])
    torch.testing.assert_close(value, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grad, want_grad, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("cls", [SupConLoss, NCALoss])
def test_the_closed_form_is_the_default_path_and_says_so(cls, monkeypatch):
    """``_has_closed_form()`` (which the reference tests read to run both paths) is True exactly because the
    default call takes the neighbour softmax; ``closed_form=False`` does not."""
    calls = []
    forward = softmax_pairs._NeighbourSoftmax.forward
    monkeypatch.setattr(softmax_pairs._NeighbourSoftmax, "forward",
                        staticmethod(lambda ctx, *a: calls.append(1) or forward(ctx, *a)))
    z, y = _batch_with_references()
    loss = cls()
    assert loss._has_closed_form() is True
    loss(z, y)
    assert len(calls) == 1
    loss.closed_form = False
    loss(z, y)
    assert len(calls) == 1


def test_nca_closed_form_at_an_extreme_scale_equals_the_autograd_path():
    """NCA at ``s = 1e30`` (fp32): ``-log p_i = 2 s (max_N S - max_P S)`` to float precision, finite (6.7e29 here),
    on both paths. (Issue 26: the exponents were formed as ``a S - a shift`` in one fused multiply-add, whose
    rounding of ``a shift`` alone, ~1e23, sent a row's largest entry to e^(+-1e23): NaN.)"""
    e = torch.eye(4)
    z = torch.stack([e[0], 0.9 * e[0] + 0.1 * e[1], e[1], 0.8 * e[1] + 0.2 * e[2], e[3], -e[3]])
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    loss = NCALoss(scale=1e30)
    closed = loss(z, y)
    loss.closed_form = False
    plain = loss(z, y)
    assert torch.isfinite(plain)
    torch.testing.assert_close(closed, plain)


@pytest.mark.parametrize("closed_form", [True, False])
def test_batch_hard_skips_anchors_without_a_positive(closed_form):
    """Batch-hard (GPW Eq. 20) needs a positive and a negative per anchor: a singleton close to another class
    (its hinge ``margin - d_an`` would be positive) adds no term, on either path."""
    z = torch.tensor([[1.0, 0.0, 0.0], [0.9, 0.3, 0.0], [0.0, 1.0, 0.0], [0.2, 1.0, 0.1], [0.95, 0.1, 0.05]],
                     dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1, 7])
    loss = TripletLoss(margin=1.0, mining="batch_hard", reduction="mean")
    loss.closed_form = closed_form
    value, grad = _value_and_grad(lambda e: loss(e, y), z)
    want, want_grad = _value_and_grad(lambda e: RL.triplet(e, y, margin=1.0, mining="batch_hard",
                                                           reduction="mean"), z)
    torch.testing.assert_close(value, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grad, want_grad, rtol=1e-7, atol=1e-9)


def test_triplet_closed_form_mean_counts_anchor_positive_negative_triples_with_references():
    """``reduction="mean"`` divides by the number of (anchor, positive, negative) triples, each anchor's positives
    times its negatives along its own ``N``-long row: ``pair_loss_and_grad`` equals autograd through ``pair_loss``."""
    z, y = _batch_with_references()
    x = torch.nn.functional.normalize(z, dim=1)
    sim = x[:8] @ x.T
    pos, neg = label_masks(y[:8], y)
    loss = TripletLoss(margin=0.5, reduction="mean")
    s = sim.clone().requires_grad_(True)
    plain = loss.pair_loss(s, pos, neg)
    (expected,) = torch.autograd.grad(plain, s)
    value, weights = loss.pair_loss_and_grad(sim, pos, neg)
    torch.testing.assert_close(value, plain.detach(), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights, expected, rtol=1e-12, atol=1e-12)
    want = RL.triplet(z[:8], y[:8], margin=0.5, reduction="mean", ref=z[8:], ref_labels=y[8:])
    torch.testing.assert_close(value, want, rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("variant", ["mc", "ovo", "multi_positive"])
def test_npair_tiny_embeddings_keep_their_gradient(variant):
    """fp32 embeddings of magnitude 1e-30: the logits vanish but the gradient (of order 1e-30, a normal fp32 number)
    is the fp64 one, not flushed to 0."""
    g = torch.Generator().manual_seed(12)
    z = torch.randn(8, 6, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    loss = NPairLoss(l2_reg=0.0, variant=variant)
    value, grad = _value_and_grad(lambda e: loss(e, y), (z * 1e-30).float())
    want, want_grad = _value_and_grad(lambda e: loss(e, y), z * 1e-30)
    assert float(grad.abs().max()) > 0
    torch.testing.assert_close(value.double(), want, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-4, atol=1e-4 * float(want_grad.abs().max()))


@pytest.mark.parametrize("variant", ["mc", "multi_positive"])
def test_npair_without_regulariser_at_huge_magnitude_is_inf_not_nan(variant):
    """Entries of 2**600 (fp64): the true loss is beyond the float range, so ``inf``; with ``l2_reg = 0`` no
    ``0 * inf`` of the (switched-off) regulariser may turn it into NaN."""
    g = torch.Generator().manual_seed(13)
    z = torch.randn(8, 6, generator=g, dtype=torch.float64) * 2.0**600
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    value = NPairLoss(l2_reg=0.0, variant=variant)(z, y)
    assert value.item() == math.inf


def _saturated_eq9_batch():
    """Every anchor's positive is by far its nearest; entries of 2**600 (fp64): the scale squared is beyond the
    float range (the neighbour softmax takes the scale as two factors)."""
    e = torch.eye(4, dtype=torch.float64)
    z = torch.cat([e, e + 0.01 * torch.roll(e, 1, 0)]) * 2.0**600
    return z, torch.tensor([0, 1, 2, 3, 0, 1, 2, 3])


def test_npair_eq9_saturated_at_huge_magnitude_is_zero():
    """Each ``p_i`` is 1 to double precision: the loss is exactly 0 (finite, not NaN)."""
    z, y = _saturated_eq9_batch()
    assert NPairLoss(l2_reg=0.0, variant="multi_positive")(z, y).item() == 0.0


def test_npair_eq9_saturated_at_huge_magnitude_has_zero_gradient():
    """The scale squared is beyond the float range: the backward forms ``W = dL/dl`` (here exactly 0) before
    applying the factors (issue 26: ``grad / sum`` times ``s * s`` first gave ``0 * inf``: a NaN gradient)."""
    z, y = _saturated_eq9_batch()
    value, grad = _value_and_grad(lambda t: NPairLoss(l2_reg=0.0, variant="multi_positive")(t, y), z)
    assert value.item() == 0.0
    assert torch.equal(grad, torch.zeros_like(grad))


def test_ranked_list_mines_non_trivial_pairs_strictly():
    """RLL Eqs. 8-9: positives farther than ``alpha - m`` and negatives closer than ``alpha``, both strict: pairs
    exactly at a threshold are trivial. Cosines 0.5, 0.21875, -0.125 give distances exactly 1, 1.25, 1.5."""
    from lightning_dml.losses import RankedListLoss

    sim = torch.tensor([[1.0, 0.5, 0.21875, -0.125, 0.5]], dtype=torch.float64)
    pos = torch.tensor([[False, True, True, False, False]])
    neg = torch.tensor([[False, False, False, True, True]])
    loss = RankedListLoss(alpha=1.5, margin=0.5, temperature=10.0, lam=1.0)
    # positives: only d = 1.25 > 1.0 (mean 0.25); negatives: only d = 1.0 < 1.5 (weight 1, hinge 0.5)
    torch.testing.assert_close(loss.pair_loss(sim, pos, neg), torch.tensor(0.75, dtype=torch.float64))


@pytest.mark.parametrize("weight", [0.0, 1.0, 2.0])
def test_tuplet_margin_variance_weight_scales_the_regulariser(weight):
    """TML Eq. 17 ``L_tuplet + lambda (L_pos + L_neg)`` for lambda 0, 1 and 2 (all negatives: deterministic)."""
    from lightning_dml.losses import TupletMarginLoss

    z, y = _batch_with_references()
    loss = TupletMarginLoss(scale=8.0, variance_weight=weight, negatives="all")
    value, grad = _value_and_grad(lambda e: loss(e, y), z)
    want, want_grad = _value_and_grad(
        lambda e: RL.tuplet_margin_all_negatives(e, y, scale=8.0, variance_weight=weight), z)
    torch.testing.assert_close(value, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grad, want_grad, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("kind", ["no_positive_pair", "one_class", "duplicates_and_opposites"])
def test_tuplet_margin_degenerate_batches_follow_the_reference(kind):
    """No positive pair (the tuplet and ``L_pos`` terms are 0), one class (``L_neg`` is 0, every LSE0 over an empty
    set is 0), and positive pairs at exactly 0 and pi (fp64 duplicates and opposites: ``theta`` from the cosine
    clamped to ``[-1 + 1e-7, 1 - 1e-7]``, so the gradient stays finite): value and gradient of TML Eqs. 13-17."""
    from lightning_dml.losses import TupletMarginLoss

    g = torch.Generator().manual_seed(14)
    z = torch.randn(6, 5, generator=g, dtype=torch.float64)
    if kind == "no_positive_pair":
        y = torch.arange(6)
    elif kind == "one_class":
        y = torch.zeros(6, dtype=torch.long)
    else:
        z = torch.cat([z[:2], z[:1], -z[1:2], z[4:]])  # row 2 duplicates row 0, row 3 is row 1's opposite
        y = torch.tensor([0, 1, 0, 1, 2, 2])
    for weight in (0.0, 0.5):
        loss = TupletMarginLoss(scale=8.0, variance_weight=weight, negatives="all")
        value, grad = _value_and_grad(lambda e: loss(e, y), z)
        want, want_grad = _value_and_grad(
            lambda e: RL.tuplet_margin_all_negatives(e, y, scale=8.0, variance_weight=weight) + 0.0 * e.sum(), z)
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(value, want, rtol=1e-9, atol=1e-9)
        torch.testing.assert_close(grad, want_grad, rtol=1e-6, atol=1e-8)


def test_nca_scale_must_be_positive():
    assert NCALoss(scale=0.5).scale == 0.5
    for bad in (0.0, -0.5):
        with pytest.raises(ValueError, match="scale must be > 0"):
            NCALoss(scale=bad)


def test_tuplet_margin_with_a_single_positive_pair():
    """One anchor whose only positive is a reference: a single ordered positive pair, one tuplet."""
    from lightning_dml.losses import TupletMarginLoss

    z, _ = _batch_with_references()
    y = torch.tensor([0, 1, 2, 3, 4, 9, 9, 0])  # anchors 0-4 (distinct), references 5-7: only (0, 7) is positive
    loss = TupletMarginLoss(scale=8.0, variance_weight=0.5, negatives="all")
    zz = z[:8]
    value, grad = _value_and_grad(lambda e: loss(e[:5], y[:5], e[5:], y[5:]), zz)
    want, want_grad = _value_and_grad(
        lambda e: RL.tuplet_margin_all_negatives(e[:5], y[:5], scale=8.0, ref=e[5:], ref_labels=y[5:]), zz)
    torch.testing.assert_close(value, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grad, want_grad, rtol=1e-7, atol=1e-9)


def test_npair_eq9_uses_raw_inner_products_beyond_one():
    """Eq. 9 has no clamp: rows of norm about 2.5 (raw products up to about 6, also after the power-of-two
    scaling) give the loop reference."""
    g = torch.Generator().manual_seed(15)
    z = (torch.rand(8, 8, generator=g, dtype=torch.float64) + 0.5)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    loss = NPairLoss(l2_reg=0.01, variant="multi_positive")
    value, grad = _value_and_grad(lambda e: loss(e, y), z)
    want, want_grad = _value_and_grad(lambda e: R.npair_multi_positive(e, y, 0.01), z)
    torch.testing.assert_close(value, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grad, want_grad, rtol=1e-7, atol=1e-9)


def _mp_npair(z, y, variant: str, symmetric: bool = False, l2_reg: float = 0.0):
    """``(value, gradient)`` in float64 of N-pair Eq. 7 (``"mc"``) / Eq. 8 (``"ovo"``) with its regulariser,
    computed in mpmath (60 digits, unbounded exponents) from the definition on the pairs of ``npair_indices``."""
    import mpmath

    from lightning_dml.losses.npair import npair_indices

    a_idx, p_idx = (t.tolist() for t in npair_indices(y))
    n, d = len(a_idx), z.shape[1]
    with mpmath.workdps(60):
        rows = [[mpmath.mpf(v) for v in row] for row in z.double().tolist()]
        a, p = [rows[i] for i in a_idx], [rows[i] for i in p_idx]
        logit = [[mpmath.fsum(u * v for u, v in zip(a[i], p[j])) for j in range(n)] for i in range(n)]

        def one_direction(m):  # value and dL/dm of one direction, m[i][j] the logits
            value, g = mpmath.mpf(0), [[mpmath.mpf(0)] * n for _ in range(n)]
            for i in range(n):
                diff = [m[i][j] - m[i][i] for j in range(n)]
                if variant == "mc":
                    top = max(diff)
                    e = [mpmath.exp(v - top) for v in diff]
                    value += top + mpmath.log(mpmath.fsum(e))
                    for j in range(n):
                        g[i][j] += e[j] / mpmath.fsum(e) / n
                    g[i][i] -= mpmath.mpf(1) / n
                else:
                    for j in range(n):
                        if j != i:
                            value += mpmath.log1p(mpmath.exp(diff[j])) if diff[j] < 0 else (
                                diff[j] + mpmath.log1p(mpmath.exp(-diff[j])))
                            sig = 1 / (1 + mpmath.exp(-diff[j]))
                            g[i][j] += sig / n
                            g[i][i] -= sig / n
            return value / n, g

        value, g = one_direction(logit)
        if symmetric:
            value_t, g_t = one_direction([list(col) for col in zip(*logit)])
            value = (value + value_t) / 2
            g = [[(g[i][j] + g_t[j][i]) / 2 for j in range(n)] for i in range(n)]
        grad = [[mpmath.mpf(0)] * d for _ in rows]
        for i in range(n):
            for j in range(n):
                for k in range(d):
                    grad[a_idx[i]][k] += g[i][j] * p[j][k]
                    grad[p_idx[j]][k] += g[i][j] * a[i][k]
        if l2_reg:
            value += l2_reg * (mpmath.fsum(mpmath.fsum(v * v for v in r) for r in a)
                               + mpmath.fsum(mpmath.fsum(v * v for v in r) for r in p)) / (2 * n)
            for idx in (a_idx, p_idx):
                for i in idx:
                    for k in range(d):
                        grad[i][k] += l2_reg * rows[i][k] / n
        return (torch.tensor(float(value), dtype=torch.float64),
                torch.tensor([[float(v) for v in r] for r in grad], dtype=torch.float64))


def _npair_clustered(seed: int):
    """A trained-like fp64 batch of 8 classes of 2 (the N-pair batch), clusters around 0.7 / 0.45 cosines."""
    from tests.test_losses_trained_like import trained_like_batch

    return trained_like_batch(seed, 0.7, 0.45, classes=8, per_class=2, dim=8)


#: (variant, symmetric, l2_reg, c2): the batch is scaled by sqrt(c2) 2**exponent, c2 chosen so that at 2**510 every
#: row's term is below fp64's maximum and their sum beyond it
NPAIR_EDGE_CASES = [("mc", False, 0.0, 2.0), ("mc", True, 0.005, 2.0), ("ovo", False, 0.0, 0.8),
                    ("ovo", True, 0.005, 0.8)]


@pytest.mark.parametrize("variant, symmetric, l2_reg, c2", NPAIR_EDGE_CASES)
@pytest.mark.parametrize("exponent", [0, 508, 510])
def test_npair_mc_ovo_on_clustered_data_up_to_the_edge_of_fp64(variant, symmetric, l2_reg, c2, exponent):
    """N-pair Eqs. 7-8 on a trained-like batch scaled by ``sqrt(c2) 2**exponent`` (fp64): the mpmath reference's
    value and gradient. At ``2**510`` the rows' terms are ~1e307 to ~1.6e308 and their sum is beyond fp64 (issue
    26: the mean summed them first), and the logits' scale ``s**2`` is beyond fp64: the regulariser's gradient,
    ``s * s`` times that of ``mean ||x||**2``, is finite only with the loss's incoming gradient divided by ``s``."""
    z, y = _npair_clustered(4)
    z = z * math.sqrt(c2) * 2.0**exponent
    zz = z.clone().requires_grad_(True)
    value = NPairLoss(l2_reg=l2_reg, symmetric=symmetric, variant=variant)(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    want, want_grad = _mp_npair(z, y, variant, symmetric, l2_reg)
    if exponent == 510:
        assert 1e307 < float(want) < 1.7e308
    torch.testing.assert_close(value, want, rtol=1e-9, atol=0.0)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-9 * float(want_grad.abs().max()))
