"""Issue 29, package C: Instance, Manifold, DynamicArcFace and the SelfSupervisedLoss wrapper (with the data modules'
``views`` option) against pytorch-metric-learning 2.9 (values and gradients, fp64, random and trained-like batches)
and against loop references from the papers (tests/reference_losses_part3c.py), with ties, degenerate batches,
DDP refusals and the CLI.

pml conventions (documented in each loss's docstring): InstanceLoss's target column is the rank of the item's label
among the batch's distinct labels (pml and the authors' code); ManifoldLoss takes its proxy assignments as labels
(pml's ``indices_tuple``) and pml inverts its graph matrix in fp32 (compared to 1e-6; the fp64 series reference to
1e-9); pml 3's DynamicArcFaceLoss (Python >= 3.12, not installable here) sets pml's sub-center ArcFace's margin to
the batch's per-class margins, which pml 2.9's loss accepts: that is the comparison.
"""

from __future__ import annotations

import math

import pytest
import torch

from lightning_dml.losses import LOSSES, build_loss
from tests import reference_losses_part3c as ref
from tests.test_losses_trained_like import trained_like_batch

pml_losses = pytest.importorskip("pytorch_metric_learning.losses")

#: every loss of this package
NAMES = ["instance", "manifold", "self_supervised", "dynamic_arcface"]
COUNTS = torch.tensor([1, 3, 10, 50, 200])  # items per class: margins from a + b = 0.55 down to 0.18


def random_batch(seed: int, b: int = 20, classes: int = 5, d: int = 12) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = (torch.arange(b) % classes)[torch.randperm(b, generator=g)]
    return torch.randn(b, d, generator=g, dtype=torch.float64), y


#: random batches and trained-like clusters (cosines about 0.7 within a class, 0.45 across; tight 0.96 / 0.8)
BATCHES = {
    "random": lambda: random_batch(0),
    "near_margin": lambda: trained_like_batch(0, 0.7, 0.45, dim=12),
    "tight": lambda: trained_like_batch(2, 0.96, 0.8, dim=12),
}


def value_and_grad(fn, z, y, params=()):
    z = z.detach().clone().requires_grad_(True)
    value = fn(z, y)
    grads = torch.autograd.grad(value, [z, *params])
    return value.detach(), grads


def assert_same(ours, theirs, z, y, rtol=1e-10, params=((), ())):
    v1, g1 = value_and_grad(ours, z, y, params[0])
    v2, g2 = value_and_grad(theirs, z, y, params[1])
    torch.testing.assert_close(v1, v2, rtol=rtol, atol=1e-12)
    for a, b in zip(g1, g2):
        atol = max(1e-12, rtol * float(b.abs().max()))  # relative to the gradient's scale
        torch.testing.assert_close(a, b.reshape(a.shape) if a.shape == b.shape else b.T, rtol=max(rtol, 1e-8),
                                   atol=atol)
    assert float(g1[0].abs().max()) > 0  # the comparison has something to compare


# ------------------------------------------------------------------------------------------------ instance
@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("gamma,instances", [(64.0, False), (4.0, True)])
def test_instance_matches_pml(batch, gamma, instances):
    """Class labels, and one instance per item (labels = arange: pml's default without labels)."""
    z, y = BATCHES[batch]()
    y = torch.arange(len(y)) if instances else y
    assert_same(build_loss("instance", gamma=gamma), pml_losses.InstanceLoss(gamma=gamma), z, y)


@pytest.mark.parametrize("labels", ["classes", "shuffled_ids"])
def test_instance_matches_loop_reference(labels):
    z, y = trained_like_batch(1, 0.85, 0.5, classes=4, per_class=3, dim=8)
    if labels == "shuffled_ids":  # distinct labels out of order: the target is the rank, not the item itself
        y = torch.randperm(len(y), generator=torch.Generator().manual_seed(0)) * 3 + 7
    assert_same(build_loss("instance", gamma=8.0), lambda e, t: ref.instance(e, t, gamma=8.0), z, y)


