"""Losses restricted to a miner's tuples (``indices_tuple``, issue 29 s.2) against pytorch-metric-learning 2.9's
losses given the same tuples: values and gradients in fp64 on random and clustered batches; pml's positional call
``loss(embeddings, labels, miner(embeddings, labels))``; refusals; ``DMLModule(miner=...)`` and ``--model.miner``.

Conventions: pml's ContrastiveLoss, IntraPairVarianceLoss and ThresholdConsistentMarginLoss score the listed pairs
one by one (a pair listed twice counts twice) where ours takes the tuple as masks, so they are compared on tuples
without repeated pairs (pair miners, BatchHard's one triplet per anchor); MultiSimilarity, Circle, NT-Xent and
SupCon take masks in pml too.
"""

import pytest
import torch

from lightning_dml.losses import BinomialDevianceLoss, CircleLoss, ContrastiveLoss, MultiSimilarityLoss, NTXentLoss
from lightning_dml.losses import SupConLoss, TripletLoss, build_loss
from lightning_dml.losses.registry import LOSSES as LOSS_REGISTRY
from lightning_dml.miners import (
    BatchHardMiner,
    HDCMiner,
    MinedLoss,
    MultiSimilarityMiner,
    PairMarginMiner,
    TripletMarginMiner,
)
from tests.test_miners import miner_batch

pml_losses = pytest.importorskip("pytorch_metric_learning.losses")

MINERS = {
    "pair_margin": lambda: PairMarginMiner(0.5, 0.7),
    "multi_similarity": lambda: MultiSimilarityMiner(0.1),
    "batch_hard": lambda: BatchHardMiner(),
    "triplet_margin": lambda: TripletMarginMiner(0.05, "all"),
    "semihard": lambda: TripletMarginMiner(0.2, "semihard"),
}
LOSSES = {  # ours, pml's, the miners whose tuples they are compared on
    "contrastive": (lambda: ContrastiveLoss(neg_margin=0.8), lambda: pml_losses.ContrastiveLoss(0.0, 0.8),
                    ("pair_margin", "multi_similarity", "batch_hard")),
    "triplet": (lambda: TripletLoss(margin=0.1), lambda: pml_losses.TripletMarginLoss(margin=0.1),
                ("triplet_margin", "semihard", "batch_hard", "pair_margin")),
    "multi_similarity": (lambda: MultiSimilarityLoss(mining=False), lambda: pml_losses.MultiSimilarityLoss(),
                         ("multi_similarity", "pair_margin", "triplet_margin")),
    "circle": (lambda: CircleLoss(m=0.4, gamma=80), lambda: pml_losses.CircleLoss(m=0.4, gamma=80),
               ("multi_similarity", "pair_margin", "batch_hard")),
    "ntxent": (lambda: NTXentLoss(), lambda: pml_losses.NTXentLoss(temperature=0.1),
               ("multi_similarity", "pair_margin", "batch_hard")),
    "supcon": (lambda: SupConLoss(), lambda: pml_losses.SupConLoss(temperature=0.1),
               ("multi_similarity", "pair_margin", "batch_hard")),
    "intra_pair_variance": (lambda: build_loss("intra_pair_variance"), lambda: pml_losses.IntraPairVarianceLoss(),
                            ("multi_similarity", "pair_margin", "batch_hard")),
    "threshold_consistent_margin": (lambda: build_loss("threshold_consistent_margin"),
                                    lambda: pml_losses.ThresholdConsistentMarginLoss(),
                                    ("multi_similarity", "pair_margin", "batch_hard")),
}
CASES = [(loss, miner) for loss, (_, _, miners) in LOSSES.items() for miner in miners]


def _value_and_grad(fn, z):
    z = z.clone().requires_grad_(True)
    value = fn(z)
    (grad,) = torch.autograd.grad(value, z)
    return value, grad


