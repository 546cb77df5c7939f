"""The shared pieces of the pair losses (``lightning_dml/losses/base.py``) at the edges of their contracts.

* SPEC 0.3 numerics: ``S`` clamped to ``[-1, 1]``, ``D = sqrt(max(2 - 2S, 1e-12))``, ``D^2 = max(2 - 2S, 0)``, and
  ``dD/dS`` "as autograd computes it through the clamps", beyond the clamp points (at a kink itself, S = +-1,
  the closed forms pass the gradient and torch's clamp does not: parallel unit vectors, whose contribution the
  normalisation's backward removes anyway, so neither choice is asserted);
* ``lse0``: an empty row is exactly 0;
* ``ClosedFormPairFunction``: the backward is ``W G`` / ``W^T A`` with ``W = dL/dS`` for ``S = clamp(A G^T, -1, 1)``,
  so products outside ``[-1, 1]`` pass no gradient, for a dense and a sparse ``W``, and each input gets its
  gradient whichever of the two requires one;
* ``batch_normaliser`` / ``global_reduction`` under a (simulated) world of two processes: ``max(sum of counts, 1) / W``
  and ``1 / W`` for a sum (the derivation in the module docstring), and a loss's reductions scaled by it;
* ``check_label_sets``: the row its error names.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed

import lightning_dml.losses.base as base
from lightning_dml.losses import LOSSES
from lightning_dml.losses.base import (
    ClosedFormPairFunction,
    batch_normaliser,
    distance_and_derivative,
    distance_from_similarity,
    global_reduction,
    lse0,
    similarity_matrix,
    squared_distance_from_similarity,
)

F64 = torch.float64

# similarities at and beyond the ends of [-1, 1] (beyond: rounding of unit vectors, or a caller's raw products)
EDGE_S = [-1.5, -0.25, 0.0, 0.5, 0.9999, 1.25, 1.5]


def _autograd_derivative(fn, s: torch.Tensor) -> torch.Tensor:
    s = s.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(fn(s).sum(), s)
    return grad


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_distance_and_derivative_equal_the_clamped_formulas_and_autograd(dtype):
    """Inside, and beyond S = 1 (gap < 0: both clamps active, derivative 0); at S = 1 the floor of D."""
    s = torch.tensor(EDGE_S, dtype=dtype)
    for squared, reference in ((False, distance_from_similarity), (True, squared_distance_from_similarity)):
        value, derivative = distance_and_derivative(s, squared)
        torch.testing.assert_close(value, reference(s))
        torch.testing.assert_close(derivative, _autograd_derivative(reference, s), check_dtype=False)
    # the default is the (non-squared) distance
    torch.testing.assert_close(distance_and_derivative(s)[0], distance_from_similarity(s))
    # SPEC 0.3 in numbers: D floors at sqrt(1e-12), D^2 at 0; beyond S = 1 the derivative is 0
    assert distance_from_similarity(torch.tensor([1.0, 1.25], dtype=dtype)).tolist() == pytest.approx([1e-6, 1e-6])
    assert squared_distance_from_similarity(torch.tensor([1.0, 1.25], dtype=dtype)).tolist() == [0.0, 0.0]
    assert distance_and_derivative(torch.tensor([1.0, 1.25], dtype=dtype), False)[1].tolist() == [0.0, 0.0]


def test_similarity_matrix_is_clamped_to_the_unit_interval():
    a = torch.tensor([[2.0, 0.0], [-3.0, 0.0], [0.5, 0.0]])
    g = torch.tensor([[1.0, 0.0]])
    assert similarity_matrix(a, g).flatten().tolist() == [1.0, -1.0, 0.5]


@pytest.mark.parametrize("dtype", [torch.float32, F64], ids=str)
def test_lse0_of_an_empty_row_is_exactly_zero(dtype):
    """SPEC 0.2: ``log(1 + sum over nothing) = 0`` exactly, whatever the masked values."""
    x = torch.tensor([[-5.0, 3.0, 100.0], [-5.0, -7.0, -90.0]], dtype=dtype)
    empty = torch.zeros(2, 3, dtype=torch.bool)
    assert lse0(x, empty).tolist() == [0.0, 0.0]


# --------------------------------------------------------------------------------------------- closed form
# raw products A G^T inside [-1, 1] and beyond both ends, none at a kink (+-1)
ANCHORS = torch.tensor([[0.75, 0.0], [0.0, 1.5], [2.0, 0.5], [-1.5, 0.0]], dtype=F64)
GALLERY = torch.tensor([[1.0, 0.0], [-1.0, 0.0], [0.5, 0.5], [0.0, -1.0], [0.25, 0.0]], dtype=F64)
COEF = torch.arange(1.0, 21.0, dtype=F64).reshape(4, 5) / 7.0


def _loss_of_similarity(s: torch.Tensor) -> torch.Tensor:
    """A loss whose weights differ per pair: ``sum c_ij S_ij + sum S_ij^2 / 2``; ``dL/dS = c + S``."""
    return (COEF[: s.shape[0], : s.shape[1]] * s).sum() + 0.5 * (s * s).sum()


def _weights(s: torch.Tensor) -> torch.Tensor:
    return COEF[: s.shape[0], : s.shape[1]] + s


def _dense_fn(raw):
    s = raw.clamp(-1.0, 1.0)
    return _loss_of_similarity(s), _weights(s)


def _sparse_fn(raw):
    s = raw.clamp(-1.0, 1.0)
    rows, cols = torch.meshgrid(torch.arange(s.shape[0]), torch.arange(s.shape[1]), indexing="ij")
    return _loss_of_similarity(s), (rows.flatten(), cols.flatten(), _weights(s).flatten())


@pytest.mark.parametrize("fn", [_dense_fn, _sparse_fn], ids=["dense", "sparse"])
@pytest.mark.parametrize("grads", [(True, True), (True, False), (False, True)], ids=str)
def test_closed_form_backward_is_autograd_through_the_clamp(fn, grads):
    raw = ANCHORS @ GALLERY.T
    assert raw.max() > 1 and raw.min() < -1 and not (raw.abs() == 1).any()  # the cases are there
    a = ANCHORS.clone().requires_grad_(grads[0])
    g = GALLERY.clone().requires_grad_(grads[1])
    value = ClosedFormPairFunction.apply(a, g, fn)
    inputs = [t for t in (a, g) if t.requires_grad]
    got = torch.autograd.grad(value, inputs)
    a2 = ANCHORS.clone().requires_grad_(grads[0])
    g2 = GALLERY.clone().requires_grad_(grads[1])
    expected_value = _loss_of_similarity((a2 @ g2.T).clamp(-1.0, 1.0))
    expected = torch.autograd.grad(expected_value, [t for t in (a2, g2) if t.requires_grad])
    torch.testing.assert_close(value, expected_value.detach())
    for x, y in zip(got, expected):
        torch.testing.assert_close(x, y)


@pytest.mark.parametrize("fn", [_dense_fn, _sparse_fn], ids=["dense", "sparse"])
def test_closed_form_backward_on_the_batch_itself(fn):
    """``gallery=None``: the gallery is the batch, the gradient ``(W + W^T) A``."""
    a = ANCHORS.clone().requires_grad_(True)
    value = ClosedFormPairFunction.apply(a, None, fn)
    (got,) = torch.autograd.grad(value, a)
    a2 = ANCHORS.clone().requires_grad_(True)
    expected_value = _loss_of_similarity((a2 @ a2.T).clamp(-1.0, 1.0))
    (expected,) = torch.autograd.grad(expected_value, a2)
    torch.testing.assert_close(value, expected_value.detach())
    torch.testing.assert_close(got, expected)


# ------------------------------------------------------------------------------------------ DDP reductions
@pytest.fixture
def two_identical_processes(monkeypatch):
    """A world of 2 processes holding the same counts: the all-reduce sums two equal copies."""
    calls = []

    def all_reduce(t, *args, **kwargs):
        calls.append(t.clone())
        t.mul_(2)

    monkeypatch.setattr(base, "get_world_size", lambda: 2)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    return calls


def test_batch_normaliser_inside_global_reduction_over_two_processes(two_identical_processes):
    like = torch.zeros((), dtype=F64)
    with global_reduction():
        assert float(batch_normaliser(None, like)) == 0.5  # a sum: 1 / W
        assert float(batch_normaliser(3, like)) == 3.0  # (3 + 3) / 2
        assert batch_normaliser(torch.tensor([0, 5]), like).tolist() == [0.5, 5.0]  # max(0 + 0, 1) / 2
        assert batch_normaliser(torch.tensor(4.0), like).dtype == F64
    assert len(two_identical_processes) == 3  # one collective per call with a count
    # outside the context: the process alone
    assert float(batch_normaliser(None, like)) == 1.0
    assert batch_normaliser(torch.tensor([0, 5]), like).tolist() == [1.0, 5.0]
    with global_reduction(False):
        assert float(batch_normaliser(3, like)) == 3.0
    assert len(two_identical_processes) == 3


def test_only_the_cross_batch_memory_needs_the_embedding_width():
    """``needs_embedding_dim`` makes ``DMLModule`` call ``complete(embedding_dim=...)``: declared only by losses
    that have such a method (the base class default is False)."""
    assert base.PairLoss.needs_embedding_dim is False
    for name, cls in LOSSES.items():
        if getattr(cls, "needs_embedding_dim", False):
            assert hasattr(cls, "complete"), name
    assert [n for n, c in LOSSES.items() if getattr(c, "needs_embedding_dim", False)] == ["cross_batch_memory"]


@pytest.mark.parametrize("closed_form", [True, False])
@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_a_reduction_inside_global_reduction_is_scaled_to_the_global_batch(two_identical_processes, reduction,
                                                                           closed_form):
    """Two processes with identical batches: the global batch's sum is twice this process's terms, so process r
    returns ``W T_r / N_global``: ``2 T`` for a sum, the local mean for a mean (``N_global = 2 N``)."""
    from lightning_dml.losses import ContrastiveLoss

    g = torch.Generator().manual_seed(3)
    z, y = torch.randn(6, 4, generator=g, dtype=F64), torch.tensor([0, 0, 1, 1, 2, 2])
    loss = ContrastiveLoss(reduction=reduction, neg_margin=1.2)
    loss.closed_form = closed_form
    alone = loss(z, y)
    with global_reduction():
        scaled = loss(z, y)
    torch.testing.assert_close(scaled, 2 * alone if reduction == "sum" else alone)


def test_malformed_label_sets_name_the_first_row_below_minus_one():
    """``-1`` pads a set; a value below it is an error naming the first row that holds one (a padded row before it
    is fine)."""
    from lightning_dml.losses.base import check_label_sets

    with pytest.raises(ValueError, match=r"found -2 in row 1$"):
        check_label_sets(torch.tensor([[0, -1], [1, -2], [-2, 0]]), 3)
    check_label_sets(torch.tensor([[0, -1], [-1, -1], [2, 3]]), 3)  # padding, and an empty set, are valid


def test_malformed_label_sets_name_a_value_of_the_row_they_name():
    from lightning_dml.losses.base import check_label_sets

    with pytest.raises(ValueError, match=r"found -2 in row 1$|found -3 in row 2$"):
        check_label_sets(torch.tensor([[0, -1], [1, -2], [-3, 0]]), 3)
