"""Issue 29: tests that kill the survivors of the mutation check over the part-3 losses, miners and reducers
(``tools/mutants.py --sample 70 --seed 29``, docs/testing.md, section "Issue 29"). Each test states the rule the
mutant broke and checks it against a reference (pml, the documented contract, or the brute-force answer)."""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dml.losses import build_loss
from lightning_dml.losses.reducers import ClassWeightedReducer
from lightning_dml.miners.batch_easy_hard import BatchEasyHardMiner, BatchHardMiner
from lightning_dml.miners.indices import check_indices_tuple


# ------------------------------------------------------------------------------------------ argument validation
# Each constructor documents "weights >= 0" (or "> 0", "finite"): a negative value between -1 and 0, a zero where
# "> 0" is asked and a NaN are refused (mutants "< 0" -> "< -1", "or" -> "and", "all" -> "any").
@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("vicreg", {"invariance_lambda": -0.5}),
        ("vicreg", {"variance_mu": -0.5}),
        ("vicreg", {"covariance_v": -0.5}),
        ("pnp", {"anneal": 0.0}),
        ("pnp", {"anneal": -0.5}),
        ("pnp", {"b": 0.0}),
        ("threshold_consistent_margin", {"lambda_plus": -0.5}),
        ("threshold_consistent_margin", {"lambda_minus": -0.5}),
        ("hier", {"margin": -0.5}),
        ("hier", {"weight": -0.5}),
        ("hier", {"base_weight": float("nan")}),
    ],
)
def test_part3_losses_refuse_out_of_range_arguments(name, kwargs):
    with pytest.raises(ValueError):
        build_loss(name, **kwargs)


@pytest.mark.parametrize("weights", [[1.0, float("nan")], [float("inf"), 2.0]])
def test_class_weighted_reducer_refuses_any_non_finite_weight(weights):
    with pytest.raises(ValueError, match="finite"):
        ClassWeightedReducer(weights)


# ------------------------------------------------------------------------------------------ miners
def test_batch_easy_hard_allowed_ranges_are_inclusive_like_pml():
    """pml's BatchEasyHardMiner drops a pair only when ``d < low`` or ``d > high``: a distance equal to a bound is
    allowed. Antipodal unit vectors are exactly 2 apart (``sqrt(2 - 2 * (-1))``), so the ranges ``(2, 2)`` keep
    exactly the antipodal pairs."""
    e = torch.eye(3, dtype=torch.float64)
    x = torch.stack([e[0], -e[0], e[1], -e[1], e[2]])
    y = torch.tensor([0, 0, 1, 1, 0])
    # anchor 0: positives 1 (d = 2) and 4 (d = sqrt 2); negatives 2, 3 (d = sqrt 2)
    miner = BatchHardMiner(allowed_pos_range=(2.0, 2.0))
    a, p, n = miner(x, y)
    pairs = {(int(i), int(j)) for i, j in zip(a, p)}
    assert (0, 1) in pairs and (1, 0) in pairs and (2, 3) in pairs and (3, 2) in pairs
    assert all(torch.allclose((x[i] - x[j]).norm(), torch.tensor(2.0, dtype=torch.float64)) for i, j in pairs)
    a1, p1, a2, n2 = BatchEasyHardMiner("hard", "hard", allowed_neg_range=(2.0, 2.0))(
        torch.stack([e[0], e[0], -e[0], e[1]]), torch.tensor([0, 0, 1, 1])
    )
    # anchor 0's only negative at distance 2 is item 2 (item 3 is sqrt 2 away); anchor 2: items 0 and 1 (the first)
    assert {(int(i), int(j)) for i, j in zip(a2, n2)} == {(0, 2), (1, 2), (2, 0)}
    pml_miners = pytest.importorskip("pytorch_metric_learning.miners")
    theirs = pml_miners.BatchEasyHardMiner("hard", "hard", allowed_neg_range=(2.0, 2.0))(
        torch.stack([e[0], e[0], -e[0], e[1]]), torch.tensor([0, 0, 1, 1])
    )
    assert {(int(i), int(j)) for i, j in zip(theirs[2], theirs[3])} == {(0, 2), (1, 2), (2, 0)}


