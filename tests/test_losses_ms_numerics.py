"""MultiSimilarityLoss where its numerics decide: empty and one-element mined sets, exponents far beyond fp32's range,
anchors whose mined sets are emptied by mining, a gallery wider than the batch.

Two contracts are checked. ``pair_loss_and_grad(S, pos, neg)`` returns MS Eq. 15 and its gradient ``dL/dS``
(the pair weights of MS Eqs. 13-14), so it must equal ``pair_loss`` and autograd through it, evaluated in float64.
The loss called on embeddings must equal the float64 loop reference of MS Eq. 15 (``tests/reference_losses.py``).
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dml.losses import MultiSimilarityLoss
from tests import reference_losses as ref


def _masks(labels: torch.Tensor, gallery_labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    same = labels[:, None] == gallery_labels[None, :]
    B = labels.shape[0]
    self_pair = torch.zeros_like(same)
    self_pair[:, :B] = torch.eye(B, dtype=torch.bool)
    return same & ~self_pair, ~same


def _closed_form_equals_autograd(loss: MultiSimilarityLoss, sim64: torch.Tensor, pos, neg, dtype, rtol=1e-5):
    """``pair_loss_and_grad`` in ``dtype`` against ``pair_loss`` + autograd in float64."""
    value, weights = loss.pair_loss_and_grad(sim64.to(dtype), pos, neg)
    s = sim64.clone().requires_grad_(True)
    expected = loss.pair_loss(s, pos, neg)
    (grad,) = torch.autograd.grad(expected, s)
    assert torch.isfinite(value) and torch.isfinite(weights).all()
    torch.testing.assert_close(value.double(), expected.detach(), rtol=rtol, atol=1e-6)
    torch.testing.assert_close(weights.double(), grad, rtol=rtol, atol=1e-6)
    return expected.detach()


def _similarities(B: int, N: int, seed: int, low: float = -1.0, high: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(B, N, generator=g, dtype=torch.float64) * (high - low) + low


# labels of a 6-anchor batch against an 9-column gallery (the batch and 3 references): anchor 4 (class 7) has no
# positive at all, anchor 5 (class 5) exactly one (reference 8), anchor 3 (class 2) exactly one (anchor 2)
LABELS = torch.tensor([0, 0, 2, 2, 7, 5])
GALLERY = torch.cat([LABELS, torch.tensor([0, 3, 5])])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize(
    "kw",
    [{"plus_one": False}, {"plus_one": False, "mining": False}, {}, {"mining": False},
     {"mining": False, "on_empty": "skip"}, {"mining": False, "plus_one": False, "on_empty": "skip"},
     {"weighting": False}, {"weighting": False, "mining": False, "on_empty": "skip"}],
    ids=str,
)
def test_closed_form_with_empty_and_one_element_sets_equals_autograd(kw, dtype):
    """Without the "+1" an empty set contributes 0 (GPW's MS v2) and a one-element set ``x`` contributes ``x``:
    the closed form must give exactly that, with zero weights on an empty row (not 0/0 nor the log of the
    ``exp(-87)`` floor), on a ``B x N`` gallery wider than the batch (the divisor is ``B``)."""
    pos, neg = _masks(LABELS, GALLERY)
    sim = _similarities(6, 9, seed=0, low=-0.3, high=0.9)
    expected = _closed_form_equals_autograd(MultiSimilarityLoss(**kw), sim, pos, neg, dtype)
    assert expected != 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_closed_form_of_a_single_positive_row_without_plus_one_is_its_exponent(dtype):
    """One anchor, one positive, no negative, no mining, no "+1": ``L = (1/alpha) * (-alpha (S - lam)) = lam - S``
    (MS Eq. 15 without +1: ``log(exp(x)) = x``; the empty negative set contributes 0), gradient ``-1``."""
    loss = MultiSimilarityLoss(mining=False, plus_one=False)
    sim = torch.tensor([[0.0, 0.8]], dtype=dtype)
    pos, neg = torch.tensor([[False, True]]), torch.tensor([[False, False]])
    value, weights = loss.pair_loss_and_grad(sim, pos, neg)
    torch.testing.assert_close(value.double(), torch.tensor(0.5 - 0.8, dtype=torch.float64))
    torch.testing.assert_close(weights.double(), torch.tensor([[0.0, -1.0]], dtype=torch.float64))


@pytest.mark.parametrize(
    "kw,low,high",
    [({"alpha": 400.0, "beta": 1.0}, 0.9, 1.0),  # -alpha (S - lam) down to -200: exp(200) overflows in fp32
     ({"alpha": 400.0, "beta": 1.0, "plus_one": False}, 0.9, 1.0),
     ({"beta": 400.0}, 0.9, 1.0),  # beta (S - lam) up to 200: the shift must be the row maximum
     ({"beta": 400.0, "plus_one": False}, 0.9, 1.0),
     ({"beta": 400.0, "alpha": 400.0}, -1.0, 1.0)],
    ids=str,
)
def test_closed_form_at_exponents_beyond_fp32_range_equals_autograd(kw, low, high):
    """Scales of 400 put the exponents of Eq. 15 at +-200 (``exp`` overflows fp32 beyond 88): the closed form in
    fp32 must still equal the float64 value and gradient (the shift is the row maximum, clamped at 0 only where
    the "+1" term is the largest)."""
    pos, neg = _masks(LABELS, GALLERY)
    sim = _similarities(6, 9, seed=1, low=low, high=high)
    _closed_form_equals_autograd(MultiSimilarityLoss(mining=False, **kw), sim, pos, neg, torch.float32, rtol=1e-4)


def _fan(angles_and_labels: list[tuple[float, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    z = torch.tensor([[math.cos(a), math.sin(a)] for a, _ in angles_and_labels], dtype=torch.float64)
    return z, torch.tensor([c for _, c in angles_and_labels])


@pytest.mark.parametrize("kw", [{"beta": 1000.0}, {"beta": 1000.0, "on_empty": "skip"}], ids=str)
def test_anchor_whose_hardest_negative_is_mined_away_at_a_huge_scale(kw):
    """Anchor 0's positive has S = cos(0.3) = 0.955, its only negative S = cos(0.8) = 0.70: mining (MS Eqs. 11-12,
    eps = 0.1) drops both, so the anchor contributes 0 even though ``beta (S_neg - lam) = 197`` would underflow
    ``exp(-197)`` to 0 in fp32 (log 0 = -inf) were that negative used to shift its empty row. Anchor 4 keeps its
    pairs (negative S = 0.955 > positive S = 0.825 - eps), so the loss is not 0."""
    z, y = _fan([(0.0, 0), (0.3, 0), (-0.8, 1), (-0.85, 1), (2.0, 2), (2.6, 2), (2.3, 3)])
    zz = z.float().requires_grad_(True)
    value = MultiSimilarityLoss(**kw)(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    zr = z.clone().requires_grad_(True)
    expected = ref.multi_similarity(zr, y, **kw)
    (grad_ref,) = torch.autograd.grad(expected, zr)
    assert torch.isfinite(value) and torch.isfinite(grad).all()
    torch.testing.assert_close(value.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), grad_ref, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("closed_form", [True, False])
@pytest.mark.parametrize("on_empty", ["keep", "skip"])
@pytest.mark.parametrize("kw", [{"mining": False}, {"mining": False, "plus_one": False}, {"mining": False,
                                                                                         "weighting": False}], ids=str)
def test_on_empty_with_an_anchor_without_positives(kw, on_empty, closed_form):
    """Without mining, anchor 4 (a singleton class) has negatives but no positive: ``on_empty="keep"`` keeps its
    negative term, ``"skip"`` drops the anchor (it still counts in 1/B), on both paths, as the loop reference."""
    g = torch.Generator().manual_seed(5)
    z = torch.randn(7, 5, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1, 9, 2, 2])
    loss = MultiSimilarityLoss(on_empty=on_empty, **kw)
    loss.closed_form = closed_form
    zz = z.float().requires_grad_(True)
    value = loss(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    zr = z.clone().requires_grad_(True)
    expected = ref.multi_similarity(zr, y, on_empty=on_empty, **kw)
    (grad_ref,) = torch.autograd.grad(expected, zr)
    torch.testing.assert_close(value.double(), expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), grad_ref, rtol=1e-4, atol=1e-6)
    other = ref.multi_similarity(z, y, on_empty="skip" if on_empty == "keep" else "keep", **kw)
    assert not torch.isclose(expected, other, rtol=1e-3)  # the batch tells the two rules apart


@pytest.mark.parametrize(
    "kw",
    [{"alpha": 400.0, "beta": 2.0, "mining": False}, {"alpha": 2.0, "beta": 400.0, "mining": False},
     {"alpha": 400.0, "beta": 400.0}, {"alpha": 400.0, "beta": 2.0, "mining": False, "plus_one": False}],
    ids=str,
)
def test_tight_clusters_at_huge_scales_on_the_default_path(kw):
    """Two tight clusters close to each other: every positive S > lam and the hardest negative S ~ 0.95, so the
    exponents of Eq. 15 reach -alpha (S - lam) ~ -190 and beta (S - lam) ~ +180, beyond fp32's exp range: the shift
    of each row must be its hardest kept pair (not 0, not the pair without lam), clamped at 0 only with the "+1"."""
    g = torch.Generator().manual_seed(12)
    centre = torch.randn(1, 6, generator=g, dtype=torch.float64)
    other = centre + 0.3 * torch.randn(1, 6, generator=g, dtype=torch.float64)
    z = torch.cat([centre + 0.02 * torch.randn(4, 6, generator=g, dtype=torch.float64),
                   other + 0.02 * torch.randn(4, 6, generator=g, dtype=torch.float64)])
    y = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    zz = z.float().requires_grad_(True)
    value = MultiSimilarityLoss(**kw)(zz, y)
    (grad,) = torch.autograd.grad(value, zz)
    zr = z.clone().requires_grad_(True)
    expected = ref.multi_similarity(zr, y, **kw)
    (grad_ref,) = torch.autograd.grad(expected, zr)
    assert torch.isfinite(value) and torch.isfinite(grad).all() and expected > 0
    torch.testing.assert_close(value.double(), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(grad.double(), grad_ref, rtol=1e-3, atol=1e-4)


@pytest.mark.parametrize("closed_form", [True, False])
def test_plain_labels_against_label_set_references(closed_form):
    """Anchors with one label each ``[B]`` against references with label sets ``[M, L]``: a pair is positive when
    the anchor's label is in the reference's set (the anchors become one-label sets), on both paths, as the loop
    reference with that pair matrix."""
    g = torch.Generator().manual_seed(14)
    z, r = torch.randn(5, 4, generator=g, dtype=torch.float64), torch.randn(4, 4, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 2, 2])
    ry = torch.tensor([[0, 2], [1, -1], [3, -1], [2, 1]])
    sets = [{int(v)} for v in y] + [{int(v) for v in row if v >= 0} for row in ry]
    same = [[bool(a & b) for b in sets] for a in sets]
    loss = MultiSimilarityLoss(mining=False)
    loss.closed_form = closed_form
    zz = z.clone().requires_grad_(True)
    value = loss(zz, y, ref_embeddings=r, ref_labels=ry)
    (grad,) = torch.autograd.grad(value, zz)
    zr = z.clone().requires_grad_(True)
    y_all = torch.cat([torch.stack([y, torch.full_like(y, -1)], 1), ry])
    expected = ref.multi_similarity(zr, y_all[:5], mining=False, ref=r, ref_labels=y_all[5:], same=same)
    (grad_ref,) = torch.autograd.grad(expected, zr)
    torch.testing.assert_close(value, expected.detach())
    torch.testing.assert_close(grad, grad_ref)
