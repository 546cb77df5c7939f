"""The neighbour softmax of :mod:`lightning_dml.losses.softmax_pairs` (SupCon, NCA, N-pair Eq. 9) at its edges.

:func:`neighbour_softmax_terms` is public and documented for any anchors (not only unit rows): its value and
closed-form gradient are compared here with a plain autograd composition of its docstring (``S = A G^T``, clamped
to ``[-1, 1]`` where asked, logits ``a S``, ``lse_i = log sum_{j != i} e^{l_ij} - r_i`` and
``positives_ik = l_{i, p_k} - r_i`` with ``r_i`` the row's largest logit, held constant) on inputs that reach every
branch: products beyond and exactly at ``+-1``, a scale given as two factors, a reference gallery with only one of
the two inputs requiring a gradient, a one-item batch. The losses built on it are checked against the loop
references of ``tests/reference_pairset_losses.py`` where a shared shift would underflow in fp32, and at the
documented spread threshold of the shared shift (60). Near the float range's edge (issue 26: fp64 N-pair Eq. 9
entries up to ``2**600``, fp32 NCA / SupCon logits up to 1e38) they are compared, on trained-like and clustered
batches, with an mpmath reference of their values and gradients (``_mp_neighbour_loss``).
"""

from __future__ import annotations

import math

import pytest
import torch

import lightning_dml.losses.softmax_pairs as softmax_pairs
from lightning_dml.losses import NCALoss, NPairLoss, SupConLoss
from lightning_dml.losses.softmax_pairs import neighbour_log_probability, neighbour_softmax_terms
from lightning_dml.miners.pairs import positive_table
from tests import reference_pairset_losses as R


@pytest.fixture
def paths(monkeypatch):
    """The (common shift, clamped) path of every forward of the neighbour softmax."""
    seen: list[tuple[bool, bool]] = []
    forward = softmax_pairs._NeighbourSoftmax.forward

    def spy(ctx, *args):
        out = forward(ctx, *args)
        seen.append((ctx.common, ctx.out_of_range is not None))
        return out

    monkeypatch.setattr(softmax_pairs._NeighbourSoftmax, "forward", staticmethod(spy))
    return seen


def plain_terms(anchors, labels, gallery, gallery_labels, factors, clamp):
    """The docstring of ``neighbour_softmax_terms`` composed with autograd (``r_i`` detached: a constant).

    The clamp is written out: ``torch.clamp``'s own backward also zeroes the gradient at exactly +-1, a choice
    of subgradient the docstring does not make ("its gradient is 0 outside" ``[-1, 1]``)."""
    b = anchors.shape[0]
    g = anchors if gallery is None else gallery
    s = anchors @ g.T
    if clamp:  # the value clamped, the gradient 0 outside [-1, 1] (the closed interval: +-1 keep theirs)
        s = torch.where((s < -1.0) | (s > 1.0), s.detach().clamp(-1.0, 1.0), s)
    logits = s * math.prod(factors)
    others = torch.ones_like(logits, dtype=torch.bool)
    others[:, :b] &= ~torch.eye(b, dtype=torch.bool)
    masked = logits.masked_fill(~others, -math.inf)
    r = masked.amax(dim=1).detach()
    r = torch.where(torch.isfinite(r), r, 0.0)
    lse = torch.logsumexp(masked, dim=1) - r
    _, cols, valid = positive_table(labels, gallery_labels)
    return lse, logits.gather(1, cols) - r[:, None], valid


def _downstream(lse, positives, valid):
    """A generic scalar of both outputs (fixed weights), so that both gradients are exercised."""
    g = torch.Generator().manual_seed(7)
    w1 = torch.rand(lse.shape, generator=g, dtype=lse.dtype) + 0.5
    w2 = torch.rand(positives.shape, generator=g, dtype=positives.dtype) - 0.5
    return (w1 * torch.where(torch.isfinite(lse), lse, 0.0)).sum() + torch.where(valid, w2 * positives, 0.0).sum()