@pytest.mark.parametrize("kind", ["random", "clustered"])
@pytest.mark.parametrize("loss_name,miner_name", CASES)
def test_loss_on_a_miners_tuples_equals_pml(loss_name, miner_name, kind):
    ours_f, theirs_f, _ = LOSSES[loss_name]
    z, y = miner_batch(kind, 2, classes=5, per_class=4, d=8)
    z = z * 1.7  # raw embeddings: both normalise
    tuples = MINERS[miner_name]()(z, y)
    assert len(tuples[0]) > 0
    value, grad = _value_and_grad(lambda e: ours_f()(e, y, indices_tuple=tuples), z)
    ref_value, ref_grad = _value_and_grad(lambda e: theirs_f()(e, y, tuples), z)
    assert value.dtype == torch.float64
    torch.testing.assert_close(value, ref_value, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-8, atol=1e-12)
    # the restriction matters: the loss of all pairs differs
    assert not torch.allclose(ours_f()(z, y), value)


def test_pml_positional_order_and_references():
    z, y = miner_batch("clustered", 3, per_class=5)
    loss, miner = ContrastiveLoss(neg_margin=0.8), PairMarginMiner(0.3, 0.9)
    t = miner(z, y)
    assert torch.equal(loss(z, y, t), loss(z, y, indices_tuple=t))
    # with references the tuple indexes the gallery (the batch, then the references), as the miner's output does:
    # the first b rows mined against all rows = the whole batch's tuples of those anchors
    b = 14
    tr = miner(z[:b], y[:b], z[b:], y[b:])
    assert int(tr[1].max()) >= b
    a1, p, a2, n = t
    first = (a1[a1 < b], p[a1 < b], a2[a2 < b], n[a2 < b])
    assert _as_set(tr[:2]) == _as_set(first[:2]) and _as_set(tr[2:]) == _as_set(first[2:])
    with_refs = loss(z[:b], y[:b], tr, z[b:], y[b:])  # pml's positional order with references
    assert torch.equal(with_refs, loss(z[:b], y[:b], z[b:], y[b:], indices_tuple=tr))
    assert torch.equal(with_refs, MinedLoss(loss, miner)(z[:b], y[:b], z[b:], y[b:]))
    torch.testing.assert_close(with_refs, loss(z, y, indices_tuple=first), rtol=1e-12, atol=0)


def _as_set(t):
    return sorted(zip(*[x.tolist() for x in t]))


def test_indices_tuple_refusals_are_one_line():
    z, y = miner_batch("random", 4)
    t = PairMarginMiner()(z, y)
    with pytest.raises(ValueError, match=r"BinomialDevianceLoss does not take indices_tuple"):
        BinomialDevianceLoss()(z, y, indices_tuple=t)
    with pytest.raises(ValueError, match=r"ContrastiveLoss: indices_tuple lists \(\d+, \d+\) as a positive pair"):
        ContrastiveLoss()(z, y, indices_tuple=(t[2], t[3], t[2], t[3]))  # negatives as positives
    with pytest.raises(ValueError, match=r"as a positive pair"):
        ContrastiveLoss()(z, y, indices_tuple=(torch.tensor([0]), torch.tensor([0]), t[2], t[3]))  # a self-pair
    with pytest.raises(ValueError, match=r"gallery columns 0\.\.23"):
        ContrastiveLoss()(z, y, indices_tuple=(t[0], t[1] + 100, t[2], t[3]))
    with pytest.raises(ValueError, match=r"pairs \(a1, p, a2, n\) or triplets"):
        ContrastiveLoss()(z, y, indices_tuple=(t[0], t[1]))
    with pytest.raises(ValueError, match=r"1-D integer tensor"):
        ContrastiveLoss()(z, y, indices_tuple=(t[0].float(), t[1], t[2], t[3]))
    with pytest.raises(ValueError, match=r"a, p, n have different lengths"):
        TripletLoss()(z, y, indices_tuple=(t[0], t[1], t[3][:1]))
    with pytest.raises(ValueError, match=r"triplet indices_tuple needs mining='all'"):
        TripletLoss(mining="batch_hard")(z, y, indices_tuple=BatchHardMiner()(z, y))
    with pytest.raises(ValueError, match=r"does not combine with anchor_chunk_size"):
        ContrastiveLoss(anchor_chunk_size=4)(z, y, indices_tuple=t)


