"""The closed-form neighbour softmax (lightning_dml.losses.softmax_pairs) shared by SupCon, NCA and the multi-positive
N-pair loss: each of its backward paths against autograd through the plain composition and the loop references.

Paths: one shift for all rows with the symmetric ``W + W^T`` (the gallery is the batch, the rows' largest logits
close together: the defaults), per-row shifts with two products (a small temperature / a large scale spreads the
rows' maxima), the clamp path (fp32 duplicates and opposites give cosines beyond [-1, 1] by rounding) and the
reference-gallery path. Each case asserts that it took the path it is meant to test.
"""

from __future__ import annotations

import pytest
import torch

import lightning_dml.losses.softmax_pairs as softmax_pairs
from lightning_dml.losses import NCALoss, NPairLoss, SupConLoss
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


def _batch(kind: str):
    g = torch.Generator().manual_seed(0)
    if kind == "random":
        return torch.randn(18, 16, generator=g, dtype=torch.float64), torch.arange(18) % 5
    # fp32 duplicates (and their opposites): normalised self-products round beyond 1
    z = torch.randn(6, 16, generator=g).repeat(3, 1)
    return (z if kind == "duplicates" else torch.cat([z[:9], -z[9:]])), torch.tensor([0, 1, 2, 0, 1, 2] * 3)


def _value_and_grad(fn, z, y):
    z = z.clone().requires_grad_(True)
    value = fn(z, y)
    (grad,) = torch.autograd.grad(value, z)
    return value.detach(), grad


# (loss, batch, expected (common shift, clamped) path)
CASES = [
    ("supcon", lambda: SupConLoss(), "random", (True, False)),
    ("supcon_t005", lambda: SupConLoss(0.005), "random", (False, False)),
    ("supcon_dup", lambda: SupConLoss(), "duplicates", (False, True)),
    ("supcon_opposite", lambda: SupConLoss(0.005), "opposites", (False, True)),
    ("nca", lambda: NCALoss(), "random", (True, False)),
    ("nca_s100_expected", lambda: NCALoss(100.0, "expected"), "random", (False, False)),
    ("nca_dup_expected", lambda: NCALoss(objective="expected"), "duplicates", (False, True)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_every_path_equals_autograd_and_the_reference(case, paths):
    name, make, kind, expected_path = case
    z, y = _batch(kind)
    loss = make()
    value, grad = _value_and_grad(loss, z, y)
    assert paths and paths[-1] == expected_path, paths
    loss.closed_form = False
    plain_value, plain_grad = _value_and_grad(loss, z, y)
    tol = 1e-10 if z.dtype == torch.float64 else 1e-5
    torch.testing.assert_close(value, plain_value, rtol=tol, atol=tol)
    torch.testing.assert_close(grad, plain_grad, rtol=tol, atol=tol * max(1.0, float(plain_grad.abs().max())))
    if kind == "random":  # the loop references (fp64)
        if name.startswith("supcon"):
            ref = lambda e, l: R.supcon(e, l, temperature=loss.temperature)  # noqa: E731
        else:
            ref = lambda e, l: R.nca(e, l, loss.scale, loss.objective)  # noqa: E731
        ref_value, ref_grad = _value_and_grad(ref, z, y)
        torch.testing.assert_close(value, ref_value, rtol=1e-7, atol=1e-9)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-9)


def test_multi_positive_npair_spread_rows_take_the_per_row_path(paths):
    """Large raw inner products spread the rows' maxima: per-row shifts, gradient still Eq. 9's."""
    z, y = _batch("random")
    z = z * 4.0
    value, grad = _value_and_grad(NPairLoss(l2_reg=0.0, variant="multi_positive"), z, y)
    assert paths[-1] == (False, False)
    ref_value, ref_grad = _value_and_grad(lambda e, l: R.npair_multi_positive(e, l, 0.0), z, y)
    torch.testing.assert_close(value, ref_value, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-7, atol=1e-9)


def test_backward_runs_once(paths):
    z, y = _batch("random")
    z.requires_grad_(True)
    value = SupConLoss()(z, y)
    value.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward can run only once"):
        value.backward()