@pytest.mark.parametrize("tuple_kind", ["triplets", "pairs"])
def test_check_indices_tuple_checks_every_anchor_column(tuple_kind):
    """The anchors (``a`` of a triplet tuple, ``a1`` and ``a2`` of a pair tuple) must be batch rows; a positive
    may be a reference item (column >= B). An anchor out of range is refused by name, a reference positive is not."""
    b, m = 4, 3
    ok = (torch.tensor([0]), torch.tensor([b + 1]), torch.tensor([2]))
    bad = (torch.tensor([b]), torch.tensor([1]), torch.tensor([2]))
    if tuple_kind == "pairs":
        ok = (torch.tensor([0]), torch.tensor([b + 1]), torch.tensor([1]), torch.tensor([2]))
        bad = (torch.tensor([b]), torch.tensor([1]), torch.tensor([1]), torch.tensor([2]))
    check_indices_tuple(ok, b, b + m, torch.device("cpu"))
    with pytest.raises(ValueError, match="anchors must be batch rows"):
        check_indices_tuple(bad, b, b + m, torch.device("cpu"))
    # the last gallery column b + m - 1 is valid, b + m is one past it
    last = tuple(torch.tensor([b + m - 1 if i in (1, len(ok) - 1) else 0]) for i in range(len(ok)))
    check_indices_tuple(last, b, b + m, torch.device("cpu"))
    past = tuple(torch.tensor([b + m if i == len(ok) - 1 else 0]) for i in range(len(ok)))
    with pytest.raises(ValueError, match=str(b + m)):
        check_indices_tuple(past, b, b + m, torch.device("cpu"))


@pytest.mark.parametrize("largest", [True, False])
def test_hdc_hardest_equals_a_sort_for_every_k(largest):
    """``hardest(values, k, largest)``: the ``k`` largest (smallest) values' indices, increasing, ties at the cut
    to the lowest indices; against a stable sort, every ``k`` from 0 to ``n + 1`` (k = 1 included)."""
    from lightning_dml.miners.hdc import hardest

    values = torch.tensor([0.5, 2.0, -1.0, 2.0, 0.5, 3.0, 0.5, -1.0], dtype=torch.float64)
    order = torch.sort(values, descending=largest, stable=True).indices
    for k in range(values.numel() + 2):
        expected = torch.sort(order[:k]).values
        assert torch.equal(hardest(values, k, largest), expected), k


# ------------------------------------------------------------------------------------------ losses
def test_multi_supcon_with_class_labels_is_supcon_for_every_label_value():
    """``[B]`` labels: MultiSupCon is exactly SupCon (its docstring), whatever the class ids, negative ones
    included (a label set treats -1 as padding, a class id does not)."""
    g = torch.Generator().manual_seed(0)
    z = torch.randn(8, 5, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1, -1, -1, 2, 2])
    ours = build_loss("multi_supcon")(z, y)
    torch.testing.assert_close(ours, build_loss("supcon")(z, y), rtol=1e-13, atol=0.0)


def test_large_margin_softmax_defaults_are_pmls():
    """Defaults ``margin=4, scale=1`` as pml's ``LargeMarginSoftmaxLoss(num_classes, embedding_size)``."""
    pml_losses = pytest.importorskip("pytorch_metric_learning.losses")
    g = torch.Generator().manual_seed(3)
    classes, dim = 5, 6
    ours = build_loss("large_margin_softmax", num_classes=classes, embedding_dim=dim).double()
    theirs = pml_losses.LargeMarginSoftmaxLoss(classes, dim).double()
    weight = torch.randn(dim, classes, generator=g, dtype=torch.float64)
    with torch.no_grad():
        theirs.W.copy_(weight)
        params = [p for p in ours.parameters()]
        assert len(params) == 1
        params[0].copy_(weight.T if params[0].shape == (classes, dim) else weight)
    x = 2.0 * torch.randn(12, dim, generator=g, dtype=torch.float64)
    y = torch.randint(0, classes, (12,), generator=g)
    torch.testing.assert_close(ours(x, y), theirs(x, y), rtol=1e-10, atol=1e-12)
    assert math.isclose(ours.scale, theirs.scale) and ours.margin == theirs.margin