def test_instance_target_is_the_label_rank():
    from lightning_dml.losses.instance import instance_targets

    assert instance_targets(torch.tensor([3, 1, 3, 7])).tolist() == [1, 0, 1, 2]


# ------------------------------------------------------------------------------------------------ manifold
def _manifold_pair(classes: int, dim: int, **kwargs):
    torch.manual_seed(0)
    theirs = pml_losses.ManifoldLoss(dim, K=classes, **{"lambdaC": kwargs.get("lambda_c", 1.0),
                                                       **{k: v for k, v in kwargs.items() if k != "lambda_c"}})
    ours = build_loss("manifold", num_classes=classes, embedding_dim=dim, **kwargs).double()
    with torch.no_grad():
        ours.proxies.copy_(theirs.proxies)
    return ours, theirs.double()


@pytest.mark.parametrize("batch,kwargs", [("random", {}), ("tight", {}),
                                          ("near_margin", {"lambda_c": 0.3, "alpha": 0.5, "margin": 0.01})])
def test_manifold_matches_pml(batch, kwargs):
    """Values and embedding and proxy gradients; pml inverts the graph matrix in fp32 (relative 1e-7 noise)."""
    z, y = BATCHES[batch]()
    ours, theirs = _manifold_pair(5, z.shape[1], **kwargs)
    assert_same(ours, lambda e, t: theirs(e, indices_tuple=t), z, y, rtol=1e-6,
                params=((ours.proxies,), (theirs.proxies,)))


@pytest.mark.parametrize("batch", ["random", "near_margin"])
def test_manifold_matches_the_random_walk_series(batch):
    """fp64 against F = (1 - alpha) sum_t (alpha S_bar)^t and loops over the hinge terms (no inverse, no pml)."""
    z, y = BATCHES[batch]()
    z, y = z[:10], y[:10]
    ours = build_loss("manifold", num_classes=5, embedding_dim=z.shape[1], margin=0.02).double()
    w = ours.proxies.detach().clone().requires_grad_(True)
    assert_same(ours, lambda e, t: ref.manifold(e, w, t, margin=0.02), z, y, rtol=1e-9,
                params=((ours.proxies,), (w,)))


def test_manifold_hinge_counts_only_violating_proxies():
    """Control for the comparisons above: with a huge margin every other proxy counts, which changes the value."""
    z, y = random_batch(3)
    small = build_loss("manifold", num_classes=5, embedding_dim=12).double()
    big = build_loss("manifold", num_classes=5, embedding_dim=12, margin=10.0).double()
    big.load_state_dict(small.state_dict())
    from lightning_dml.losses.manifold import manifold_similarity, proxy_hinge_lse

    x = torch.nn.functional.normalize(z, dim=1)
    f = manifold_similarity(x, torch.nn.functional.normalize(small.proxies.detach(), dim=1), 0.8)
    everything = torch.log1p((f[:20, 20:] - f[:20, 20:].gather(1, y[:, None]) + 10.0).exp().sum(1) - math.exp(10.0))
    torch.testing.assert_close(proxy_hinge_lse(f[:20, 20:], y, 10.0), everything.mean())
    assert float(small(z, y).detach()) < float(big(z, y).detach())


def test_manifold_hinge_counts_a_proxy_exactly_at_the_margin():
    """pml drops a proxy only where z < 0: a tie (z = 0) counts, log(1 + e^0) = log 2."""
    from lightning_dml.losses.manifold import proxy_hinge_lse

    scores = torch.tensor([[0.5, 0.5, 0.2], [0.1, 0.4, 0.4]], dtype=torch.float64)
    got = proxy_hinge_lse(scores, torch.tensor([0, 2]), 0.0)
    torch.testing.assert_close(got, torch.tensor(math.log(2.0), dtype=torch.float64))