def _boundary_batch(below_only: bool = False):
    """fp64 rows (not unit) with same-label pairs whose products are exactly 1 and -1, 1.44 and -1.44, plus small
    random rows; ``below_only``: no product above 1 (only the pair at -1.44 leaves the range)."""
    e = torch.eye(6, dtype=torch.float64)
    g = torch.Generator().manual_seed(3)
    rows = [e[0], e[0], e[1], -e[1], 1.2 * e[3], -1.2 * e[3]]
    labels = [0, 0, 1, 1, 3, 3]
    if not below_only:
        rows += [1.2 * e[2], 1.2 * e[2]]
        labels += [2, 2]
    small = 0.3 * torch.randn(6, 6, generator=g, dtype=torch.float64)
    z = torch.cat([torch.stack(rows), small])
    y = torch.tensor(labels + [4, 4, 5, 5, 6, 7])
    return z, y


def _compare(z, y, gallery=None, gallery_labels=None, factors=(3.0,), clamp=True, grads=(True, True)):
    a = z.clone().requires_grad_(grads[0])
    gal = None if gallery is None else gallery.clone().requires_grad_(grads[1])
    gl = y if gallery_labels is None else gallery_labels
    lse, positives, valid = neighbour_softmax_terms(a, y, gal, gl, factors if len(factors) > 1 else factors[0], clamp)
    a2 = z.clone().requires_grad_(grads[0])
    gal2 = None if gallery is None else gallery.clone().requires_grad_(grads[1])
    p_lse, p_pos, p_valid = plain_terms(a2, y, gal2, gl, factors, clamp)
    assert torch.equal(valid, p_valid)
    torch.testing.assert_close(lse, p_lse, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(positives[valid], p_pos[p_valid], rtol=1e-12, atol=1e-12)
    inputs = [t for t in (a, gal) if t is not None and t.requires_grad]
    inputs2 = [t for t in (a2, gal2) if t is not None and t.requires_grad]
    got = torch.autograd.grad(_downstream(lse, positives, valid), inputs)
    want = torch.autograd.grad(_downstream(p_lse, p_pos, p_valid), inputs2)
    for x, w in zip(got, want):
        torch.testing.assert_close(x, w, rtol=1e-10, atol=1e-12)


def test_products_beyond_and_at_the_unit_range_are_clamped_with_zero_gradient_outside(paths):
    """Products 1.44 / -1.44 (positives) are clamped to +-1 with zero gradient; exactly +-1 keep theirs."""
    z, y = _boundary_batch()
    _compare(z, y)
    assert paths[-1] == (False, True)


def test_a_product_only_below_minus_one_also_clamps(paths):
    z, y = _boundary_batch(below_only=True)
    _compare(z, y)
    assert paths[-1] == (False, True)


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_products_exactly_at_plus_or_minus_one_need_no_clamp(paths, sign):
    """Unit rows whose largest (smallest) product is exactly 1 (-1): in range, the unclamped shared-shift path."""
    e = torch.eye(4, dtype=torch.float64)
    z = torch.stack([e[0], sign * e[0], e[1], e[2], e[3], -0.6 * e[1] + 0.8 * e[2]])
    y = torch.tensor([0, 0, 1, 1, 2, 2])
    _compare(z, y)
    assert paths[-1] == (True, False)


def test_rows_whose_largest_product_is_negative_keep_it_as_their_shift():
    """The clamp path with rows whose largest product is below -1 (row 3: -1.3) or in (-1, 0) (row 4: -0.3):
    ``r_i`` is the clamped value, -1 and -0.3."""
    z = torch.tensor([[2.0, 0.0, 0.0], [1.5, 0.5, 0.0], [1.5, -0.5, 0.0], [-1.0, 0.0, 1.0], [-0.2, 0.0, -1.5]],
                     dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 2, 2])
    _compare(z, y)


def test_no_clamp_keeps_products_beyond_one():
    z, y = _boundary_batch()
    _compare(z, y, clamp=False)


