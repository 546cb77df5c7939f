"""Hyperbolic embeddings (issue 29 section 3): the Poincare-ball operations against their closed forms, Hyp-ViT's
loss against the authors' ``contrastive_loss`` written out over view pairs, HIER against a loop over its triplets
from the paper's equations (fp64 values and gradients, random and clustered batches, degenerate batches finite).

The DDP equality of both losses (2 and 3 gloo processes) is checked with every registered loss by
``tests/distributed/run_gather_loss.py``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lightning_dml.losses import LOSSES, HIERLoss, HypViTLoss, ProxyAnchorLoss, build_loss
from lightning_dml.losses.hier import hierarchical_triplet_loss, reciprocal_triplets
from lightning_dml.losses.hyperbolic import view_indices
from lightning_dml.models.hyperbolic import (
    RiemannianGradient,
    ToPoincare,
    clip_features,
    distance_to_origin,
    expmap0,
    logmap0,
    mobius_add,
    poincare_distance,
    poincare_distance_matrix,
    project,
    to_poincare,
)

C = 0.1


def _ball_points(n: int, dim: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return to_poincare(scale * torch.randn(n, dim, generator=g, dtype=torch.float64), C)


def _clustered(p: int, k: int, dim: int, seed: int, spread: float = 0.3) -> tuple[torch.Tensor, torch.Tensor]:
    """Trained-like: each class a tight cluster around a centre of norm ~2 (near the clipping radius)."""
    g = torch.Generator().manual_seed(seed)
    centres = 2.0 * F.normalize(torch.randn(p, dim, generator=g, dtype=torch.float64), dim=1)
    labels = torch.arange(p).repeat_interleave(k)
    x = centres[labels] + spread * torch.randn(p * k, dim, generator=g, dtype=torch.float64)
    perm = torch.randperm(p * k, generator=g)
    return x[perm], labels[perm]


def _random(p: int, k: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(p).repeat_interleave(k)[torch.randperm(p * k, generator=g)]
    return 1.5 * torch.randn(p * k, dim, generator=g, dtype=torch.float64), labels


# ------------------------------------------------------------------------------------------------ the ball
@pytest.mark.parametrize("c", [0.1, 1.0, 2.5])
def test_distance_closed_forms(c):
    x = to_poincare(torch.randn(7, 5, dtype=torch.float64), c)
    y = to_poincare(torch.randn(9, 5, dtype=torch.float64), c)
    # the Gram-matrix form equals the Moebius definition (Ermolov Eq. 4)
    torch.testing.assert_close(poincare_distance_matrix(x, y, c), poincare_distance(x[:, None], y[None], c))
    # and the arcosh form cosh(sqrt(c) d) = 1 + 2 c |x - y|^2 / ((1 - c|x|^2)(1 - c|y|^2))
    d2 = ((x[:, None] - y[None]) ** 2).sum(-1)
    a, b = 1 - c * (x * x).sum(-1), 1 - c * (y * y).sum(-1)
    arcosh = torch.acosh(1 + 2 * c * d2 / (a[:, None] * b[None])) / math.sqrt(c)
    torch.testing.assert_close(poincare_distance_matrix(x, y, c), arcosh)
    # symmetric, zero on the diagonal, and the distance to the origin
    torch.testing.assert_close(poincare_distance_matrix(y, x, c), poincare_distance_matrix(x, y, c).T)
    dxx = poincare_distance_matrix(x, x, c)
    assert torch.equal(dxx.diagonal(), torch.zeros(7, dtype=torch.float64))
    assert torch.equal(dxx, dxx.T)
    torch.testing.assert_close(distance_to_origin(x, c), poincare_distance(torch.zeros_like(x), x, c))
    # on a line through the origin: d(0, r e1) = 2 / sqrt(c) artanh(sqrt(c) r)
    r = 0.7 / math.sqrt(c)
    point = torch.zeros(1, 5, dtype=torch.float64)
    point[0, 0] = r
    assert float(distance_to_origin(point, c)) == pytest.approx(2 / math.sqrt(c) * math.atanh(math.sqrt(c) * r))
    # triangle inequality
    z = to_poincare(torch.randn(4, 5, dtype=torch.float64), c)
    dxy, dyz, dxz = (poincare_distance_matrix(x[:4], y[:4], c).diagonal(),
                     poincare_distance_matrix(y[:4], z, c).diagonal(), poincare_distance_matrix(x[:4], z, c).diagonal())
    assert bool((dxz <= dxy + dyz + 1e-12).all())


def test_distance_gradient_matches_the_definition_and_is_zero_at_coincident_points():
    x = _ball_points(6, 4, 1).requires_grad_(True)
    y = _ball_points(5, 4, 2).requires_grad_(True)
    w = torch.randn(6, 5, dtype=torch.float64)
    gx, gy = torch.autograd.grad((poincare_distance_matrix(x, y, C) * w).sum(), (x, y))
    rx, ry = torch.autograd.grad((poincare_distance(x[:, None], y[None], C) * w).sum(), (x, y))
    torch.testing.assert_close(gx, rx)
    torch.testing.assert_close(gy, ry)
    same = x.detach().clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(poincare_distance_matrix(same, same, C).diagonal().sum(), same)
    assert torch.isfinite(grad).all() and float(grad.abs().max()) == 0.0


def test_exp_and_log_maps_are_inverse_and_stay_in_the_ball():
    u = torch.randn(10, 6, dtype=torch.float64)
    for c in (0.1, 1.0):
        torch.testing.assert_close(logmap0(expmap0(u, c), c), u)
        y = to_poincare(u, c, clip_r=None)
        torch.testing.assert_close(expmap0(logmap0(y, c), c), y)
        # the exp map's radius: tanh(sqrt(c) |u|) / sqrt(c), along u
        torch.testing.assert_close(expmap0(u, c).norm(dim=1), torch.tanh(math.sqrt(c) * u.norm(dim=1)) / math.sqrt(c))
        torch.testing.assert_close(F.normalize(expmap0(u, c), dim=1), F.normalize(u, dim=1))
    # the boundary: huge vectors land strictly inside, at most (1 - 1e-3) / sqrt(c) after the projection
    huge = 1e6 * torch.randn(5, 6, dtype=torch.float64)
    for c in (0.1, 1.0):
        inside = to_poincare(huge, c, clip_r=None)
        assert bool((inside.norm(dim=1) <= (1 - 1e-3) / math.sqrt(c) + 1e-12).all())
        assert torch.isfinite(distance_to_origin(inside, c)).all()
    far = torch.zeros(1, 3, dtype=torch.float64)
    far[0, 0] = 0.9999 / math.sqrt(C)
    assert float(project(far, C).norm()) == pytest.approx((1 - 1e-3) / math.sqrt(C))
    inner = torch.full((1, 3), 0.1, dtype=torch.float64)
    assert torch.equal(project(inner, C), inner)


def test_mobius_addition_closed_forms():
    x, y = _ball_points(4, 3, 3), _ball_points(4, 3, 4)
    torch.testing.assert_close(mobius_add(torch.zeros_like(x), y, C), y)
    torch.testing.assert_close(mobius_add(-x, mobius_add(x, y, C), C), y)  # left cancellation
    assert float(mobius_add(-x, x, C).abs().max()) < 1e-15


def test_clipping_and_riemannian_gradient():
    x = torch.tensor([[3.0, 4.0], [0.3, 0.4]], dtype=torch.float64)
    clipped = clip_features(x, 2.3)
    assert float(clipped[0].norm()) == pytest.approx(5 * 2.3 / (5 + 1e-5))  # min(1, r / (|x| + 1e-5)) x
    torch.testing.assert_close(clipped[1], x[1])
    assert clip_features(x, None) is x
    p = _ball_points(3, 2, 5).requires_grad_(True)
    g = torch.randn(3, 2, dtype=torch.float64)
    (grad,) = torch.autograd.grad((RiemannianGradient.apply(p, C) * g).sum(), p)
    torch.testing.assert_close(grad, g * (1 - C * (p.detach() ** 2).sum(1, keepdim=True)) ** 2 / 4)
    layer = ToPoincare(c=C, clip_r=2.3, riemannian=True)
    torch.testing.assert_close(layer(x), to_poincare(x, C, 2.3))
    with pytest.raises(ValueError, match="curvature c"):
        ToPoincare(c=0.0)
    with pytest.raises(ValueError, match="clip_r"):
        ToPoincare(c=0.1, clip_r=-1.0)


# ------------------------------------------------------------------------------------------------ Hyp-ViT
def _hyp_vit_reference(x: torch.Tensor, labels: torch.Tensor, tau: float, c: float, clip_r: float) -> torch.Tensor:
    """The authors' ``contrastive_loss`` (htdt/hyp_metric, train.py) over every ordered pair of views, with views
    built by hand (the k-th item of each class) and distances by the Moebius definition."""
    z = to_poincare(x, c, clip_r)
    classes = sorted(set(labels.tolist()))
    members = {k: [int(i) for i in (labels == k).nonzero().flatten()] for k in classes}
    num_views = max(len(v) for v in members.values())
    total = x.new_zeros(())
    for i in range(num_views):
        for j in range(num_views):
            if i == j:
                continue
            both = [k for k in classes if len(members[k]) > max(i, j)]
            if not both:
                continue
            only_i = [k for k in classes if len(members[k]) > i and k not in both]
            x0 = z[[members[k][i] for k in both]]
            x1 = z[[members[k][j] for k in classes if len(members[k]) > j]]
            xi_extra = z[[members[k][i] for k in only_i]] if only_i else z[:0]
            view_i = torch.cat([x0, xi_extra])  # every item of view i (anchors first)
            targets = torch.tensor([[k for k in classes if len(members[k]) > j].index(k) for k in both])
            dist = lambda a, b: poincare_distance(a[:, None], b[None], c)  # noqa: E731
            logits01 = -dist(x0, x1) / tau
            logits00 = -dist(x0, view_i) / tau - torch.eye(len(both), view_i.shape[0], dtype=x.dtype) * 1e9
            logits = torch.cat([logits01, logits00], dim=1)
            logits = logits - logits.max(1, keepdim=True)[0].detach()
            total = total + F.cross_entropy(logits, targets)
    return total


@pytest.mark.parametrize("kind", ["random", "clustered"])
@pytest.mark.parametrize("p,k", [(6, 2), (5, 3)])
def test_hyp_vit_equals_the_authors_loss(kind, p, k):
    x, y = (_random if kind == "random" else _clustered)(p, k, 8, seed=p * k)
    for tau, c, clip_r in ((0.2, 0.1, 2.3), (0.5, 1.0, 1.0)):
        xa = x.clone().requires_grad_(True)
        xb = x.clone().requires_grad_(True)
        value = HypViTLoss(c=c, tau=tau, clip_r=clip_r)(xa, y)
        want = _hyp_vit_reference(xb, y, tau, c, clip_r)
        torch.testing.assert_close(value, want)
        (ga,), (gb,) = torch.autograd.grad(value, xa), torch.autograd.grad(want, xb)
        torch.testing.assert_close(ga, gb)
        assert value.dtype == torch.float64


def test_hyp_vit_uneven_classes_and_label_order():
    x, y = _random(4, 3, 6, seed=11)
    keep = torch.ones(12, dtype=torch.bool)
    keep[(y == 2).nonzero()[0]] = False  # class 2 has two items, class 3 one (a singleton: no anchor)
    keep[(y == 3).nonzero()[:2].flatten()] = False
    x, y = x[keep], y[keep]
    torch.testing.assert_close(HypViTLoss()(x, y), _hyp_vit_reference(x, y, 0.2, 0.1, 2.3))
    assert view_indices(torch.tensor([5, 7, 5, 5, 7])).tolist() == [0, 0, 1, 2, 1]


def test_hyp_vit_degenerate_batches_are_finite():
    loss = HypViTLoss()
    one_class = torch.randn(6, 4, requires_grad=True)
    value = loss(one_class, torch.zeros(6, dtype=torch.long))
    assert float(value.detach()) == pytest.approx(0.0, abs=1e-6)  # the positive is the only candidate of every anchor
    value.backward()
    assert torch.isfinite(one_class.grad).all()
    singles = torch.randn(5, 4, requires_grad=True)
    value = loss(singles, torch.arange(5))
    assert float(value.detach()) == 0.0
    value.backward()
    assert torch.isfinite(singles.grad).all()
    same = torch.ones(8, 4, requires_grad=True)
    value = loss(same, torch.arange(8) % 4)
    value.backward()
    assert math.isfinite(float(value.detach())) and torch.isfinite(same.grad).all()
    # all distances equal: each of the two view pairs is -log(1 / 7) averaged over its 4 anchors
    assert float(value.detach()) == pytest.approx(2 * math.log(7), rel=1e-5)


def test_hyp_vit_bad_input():
    with pytest.raises(ValueError, match="ref_embeddings"):
        HypViTLoss()(torch.randn(4, 3), torch.arange(4) % 2, torch.randn(2, 3), torch.arange(2))
    with pytest.raises(ValueError, match="label sets"):
        HypViTLoss()(torch.randn(4, 3), torch.zeros(4, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="tau"):
        HypViTLoss(tau=0.0)
    with pytest.raises(ValueError, match="curvature"):
        HypViTLoss(c=-1.0)
    z = torch.randn(4, 3)
    z[2, 0] = float("nan")
    with pytest.raises(ValueError, match="row 2"):
        HypViTLoss()(z, torch.arange(4) % 2)


# ------------------------------------------------------------------------------------------------ HIER
def _all_triplets_reference(sim: torch.Tensor, topk: int) -> set[tuple[int, int, int]]:
    n = sim.shape[0]
    k = min(topk, n)
    near = [set(sim[i].topk(k).indices.tolist()) for i in range(n)]
    out = set()
    for i in range(n):
        mutual = [j for j in range(n) if j != i and j in near[i] and i in near[j]]
        others = [m for m in range(n) if m != i and m not in mutual]
        if len(mutual) < 2 or not others:
            continue
        out |= {(i, j, m) for j in mutual for m in others}
    return out


def test_reciprocal_triplets_are_the_brute_force_sets_and_draws_stay_in_them():
    x, y = _clustered(5, 4, 6, seed=3, spread=0.6)
    z = to_poincare(x, C)
    sim = torch.exp(-poincare_distance_matrix(z, z, C)) + (y[:, None] == y[None]).double()
    for topk in (3, 6, 30):
        i, j, k = reciprocal_triplets(sim, topk, None)
        got = set(zip(i.tolist(), j.tolist(), k.tolist()))
        want = _all_triplets_reference(sim, topk)
        assert got == want and len(got) == i.numel()
        g = torch.Generator().manual_seed(0)
        i, j, k = reciprocal_triplets(sim, topk, 7, g)
        assert set(zip(i.tolist(), j.tolist(), k.tolist())) <= want
        anchors = {a for a, _, _ in want}
        assert set(i.tolist()) == anchors and i.numel() == 7 * len(anchors)


def _hier_reference(to_proxies_rows, triplets, margin):
    """HIER Eq. 3 looped over the triplets, LCA by Eq. 2 (first arg-min)."""
    terms = []
    for i, j, k in triplets:
        di, dj, dk = to_proxies_rows(i), to_proxies_rows(j), to_proxies_rows(k)
        lij = int(torch.argmin(torch.maximum(di, dj).detach()))
        lijk = int(torch.argmin(torch.maximum(dk, torch.maximum(di, dj)).detach()))
        if lij == lijk:
            terms.append(di.sum() * 0.0)
            continue
        terms.append(torch.relu(di[lij] - di[lijk] + margin) + torch.relu(dj[lij] - dj[lijk] + margin)
                     + torch.relu(dk[lijk] - dk[lij] + margin))
    return torch.stack(terms).mean() if terms else torch.zeros((), dtype=torch.float64)


def _hier_full_reference(loss: HIERLoss, x: torch.Tensor, y: torch.Tensor, proxies: torch.Tensor) -> torch.Tensor:
    """Base loss + weight * (Eq. 3 over the samples' triplets + Eq. 3 over the proxies' triplets), distances by the
    Moebius definition, triplets from the brute-force mining."""
    z = to_poincare(x, loss.c, loss.clip_r)
    rho = to_poincare(proxies, loss.c, loss.clip_r)
    d = lambda a, b: poincare_distance(a[:, None], b[None], loss.c)  # noqa: E731
    sim = torch.exp(-d(z, z)).detach() + (y[:, None] == y[None]).double()
    sample_triplets = sorted(_all_triplets_reference(sim, loss.topk))
    zp, pp = d(z, rho), d(rho, rho)
    pp = (pp + pp.T) / 2  # exact ties d(i, j) = d(j, i): the LCA of proxies i, j is the first of them (Eq. 2 arg-min)
    hier = _hier_reference(lambda i: zp[i], sample_triplets, loss.margin)
    proxy_triplets = sorted(_all_triplets_reference(torch.exp(-pp).detach(), loss.topk))
    hier = hier + _hier_reference(lambda i: pp[i], proxy_triplets, loss.margin)
    return loss.base_weight * loss.base(z, y) + loss.weight * hier


@pytest.mark.parametrize("kind", ["random", "clustered"])
@pytest.mark.parametrize("base", ["proxy_anchor", "multi_similarity"])
def test_hier_equals_the_paper_equations(kind, base):
    x, y = (_random if kind == "random" else _clustered)(4, 3, 6, seed=5)
    torch.manual_seed(0)
    loss = HIERLoss(base=base, num_classes=4, embedding_dim=6, num_proxies=6, topk=4, triplets_per_anchor=None,
                    riemannian=False).double()
    xa = x.clone().requires_grad_(True)
    value = loss(xa, y)
    ga, gpa = torch.autograd.grad(value, (xa, loss.proxies))
    xb = x.clone().requires_grad_(True)
    want = _hier_full_reference(loss, xb, y, loss.proxies)
    gb, gpb = torch.autograd.grad(want, (xb, loss.proxies))
    torch.testing.assert_close(value, want)
    torch.testing.assert_close(ga, gb)
    torch.testing.assert_close(gpa, gpb)
    assert float((value - loss.base(to_poincare(x, C), y)).detach()) > 0  # the hierarchy term is active


def test_hier_riemannian_gradient_scales_the_ball_points_gradient():
    x, y = _clustered(4, 3, 6, seed=8)
    torch.manual_seed(0)
    plain = HIERLoss(num_classes=4, embedding_dim=6, num_proxies=6, topk=4, triplets_per_anchor=None,
                     riemannian=False).double()
    riem = HIERLoss(num_classes=4, embedding_dim=6, num_proxies=6, topk=4, triplets_per_anchor=None).double()
    riem.load_state_dict(plain.state_dict())
    z = to_poincare(x, C).requires_grad_(True)
    x_plain = x.clone().requires_grad_(True)
    v = plain(x_plain, y)
    # d loss / d z at the ball points, scaled by (1 - c|z|^2)^2 / 4, pulled back through to_poincare
    (gz,) = torch.autograd.grad(plain.base(z, y) * plain.base_weight + plain.weight * plain.hier_term(
        z, y, to_poincare(plain.proxies, C), None), z)
    scaled = gz * (1 - C * (z.detach() ** 2).sum(1, keepdim=True)) ** 2 / 4
    xr = x.clone().requires_grad_(True)
    zr = to_poincare(xr, C)
    (want,) = torch.autograd.grad((zr * scaled).sum(), xr)
    x_riem = x.clone().requires_grad_(True)
    value = riem(x_riem, y)
    (got,) = torch.autograd.grad(value, x_riem)
    torch.testing.assert_close(value, v)
    torch.testing.assert_close(got, want)


def test_hier_draws_are_seeded_and_change_per_call():
    x, y = _clustered(4, 4, 6, seed=2, spread=0.8)
    torch.manual_seed(0)
    a = HIERLoss(num_classes=4, embedding_dim=6, num_proxies=8, topk=5, triplets_per_anchor=3).double()
    b = HIERLoss(num_classes=4, embedding_dim=6, num_proxies=8, topk=5, triplets_per_anchor=3).double()
    b.load_state_dict(a.state_dict())
    with torch.no_grad():
        first = [float(a(x, y)) for _ in range(3)]
        assert first == [float(b(x, y)) for _ in range(3)]  # same seed, same calls: same draws
        assert len(set(first)) > 1  # each call its own draws
        c = HIERLoss(num_classes=4, embedding_dim=6, num_proxies=8, topk=5, triplets_per_anchor=3, seed=9).double()
        c.load_state_dict(a.state_dict())
        assert float(c(x, y)) != first[0]


def test_hier_triplet_loss_without_triplets_is_zero_with_a_gradient_path():
    d = torch.rand(5, 4, dtype=torch.float64, requires_grad=True)
    empty = torch.zeros(0, dtype=torch.long)
    value = hierarchical_triplet_loss(d, empty, empty, empty, 0.1)
    value.backward()
    assert float(value.detach()) == 0.0 and float(d.grad.abs().sum()) == 0.0


@pytest.mark.parametrize("case", ["one_class", "singletons", "identical"])
def test_hier_degenerate_batches_are_finite(case):
    torch.manual_seed(0)
    loss = HIERLoss(num_classes=8, embedding_dim=4, num_proxies=6, topk=4)
    if case == "one_class":
        x, y = torch.randn(8, 4), torch.zeros(8, dtype=torch.long)
    elif case == "singletons":
        x, y = torch.randn(8, 4), torch.arange(8)
    else:
        x, y = torch.ones(8, 4), torch.arange(8) % 4
    x.requires_grad_(True)
    value = loss(x, y)
    value.backward()
    assert math.isfinite(float(value.detach())) and torch.isfinite(x.grad).all()
    assert torch.isfinite(loss.proxies.grad).all()


def test_hier_sizes_defaults_and_bad_input():
    loss = build_loss("hier")
    assert not loss.is_complete
    assert (loss.num_proxies, loss.c, loss.clip_r, loss.margin, loss.topk, loss.triplets_per_anchor, loss.weight,
            loss.base_weight, loss.riemannian) == (512, 0.1, 2.3, 0.1, 20, 50, 0.5, 1.0, True)
    assert isinstance(loss.base, ProxyAnchorLoss) and (loss.base.alpha, loss.base.delta) == (32.0, 0.1)
    with pytest.raises(ValueError, match="no proxies yet"):
        loss(torch.randn(4, 8), torch.arange(4))
    loss.complete(num_classes=4, embedding_dim=8)
    assert loss.is_complete and tuple(loss.proxies.shape) == (512, 8) and loss.base.num_classes == 4
    # the authors' start: randn / sqrt(D) * clip_r * 0.9, mean squared norm (2.3 * 0.9)^2
    assert float((loss.proxies.detach() ** 2).sum(1).mean()) == pytest.approx((2.3 * 0.9) ** 2, rel=0.1)
    with pytest.raises(ValueError, match="embedding_dim=8"):
        loss.complete(embedding_dim=16)
    with pytest.raises(ValueError, match="dim 5"):
        loss(torch.randn(4, 5), torch.arange(4))
    with pytest.raises(ValueError, match="base must be one of"):
        HIERLoss(base="triplet")
    with pytest.raises(ValueError, match="topk"):
        HIERLoss(topk=1)
    with pytest.raises(ValueError, match="label sets"):
        loss(torch.randn(4, 8), torch.zeros(4, 2, dtype=torch.long))
    assert LOSSES["hier"] is HIERLoss and LOSSES["hyp_vit"] is HypViTLoss


# ------------------------------------------------------------------------------------------------ the CLI
@pytest.mark.slow  # a fit each (two training steps and the end-of-fit validation on Glyphs): seconds on a quiet machine
@pytest.mark.parametrize("name", ["hyp_vit", "hier"])
def test_fit_by_registry_name(name, tmp_path, monkeypatch):
    """``lightning-dml fit --model.loss <name>`` on the demo's config (1 epoch of 2 batches): HIER's sizes are filled
    in from the data module (num_classes, the head's width) and recorded as loss_sizes."""
    from lightning_dml.cli import build_cli
    from tests.test_cli import FAST, GLYPHS

    monkeypatch.chdir(tmp_path)
    quick = ["--trainer.limit_train_batches=2", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0"]
    cli = build_cli(["fit", "--config", str(GLYPHS), *FAST, "--trainer.callbacks=[]", f"--model.loss={name}", *quick])
    assert type(cli.model.loss) is LOSSES[name]
    assert cli.trainer.global_step == 2
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    if name == "hier":
        loss = cli.model.loss
        assert loss.is_complete and loss.proxies.shape[1] == cli.model.head.embedding_dim
        assert cli.model.hparams["loss_sizes"] == {"num_classes": loss.num_classes, "embedding_dim": loss.embedding_dim}
        assert loss.base.num_classes == loss.num_classes


# ------------------------------------------------------------------------------------------------ recipes
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
#: the authors' settings, written out independently of the configs: HIER scripts/DINO/hier_<ds>.sh
#: (lr, epochs, weight decay, warm-up epochs, fc_lr_scale) and hyp_metric train.py's Config (lr 1e-5, tau 0.2, 100 ep)
HIER_SCRIPTS = {"cub200": (5e-6, 100, 1e-2, 1, 1.0), "cars196": (5e-6, 100, 1e-2, 1, 1.0),
                "sop": (5e-6, 150, 1e-4, 5, 100.0), "inshop": (5e-6, 150, 1e-4, 5, 100.0)}


@pytest.mark.parametrize("dataset", sorted(HIER_SCRIPTS))
def test_hyperbolic_recipes_follow_the_authors_code(dataset):
    import yaml

    doc = (CONFIGS.parent / "docs" / "reproduction.md").read_text()
    for kind in ("hypvit", "hier"):
        name = f"{kind}_{dataset}.yaml"
        text = (CONFIGS / name).read_text()
        cfg = yaml.safe_load(text)
        header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
        assert "Target:" in header and "row" in header and "Deviations" in header and "Poincare distance" in header
        backbone = cfg["model"]["backbone"]["init_args"]
        assert backbone["model_name"] == "vit_small_patch16_224.dino" and backbone["pretrained"] is True
        assert cfg["model"]["embedding_dim"] == 128
        loss = cfg["model"]["loss"]["init_args"]
        assert (loss["c"], loss["clip_r"]) == (0.1, 2.3)
        opt = cfg["model"]["optimizer"]
        assert opt["class_path"] == "torch.optim.AdamW"
        args = cfg["data"]["init_args"]
        assert args["samples_per_class"] == 2  # num_samples / IPC 2
        if kind == "hypvit":
            assert cfg["model"]["loss"]["class_path"] == "lightning_dml.losses.HypViTLoss" and loss["tau"] == 0.2
            assert opt["init_args"]["lr"] == pytest.approx(1e-5) and cfg["trainer"]["max_epochs"] == 100
            assert (cfg["trainer"]["gradient_clip_val"], cfg["trainer"]["gradient_clip_algorithm"]) == (3.0, "norm")
            assert "R@1 = " in header
        else:
            lr, epochs, wd, warm, fc_scale = HIER_SCRIPTS[dataset]
            assert cfg["model"]["loss"]["class_path"] == "lightning_dml.losses.HIERLoss"
            assert (loss["base"], loss["num_proxies"], loss["margin"], loss["topk"], loss["triplets_per_anchor"],
                    loss["weight"], loss["base_weight"], loss["riemannian"]) == (
                        "proxy_anchor", 512, 0.1, 20, 50, 0.5, 1.0, True)
            assert opt["init_args"]["lr"] == pytest.approx(lr) and opt["init_args"]["weight_decay"] == pytest.approx(wd)
            assert cfg["trainer"]["max_epochs"] == epochs and cfg["model"]["freeze_backbone_epochs"] == warm
            assert cfg["model"]["head_lr_multiplier"] == fc_scale
            assert (cfg["trainer"]["gradient_clip_val"], cfg["trainer"]["gradient_clip_algorithm"]) == (10.0, "value")
            assert args["classes_per_batch"] == 90  # 2 GPUs x 90 images = 90 classes x 2
        row = next(line for line in doc.splitlines() if line.startswith(f"| `configs/{name}`"))
        assert row.rstrip().endswith("| |")  # the `ours` column stays empty until a real run