def test_manifold_rejects_bad_settings():
    for kwargs in ({"alpha": 1.0}, {"alpha": 0.0}, {"lambda_c": math.inf}, {"lambda_c": -1.0}):
        with pytest.raises(ValueError, match="ManifoldLoss"):
            build_loss("manifold", **kwargs)


# ----------------------------------------------------------------------------------------- dynamic ArcFace
def _dynamic_pair(sub_centers: int, dim: int, scale: float = 64.0):
    torch.manual_seed(0)
    ours = build_loss("dynamic_arcface", num_classes=5, embedding_dim=dim, class_counts=COUNTS,
                      sub_centers=sub_centers, scale=scale).double()
    if sub_centers == 1:
        theirs = pml_losses.ArcFaceLoss(5, dim, scale=scale)
    else:
        theirs = pml_losses.SubCenterArcFaceLoss(num_classes=5, embedding_size=dim, sub_centers=sub_centers,
                                                 scale=scale)
    theirs = theirs.double()
    with torch.no_grad():
        theirs.W.copy_(ours.proxies.T)
    margins = 0.5 * COUNTS.double() ** -0.25 + 0.05

    def pml3(e, t):  # pml 3's DynamicArcFaceLoss.forward: the wrapped loss's margin set to the batch's margins
        theirs.margin = margins[t]
        return theirs(e, t)

    return ours, theirs, pml3


@pytest.mark.parametrize("batch", BATCHES)
@pytest.mark.parametrize("sub_centers,scale", [(3, 64.0), (1, 64.0), (2, 8.0)])
def test_dynamic_arcface_matches_pml3_convention(batch, sub_centers, scale):
    z, y = BATCHES[batch]()
    ours, theirs, pml3 = _dynamic_pair(sub_centers, z.shape[1], scale)
    assert_same(ours, pml3, z, y, params=((ours.proxies,), (theirs.W,)))


def test_dynamic_arcface_matches_loop_reference_past_pi_minus_m():
    """Embeddings opposite their class's sub-centres (theta_y > pi - m): the linear branch of the ArcFace code."""
    z, y = random_batch(4, b=10)
    ours = build_loss("dynamic_arcface", num_classes=5, embedding_dim=12, class_counts=COUNTS, sub_centers=1,
                      scale=4.0).double()
    unit = torch.nn.functional.normalize
    z = unit(z.clone(), dim=1)
    z[:3] = unit(-unit(ours.proxies.detach()[y[:3]], dim=1) + 0.1 * z[:3], dim=1)  # opposite its class's weight
    w = ours.proxies.detach().clone().requires_grad_(True)
    cos = (z @ unit(w.detach(), dim=1).T)[torch.arange(10), y]
    margins = 0.5 * COUNTS[y].double() ** -0.25 + 0.05
    beyond = torch.acos(cos) > math.pi - margins
    assert bool(beyond[:3].all()) and not bool(beyond[3:].any())  # both branches
    assert_same(ours, lambda e, t: ref.dynamic_arcface(e, w, t, COUNTS, sub_centers=1, scale=4.0), z, y,
                params=((ours.proxies,), (w,)))