def test_p2sgrad_backward_is_the_clamped_definitions_gradient_where_a_cosine_rounds_above_one():
    """P2SGradFunction's closed-form backward is the autograd gradient of ``mean (clamp(cos, -1, 1) - onehot)^2``
    (the authors' code, pml): where a cosine rounds above 1 the clamp is active and that entry passes no gradient
    (torch's clamp backward). A class weight parallel to the embedding gives such a cosine for some vectors; the
    first of a seeded search is used (a cosine of exactly 1 would pass the gradient in both)."""
    from lightning_dml.losses.p2sgrad import P2SGradFunction

    for seed in range(500):
        g = torch.Generator().manual_seed(seed)
        v = torch.randn(8, generator=g, dtype=torch.float64)
        x = (v / v.norm())[None]
        proxies = torch.stack([torch.randn(8, generator=g, dtype=torch.float64), 3.0 * v])
        unit = proxies / torch.linalg.vector_norm(proxies, dim=1, keepdim=True).clamp(min=1e-12)
        if float((x @ unit.T)[0, 1]) > 1.0:
            break
    else:
        pytest.fail("no cosine above 1 in the search")
    labels = torch.tensor([0])
    xa, pa = x.clone().requires_grad_(), proxies.clone().requires_grad_()
    P2SGradFunction.apply(xa, pa, labels).backward()
    xr, pr = x.clone().requires_grad_(), proxies.clone().requires_grad_()
    cos = (xr @ (pr / torch.linalg.vector_norm(pr, dim=1, keepdim=True).clamp(min=1e-12)).T).clamp(-1.0, 1.0)
    target = torch.nn.functional.one_hot(labels, 2).to(cos.dtype)
    ((cos - target) ** 2).mean().backward()
    torch.testing.assert_close(xa.grad, xr.grad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(pa.grad, pr.grad, rtol=1e-12, atol=1e-14)


def test_p2sgrad_backward_at_a_cosine_of_exactly_one_is_the_clamps():
    """torch 2.14's clamp passes no gradient at its bounds (``d clamp(t, -1, 1) / dt = 0`` at ``t = 1``): a cosine
    of exactly 1 (the embedding equal to another class's weight, unit basis vectors) should contribute nothing to
    ``dL/dx`` of the Function, as in the autograd of the definition. Through ``P2SGradLoss`` the embedding is
    normalised and the cosine's own gradient vanishes at 1, so the loss's gradient differs only where a cosine of
    two nearly (not exactly) parallel vectors rounds to 1."""
    from lightning_dml.losses.p2sgrad import P2SGradFunction

    e = torch.eye(3, dtype=torch.float64)
    x, proxies, labels = e[:1].clone(), torch.stack([e[1], e[0]]), torch.tensor([0])
    xa = x.clone().requires_grad_()
    P2SGradFunction.apply(xa, proxies, labels).backward()
    xr = x.clone().requires_grad_()
    raw = xr @ proxies.T
    # clamp(-1, 1) with torch 2.14's subgradient (0 at the bounds) written out: torch 2.11's clamp passes 1 there
    cos = torch.where(raw.abs() < 1.0, raw, raw.detach().clamp(-1.0, 1.0))
    ((cos - torch.nn.functional.one_hot(labels, 2).to(cos.dtype)) ** 2).mean().backward()
    torch.testing.assert_close(xa.grad, xr.grad, rtol=1e-12, atol=1e-15)


def test_dynamic_soft_margin_accepts_one_bin():
    """``num_bins`` is documented ``>= 1``: one bin is a valid (coarse) histogram, equal to the paper loop."""
    from tests import reference_losses_part3a as ref

    g = torch.Generator().manual_seed(5)
    z = torch.randn(10, 6, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1, 2, 3])
    loss = build_loss("dynamic_soft_margin", num_bins=1).double()
    theirs = ref.DynamicSoftMargin(num_bins=1)
    torch.testing.assert_close(loss(z, y), theirs(z, ref.same_label(y)), rtol=1e-10, atol=1e-12)


def test_histogram_default_bins_are_pmls():
    """Neither ``n_bins`` nor ``delta`` given: 100 bins, as pml's ``HistogramLoss()``."""
    pml_losses = pytest.importorskip("pytorch_metric_learning.losses")
    g = torch.Generator().manual_seed(2)
    z = torch.randn(16, 8, generator=g, dtype=torch.float64)
    y = torch.arange(16) // 4
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = pml_losses.HistogramLoss()(z, y)
    torch.testing.assert_close(build_loss("histogram")(z, y), theirs, rtol=1e-6, atol=1e-8)


