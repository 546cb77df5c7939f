"""MatryoshkaLoss over losses with parameters (Kusupati et al., NeurIPS 2022, Eq. 1: a classifier ``W^(m)`` per
width; Sec. 3 MRL-E: one tied ``W`` whose leading ``m`` columns are ``W^(m)``): in fp64 the weighted sum over the
widths equals the slow loop references of tests/reference_proxy_losses.py (written from the papers) on the cut
embeddings with each width's own proxies, values and gradients of the embeddings and of every width's proxies; and
the same library loss built alone at each width. State-dict round trips, one-line refusals. The config path (a
yaml snippet with a proxy inner loss, the optimizer group, a checkpoint): tests/test_matryoshka.py's CLI fit."""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from lightning_dml.losses import MatryoshkaLoss, ProxyAnchorLoss, build_loss
from tests import reference_proxy_losses as ref

WIDTHS, WEIGHTS, C = [2, 5, 8], [0.5, 1.0, 2.0], 4

#: registry name, constructor arguments, the reference (its arguments matching), proxies per class
CASES = {
    "proxy_anchor": ({}, ref.proxy_anchor, 1),
    "arcface": ({"scale": 16.0}, functools.partial(ref.arcface, scale=16.0), 1),
    "proxy_nca": ({}, ref.proxy_nca, 1),
    "soft_triple": ({"centers_per_class": 2}, functools.partial(ref.soft_triple, centers_per_class=2), 2),
}