def test_dynamic_margins_follow_the_class_counts():
    from lightning_dml.losses.dynamic_arcface import additive_angular_margins, dynamic_margins
    from lightning_dml.losses.arcface import additive_angular_margin

    m = dynamic_margins(COUNTS, 0.5, 0.05, 0.25)
    torch.testing.assert_close(m, torch.tensor([0.55, 0.5 / 3**0.25 + 0.05, 0.5 / 10**0.25 + 0.05,
                                                0.5 / 50**0.25 + 0.05, 0.5 / 200**0.25 + 0.05], dtype=torch.float64))
    assert bool((m.diff() < 0).all())  # rarer classes, larger margins
    edge = torch.cos(math.pi - m)  # exactly at theta = pi - m: still cos(theta + m) = cos(pi) = -1
    torch.testing.assert_close(additive_angular_margins(edge, m), torch.full_like(m, -1.0), rtol=0, atol=1e-12)
    cos = torch.linspace(-1, 1, 101, dtype=torch.float64)
    for margin in (0.1, 0.5):  # one margin: ArcFace's function
        torch.testing.assert_close(additive_angular_margins(cos, torch.full_like(cos, margin)),
                                   additive_angular_margin(cos, margin), rtol=0, atol=1e-15)
    # equal counts: ArcFace / sub-center ArcFace with that margin
    z, y = random_batch(5)
    equal = build_loss("dynamic_arcface", num_classes=5, embedding_dim=12, class_counts=[16] * 5).double()
    plain = build_loss("subcenter_arcface", num_classes=5, embedding_dim=12, margin=0.5 / 2 + 0.05).double()
    plain.load_state_dict({"proxies": equal.proxies.detach()})
    torch.testing.assert_close(equal(z, y), plain(z, y), rtol=1e-12, atol=0)


def test_dynamic_arcface_class_counts_are_checked_and_saved():
    with pytest.raises(ValueError, match="no class_counts"):
        build_loss("dynamic_arcface", num_classes=5, embedding_dim=4)(torch.randn(3, 4), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="has 3 entries"):
        build_loss("dynamic_arcface", num_classes=5, embedding_dim=4, class_counts=[1, 2, 3])
    for bad in ([1, 0, 2, 2, 2], [1.5, 2.0, 1.0, 1.0, 1.0]):
        with pytest.raises(ValueError, match="class_counts|class count"):
            build_loss("dynamic_arcface", num_classes=5, embedding_dim=4, class_counts=bad)
    with pytest.raises(ValueError, match="a \\+ b"):
        build_loss("dynamic_arcface", a=1.5, b=0.1)
    saved = build_loss("dynamic_arcface", num_classes=5, embedding_dim=4, class_counts=COUNTS).state_dict()
    fresh = build_loss("dynamic_arcface")  # sizes and counts from the state dict
    fresh.load_state_dict(saved)
    assert fresh.class_counts.tolist() == COUNTS.tolist() and fresh.num_classes == 5
    parent = torch.nn.ModuleDict({"loss": build_loss("dynamic_arcface")})  # inside a model: a prefixed key
    parent.load_state_dict({f"loss.{k}": v for k, v in saved.items()})
    assert parent["loss"].class_counts.tolist() == COUNTS.tolist()


class TinyData:
    """A data module of 15 blank 8 x 8 images: classes 3, 5, 9 with 2, 4 and 9 items (unequal counts)."""

    @staticmethod
    def make(**kwargs):
        from lightning_dml.data.base import DMLDataModule, TensorImageDataset

        class Tiny(DMLDataModule):
            def build_datasets(self):
                labels = torch.tensor([9, 3, 5, 9, 9, 5, 3, 9, 5, 9, 9, 5, 9, 9, 9])
                data = TensorImageDataset(torch.randint(0, 255, (15, 1, 8, 8), dtype=torch.uint8), labels)
                return data, data

        return Tiny(**kwargs)


def test_dynamic_arcface_counts_come_from_the_data_module():
    """DMLModule fills in num_classes and the class counts from the training split (train_class_counts, in the
    order of train_class_ids)."""
    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule

    dm = TinyData.make(classes_per_batch=2, samples_per_class=2)
    assert dm.train_class_ids.tolist() == [3, 5, 9] and dm.train_class_counts.tolist() == [2, 4, 9]
    model = DMLModule(backbone=SmallConvNet(width=4), embedding_dim=8, loss=build_loss("dynamic_arcface"))
    model._complete_losses(dm)
    assert model.loss.class_counts.tolist() == [2, 4, 9] and model.loss.num_classes == 3
    given = DMLModule(backbone=SmallConvNet(width=4), embedding_dim=8,
                      loss=build_loss("dynamic_arcface", class_counts=[1, 1, 1]))
    given._complete_losses(dm)  # counts set in the config are kept
    assert given.loss.class_counts.tolist() == [1, 1, 1]


