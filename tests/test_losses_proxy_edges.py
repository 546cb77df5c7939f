"""Proxy losses (:mod:`lightning_dml.losses.proxies` and its users) at the edges the other proxy tests leave out.

Frozen embeddings (only the proxies need a gradient), fp32 gradients against the fp64 loop references (the
closed-form backward runs with autocast off), two sub-centres per class, SoftTriple's centre regulariser for
``K = 1`` / ``K = 2`` / ``tau = 0``, reference embeddings given alone, a state dict loaded into a complete loss.
Every expected value comes from the loop references of ``tests/reference_proxy_losses.py`` or from a documented
property (scale invariance, the normalisation's derivative).
"""

from __future__ import annotations

import pytest
import torch

from lightning_dml.losses import (
    NormalizedSoftmaxLoss,
    ProxyAnchorLoss,
    ProxyNCALoss,
    SoftTripleLoss,
    SubCenterArcFaceLoss,
)
from lightning_dml.losses.proxies import ProxyLoss
from tests import reference_proxy_losses as ref

C, D = 5, 8


def _batch(seed: int, rows: int, b: int = 14, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, D, generator=g, dtype=torch.float64)
    y = torch.arange(b) % C
    proxies = torch.randn(rows, D, generator=g, dtype=torch.float64)
    return z.to(dtype), y, proxies.to(dtype)


def _loss(cls, proxies, dtype=torch.float64, **kw):
    loss = cls(num_classes=C, embedding_dim=D, **kw).to(dtype)
    with torch.no_grad():
        loss.proxies.copy_(proxies)
    return loss


def _ref_grads(reference, z, y, proxies, **kw):
    z = z.double().clone().requires_grad_(True)
    p = proxies.double().clone().requires_grad_(True)
    value = reference(z, y, p, **kw)
    gz, gp = torch.autograd.grad(value, [z, p])
    return value.detach(), gz, gp


SOFTMAX_CASES = {
    "normalized_softmax": (NormalizedSoftmaxLoss, {}, ref.normalized_softmax, {"temperature": 0.05}, 1),
    "subcenter_k2": (SubCenterArcFaceLoss, {"sub_centers": 2}, ref.arcface, {"scale": 64.0, "margin": 0.5,
                                                                             "sub_centers": 2}, 2),
    "soft_triple_k2": (SoftTripleLoss, {"centers_per_class": 2, "tau": 0.3}, ref.soft_triple,
                       {"centers_per_class": 2, "tau": 0.3}, 2),
    "proxy_nca": (ProxyNCALoss, {}, ref.proxy_nca, {}, 1),
}