def test_hier_completes_with_sizes_of_one():
    """``complete`` accepts any size ``>= 1`` where the base loss does (a one-class set with the proxy-free base
    ``supcon``, a width-1 embedding with Proxy-Anchor) and refuses 0."""
    loss = build_loss("hier", base="supcon", num_proxies=4)
    loss.complete(num_classes=1, embedding_dim=3)
    assert loss.num_classes == 1 and loss.proxies.shape == (4, 3)
    loss = build_loss("hier", num_proxies=4).complete(num_classes=2, embedding_dim=1)
    assert loss.embedding_dim == 1 and loss.proxies.shape == (4, 1)
    with pytest.raises(ValueError, match="num_classes"):
        build_loss("hier", base="supcon", num_proxies=4).complete(num_classes=0, embedding_dim=3)


# ------------------------------------------------------------------------------------------ second sample (seed 30)
@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("multi_supcon", {"threshold": 1.0}),
        ("selectively_contrastive_triplet", {"penalty": -0.5}),
    ],
)
def test_part3_losses_refuse_out_of_range_arguments_2(name, kwargs):
    with pytest.raises(ValueError):
        build_loss(name, **kwargs)


@pytest.mark.parametrize(
    "name, kwargs",
    [
        ("intra_pair_variance", {"pos_eps": 0.0, "neg_eps": 0.0}),
        ("vicreg", {"invariance_lambda": 0.5, "variance_mu": 0.5, "covariance_v": 0.5, "eps": 0.5}),
    ],
)
def test_part3_losses_accept_the_edges_of_their_ranges(name, kwargs):
    """``>= 0`` admits 0 and ``> 0`` admits every positive value (below 1 included)."""
    loss = build_loss(name, **kwargs)
    for key, value in kwargs.items():
        assert getattr(loss, key) == value


def test_miners_settings_ranges():
    from lightning_dml.miners.angular_miner import AngularMiner
    from lightning_dml.miners.uniform_histogram import UniformHistogramMiner

    UniformHistogramMiner(num_bins=1, pos_per_bin=1, neg_per_bin=1)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match="num_bins"):
            UniformHistogramMiner(num_bins=bad)
    AngularMiner(angle=0.0)
    with pytest.raises(ValueError, match="angle"):
        AngularMiner(angle=-0.5)


def test_miner_reference_zero_row_is_the_zero_vector():
    """A zero reference embedding normalises to the zero vector (cosine 0, distance sqrt 2 to every unit vector),
    as a zero batch embedding does: with ``neg_margin = 1.5`` it is a negative of every anchor of another class."""
    from lightning_dml.miners.pair_margin import PairMarginMiner

    x = torch.eye(3, dtype=torch.float64)
    y = torch.tensor([0, 0, 1])
    ref = torch.zeros(1, 3, dtype=torch.float64)
    _, _, a2, n2 = PairMarginMiner(pos_margin=0.0, neg_margin=1.5)(x, y, ref, torch.tensor([2]))
    negatives = {(int(a), int(n)) for a, n in zip(a2, n2)}
    # brute force: every (anchor, other-label column) with distance < 1.5; the batch's are sqrt 2, the ref's sqrt 2
    assert negatives == {(0, 2), (1, 2), (2, 0), (2, 1), (0, 3), (1, 3), (2, 3)}


def test_dynamic_soft_margin_in_eval_mode_with_an_empty_histogram_uses_the_batch():
    """``eval()`` before any training batch: the histogram is empty, so the batch's own histogram weights the
    triplets (without being stored), as the paper loop with ``train=False``."""
    from tests import reference_losses_part3a as ref

    g = torch.Generator().manual_seed(7)
    z = torch.randn(10, 6, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 0, 1, 1, 2, 2, 0, 1, 2, 3])
    loss = build_loss("dynamic_soft_margin").double().eval()
    theirs = ref.DynamicSoftMargin()
    torch.testing.assert_close(loss(z, y), theirs(z, ref.same_label(y), train=False), rtol=1e-10, atol=1e-12)
    assert float(loss(z, y)) != 0.0 and not bool(loss.histogram.any())