# ------------------------------------------------------------------------------------------ self-supervised
SELF_SUPERVISED_INNER = {
    "ntxent": (lambda: build_loss("ntxent", temperature=0.2), lambda: pml_losses.NTXentLoss(temperature=0.2)),
    "contrastive": (lambda: build_loss("contrastive", pos_margin=0.1, neg_margin=0.9),
                    lambda: pml_losses.ContrastiveLoss(pos_margin=0.1, neg_margin=0.9)),
    "supcon": (lambda: build_loss("supcon", temperature=0.1), lambda: pml_losses.SupConLoss(temperature=0.1)),
    "snr_contrastive": (lambda: build_loss("snr_contrastive"), lambda: pml_losses.SignalToNoiseRatioContrastiveLoss()),
}


def two_views(seed: int, n: int = 10, d: int = 8, noise: float = 0.4) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, d, generator=g, dtype=torch.float64)
    return z, z + noise * torch.randn(n, d, generator=g, dtype=torch.float64)


@pytest.mark.parametrize("inner", SELF_SUPERVISED_INNER)
@pytest.mark.parametrize("seed,noise", [(0, 0.4), (1, 1.5)])
def test_self_supervised_matches_pml(inner, seed, noise):
    """pml's SelfSupervisedLoss(inner)(emb, ref_emb) is our forward_views(emb, ref_emb): values and both views'
    gradients."""
    ours_inner, their_inner = SELF_SUPERVISED_INNER[inner]
    ours = build_loss("self_supervised", loss=ours_inner())
    theirs = pml_losses.SelfSupervisedLoss(their_inner())
    z, r = two_views(seed, noise=noise)
    for view in (0, 1):
        if view == 0:
            o, t = (lambda e, _: ours.forward_views(e, r)), (lambda e, _: theirs(e, r))
        else:
            o, t = (lambda e, _: ours.forward_views(z, e)), (lambda e, _: theirs(z, e))
        assert_same(o, t, z if view == 0 else r, None)


def test_self_supervised_three_views_are_the_inner_loss_on_item_ids():
    z, r = two_views(2)
    third = z - 0.3 * r
    inner = build_loss("ntxent", temperature=0.3)
    want = inner(torch.cat([z, r, third]), torch.arange(10).repeat(3))
    got = build_loss("self_supervised", loss=inner).forward_views(z, r, third)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    # items in any order, ids any integers: the views are found by their id
    perm = torch.randperm(30, generator=torch.Generator().manual_seed(1))
    items, ids = torch.cat([z, r, third])[perm], (torch.arange(10).repeat(3) * 5 + 2)[perm]
    shuffled = build_loss("self_supervised", loss=inner, views=3)(items, ids)
    torch.testing.assert_close(shuffled, inner(items, ids))


@pytest.mark.parametrize("labels,views", [(torch.tensor([0, 0, 1, 1, 1, 2]), None), (torch.tensor([0, 1, 2, 3]), None),
                                          (torch.tensor([0, 0, 1, 1]), 3)])
def test_self_supervised_rejects_batches_that_are_not_views(labels, views):
    with pytest.raises(ValueError, match="every item id must occur exactly"):
        build_loss("self_supervised", views=views)(torch.randn(labels.numel(), 4), labels)


def test_self_supervised_refusals():
    with pytest.raises(ValueError, match="wraps a pair loss"):
        build_loss("self_supervised", loss=build_loss("arcface"))
    with pytest.raises(ValueError, match="views must be an integer >= 2"):
        build_loss("self_supervised", views=1)
    with pytest.raises(ValueError, match="no ref_embeddings"):
        build_loss("self_supervised")(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]), torch.randn(2, 3),
                                      torch.tensor([0, 1]))
    assert build_loss("self_supervised", loss="npair").gather_mode is None  # npair cannot gather: nor can it