@pytest.mark.parametrize("name", sorted(SOFTMAX_CASES))
def test_frozen_embeddings_still_train_the_proxies(name):
    """Embeddings that need no gradient (a frozen backbone): the proxies get the reference gradient."""
    cls, kw, reference, ref_kw, k = SOFTMAX_CASES[name]
    z, y, proxies = _batch(1, C * k)
    loss = _loss(cls, proxies, **kw)
    value = loss(z, y)
    (gp,) = torch.autograd.grad(value, loss.proxies)
    want, _, want_gp = _ref_grads(reference, z, y, proxies, **ref_kw)
    torch.testing.assert_close(value, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(gp, want_gp, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("name", sorted(SOFTMAX_CASES))
def test_fp32_gradients_match_the_fp64_reference(name):
    """float32 loss and gradients within float32 rounding of the float64 loop reference (no reduced-precision
    product anywhere in the closed-form backward)."""
    cls, kw, reference, ref_kw, k = SOFTMAX_CASES[name]
    z, y, proxies = _batch(2, C * k, dtype=torch.float32)
    loss = _loss(cls, proxies, dtype=torch.float32, **kw)
    zz = z.clone().requires_grad_(True)
    value = loss(zz, y)
    gz, gp = torch.autograd.grad(value, [zz, loss.proxies])
    want, want_gz, want_gp = _ref_grads(reference, z, y, proxies, **ref_kw)
    torch.testing.assert_close(value.double(), want, rtol=2e-5, atol=2e-5)
    for got, expected in ((gz, want_gz), (gp, want_gp)):
        scale = float(expected.abs().max())
        torch.testing.assert_close(got.double(), expected, rtol=1e-4, atol=1e-5 * scale)


def test_soft_triple_regulariser_gradient_follows_the_output_gradient():
    """``(2.5 L).backward()`` gives 2.5 times the centres' gradient, the regulariser's part included; with a
    frozen batch only the centres (and the regulariser) get one."""
    z, y, proxies = _batch(3, C * 3)
    loss = _loss(SoftTripleLoss, proxies, centers_per_class=3, tau=5.0)
    (one,) = torch.autograd.grad(loss(z, y), loss.proxies)
    (scaled,) = torch.autograd.grad(2.5 * loss(z, y), loss.proxies)
    torch.testing.assert_close(scaled, 2.5 * one, rtol=1e-12, atol=1e-12)
    _, _, want = _ref_grads(ref.soft_triple, z, y, proxies, centers_per_class=3, tau=5.0)
    torch.testing.assert_close(one, want, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("k, tau", [(1, 0.2), (2, 0.2), (3, 0.0)])
def test_soft_triple_regulariser_only_with_several_centres_and_a_weight(k, tau):
    """The regulariser is ``tau sum_c sum_{t<s} ||w_c^t - w_c^s|| / (C K (K - 1))``: 0 for ``K = 1`` (no pair of
    centres, not 0 / 0) and for ``tau = 0`` (also in the gradient where two centres coincide: no ``0 * inf``)."""
    z, y, proxies = _batch(4, C * k)
    if k == 3:
        proxies[1] = proxies[0]  # two identical centres of class 0: the distance's derivative is unbounded there
    loss = _loss(SoftTripleLoss, proxies, centers_per_class=k, tau=tau)
    zz = z.clone().requires_grad_(True)
    value = loss(zz, y)
    gz, gp = torch.autograd.grad(value, [zz, loss.proxies])
    want, want_gz, want_gp = _ref_grads(ref.soft_triple, z, y, proxies, centers_per_class=k, tau=tau)
    assert torch.isfinite(value) and torch.isfinite(gz).all() and torch.isfinite(gp).all()
    torch.testing.assert_close(value, want, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(gz, want_gz, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(gp, want_gp, rtol=1e-7, atol=1e-9)


@pytest.mark.parametrize("which", ["ref_embeddings", "ref_labels"])
def test_reference_embeddings_or_labels_alone_are_refused(which):
    z, y, proxies = _batch(5, C)
    loss = _loss(ProxyAnchorLoss, proxies)
    with pytest.raises(ValueError, match="takes no ref_embeddings"):
        loss(z, y, **{which: z if which == "ref_embeddings" else y})


def test_loading_a_state_dict_into_a_complete_loss_keeps_its_dtype():
    """A complete loss copies the loaded proxies into its own parameter (torch's load_state_dict): its dtype and
    identity stay; only an incomplete loss takes the sizes (and dtype) of the state dict."""
    loss = ProxyNCALoss(num_classes=C, embedding_dim=D)
    param = loss.proxies
    state = {"proxies": torch.randn(C, D, dtype=torch.float64)}
    loss.load_state_dict(state)
    assert loss.proxies is param and loss.proxies.dtype == torch.float32
    torch.testing.assert_close(loss.proxies.detach(), state["proxies"].float())
    fresh = ProxyNCALoss()
    fresh.load_state_dict(state)
    assert fresh.proxies.shape == (C, D) and fresh.proxies.dtype == torch.float64


@pytest.mark.parametrize("cls", [ProxyAnchorLoss, NormalizedSoftmaxLoss, ProxyNCALoss, SoftTripleLoss,
                                 SubCenterArcFaceLoss])
def test_proxy_losses_say_they_normalise_and_do(cls):
    """The anatomy flag ``normalize`` ("proxy losses L2-normalise embeddings and proxies", as PairLoss's flag of the
    same name) is True, and it is true: the loss does not change when the embeddings are scaled by 3."""
    assert issubclass(cls, ProxyLoss) and cls.normalize is True
    loss = cls(num_classes=C, embedding_dim=D).double()
    z, y, _ = _batch(6, 1)
    torch.testing.assert_close(loss(3.0 * z, y), loss(z, y), rtol=1e-12, atol=1e-12)


def test_complete_checks_each_size_against_its_own_minimum():
    """``complete``: ``num_classes >= 2`` and ``embedding_dim >= 1``, each at its bound and just below."""
    assert ProxyNCALoss().complete(embedding_dim=1).embedding_dim == 1
    assert ProxyNCALoss().complete(num_classes=2).num_classes == 2
    for kw in ({"embedding_dim": 0}, {"num_classes": 1}):
        with pytest.raises(ValueError, match=f"{next(iter(kw))} must be an integer >= "):
            ProxyNCALoss().complete(**kw)