def test_hyp_vit_loss_is_exact_with_a_wide_spread_of_distances():
    """Hyp-ViT's cross-entropy with distances spread over [0, 400] at tau = 0.2 (logits down to -2000): a loop of
    log-sum-exps in fp64 (module docstring's definition; two views of two classes, every view pair has 2 anchors)."""
    from lightning_dml.losses.hyperbolic import hyp_vit_loss

    labels = torch.tensor([0, 0, 1, 1])  # views: items 0, 2 are view 0; items 1, 3 view 1
    views = [0, 1, 0, 1]
    # item 1 is far from everything: its log-sum-exps (logits -1500 .. -2000) underflow without the max shift
    d = torch.tensor([[0.0, 400.0, 3.0, 1.0], [400.0, 0.0, 300.0, 350.0], [3.0, 300.0, 0.0, 250.0],
                      [1.0, 350.0, 250.0, 0.0]], dtype=torch.float64)
    tau = 0.2
    expected = torch.zeros((), dtype=torch.float64)
    for a in range(4):
        for p in range(4):
            if p == a or labels[p] != labels[a]:
                continue
            cand = [n for n in range(4) if n != a and views[n] in (views[a], views[p])]
            ce = d[a, p] / tau + torch.logsumexp(-d[a, cand] / tau, dim=0)
            expected = expected + ce / 2.0
    got = hyp_vit_loss(d, labels, tau)
    assert torch.isfinite(got)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


def test_p2sgrad_zero_class_weight_is_the_zero_vector():
    """A zero class weight normalises to the zero vector (``F.normalize``'s ``eps = 1e-12``): cosines 0, a finite
    loss and gradients equal to the autograd of the definition."""
    from lightning_dml.losses.p2sgrad import P2SGradFunction

    g = torch.Generator().manual_seed(11)
    x = torch.nn.functional.normalize(torch.randn(4, 5, generator=g, dtype=torch.float64), dim=1)
    proxies = torch.randn(3, 5, generator=g, dtype=torch.float64)
    proxies[1] = 0.0
    labels = torch.tensor([0, 1, 2, 1])
    xa, pa = x.clone().requires_grad_(), proxies.clone().requires_grad_()
    ours = P2SGradFunction.apply(xa, pa, labels)
    ours.backward()
    xr, pr = x.clone().requires_grad_(), proxies.clone().requires_grad_()
    cos = (xr @ torch.nn.functional.normalize(pr, dim=1, eps=1e-12).T).clamp(-1.0, 1.0)
    ref = ((cos - torch.nn.functional.one_hot(labels, 3).to(cos.dtype)) ** 2).mean()
    ref.backward()
    torch.testing.assert_close(ours, ref, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(xa.grad, xr.grad, rtol=1e-12, atol=1e-14)


def test_angular_miner_exact_duplicates_give_pmls_angle():
    """Three identical embeddings (not orthogonal to the all-ones vector): the distances carry
    ``pairwise_distance``'s ``eps``, so the angle is ``atan(1/2)`` = 26.6 degrees (the class docstring), above 20:
    the triplet is mined, as by pml's AngularMiner."""
    from lightning_dml.miners.angular_miner import AngularMiner

    v = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    x = torch.stack([v, v, v])
    y = torch.tensor([0, 0, 1])
    ours = {tuple(int(t) for t in trip) for trip in zip(*AngularMiner(angle=20.0)(x, y))}
    assert ours == {(0, 1, 2), (1, 0, 2)}
    assert not {tuple(int(t) for t in trip) for trip in zip(*AngularMiner(angle=27.0)(x, y))}
    pml_miners = pytest.importorskip("pytorch_metric_learning.miners")
    theirs = pml_miners.AngularMiner(angle=20)(x, y)
    assert {tuple(int(t) for t in trip) for trip in zip(*theirs)} == ours


def test_uniform_histogram_bins_are_closed_below():
    """Bin ``i`` holds ``e_i <= v < e_{i+1}`` (pml's edges): a value on an inner edge belongs to the upper bin. With
    values 0, 1, 2 and two bins (edges 0, 1, 2), bin 0 is {0} and bin 1 is {1, 2}: all of bin 0's draws are item 0."""
    from lightning_dml.miners.uniform_histogram import uniform_histogram_draw

    values = torch.tensor([0.0, 1.0, 2.0], dtype=torch.float64)
    drawn = uniform_histogram_draw(values, 2, 40, torch.Generator().manual_seed(0))
    assert drawn.numel() == 80
    assert int((drawn == 0).sum()) == 40 and bool((drawn[40:] >= 1).all())