def test_views_batches_are_labelled_by_item():
    """The data module's views: V reads of each drawn item (independent random transforms), view-major, labelled
    by the item's index in the training split."""
    from lightning_dml.data.views import ViewsCollate, ViewsDataset
    from lightning_dml.data.image_list import collate_skipping

    class Noisy(torch.utils.data.Dataset):
        labels = torch.tensor([5, 5, 6, 6, 7, 7])

        def __len__(self):
            return 6

        def __getitem__(self, i):
            return torch.full((2,), float(i)) + torch.rand(2), int(self.labels[i]), i

    data = ViewsDataset(Noisy(), 3)
    assert data.labels is Noisy.labels and len(data) == 6
    images, labels, index = ViewsCollate(collate_skipping, 3)([data[i] for i in (4, 1, 2)])
    assert images.shape == (9, 2)
    assert index.tolist() == labels.tolist() == [4, 1, 2] * 3
    assert torch.equal(images.floor(), index[:, None].float().expand(9, 2))  # view v of item i is item i
    assert not torch.equal(images[:3], images[3:6])  # each view its own random draw
    with pytest.raises(ValueError, match="views must be an integer >= 1"):
        ViewsDataset(Noisy(), 0)


def test_views_option_of_the_data_modules():
    dm = TinyData.make(classes_per_batch=2, samples_per_class=2, views=3)
    images, labels, index = next(iter(dm.train_dataloader()))
    assert images.shape == (12, 1, 8, 8) and labels.tolist() == index.tolist() == index[:4].tolist() * 3
    assert len(set(index[:4].tolist())) == 4
    # the blank images have no random augmentation: identical views, each the item's own image
    assert torch.equal(images[:4], images[4:8]) and torch.equal(images[:4], torch.stack([dm.train_dataset[int(i)][0]
                                                                                           for i in index[:4]]))
    value = build_loss("self_supervised")(torch.randn(12, 8, requires_grad=True), labels)
    assert torch.isfinite(value)
    plain = next(iter(TinyData.make(classes_per_batch=2, samples_per_class=2).train_dataloader()))
    assert plain[0].shape[0] == 4 and set(plain[1].tolist()) <= {3, 5, 9}  # views: 1 is the plain batch
    from lightning_dml.data import GlyphsDataModule
    from lightning_dml.data.files import ImageFilesDataModule

    for cls in (GlyphsDataModule, ImageFilesDataModule):  # the concrete modules forward the option
        assert "views" in __import__("inspect").signature(cls.__init__).parameters
    with pytest.raises(ValueError, match="views must be an integer >= 1"):
        GlyphsDataModule(views=0)


# ------------------------------------------------------------------------------------ ties and degenerate
def _build(name: str):
    kwargs = {"num_classes": 6, "embedding_dim": 8} if name in ("manifold", "dynamic_arcface") else {}
    if name == "dynamic_arcface":
        kwargs["class_counts"] = [1, 2, 3, 4, 5, 6]
    return build_loss(name, **kwargs).double()


