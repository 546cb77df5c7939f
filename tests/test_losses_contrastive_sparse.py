"""ContrastiveLoss's sparse closed form (``ContrastiveLoss.compute``) where its shortcuts decide.

The default path lists only the positive pairs and the negatives of the rows whose largest non-self similarity can
reach the negative margin (``D < m2`` <=> ``S > 1 - m2^2 / 2``); it must give the value and gradient of the loop
reference (``tests/reference_losses.py``, contrastive loss of Hadsell et al. / pml's ``ContrastiveLoss``) and of
the autograd path (``closed_form=False``) for: a single candidate row, references beyond the batch, label sets
with the ``"mean"`` reduction (its divisor counts the ``B x N`` pairs), positive margins with pairs inside them.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dml.losses import ContrastiveLoss
from tests import reference_losses as ref


def _value_and_grad(loss, z, y, **kw):
    zz = z.clone().requires_grad_(True)
    value = loss(zz, y, **kw)
    (grad,) = torch.autograd.grad(value, zz)
    return value.detach(), grad


def test_the_default_path_is_the_sparse_closed_form():
    z, y = torch.randn(6, 4, dtype=torch.float64), torch.tensor([0, 0, 1, 1, 2, 2])
    value = ContrastiveLoss()(z.requires_grad_(True), y)
    assert type(value.grad_fn).__name__ == "ClosedFormPairFunctionBackward" and value.grad_fn.sparse
    loss = ContrastiveLoss()
    loss.closed_form = False
    assert type(loss(z, y).grad_fn).__name__ != "ClosedFormPairFunctionBackward"


def _unit(*angles: float) -> torch.Tensor:
    return torch.tensor([[math.cos(a), math.sin(a), 0.0] for a in angles], dtype=torch.float64)


@pytest.mark.parametrize("kw", [{}, {"reduction": "mean"}, {"reduction": "sum", "squared": True},
                                {"squared_hinge": True}], ids=str)
def test_a_single_candidate_row(kw):
    """Only anchor 0 has a pair within the margin (its negative reference at S = cos(0.45) = 0.90, D = 0.45 < 0.8):
    the row list holds one row, whose negative term must still count."""
    z = torch.cat([_unit(0.0), torch.tensor([[0.0, 0.0, 1.0]], dtype=torch.float64)])
    y = torch.tensor([0, 0])
    r, ry = _unit(0.45, math.pi), torch.tensor([1, 1])
    value, grad = _value_and_grad(ContrastiveLoss(**kw), z, y, ref_embeddings=r, ref_labels=ry)
    zr = z.clone().requires_grad_(True)
    expected = ref.contrastive(zr, y, ref=r, ref_labels=ry, **kw)
    (grad_ref,) = torch.autograd.grad(expected, zr)
    assert expected > 0
    torch.testing.assert_close(value, expected.detach())
    torch.testing.assert_close(grad, grad_ref)


@pytest.mark.parametrize("kw", [{"reduction": "mean"}, {"reduction": "mean", "squared": True, "pos_margin": 0.1},
                                {}, {"reduction": "sum"}], ids=str)
def test_label_sets_with_references_on_both_paths(kw):
    """Label sets ``[B, L]`` (a pair is positive when the sets intersect) against references: the mean's divisor
    is the number of positive (negative) pairs of the ``B x (B + M)`` gallery, whatever the set width ``L``."""
    g = torch.Generator().manual_seed(2)
    z, r = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(3, 4, generator=g, dtype=torch.float64)
    y = torch.tensor([[0, -1, -1], [0, 1, -1], [2, -1, -1], [1, 2, 3], [4, -1, -1]])
    ry = torch.tensor([[2, 4, -1], [0, -1, -1], [5, -1, -1]])
    results = []
    for closed_form in (True, False):
        loss = ContrastiveLoss(neg_margin=1.2, **kw)
        loss.closed_form = closed_form
        results.append(_value_and_grad(loss, z, y, ref_embeddings=r, ref_labels=ry))
    (v1, g1), (v2, g2) = results
    assert v1 > 0
    torch.testing.assert_close(v1, v2)
    torch.testing.assert_close(g1, g2)


@pytest.mark.parametrize("kw", [{"pos_margin": 0.5}, {"pos_margin": 0.5, "squared": True},
                                {"pos_margin": 0.5, "reduction": "mean"}, {"pos_margin": 0.5, "squared_hinge": True},
                                {"pos_margin": 0.5, "reduction": "sum"}], ids=str)
def test_positive_pairs_inside_the_positive_margin(kw):
    """Positive pairs nearer than ``pos_margin`` have a zero hinge: no loss, no gradient, and (``mean_nonzero``)
    not counted; on both paths, as the loop reference."""
    z = torch.cat([_unit(0.0, 0.2, 1.2, 3.0, 3.1, 4.5)])
    y = torch.tensor([0, 0, 0, 1, 1, 1])  # D(0, 0.2) = 0.2 < 0.5 inside; D(0, 1.2) = 1.13 outside
    zr = z.clone().requires_grad_(True)
    expected = ref.contrastive(zr, y, **kw)
    (grad_ref,) = torch.autograd.grad(expected, zr)
    for closed_form in (True, False):
        loss = ContrastiveLoss(**kw)
        loss.closed_form = closed_form
        value, grad = _value_and_grad(loss, z, y)
        torch.testing.assert_close(value, expected.detach())
        torch.testing.assert_close(grad, grad_ref)


@pytest.mark.parametrize("neg_margin", [0.8, 0.3])
def test_a_negative_just_inside_the_margin_counts(neg_margin):
    """A single active negative at ``D = m2 - 4e-7`` (hinge 4e-7): its row's largest similarity exceeds the
    candidate bound ``1 - m2^2 / 2`` by less than 1e-6, and the pair must still be listed."""
    gap = neg_margin - 4e-7
    angle = 2.0 * math.asin(gap / 2.0)
    z = torch.cat([_unit(0.0, angle), torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.0, -1.0]], dtype=torch.float64)])
    y = torch.tensor([0, 1, 2, 3])
    value, grad = _value_and_grad(ContrastiveLoss(neg_margin=neg_margin), z, y)
    zr = z.clone().requires_grad_(True)
    expected = ref.contrastive(zr, y, neg_margin=neg_margin)
    (grad_ref,) = torch.autograd.grad(expected, zr)
    assert 3e-7 < float(expected.detach()) < 5e-7
    torch.testing.assert_close(value, expected.detach(), rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(grad, grad_ref)


@pytest.mark.parametrize("kw", [{"pos_margin": 0.5}, {"pos_margin": 0.5, "squared": True, "squared_hinge": True},
                                {"pos_margin": 0.5, "reduction": "mean"}], ids=str)
def test_dense_closed_form_with_positives_inside_the_margin(kw):
    """``pair_loss_and_grad`` (``dL/dS`` in closed form, used by ``PairLoss.compute`` for the dense path) equals
    ``pair_loss`` and autograd through it on a ``B x N`` similarity matrix whose positives lie partly within
    ``pos_margin`` (zero hinge, zero weight, not counted by ``mean_nonzero``)."""
    sim = torch.tensor([[1.0, 0.99, 0.2, -0.3, 0.6], [0.99, 1.0, 0.1, 0.95, 0.3], [0.2, 0.1, 1.0, 0.5, 0.98]],
                       dtype=torch.float64)
    pos = torch.tensor([[False, True, True, False, False], [True, False, False, True, False],
                        [True, False, False, False, True]])
    neg = ~pos & ~torch.eye(3, 5, dtype=torch.bool)
    loss = ContrastiveLoss(**kw)
    value, weights = loss.pair_loss_and_grad(sim, pos, neg)
    s = sim.clone().requires_grad_(True)
    expected = loss.pair_loss(s, pos, neg)
    (grad,) = torch.autograd.grad(expected, s)
    torch.testing.assert_close(value, expected.detach())
    torch.testing.assert_close(weights, grad)