@pytest.mark.parametrize("clamp", [True, False])
def test_a_scale_given_as_two_factors(clamp):
    """``a = (2, 1.5)``: applied one after the other, the logits are ``3 S``."""
    z, y = _boundary_batch()
    _compare(z, y, factors=(2.0, 1.5), clamp=clamp)


@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)], ids=["both", "anchors", "gallery"])
def test_a_reference_gallery_gets_its_own_gradient(grads):
    """Anchors are the gallery's first rows; each input gets its gradient whether or not the other needs one."""
    z, y = _boundary_batch()
    g = torch.Generator().manual_seed(5)
    extra = torch.randn(5, 6, generator=g, dtype=torch.float64) * 0.4
    gallery = torch.cat([z, extra])
    gallery_labels = torch.cat([y, torch.tensor([0, 1, 4, 9, 9])])
    anchors = gallery[: y.numel()]
    _compare(anchors, y, gallery=gallery, gallery_labels=gallery_labels, grads=grads)


def test_one_item_has_no_others_and_a_zero_gradient():
    """``lse = -inf`` for an anchor without any other item; whatever weight the caller gives it, the gradient is 0."""
    z = torch.tensor([[0.6, 0.8]], dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0])
    lse, positives, valid = neighbour_softmax_terms(z, y, None, y, 5.0)
    assert lse.shape == (1,) and lse[0] == -math.inf and not valid.any()
    (grad,) = torch.autograd.grad((lse * 2.0).sum(), z)
    assert torch.equal(grad, torch.zeros_like(z))


def test_log_probability_of_an_anchor_without_positives_is_minus_inf():
    """``neighbour_log_probability``: ``-inf`` without positives, 0 when every other item is a positive, else
    ``log sum_P e^l - log sum_{j != i} e^l``."""
    z = torch.tensor([[1.0, 0.0], [0.8, 0.6], [0.0, 1.0], [-0.6, 0.8]], dtype=torch.float64)
    for y, expect_zero in ((torch.tensor([0, 0, 1, 2]), False), (torch.tensor([3, 3, 3, 3]), True)):
        lse, positives, valid = neighbour_softmax_terms(z, y, None, y, 2.0)
        log_p = neighbour_log_probability(lse, positives, valid, y.numel())
        s = 2.0 * (z @ z.T)
        for i in range(4):
            others = [j for j in range(4) if j != i]
            pos = [j for j in others if y[j] == y[i]]
            if not pos:
                assert log_p[i] == -math.inf
            elif expect_zero:
                assert log_p[i] == 0.0
            else:
                want = torch.logsumexp(s[i, pos], 0) - torch.logsumexp(s[i, others], 0)
                torch.testing.assert_close(log_p[i], want, rtol=1e-12, atol=1e-12)


def _far_apart_rows_fp32():
    """Unit rows (fp32) whose largest cosines are about 0.05 (class 1) and -0.2 (class 0): at temperature 0.001 the
    rows' largest logits spread by about 250, and even the row maximum 0.05 is below the spread threshold alone."""
    c, d = math.sqrt(0.2), math.sqrt(0.6)
    y1 = [1.0, 0.0, 0.0, 0.0]
    y2 = [0.05, math.sqrt(1 - 0.05**2), 0.0, 0.0]
    x1 = [-c, -c, d, 0.0]
    x2 = [-c, -c, -d, 0.0]
    return torch.tensor([x1, x2, y1, y2], dtype=torch.float32), torch.tensor([0, 0, 1, 1])