DEGENERATE = {
    "one_class": (torch.randn(6, 8, dtype=torch.float64), torch.zeros(6, dtype=torch.long)),
    "singletons": (torch.randn(6, 8, dtype=torch.float64), torch.arange(6)),
    "identical": (torch.ones(6, 8, dtype=torch.float64) + torch.arange(8.0, dtype=torch.float64), torch.arange(6) // 2),
}


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("batch", DEGENERATE)
def test_degenerate_batches_finite(name, batch):
    z, y = DEGENERATE[batch]
    if name == "self_supervised":
        y = torch.arange(6) // 2  # its batch is views of items (the refusals are tested above)
    z = z.clone().requires_grad_(True)
    value = _build(name)(z, y)
    value.backward()
    assert torch.isfinite(value) and torch.isfinite(z.grad).all()
    if batch == "identical" and name == "instance":
        torch.testing.assert_close(value, torch.tensor(6.0, dtype=torch.float64).log())  # all logits equal


def test_ties_match_the_references():
    """Cosines exactly in {-1, -0.5, 0, 0.5, 1} (entries +-0.5): instance's equal logits, manifold's hinge and
    clamp at 0."""
    signs = torch.tensor([[1, -1, -1, -1], [1, 1, 1, -1], [1, 1, -1, -1], [1, -1, 1, -1], [-1, 1, 1, 1],
                          [1, 1, -1, 1], [1, -1, -1, 1], [-1, -1, 1, 1]], dtype=torch.float64)
    z, y = 0.5 * signs, torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    assert_same(build_loss("instance", gamma=2.0), lambda e, t: ref.instance(e, t, gamma=2.0), z, y)
    ours = build_loss("manifold", num_classes=4, embedding_dim=4).double()
    with torch.no_grad():
        ours.proxies.copy_(signs[[0, 2, 4, 6]])  # proxies on the items: exact ties of the graph's edges
    w = ours.proxies.detach().clone().requires_grad_(True)
    assert_same(ours, lambda e, t: ref.manifold(e, w, t), z, y, rtol=1e-9, params=((ours.proxies,), (w,)))


def test_bad_settings_are_refused():
    for kwargs in ({"a": -0.1}, {"b": -0.01}, {"lambda0": -0.5}, {"a": math.inf}, {"lambda0": math.nan},
                   {"a": math.nan}, {"b": math.nan},  # nan passes min(...) < 0 and a + b >= pi / 2 unnoticed
                   {"a": 1.0, "b": 0.6}):  # the last: a + b = 1.6 >= pi / 2
        with pytest.raises(ValueError, match="DynamicArcFaceLoss"):
            build_loss("dynamic_arcface", **kwargs)
    build_loss("dynamic_arcface", a=1.0, b=0.5, lambda0=0.0)  # a + b = 1.5 < pi / 2; lambda0 = 0: one margin
    build_loss("dynamic_arcface", a=0.3, b=0.0)  # b = 0: no floor
    with pytest.raises(ValueError, match="a \\+ b"):
        build_loss("dynamic_arcface", a=math.pi / 2, b=0.0)  # exactly pi / 2
    for gamma in (0.0, -0.5):
        with pytest.raises(ValueError, match="gamma must be > 0"):
            build_loss("instance", gamma=gamma)
    assert build_loss("instance", gamma=0.5).gamma == 0.5
    assert build_loss("manifold", lambda_c=0.0).lambda_c == 0.0  # the intrinsic term alone
    assert build_loss("self_supervised", views=2).views == 2
    loss = build_loss("self_supervised")
    for views in ((torch.randn(3, 4),), (torch.randn(3, 4), torch.randn(2, 4))):
        with pytest.raises(ValueError, match="at least two views of the same shape"):
            loss.forward_views(*views)
    with pytest.raises(ValueError, match="no ref_embeddings"):
        loss(torch.randn(4, 3), torch.tensor([0, 0, 1, 1]), torch.randn(2, 3))
    with pytest.raises(ValueError, match="empty"):
        loss(torch.randn(0, 3), torch.zeros(0, dtype=torch.long))


def test_defaults_are_the_documented_ones():
    """pml's defaults (docs/losses/<name>.md)."""
    from lightning_dml.losses import NTXentLoss

    assert build_loss("instance").gamma == 64.0
    m = build_loss("manifold")
    assert (m.lambda_c, m.alpha, m.margin) == (1.0, 0.8, 5e-4)
    d = build_loss("dynamic_arcface")
    assert (d.a, d.b, d.lambda0, d.scale, d.proxies_per_class) == (0.5, 0.05, 0.25, 64.0, 3)
    assert d.supports_sampling is False  # no Partial FC sharding: the margins are per class of the whole softmax
    s = build_loss("self_supervised")
    assert type(s.loss) is NTXentLoss and s.views is None and s.gather_mode == "global_batch"


@pytest.mark.parametrize("name", NAMES)
def test_anatomy_as_documented(name):
    """What each loss declares (read by the fit-start checks and DMLModule), through its behaviour."""
    from lightning_dml.checks import check_training_batch

    loss = _build(name)
    sets = torch.tensor([[0, 1], [1, -1], [0, -1], [1, -1], [2, -1], [2, 0]])
    with pytest.raises(ValueError, match=f"{type(loss).__name__} cannot train on label sets"):
        loss(torch.randn(6, 8, dtype=torch.float64), sets)
    assert loss.supports_label_sets is False and getattr(loss, "needs_embedding_dim", False) is False
    if name in ("instance", "self_supervised"):  # batch losses that take no reference items
        with pytest.raises(ValueError, match="ref_embeddings"):
            loss(torch.randn(4, 8, dtype=torch.float64), torch.tensor([0, 0, 1, 1]),
                 torch.randn(2, 8, dtype=torch.float64), torch.tensor([0, 1]))
        assert loss.supports_ref is False and loss.needs_num_classes is False
    singletons = torch.arange(6)
    if name == "self_supervised":  # the views of an item are its positive pairs
        with pytest.raises(ValueError):
            check_training_batch(loss, singletons)
        assert loss.needs_positive_pairs is True and loss.normalize is True and loss.has_parameters is False
    else:  # instance discrimination and the proxy losses learn from single items
        check_training_batch(loss, singletons)
        assert loss.needs_positive_pairs is False


# ------------------------------------------------------------------------------------------------- DDP
@pytest.mark.parametrize("name,mode", [("instance", None), ("dynamic_arcface", None), ("manifold", "global_batch"),
                                       ("self_supervised", "global_batch")])
def test_gather_modes(name, mode):
    """Instance's targets are batch positions and DynamicArcFace is per-sample: refused with gather_distributed
    when fit starts; the others compute the gathered global batch (2 and 3 gloo processes:
    tests/distributed/run_gather_loss.py runs every registered loss)."""
    from lightning_dml.checks import check_gather_combination

    loss = _build(name)
    assert loss.gather_mode == mode
    check_gather_combination(loss, False)
    if mode is None:
        with pytest.raises(ValueError, match="gather_distributed=True cannot be used with") as err:
            check_gather_combination(loss, True)
        assert type(loss).__name__ in str(err.value)
    else:
        check_gather_combination(loss, True)


# --------------------------------------------------------------------------------------------------- the CLI
@pytest.mark.slow  # a fit each (two training steps, no validation): a few seconds on a quiet machine
@pytest.mark.parametrize("name", NAMES)
def test_fit_by_registry_name(name, tmp_path, monkeypatch):
    from lightning_dml.cli import build_cli
    from tests.test_cli import FAST, GLYPHS

    monkeypatch.chdir(tmp_path)
    quick = ["--trainer.limit_train_batches=2", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0"]
    if name == "self_supervised":  # two views of every item, labelled by item
        quick.append("--data.init_args.views=2")
    cli = build_cli(["fit", "--config", str(GLYPHS), *FAST, "--trainer.callbacks=[]", f"--model.loss={name}", *quick])
    assert type(cli.model.loss) is LOSSES[name]
    assert cli.trainer.global_step == 2
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    if name == "dynamic_arcface":
        ids = cli.datamodule.train_class_ids
        labels = torch.as_tensor(cli.datamodule.train_dataset.labels)
        assert cli.model.loss.class_counts.tolist() == [int((labels == c).sum()) for c in ids]
