"""Pair losses where an anchor's positive or negative set is empty or degenerate, against the loop references.

* Lifted structure (Song et al. 2016; GPW Eq. 14; MS Eqs. 6 and 16): with label sets an anchor can have positives
  but no negative while the others have both (its set intersects every other set) - the case the class docstring
  spells out: ``"original"`` keeps ``a_j`` for such a pair, ``"gpw"`` and ``"generalized"`` give 0, ``"star"``'s
  empty set contributes 0. A one-class batch (nobody has a negative) is the same for every anchor.
* FastAP (Cakir et al. 2019, Eqs. 9-11): an anchor whose only positive is its opposite (squared distance 4, the
  last histogram bin, below which every bin is empty) has FastAP = 1 and a finite gradient; ``num_bins=1``.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dml.losses import FastAPLoss, LiftedStructureLoss
from tests import reference_losses as RL
from tests import reference_pairset_losses as RP


def _same(labels: torch.Tensor) -> list[list[bool]]:
    """Whether the label sets of ``i`` and ``j`` intersect (by a loop over Python sets)."""
    sets = [{int(v) for v in row if int(v) >= 0} for row in labels]
    return [[bool(a & b) for b in sets] for a in sets]


def _check(loss, reference, z, y, **ref_kw):
    zr = z.clone().requires_grad_(True)
    expected = reference(zr, y, **ref_kw)
    (grad_ref,) = torch.autograd.grad(expected, zr) if expected.requires_grad else (torch.zeros_like(z),)
    paths = (True, False) if loss._has_closed_form() else (False,)
    for closed_form in paths:
        loss.closed_form = closed_form
        zz = z.clone().requires_grad_(True)
        value = loss(zz, y)
        (grad,) = torch.autograd.grad(value, zz, allow_unused=True)
        grad = torch.zeros_like(z) if grad is None else grad
        assert torch.isfinite(value) and torch.isfinite(grad).all()
        torch.testing.assert_close(value, expected.detach(), rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(grad, grad_ref, rtol=1e-7, atol=1e-9)
    return expected.detach()


# anchor 0's set {0, 1} meets every other set: positives, no negative; the others have both
SETS = torch.tensor([[0, 1], [0, -1], [1, -1], [0, -1], [1, -1], [1, -1]])


@pytest.mark.parametrize("kw", [{}, {"variant": "gpw", "margin": 0.5}, {"variant": "generalized"},
                                {"variant": "generalized", "margin": 0.2}, {"variant": "star"},
                                {"variant": "star", "alpha": 3.0, "beta": 5.0}], ids=str)
def test_lifted_structure_with_an_anchor_without_negatives(kw):
    g = torch.Generator().manual_seed(7)
    z = torch.randn(6, 5, generator=g, dtype=torch.float64)
    value = _check(LiftedStructureLoss(**kw), RL.lifted_structure, z, SETS, same=_same(SETS), **kw)
    assert value != 0


@pytest.mark.parametrize("kw", [{}, {"variant": "gpw"}, {"variant": "generalized"}, {"variant": "star"},
                                {"variant": "star", "beta": 2.0}], ids=str)
def test_lifted_structure_of_a_one_class_batch(kw):
    """Nobody has a negative: 0 for the hinged variants, the positive terms alone for ``"star"``."""
    g = torch.Generator().manual_seed(8)
    z, y = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.zeros(5, dtype=torch.long)
    value = _check(LiftedStructureLoss(**kw), RL.lifted_structure, z, y, **kw)
    assert (value != 0) == (kw.get("variant") == "star")


def test_fastap_of_an_anchor_whose_positive_is_its_opposite():
    """Squared distance 4 falls on the last bin centre (kernel weight 1 there, 0 on the bin below, where the
    cumulative histogram is still 0): FastAP = 1, loss 0, and no 0/0 in the gradient."""
    x = torch.tensor([[1.0, 0.0, 0.0]], dtype=torch.float64)
    z, y = torch.cat([x, -x]), torch.tensor([0, 0])
    assert abs(float(_check(FastAPLoss(), RP.fastap, z, y))) < 1e-12
    # with a negative in between, the ratio is read on populated bins too
    z2, y2 = torch.cat([x, -x, torch.tensor([[0.8, 0.6, 0.0]], dtype=torch.float64)]), torch.tensor([0, 0, 1])
    assert _check(FastAPLoss(), RP.fastap, z2, y2) > 0


@pytest.mark.parametrize("num_bins", [1, 2, 3])
def test_fastap_with_the_fewest_bins(num_bins):
    """``num_bins >= 1`` (one bin: centres 0 and 4) matches the loop reference of Eqs. 9-11."""
    g = torch.Generator().manual_seed(9)
    z, y = torch.randn(8, 4, generator=g, dtype=torch.float64), torch.tensor([0, 0, 1, 1, 1, 2, 2, 3])
    assert _check(FastAPLoss(num_bins), lambda zz, yy: RP.fastap(zz, yy, num_bins), z, y) > 0


def test_fastap_gradient_wrt_similarity_is_finite_at_minus_one():
    """``pair_loss`` is differentiable in ``S`` over all of ``[-1, 1]``: at S = -1 (squared distance 4, the last bin
    centre) the empty bin below it must not produce 0/0 in the gradient; a finite difference agrees."""
    sim = torch.tensor([[1.0, -1.0, 0.2], [-1.0, 1.0, 0.4], [0.2, 0.4, 1.0]], dtype=torch.float64, requires_grad=True)
    pos = torch.tensor([[False, True, False], [True, False, False], [False, False, False]])
    neg = torch.tensor([[False, False, False], [False, False, True], [True, True, False]])  # row 0: nothing else
    value = FastAPLoss().pair_loss(sim, pos, neg)
    (grad,) = torch.autograd.grad(value, sim)
    assert torch.isfinite(grad).all()
    step = torch.zeros_like(sim)
    step[1, 2] = 1e-6
    with torch.no_grad():
        numeric = (FastAPLoss().pair_loss(sim + step, pos, neg) - FastAPLoss().pair_loss(sim - step, pos, neg)) / 2e-6
    torch.testing.assert_close(grad[1, 2], numeric, rtol=1e-5, atol=1e-8)
