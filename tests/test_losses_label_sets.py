"""Training with label sets: labels ``[B, L]`` padded with -1, a pair positive when the two sets intersect.

* every loss that declares ``supports_label_sets`` against its loop reference written from the paper (the
  references in ``tests/reference_*.py`` take the positive-pair matrix ``same``, built here by a loop over the
  sets), values and gradients, both code paths, fp64 and fp32, on random batches and on trained-like clustered
  batches near the margins, with empty sets, padding anywhere in a row, duplicated items and reference items of
  another width (the DDP ``"references"`` path);
* one label per item given as ``[B, 1]`` or ``[B, L]`` sets gives exactly the single-label loss and gradient;
* :mod:`lightning_dml.miners.pairs` (the one place that turns labels into pair masks) and the miners against loops;
* every other loss rejects label sets with one message naming it, why, and what to use instead - on the call, when
  fit starts, and on the first batch; malformed label sets are rejected with a message naming the problem;
* ``DMLModule`` trains on label-set batches for a supporting loss.
"""

from __future__ import annotations

import pytest
import torch

from lightning_dml.checks import check_fit_combination, check_training_batch
from lightning_dml.losses import LOSSES, build_loss
from lightning_dml.losses.base import label_set_losses
from lightning_dml.miners import (
    distance_weighted_sampling,
    label_masks,
    negative_mask,
    positive_pairs,
    positive_table,
    same_label_mask,
)
from tests import reference_losses as RL
from tests import reference_pairset_losses as RP
from tests.test_losses_trained_like import TRAINED_LIKE, trained_like_batch

#: the seed losses that train on label sets, each checked against the loop reference of this file (CASES)
SEED_SUPPORTING = [
    "binomial_deviance", "circle", "contrastive", "fastap", "lifted_structure", "multi_similarity", "nca",
    "smooth_ap", "supcon", "triplet",
]
#: issue 29's losses that train on label sets (their loop references: tests/test_losses_pml_part3a.py, _part3b.py)
PART3_SUPPORTING = [
    "decoupled_contrastive", "dynamic_soft_margin", "generalized_lifted_structure", "histogram",
    "intra_pair_variance", "multi_supcon", "pnp", "selectively_contrastive_triplet", "snr_contrastive",
    "threshold_consistent_margin",
]
SUPPORTING = sorted(SEED_SUPPORTING + PART3_SUPPORTING)
#: settings that make a stateful loss a function of its batch (DSM's histogram then follows each call's batch alone)
STATELESS = {"dynamic_soft_margin": {"momentum": 1.0}}


# ------------------------------------------------------------------------------------------------ batches
def sets_of(labels: torch.Tensor) -> list[set[int]]:
    """Each row's labels as a Python set (padding -1 dropped)."""
    rows = labels[:, None] if labels.ndim == 1 else labels
    return [{int(v) for v in row if int(v) >= 0} for row in rows]


def same_matrix(labels: torch.Tensor, gallery_labels: torch.Tensor | None = None) -> list[list[bool]]:
    """``same[i][j]``: whether the sets of ``i`` and ``j`` intersect, by a loop (no library code)."""
    a = sets_of(labels)
    g = a if gallery_labels is None else sets_of(gallery_labels)
    return [[bool(x & y) for y in g] for x in a]


def random_label_sets(seed: int, n: int, classes: int, width: int = 3) -> torch.Tensor:
    """``[n, width]`` sets of 1..width distinct labels, padding at random places, two empty rows."""
    g = torch.Generator().manual_seed(seed)
    out = torch.full((n, width), -1, dtype=torch.long)
    for i in range(n):
        k = int(torch.randint(1, width + 1, (1,), generator=g))
        labels = torch.randperm(classes, generator=g)[:k]
        slots = torch.randperm(width, generator=g)[:k]
        out[i, slots] = labels
    out[1] = -1
    out[n - 2] = -1
    return out