def test_empty_tuple_gives_zero_with_zero_gradient():
    z, y = miner_batch("random", 5)
    empty = torch.zeros(0, dtype=torch.long)
    for loss, t in ((ContrastiveLoss(), (empty,) * 4), (TripletLoss(), (empty,) * 3), (CircleLoss(), (empty,) * 4)):
        value, grad = _value_and_grad(lambda e: loss(e, y, indices_tuple=t), z)
        assert value == 0 and torch.count_nonzero(grad) == 0


def test_batch_wide_miner_mines_the_global_batch_under_gather():
    loss = ContrastiveLoss()
    assert MinedLoss(loss, PairMarginMiner()).gather_mode == "references"
    assert MinedLoss(loss, HDCMiner()).gather_mode == "global_batch"


def test_module_trains_the_loss_on_the_miners_tuples():
    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule

    module = DMLModule(SmallConvNet(width=4), loss="triplet", miner="batch_hard", embedding_dim=8, clustering=False)
    assert isinstance(module.miner, BatchHardMiner)
    z, y = miner_batch("clustered", 8)
    expected = TripletLoss()(z, y, indices_tuple=BatchHardMiner()(z, y))
    assert torch.equal(module._pair_loss(z, y), expected)
    assert not torch.equal(expected, TripletLoss()(z, y))
    with pytest.raises(ValueError, match=r"miner PairMarginMiner needs a loss that takes indices_tuple; "
                                         r"LiftedStructureLoss does not"):
        DMLModule(SmallConvNet(width=4), loss="lifted_structure", miner=PairMarginMiner())
    with pytest.raises(ValueError, match=r"unknown miner 'batch_hardd'"):
        DMLModule(SmallConvNet(width=4), loss="triplet", miner="batch_hardd")


def test_cli_model_miner_by_name_and_by_class_path(tmp_path, monkeypatch):
    from tests.test_cli import GLYPHS
    from lightning_dml.cli import build_cli

    monkeypatch.chdir(tmp_path)
    cli = build_cli(["--config", str(GLYPHS), "--model.loss=triplet", "--model.miner=batch_hard"], run=False)
    assert isinstance(cli.model.miner, BatchHardMiner)
    cli = build_cli(
        ["--config", str(GLYPHS), "--model.loss=contrastive", "--model.miner=lightning_dml.miners.PairMarginMiner",
         "--model.miner.init_args.neg_margin=0.6"],
        run=False,
    )
    assert isinstance(cli.model.miner, PairMarginMiner) and cli.model.miner.neg_margin == 0.6


def _build_registered(name):
    """The registered loss ``name`` with the sizes it needs for a batch of 8 items of width 6 in 4 classes."""
    cls = LOSS_REGISTRY[name]
    kw = {}
    if getattr(cls, "needs_num_classes", False):
        kw = {"num_classes": 4, "embedding_dim": 6}
    if name == "cross_batch_memory":
        kw = {"embedding_size": 6}
    return cls(**kw).double()


@pytest.mark.parametrize("name", sorted(LOSS_REGISTRY))
def test_every_registered_loss_takes_or_refuses_an_indices_tuple_in_one_line(name):
    """A loss either scores a miner's tuple or refuses it with the library's ValueError naming it (the losses that
    override ``forward`` raised Python's TypeError on the keyword), by keyword and in pml's positional place."""
    loss = _build_registered(name)
    z = torch.nn.functional.normalize(torch.randn(8, 6, generator=torch.Generator().manual_seed(0),
                                                  dtype=torch.float64), dim=1)
    y = torch.arange(4).repeat_interleave(2)
    t = (torch.tensor([0, 2]), torch.tensor([1, 3]), torch.tensor([0, 2]), torch.tensor([4, 6]))
    if getattr(loss, "supports_indices_tuple", False):
        assert torch.isfinite(loss(z, y, indices_tuple=t))
        return
    refusal = rf"^{type(loss).__name__} does not take indices_tuple \(a miner's output\): [^\n]+$"
    for call in (lambda: loss(z, y, indices_tuple=t), lambda: loss(z, y, t)):
        with pytest.raises(ValueError, match=refusal):
            call()