def _data(per_class: int = 3, dim: int = 8, k: int = 1):
    """Clustered fp64 embeddings (norms far from 1) and proxies near their class centres: the cosines to the own
    proxy lie around 0.5-0.9, where Proxy-Anchor's delta, ArcFace's angular margin and SoftTriple's centre weights
    are all active (not saturated)."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(C, dim, generator=g, dtype=torch.float64)
    y = torch.arange(C).repeat_interleave(per_class)
    x = 3.0 * (centres[y] + 0.7 * torch.randn(C * per_class, dim, generator=g, dtype=torch.float64))
    proxies = centres.repeat_interleave(k, dim=0) + 0.5 * torch.randn(C * k, dim, generator=g, dtype=torch.float64)
    return x, y, proxies


def _wrapper(name: str, kwargs: dict, proxies: torch.Tensor) -> MatryoshkaLoss:
    loss = MatryoshkaLoss(build_loss(name, **kwargs), widths=WIDTHS, weights=WEIGHTS).complete(C, 8).double()
    with torch.no_grad():
        for width, inner in zip(WIDTHS, loss.losses):
            inner.proxies.copy_(proxies[:, :width])  # each width its own W^(m): here the cut of one matrix
    return loss


@pytest.mark.parametrize("name", sorted(CASES))
def test_per_width_losses_equal_the_papers_references_and_separate_losses(name):
    kwargs, reference, k = CASES[name]
    x, y, proxies = _data(k=k)
    loss = _wrapper(name, kwargs, proxies)
    assert [tuple(p.shape) for p in loss.parameters()] == [(C * k, d) for d in WIDTHS]
    xg = x.clone().requires_grad_(True)
    value = loss(xg, y)
    value.backward()
    got_proxy_grads = [inner.proxies.grad for inner in loss.losses]
    # the reference: sum_m c_m L(z[:, :m], y; W^(m)), each W^(m) a leaf of its own
    xr = x.clone().requires_grad_(True)
    leaves = [proxies[:, :d].clone().requires_grad_(True) for d in WIDTHS]
    want = sum(c * reference(xr[:, :d], y, w) for d, c, w in zip(WIDTHS, WEIGHTS, leaves))
    want.backward()
    assert torch.allclose(value.detach(), want.detach(), rtol=1e-10, atol=1e-12), (float(value), float(want))
    assert torch.allclose(xg.grad, xr.grad, rtol=1e-8, atol=1e-11)
    for got, leaf in zip(got_proxy_grads, leaves):
        assert torch.allclose(got, leaf.grad, rtol=1e-8, atol=1e-11)
        assert float(leaf.grad.abs().max()) > 1e-6  # every width's proxies get a gradient
    # the library's loss built alone at each width, with the same proxies
    separate = 0.0
    for d, c, w in zip(WIDTHS, WEIGHTS, leaves):
        alone = build_loss(name, num_classes=C, embedding_dim=d, **kwargs).double()
        with torch.no_grad():
            alone.proxies.copy_(w)
        separate = separate + c * alone(x[:, :d], y)
    assert torch.allclose(loss(x, y).detach(), separate.detach(), rtol=1e-12, atol=0)


def test_tied_mrl_e_uses_the_leading_columns_of_one_proxy_matrix():
    x, y, proxies = _data()
    loss = MatryoshkaLoss(ProxyAnchorLoss(num_classes=C), widths=WIDTHS, weights=WEIGHTS, tied=True)
    loss = loss.complete(embedding_dim=8).double()
    assert [tuple(p.shape) for p in loss.parameters()] == [(C, 8)] and list(loss.state_dict()) == ["loss.proxies"]
    with torch.no_grad():
        loss.loss.proxies.copy_(proxies)
    xg = x.clone().requires_grad_(True)
    value = loss(xg, y)
    value.backward()
    xr, w = x.clone().requires_grad_(True), proxies.clone().requires_grad_(True)
    want = sum(c * ref.proxy_anchor(xr[:, :d], y, w[:, :d]) for d, c in zip(WIDTHS, WEIGHTS))
    want.backward()
    assert torch.allclose(value.detach(), want.detach(), rtol=1e-10, atol=1e-12)
    assert torch.allclose(xg.grad, xr.grad, rtol=1e-8, atol=1e-11)
    assert torch.allclose(loss.loss.proxies.grad, w.grad, rtol=1e-8, atol=1e-11)
    # columns 5..7 are used by the widest cut only, columns 0..1 by all three: both trained
    assert float(w.grad[:, 5:].abs().min()) > 0 and float(w.grad[:, :2].abs().min()) > 0


def test_state_dict_round_trip_into_an_incomplete_wrapper():
    x, y, proxies = _data()
    trained = _wrapper("proxy_anchor", {}, proxies)
    fresh = MatryoshkaLoss("proxy_anchor", widths=WIDTHS, weights=WEIGHTS)  # no num_classes: no proxies yet
    assert not fresh.is_complete and list(fresh.state_dict()) == []
    fresh.load_state_dict(trained.state_dict())
    assert fresh.is_complete and fresh.num_classes == C
    assert torch.equal(fresh.double()(x, y), trained(x, y))
    # default widths (D/8 .. D): the copies are made for the saved parameters' widths
    default = MatryoshkaLoss("arcface").complete(C, 16)
    again = MatryoshkaLoss("arcface")
    again.load_state_dict(default.state_dict())
    assert [f.embedding_dim for f in again.losses] == [2, 4, 8, 16] and again.embedding_dim == 16
    for a, b in zip(again.parameters(), default.parameters()):
        assert torch.equal(a, b)
    # a deep copy (DMLModule's per-level losses) gets its own parameters, in the state dict's layout
    twin = copy.deepcopy(trained)
    twin.reset_parameters()
    assert list(twin.state_dict()) == list(trained.state_dict())
    assert not torch.equal(twin.losses[0].proxies, trained.losses[0].proxies)


def test_anatomy_follows_the_wrapped_loss_with_parameters():
    pa = MatryoshkaLoss("proxy_anchor")
    assert (pa.has_parameters, pa.needs_num_classes, pa.gather_mode, pa.needs_positive_pairs) == (
        True, True, "global_batch", False)
    assert MatryoshkaLoss("arcface").gather_mode is None  # per-sample: exact under DDP without gathering
    from lightning_dml.checks import check_gather_combination

    with pytest.raises(ValueError, match="gather_distributed=True cannot be used with .*per-sample") as err:
        check_gather_combination(MatryoshkaLoss("arcface"), True)  # what DMLModule says at fit start
    assert "\n" not in str(err.value)
    margin = MatryoshkaLoss(build_loss("margin", class_margins=False), widths=[2, 8])
    assert margin.is_complete and not margin.needs_num_classes and margin.needs_embedding_dim
    assert [tuple(p.shape) for p in margin.parameters()] == [(1,), (1,)]  # a beta per width
    counts = MatryoshkaLoss("dynamic_arcface", widths=[2, 8]).complete(C, 8)
    assert counts.needs_class_counts and counts.class_counts is None
    counts.set_class_counts([1, 2, 3, 4])
    assert all(f.class_counts is not None for f in counts.losses)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"loss": ProxyAnchorLoss(embedding_dim=8)}, "give ProxyAnchorLoss without embedding_dim"),
        ({"loss": "arcface", "tied": "yes"}, "tied must be true or false"),
        ({"loss": "triplet", "tied": True}, "TripletLoss has none"),
        ({"loss": "margin", "tied": True}, "needs a proxy loss"),
        ({"loss": build_loss("arcface", sharded=True)}, r"ArcFaceLoss\(sharded=True\)"),
        ({"loss": "cross_batch_memory"}, "it is neither a pair loss"),
    ],
)
def test_bad_wrapped_losses_one_line(kwargs, needle):
    with pytest.raises(ValueError, match=needle) as err:
        MatryoshkaLoss(**kwargs)
    assert "\n" not in str(err.value)


def test_misuse_at_call_one_line():
    x, y, _ = _data()
    cases = [
        (lambda: MatryoshkaLoss("proxy_anchor")(x, y), "has no per-width ProxyAnchorLoss yet"),
        (lambda: MatryoshkaLoss("proxy_anchor").complete(C, 16)(x, y), "built for embedding width D = 16"),
        (lambda: MatryoshkaLoss("proxy_anchor", widths=[2, 16]).complete(C, 8), "width 16 exceeds"),
        (lambda: MatryoshkaLoss("proxy_anchor", widths=[2, 8]).complete(C, 8)(x, y + 1), r"num_classes=4\), got"),
        (lambda: MatryoshkaLoss("proxy_anchor", widths=[2, 8], tied=True).complete(C, 8)(x, y, x, y),
         "takes no ref_embeddings"),
        (lambda: MatryoshkaLoss("arcface", widths=[2, 8]).set_anchor_chunk_size(4), "does not take anchor_chunk"),
    ]
    for call, needle in cases:
        with pytest.raises(ValueError, match=needle) as err:
            call()
        assert "\n" not in str(err.value)
