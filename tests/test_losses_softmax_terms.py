"""The neighbour softmax of :mod:`lightning_dml.losses.softmax_pairs` (SupCon, NCA, N-pair Eq. 9) at its edges.

:func:`neighbour_softmax_terms` is public and documented for any anchors (not only unit rows): its value and
closed-form gradient are compared here with a plain autograd composition of its docstring (``S = A G^T``, clamped
to ``[-1, 1]`` where asked, logits ``a S``, ``lse_i = log sum_{j != i} e^{l_ij} - r_i`` and
``positives_ik = l_{i, p_k} - r_i`` with ``r_i`` the row's largest logit, held constant) on inputs that reach every
branch: products beyond and exactly at ``+-1``, a scale given as two factors, a reference gallery with only one of
the two inputs requiring a gradient, a one-item batch. The losses built on it are checked against the loop
references of ``tests/reference_pairset_losses.py`` where a shared shift would underflow in fp32, and at the
documented spread threshold of the shared shift (60).
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


@pytest.mark.xfail(
    strict=True,
    reason="bug: with one factor a (N-pair Eq. 9 at entries near 2**511, a = 2**1022) the forward forms "
    "a S - a shift, whose terms overflow fp64 (inf - inf): an anchor's lse is NaN/-inf and the loss -inf; "
    "forming a (S - shift) (the two-factor path) fixes it",
)
def test_npair_eq9_per_anchor_terms_at_the_edge_of_fp64():
    """``-log p_i >= 0`` (``p_i`` a probability) and, with every softmax saturated, homogeneous of degree 2 in
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


@pytest.mark.xfail(
    strict=True,
    reason="bug: NPairLoss(variant='multi_positive') sums the per-anchor terms before dividing by their count, "
    "so a mean below the fp64 range overflows to inf (and the one-factor forward gives -inf, see above); "
    "dividing each term by the count first, and the fix above, give the true value",
)
def test_npair_eq9_loss_is_finite_where_the_true_mean_is():
    """With every softmax saturated the loss is homogeneous of degree 2: at ``2 z`` it is 4 times that at ``z``
    (about 2.7e307 here, finite in fp64)."""
    loss = NPairLoss(l2_reg=0.0, variant="multi_positive")
    z510, y = _huge_rows(510)
    z511, _ = _huge_rows(511)
    low, high = loss(z510, y), loss(z511, y)
    assert math.isfinite(float(high))
    torch.testing.assert_close(high, 4.0 * low, rtol=1e-9, atol=0.0)