def random_batch(seed: int = 0, n: int = 14, dim: int = 6, classes: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed + 100)
    z = torch.randn(n, dim, generator=g, dtype=torch.float64)
    y = random_label_sets(seed, n, classes)
    # nearly an item drawn twice (an exact copy's zero distance is a rounding-dependent "non-zero" term in the
    # references): the pair is positive when the set is not empty
    z[5], y[5] = z[3] + 0.15, y[3]
    return z, y


def trained_like_sets(batch: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A trained-like clustered batch (cosines near the margins) whose items carry their cluster's label, a third of
    them also another cluster's label (positives at negative-like cosines), and one item no label."""
    z, y = trained_like_batch(*TRAINED_LIKE[batch])
    g = torch.Generator().manual_seed(7)
    extra = (y + 1 + torch.randint(0, 4, y.shape, generator=g)) % 5
    keep = torch.rand(y.shape, generator=g) < 0.35
    sets = torch.stack([y, torch.where(keep, extra, -1)], dim=1)
    sets[4] = -1
    return z, sets[:, [1, 0]] if batch == "at_m2" else sets  # padding first in some rows of one batch


BATCHES = {"random": lambda: random_batch(0), "random_wide": lambda: random_batch(1, n=12, classes=4),
           "at_lambda": lambda: trained_like_sets("at_lambda"), "at_m2": lambda: trained_like_sets("at_m2")}


# ------------------------------------------------------------------------------------------------ the losses
#: (registry name, constructor arguments, reference, family: "rl" takes ref=/ref_labels=, "rp" takes n_anchors=)
CASES = [
    ("multi_similarity", {}, RL.multi_similarity, "rl"),
    ("multi_similarity", {"mining": False}, RL.multi_similarity, "rl"),
    ("multi_similarity", {"plus_one": False, "on_empty": "skip"}, RL.multi_similarity, "rl"),
    ("multi_similarity", {"weighting": False}, RL.multi_similarity, "rl"),
    ("contrastive", {}, RL.contrastive, "rl"),
    ("contrastive", {"squared": True, "neg_margin": 1.0}, RL.contrastive, "rl"),
    ("contrastive", {"squared_hinge": True, "pos_margin": 0.2, "reduction": "mean"}, RL.contrastive, "rl"),
    ("contrastive", {"reduction": "sum", "neg_margin": 1.2}, RL.contrastive, "rl"),
    ("triplet", {}, RL.triplet, "rl"),
    ("triplet", {"margin": 0.3, "squared": True, "reduction": "mean"}, RL.triplet, "rl"),
    ("triplet", {"mining": "batch_hard", "margin": 0.2}, RL.triplet, "rl"),
    ("lifted_structure", {}, RL.lifted_structure, "rl"),
    ("lifted_structure", {"variant": "gpw", "margin": 0.5}, RL.lifted_structure, "rl"),
    ("lifted_structure", {"variant": "generalized"}, RL.lifted_structure, "rl"),
    ("lifted_structure", {"variant": "star"}, RL.lifted_structure, "rl"),
    ("binomial_deviance", {}, RL.binomial_deviance, "rl"),
    ("circle", {"m": 0.4, "gamma": 80.0}, RP.circle, "rp"),
    ("supcon", {}, RP.supcon, "rp"),
    ("nca", {}, RP.nca, "rp"),
    ("nca", {"objective": "expected", "scale": 2.0}, RP.nca, "rp"),
    ("fastap", {}, RP.fastap, "rp"),
    ("smooth_ap", {"temperature": 0.1}, RP.smooth_ap, "rp"),
]
CASE_IDS = [f"{name}-{'-'.join(f'{k}={v}' for k, v in kw.items()) or 'default'}" for name, kw, _, _ in CASES]


def reference_value(reference, family: str, z_all: torch.Tensor, y_all: torch.Tensor, kw: dict, n_anchors: int):
    """The loop reference on anchors ``z_all[:n_anchors]`` against the gallery ``z_all`` (pairs from the sets)."""
    same = same_matrix(y_all)
    if family == "rp":
        return reference(z_all, y_all, n_anchors=n_anchors, same=same, **kw)
    ref = z_all[n_anchors:] if n_anchors < z_all.shape[0] else None
    ref_labels = y_all[n_anchors:] if ref is not None else None
    return reference(z_all[:n_anchors], y_all[:n_anchors], ref=ref, ref_labels=ref_labels, same=same, **kw)


def check_label_sets(name, kw, reference, family, z, y, n_anchors=None, ref_labels=None, device=None):
    """Loss (both paths, fp64 and fp32) against the fp64 loop reference: value and gradient of every row.

    ``n_anchors``: the first rows are the batch, the rest reference items (given as ``ref_labels`` when set, e.g.
    of another width)."""
    device = torch.device("cpu") if device is None else device
    n = z.shape[0] if n_anchors is None else n_anchors
    zr = z.clone().requires_grad_(True)
    y_all = y if ref_labels is None else torch.cat([y[:n], ref_labels]) if ref_labels.shape[1] == y.shape[1] else None
    if y_all is None:  # another width: the reference reads the sets, whatever their padding
        width = max(y.shape[1], ref_labels.shape[1])
        pad = lambda t: torch.cat([t, t.new_full((t.shape[0], width - t.shape[1]), -1)], 1)  # noqa: E731
        y_all = torch.cat([pad(y[:n]), pad(ref_labels)])
    expected = reference_value(reference, family, zr, y_all, kw, n)
    (g_ref,) = torch.autograd.grad(expected, zr) if expected.requires_grad else (torch.zeros_like(z),)
    loss = build_loss(name, **kw).to(device)
    assert loss.supports_label_sets
    paths = (True, False) if loss._has_closed_form() else (False,)
    for closed_form in paths:
        for dtype, rtol, atol in ((torch.float64, 1e-7, 1e-9), (torch.float32, 1e-4, 1e-5)):
            loss.closed_form = closed_form
            zz = z.to(device=device, dtype=dtype).requires_grad_(True)
            extra = {}
            if n < z.shape[0]:
                extra = {"ref_embeddings": zz[n:], "ref_labels": (y[n:] if ref_labels is None else ref_labels).to(device)}
            value = loss(zz[:n], y[:n].to(device), **extra)
            (g,) = torch.autograd.grad(value, zz, allow_unused=True)
            g = torch.zeros_like(zz) if g is None else g
            where = f"{name} {kw} closed_form={closed_form} {dtype}"
            torch.testing.assert_close(value.double().cpu(), expected.detach(), rtol=rtol, atol=atol, msg=where)
            torch.testing.assert_close(g.double().cpu(), g_ref, rtol=rtol, atol=atol, msg=where)
    return float(expected.detach())


def test_the_supporting_losses_are_the_declared_ones():
    # MatryoshkaLoss takes label sets where its wrapped loss does (its default wraps one that does: test_matryoshka)
    assert [n for n in label_set_losses() if n != "matryoshka"] == sorted(SUPPORTING)
    assert {c[0] for c in CASES} == set(SEED_SUPPORTING)


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("name,kw,reference,family", CASES, ids=CASE_IDS)
def test_label_sets_match_loop_reference(name, kw, reference, family, batch, device):
    z, y = BATCHES[batch]()
    check_label_sets(name, kw, reference, family, z, y, device=device)


#: the losses that score a batch against reference items (the DDP "references" path)
REF_CASES = [c for c in CASES if build_loss(c[0], **c[1]).supports_ref]


@pytest.mark.parametrize("name,kw,reference,family", REF_CASES, ids=[CASE_IDS[CASES.index(c)] for c in REF_CASES])
def test_label_sets_with_reference_items(name, kw, reference, family):
    """Anchors = the first 9 rows; the other rows are reference items whose sets have another width."""
    z, y = trained_like_sets("at_lambda")
    ref_labels = torch.cat([y[9:], torch.full((y.shape[0] - 9, 1), -1)], dim=1)[:, [2, 0, 1]]  # width 3
    check_label_sets(name, kw, reference, family, z, y, n_anchors=9, ref_labels=ref_labels)
    # and references as plain labels next to label-set anchors
    z2, y2 = trained_like_batch(*TRAINED_LIKE["at_m2"])
    sets = torch.stack([y2, torch.where(torch.arange(y2.numel()) % 3 == 0, (y2 + 1) % 5, -1)], 1)
    check_label_sets(name, kw, reference, family, z2, torch.cat([sets[:8], torch.stack([y2[8:], -torch.ones_like(y2[8:])], 1)]),
                     n_anchors=8, ref_labels=y2[8:, None])


@pytest.mark.parametrize("name", SUPPORTING)
def test_one_label_per_item_as_sets_is_the_single_label_loss(name, device):
    """``[B]``, ``[B, 1]`` and ``[B, 3]`` (padded) give the same value and gradient, on every path (fp64: the same
    pairs, summed in another order where the positives come from the sets' mask instead of the sorted labels)."""
    z, y = trained_like_batch(*TRAINED_LIKE["at_lambda"])
    z = z.to(device)
    y = y.to(device)
    padded = torch.stack([torch.full_like(y, -1), y, torch.full_like(y, -1)], dim=1)
    for kw in ({}, {"variant": "gpw"}) if name == "lifted_structure" else (STATELESS.get(name, {}),):
        loss = build_loss(name, **kw).to(device)
        for closed_form in (True, False):
            loss.closed_form = closed_form
            results = []
            for labels in (y, y[:, None], padded):
                zz = z.clone().requires_grad_(True)
                value = loss(zz, labels)
                value.backward()
                results.append((value.detach(), zz.grad))
            for value, grad in results[1:]:
                where = f"{name} {kw} closed_form={closed_form}"
                torch.testing.assert_close(value, results[0][0], rtol=1e-13, atol=1e-15, msg=where)
                torch.testing.assert_close(grad, results[0][1], rtol=1e-13, atol=1e-15, msg=where)


@pytest.mark.parametrize("name", SUPPORTING)
def test_label_sets_change_the_loss(name):
    """Control: the second labels matter (a loss reading only the first column would pass the test above)."""
    z, y = trained_like_sets("at_lambda")
    first_only = torch.stack([y[:, 0], torch.full_like(y[:, 0], -1)], dim=1)
    loss = build_loss(name, **STATELESS.get(name, {}))
    assert not torch.allclose(loss(z, y), loss(z, first_only))


# ------------------------------------------------------------------------------------------------ pair masks
def test_pair_masks_against_loops():
    y = random_label_sets(3, 11, 5)
    ref = random_label_sets(4, 6, 5, width=2)
    gallery = torch.cat([y, torch.cat([ref, torch.full((6, 1), -1)], 1)])
    same = torch.tensor(same_matrix(y, gallery))
    assert torch.equal(same_label_mask(y, gallery), same)
    assert torch.equal(same_label_mask(y, torch.cat([y, torch.cat([ref, torch.full((6, 1), -1)], 1)])), same)
    pos, neg = label_masks(y, gallery)
    eye = torch.zeros_like(same)
    eye[:, :11] = torch.eye(11, dtype=torch.bool)
    assert torch.equal(pos, same & ~eye) and torch.equal(neg, ~same & ~eye)
    assert not bool(pos[1].any()) and bool(neg[1].sum() == gallery.shape[0] - 1)  # an empty set: all negatives
    assert torch.equal(negative_mask(y, gallery), neg)
    rows = torch.tensor([2, 7])
    assert torch.equal(negative_mask(y[rows], gallery, rows), neg[rows])
    r, c, valid = positive_table(y, gallery)
    assert sorted(zip(r[valid].tolist(), c[valid].tolist())) == sorted(map(tuple, pos.nonzero().tolist()))
    pr, pc = positive_pairs(y, gallery)
    assert sorted(zip(pr.tolist(), pc.tolist())) == sorted(map(tuple, pos.nonzero().tolist()))
    # an item drawn twice (two rows, one set) is a positive pair; with an empty set it is not, and no negative of
    # itself either (the self-pair is removed by index)
    dup = torch.tensor([[0, 1], [2, -1], [0, 1], [-1, -1], [-1, -1]])
    pos, neg = label_masks(dup)
    assert pos.nonzero().tolist() == [[0, 2], [2, 0]]
    assert not bool(neg.diagonal().any()) and bool(neg[3, 4]) and bool(neg[4, 3])
    # labels [N] against label sets and as [N, 1]: the masks of the labels
    flat = torch.tensor([0, 1, 1, 2, 0])
    for a, b in ((flat, flat[:, None]), (flat[:, None], flat), (flat[:, None], flat[:, None])):
        assert torch.equal(torch.stack(label_masks(a, b)), torch.stack(label_masks(flat)))


def test_distance_weighted_sampling_with_label_sets():
    z, y = random_batch(2)
    f = torch.nn.functional.normalize(z, dim=1)
    dist = torch.cdist(f, f)
    a, p, n = distance_weighted_sampling(dist, y, dim=6, generator=torch.Generator().manual_seed(0))
    same = torch.tensor(same_matrix(y))
    pos, _ = label_masks(y)
    has_neg = (~same & ~torch.eye(len(y), dtype=torch.bool)).any(1)
    assert a.numel() == int(pos[has_neg].sum())  # one triplet per positive pair of an anchor with a negative
    assert bool(same[a, p].all()) and bool((a != p).all())
    assert not bool(same[a, n].any()) and bool((a != n).all())


# ------------------------------------------------------------------------------------------------ rejections
def _build_any(name: str):
    cls = LOSSES[name]
    kw = {}
    if getattr(cls, "needs_num_classes", False):
        kw = {"num_classes": 6, "embedding_dim": 6}
    if name == "cross_batch_memory":
        kw = {"embedding_size": 6}
    return cls(**kw).double()


#: MatryoshkaLoss takes label sets exactly where its wrapped loss does (tests/test_matryoshka.py)
REJECTING = sorted(set(LOSSES) - set(SUPPORTING) - {"matryoshka"})


@pytest.mark.parametrize("name", REJECTING)
def test_other_losses_reject_label_sets_with_one_clear_message(name):
    loss = _build_any(name)
    z, y = random_batch(0)
    y = y.clamp(max=5)
    with pytest.raises(ValueError) as err:
        loss(z, y)
    msg = str(err.value)
    assert f"{type(loss).__name__} cannot train on label sets (labels of shape [14, 3])" in msg
    assert loss.label_sets_reason and loss.label_sets_reason in msg
    assert all(s in msg for s in SUPPORTING)  # what to use instead
    with pytest.raises(ValueError, match="cannot train on label sets"):
        check_training_batch(loss, y)


class _LabelSetData:
    """What check_fit_combination reads of a data module: its sampler, or its training labels."""

    def __init__(self, sampler=None, labels=None, samples_per_class=2):
        self.sampler, self.samples_per_class = sampler, samples_per_class
        if labels is not None:
            self.train_dataset = type("D", (), {"labels": labels})()


def test_fit_start_rejects_label_sets_for_the_other_losses():
    for dm in (_LabelSetData(sampler="label_sets"), _LabelSetData(labels=torch.zeros(4, 2, dtype=torch.long))):
        for name in ("proxy_anchor", "npair", "tuplet_margin", "arcface"):
            with pytest.raises(ValueError, match=f"{type(_build_any(name)).__name__} cannot train on label sets"):
                check_fit_combination(_build_any(name), dm)
        for name in SUPPORTING:
            check_fit_combination(build_loss(name), dm)
    for name in REJECTING:  # single labels: unchanged
        check_fit_combination(_build_any(name), _LabelSetData(sampler="balanced", labels=torch.zeros(4, dtype=torch.long)))


def test_training_batch_check_with_label_sets():
    loss = build_loss("multi_similarity")
    check_training_batch(loss, torch.tensor([[0, -1], [1, 0], [2, -1], [3, -1]]))  # 0 and 1 share label 0
    with pytest.raises(ValueError, match="no two of the 4 items .* share a label"):
        check_training_batch(loss, torch.tensor([[0, -1], [1, 4], [2, -1], [-1, -1]]))
    with pytest.raises(ValueError, match="integer"):
        check_training_batch(loss, torch.zeros(4, 2))


@pytest.mark.parametrize(
    "labels, needle",
    [
        (torch.tensor([[0, -2], [0, 1], [1, -1]]), "found -2 in row 0"),
        (torch.zeros(3, 2), "integer tensor"),
        (torch.zeros(4, 2, dtype=torch.long), "has 4 rows"),
        (torch.zeros(3, 0, dtype=torch.long), "width L = 0"),
        (torch.zeros(3, 2, 1, dtype=torch.long), "1-D tensor"),
    ],
)
def test_malformed_label_sets_are_rejected(labels, needle):
    z = torch.randn(3, 4)
    with pytest.raises(ValueError, match=needle) as err:
        build_loss("supcon")(z, labels)
    assert str(err.value).startswith("SupConLoss:")


def test_malformed_reference_label_sets_are_rejected():
    z = torch.randn(3, 4)
    with pytest.raises(ValueError, match="ContrastiveLoss: ref_labels .* found -3 in row 1"):
        build_loss("contrastive")(z, torch.tensor([0, 0, 1]), z[:2], torch.tensor([[0, 1], [-3, 1]]))


# ------------------------------------------------------------------------------------------------ training
def _label_set_datamodule(sampler: str | None):
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    class Data(pl.LightningDataModule):
        def __init__(self):
            super().__init__()
            if sampler is not None:
                self.sampler = sampler
            g = torch.Generator().manual_seed(0)
            images = torch.rand(16, 1, 8, 8, generator=g)
            base = torch.arange(16) // 2
            self.labels = torch.stack([base, torch.where(base % 3 == 0, (base + 1) % 8, -1)], dim=1)
            self.data = TensorDataset(images, self.labels, torch.arange(16))

        def train_dataloader(self):
            return DataLoader(self.data, batch_size=8, shuffle=False)

    return Data()


def _trainer():
    import pytorch_lightning as pl

    return pl.Trainer(
        accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False, limit_val_batches=0,
        enable_progress_bar=False, enable_model_summary=False,
    )


def test_dml_module_trains_on_label_sets_and_rejects_them_for_other_losses():
    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule

    torch.manual_seed(0)
    model = DMLModule(SmallConvNet(in_channels=1, width=4), loss="multi_similarity", embedding_dim=8)
    trainer = _trainer()
    trainer.fit(model, datamodule=_label_set_datamodule("label_sets"))
    assert trainer.global_step == 2 and torch.isfinite(trainer.callback_metrics["train/loss"])
    for sampler, when in (("label_sets", "fit start"), (None, "first batch")):
        model = DMLModule(SmallConvNet(in_channels=1, width=4), loss="tuplet_margin", embedding_dim=8)
        trainer = _trainer()
        with pytest.raises(ValueError, match="TupletMarginLoss cannot train on label sets"):
            trainer.fit(model, datamodule=_label_set_datamodule(sampler))
        assert trainer.global_step == 0, when