def test_rows_far_apart_take_per_row_shifts_in_fp32(paths):
    """A shift shared by rows whose largest logits differ by about 250 would underflow the far rows' sums in fp32
    (``e^-250``); the result must still be SupCon Eq. 2 (the fp64 loop reference)."""
    z, y = _far_apart_rows_fp32()
    loss = SupConLoss(temperature=0.001)
    zz = z.clone().requires_grad_(True)
    value = loss(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    assert paths[-1] == (False, False)
    zr = z.double().requires_grad_(True)
    ref = R.supcon(zr, y, temperature=0.001)
    (ref_grad,) = torch.autograd.grad(ref, zr)
    assert torch.isfinite(value)
    torch.testing.assert_close(value.double(), ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("scale, common", [(29.75, True), (30.0, True), (30.25, False)])
def test_the_shared_shift_up_to_a_spread_of_sixty(paths, scale, common):
    """NCA logits ``2 s S``: rows with largest cosine exactly 1 and exactly 0 spread by ``2 s``; the documented
    threshold is 60 (inclusive). Both sides give NCA Eq. 1-2 (the loop reference)."""
    e = torch.eye(3, dtype=torch.float64)
    z = torch.stack([e[0], e[0], e[1], e[2]])
    y = torch.tensor([0, 0, 1, 1])
    zz = z.clone().requires_grad_(True)
    value = NCALoss(scale)(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    assert paths[-1] == (common, False)
    zr = z.clone().requires_grad_(True)
    ref = R.nca(zr, y, scale)
    (ref_grad,) = torch.autograd.grad(ref, zr)
    torch.testing.assert_close(value, ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-9)


def _huge_rows(exponent: int):
    g = torch.Generator().manual_seed(0)
    z0 = torch.rand(8, 16, dtype=torch.float64, generator=g) * 0.5 + 0.5
    return z0 * 2.0**exponent, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])


def test_npair_eq9_per_anchor_terms_at_the_edge_of_fp64():
    """One factor ``a = 2**1022`` (N-pair Eq. 9 at entries near ``2**511``): ``a S`` alone overflows fp64, so the
    exponents are formed as ``a (S - shift)`` (issue 26: ``a S - a shift`` gave ``inf - inf``, a NaN / -inf lse).
    ``-log p_i >= 0`` (``p_i`` a probability) and, with every softmax saturated, homogeneous of degree 2 in
    the embeddings: the terms at ``2 z`` are 4 times those at ``z``."""
    per_anchor = {}
    for exponent in (510, 511):
        z, y = _huge_rows(exponent)
        from lightning_dml.losses.npair import scaled_for_inner_products

        x, _, s = scaled_for_inner_products(z)
        factors = (s * s,) if math.isfinite(s * s) else (s, s)
        lse, positives, valid = neighbour_softmax_terms(x, y, None, y, factors, clamp=False)
        per_anchor[exponent] = -neighbour_log_probability(lse, positives, valid, y.numel())
    assert bool((per_anchor[511] >= 0).all())
    torch.testing.assert_close(per_anchor[511], 4.0 * per_anchor[510], rtol=1e-9, atol=0.0)


def test_npair_eq9_loss_is_finite_where_the_true_mean_is():
    """Each per-anchor term is divided by the count before the sum (issue 26: the sum of the terms overflowed fp64
    where their mean does not). With every softmax saturated the loss is homogeneous of degree 2: at ``2 z`` it is
    4 times that at ``z`` (about 2.7e307 here, finite in fp64)."""
    loss = NPairLoss(l2_reg=0.0, variant="multi_positive")
    z510, y = _huge_rows(510)
    z511, _ = _huge_rows(511)
    low, high = loss(z510, y), loss(z511, y)
    assert math.isfinite(float(high))
    torch.testing.assert_close(high, 4.0 * low, rtol=1e-9, atol=0.0)


# ------------------------------------------------------------------------------------------- extremes (issue 26)
# Trained-like clustered batches at scales near the float range's edge, against a reference computed in mpmath from
# the losses' definitions (exponents unbounded, 60 digits: no overflow, no underflow, no cancellation to speak of).


def _mp_neighbour_loss(z: torch.Tensor, y: torch.Tensor, kind: str, a: float = 1.0, l2_reg: float = 0.0):
    """``(value, gradient)`` in float64 of a neighbour-softmax loss, computed in mpmath from its definition.

    Logits ``l_ij = a x_i . x_j`` over the others ``j != i`` (``x = z`` for ``"eq9"``, N-pair Eq. 9; unit rows of
    ``z`` otherwise), per-anchor terms over the anchors with a positive, averaged: ``"nca"`` / ``"eq9"``
    ``-log p_i`` (NCA Eq. 2 with the constant of ``-s ||x_i - x_j||^2`` cancelled: ``a = 2 s``), ``"supcon"``
    SupCon Eq. 2 ``lse_i - mean_P l_ip``; plus ``l2_reg`` times the mean squared norm of those anchors (``"eq9"``).
    The gradient is the chain rule written out: ``dt_i/dl_ij`` (``p_ij - q_ij``, resp. ``p_ij - [j in P] / |P|``),
    ``dl_ij/dx = a (x_j, x_i)`` and, for unit rows, the projection ``(I - x x^T) / ||z||``."""
    import mpmath

    with mpmath.workdps(60):
        rows = [[mpmath.mpf(v) for v in row] for row in z.double().tolist()]
        labels = y.tolist()
        n, d = len(rows), len(rows[0])
        norms = [mpmath.sqrt(mpmath.fsum(v * v for v in row)) for row in rows]
        x = rows if kind == "eq9" else [[v / nr for v in row] for row, nr in zip(rows, norms)]
        logit = [[a * mpmath.fsum(p * q for p, q in zip(x[i], x[j])) for j in range(n)] for i in range(n)]
        anchors = [i for i in range(n) if any(labels[j] == labels[i] for j in range(n) if j != i)]
        value = mpmath.mpf(0)
        grad_x = [[mpmath.mpf(0)] * d for _ in range(n)]
        for i in anchors:
            others = [j for j in range(n) if j != i]
            pos = [j for j in others if labels[j] == labels[i]]
            top = max(logit[i][j] for j in others)
            e = {j: mpmath.exp(logit[i][j] - top) for j in others}
            den, num = mpmath.fsum(e.values()), mpmath.fsum(e[j] for j in pos)
            if kind == "supcon":
                value += mpmath.log(den) - mpmath.fsum(logit[i][j] - top for j in pos) / len(pos)
                dt = {j: e[j] / den - (1 / mpmath.mpf(len(pos)) if j in pos else 0) for j in others}
            else:
                value += mpmath.log(den) - mpmath.log(num)
                dt = {j: e[j] / den - (e[j] / num if j in pos else 0) for j in others}
            for j in others:  # l_ij = a x_i . x_j
                for k in range(d):
                    grad_x[i][k] += a * dt[j] * x[j][k] / len(anchors)
                    grad_x[j][k] += a * dt[j] * x[i][k] / len(anchors)
        value /= len(anchors)
        if l2_reg:
            value += l2_reg * mpmath.fsum(mpmath.fsum(v * v for v in rows[i]) for i in anchors) / len(anchors)
            for i in anchors:
                for k in range(d):
                    grad_x[i][k] += 2 * l2_reg * rows[i][k] / len(anchors)
        if kind == "eq9":
            grad = grad_x
        else:  # through x = z / ||z||: (g - (g . x) x) / ||z||
            grad = []
            for g, xi, nr in zip(grad_x, x, norms):
                dot = mpmath.fsum(p * q for p, q in zip(g, xi))
                grad.append([(gk - dot * xk) / nr for gk, xk in zip(g, xi)])
        return (torch.tensor(float(value), dtype=torch.float64),
                torch.tensor([[float(v) for v in row] for row in grad], dtype=torch.float64))


def _clustered(seed: int, pos_cos: float, neg_cos: float, classes: int = 6, per_class: int = 3, dim: int = 8):
    from tests.test_losses_trained_like import trained_like_batch

    return trained_like_batch(seed, pos_cos, neg_cos, classes=classes, per_class=per_class, dim=dim)


def _tight_clusters(seed: int, classes: int = 6, per_class: int = 3, dim: int = 8):
    """fp64 items ``3 (c_y + 0.1 noise)`` around orthonormal class centres: every item's largest inner product with
    another item is with one of its class (by more than 5: checked), so a large enough scale saturates every
    softmax of N-pair Eq. 9 on a positive."""
    g = torch.Generator().manual_seed(seed)
    centres, _ = torch.linalg.qr(torch.randn(dim, dim, generator=g, dtype=torch.float64))
    y = torch.arange(classes).repeat_interleave(per_class)
    z = 3.0 * (centres[:classes][y] + 0.1 * torch.randn(y.numel(), dim, generator=g, dtype=torch.float64))
    s = z @ z.T
    same = (y[:, None] == y[None, :]).fill_diagonal_(False)
    other = ~same.clone().fill_diagonal_(True)
    assert bool((s.masked_fill(~same, -math.inf).amax(1) > s.masked_fill(~other, -math.inf).amax(1) + 5).all())
    return z, y


def _assert_matches(value, grad, want, want_grad, rtol):
    """Value and gradient equal to the reference (the same infinities; the gradient to ``rtol`` of its largest
    entry, componentwise, or to the dtype's smallest normal number where the reference's are below it)."""
    assert torch.isfinite(want) == torch.isfinite(value), (value, want)
    torch.testing.assert_close(value.double(), want, rtol=rtol, atol=0.0)
    if torch.isfinite(want):
        assert torch.isfinite(grad).all()
        atol = max(rtol * float(want_grad.abs().max()), torch.finfo(grad.dtype).tiny)
        torch.testing.assert_close(grad.double(), want_grad, rtol=rtol, atol=atol)


@pytest.mark.parametrize("exponent", [0, 256, 509, 510, 511])
def test_npair_eq9_on_clustered_data_up_to_the_edge_of_fp64(exponent):
    """N-pair Eq. 9 on a trained-like batch scaled by ``2**exponent`` (fp64): the value and gradient of the
    mpmath reference. From ``2**510`` the logits' scale ``s**2`` is ``2**1022`` (one factor, ``a S`` alone beyond
    the range), at ``2**511`` it is beyond the range itself (two factors); the largest values are ~1e307, whose
    sum over the anchors is not finite."""
    z, y = _clustered(0, 0.7, 0.45)
    z = z * 2.0**exponent
    loss = NPairLoss(l2_reg=0.0, variant="multi_positive")
    zz = z.clone().requires_grad_(True)
    value = loss(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    want, want_grad = _mp_neighbour_loss(z, y, "eq9")
    if exponent >= 510:
        assert 1e306 < float(want) < 1.7e308  # near the edge, and finite
    _assert_matches(value, grad, want, want_grad, rtol=1e-9)


def test_npair_eq9_regulariser_at_the_edge_of_fp64():
    """Tight clusters at ``2**511`` (every anchor's nearest item is a positive: the softmax part is exactly 0) with
    ``l2_reg = 0.005``: ``s**2 mean ||x||**2`` is beyond fp64, ``l2_reg`` times it is not (~1e306): finite, and
    equal to the reference with its gradient (~2**505: the gradient w.r.t. ``x / s``, ``s`` times that, is not
    finite, so none is formed)."""
    z, y = _tight_clusters(0)
    z = z * 2.0**511
    loss = NPairLoss(l2_reg=0.005, variant="multi_positive")
    zz = z.clone().requires_grad_(True)
    value = loss(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    want, want_grad = _mp_neighbour_loss(z, y, "eq9", l2_reg=0.005)
    assert 1e305 < float(want) < 1.7e308
    _assert_matches(value, grad, want, want_grad, rtol=1e-9)


def test_npair_eq9_saturated_clusters_beyond_the_squared_range():
    """Tight clusters at ``2**600`` (fp64, two factors): every ``p_i`` is 1 to double precision, so the value and
    the gradient are exactly 0 (the reference's are ~e^(-2**1100))."""
    z, y = _tight_clusters(1)
    z = z * 2.0**600
    zz = z.clone().requires_grad_(True)
    value = NPairLoss(l2_reg=0.0, variant="multi_positive")(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    want, want_grad = _mp_neighbour_loss(z, y, "eq9")
    assert float(want) == 0.0 and not want_grad.any()
    assert value.item() == 0.0 and torch.equal(grad, torch.zeros_like(grad))


#: fp32 scales from ordinary to the edge of the range: NCA's ``a = 2 s`` up to 1e38, SupCon's ``1 / tau`` up to 5e37
EXTREME_FP32 = [("nca", 1.0), ("nca", 1e4), ("nca", 1e30), ("nca", 5e37),
                ("supcon", 0.1), ("supcon", 1e-4), ("supcon", 1e-30), ("supcon", 2e-38)]


@pytest.mark.parametrize("name, param", EXTREME_FP32, ids=[f"{n}-{p:g}" for n, p in EXTREME_FP32])
@pytest.mark.parametrize("batch", ["at_lambda", "tight"])
def test_fp32_clustered_batches_at_extreme_scales(name, param, batch):
    """NCA and SupCon in fp32 on trained-like batches (6 classes of 4): the closed form's value and gradient equal
    the mpmath reference to fp32 precision at every scale, finite up to logits of 1e38 (where the anchors' terms,
    ~1e37 each, sum beyond fp32's range although their mean does not)."""
    seed, pos_cos, neg_cos = {"at_lambda": (0, 0.7, 0.45), "tight": (2, 0.96, 0.8)}[batch]
    z, y = _clustered(seed, pos_cos, neg_cos, classes=6, per_class=4, dim=8)
    loss = NCALoss(scale=param) if name == "nca" else SupConLoss(temperature=param)
    a = 2.0 * param if name == "nca" else 1.0 / param
    zz = z.float().requires_grad_(True)
    value = loss(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    want, want_grad = _mp_neighbour_loss(z.float(), y, name, a=a)
    assert torch.isfinite(want)
    _assert_matches(value, grad, want, want_grad, rtol=2e-4)


@pytest.mark.parametrize("name", ["nca", "supcon"])
def test_fp32_terms_whose_sum_overflows_have_a_finite_mean(name):
    """Every anchor's nearest item is a negative (cosine ~1) and its positive points away (~-1): at logits of
    ``1e38 S`` (NCA ``s = 5e37``, SupCon ``tau = 1e-38``) each anchor's term is ~2e38, finite in fp32, and their
    sum (8e38) is not; the loss is their mean, equal to the reference with its gradient."""
    g = torch.Generator().manual_seed(4)
    e = torch.eye(4, dtype=torch.float64)
    z = torch.stack([e[0], e[0], -e[0], -e[0], e[1], e[1], -e[1], -e[1]])
    z = z + 0.01 * torch.randn(8, 4, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 0, 1, 2, 3, 2, 3])
    loss = NCALoss(scale=5e37) if name == "nca" else SupConLoss(temperature=1e-38)
    zz = z.float().requires_grad_(True)
    value = loss(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    want, want_grad = _mp_neighbour_loss(z.float(), y, name, a=1e38)
    assert 1e38 < float(want) < 3e38
    _assert_matches(value, grad, want, want_grad, rtol=2e-4)


def test_supcon_fp32_positives_whose_sum_overflows():
    """Anchors 0 and 3 have two positives pointing away (cosine ~-1) and a negative at cosine ~1: at
    ``tau = 1e-38`` their positives' logits relative to the row maximum are ~-2e38 each, whose sum is beyond fp32;
    SupCon Eq. 2 takes their mean (each divided by ``|P(i)|`` first): finite, equal to the reference."""
    g = torch.Generator().manual_seed(6)
    e = torch.eye(3, dtype=torch.float64)
    z = torch.stack([e[0], -e[0], -e[0], e[0], -e[0], -e[0]]) + 0.01 * torch.randn(6, 3, generator=g,
                                                                                   dtype=torch.float64)
    y = torch.tensor([0, 0, 0, 1, 1, 1])
    zz = z.float().requires_grad_(True)
    value = SupConLoss(temperature=1e-38)(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    want, want_grad = _mp_neighbour_loss(z.float(), y, "supcon", a=1e38)
    assert 1e38 < float(want) < 3e38
    _assert_matches(value, grad, want, want_grad, rtol=2e-4)
