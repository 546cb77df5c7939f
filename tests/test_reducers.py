"""pml's reducers (issue 29 s.2): each equal to pytorch-metric-learning 2.9's on the same per-element losses (values
and gradients, fp64; elements, positive and negative pairs, triplets; with zeros and ties), the documented
differences (no terms -> 0, duplicate pairs), and the batch-wide normaliser of the means."""

from __future__ import annotations

import pytest
import torch
from pytorch_metric_learning import reducers as pml_reducers

from lightning_dml.errors import UserInputError
from lightning_dml.losses.reducers import (
    REDUCERS,
    AvgNonZeroReducer,
    ClassWeightedReducer,
    MeanReducer,
    PerAnchorReducer,
    SumReducer,
    ThresholdReducer,
    build_reducer,
)

B, CLASSES = 10, 4
CLASS_WEIGHTS = [0.5, 2.0, 1.0, 3.0]


def _labels() -> torch.Tensor:
    return torch.arange(B) % CLASSES


def _terms(kind: str, seed: int = 0) -> tuple[torch.Tensor, object]:
    """Hinge-like terms (a third exactly 0, some tied) with pml-style indices; pairs unique, as miners give."""
    g = torch.Generator().manual_seed(seed)
    if kind == "element":
        count, indices = B, torch.arange(B)
    elif kind in ("pos_pair", "neg_pair"):
        all_pairs = torch.cartesian_prod(torch.arange(B), torch.arange(B))
        all_pairs = all_pairs[all_pairs[:, 0] != all_pairs[:, 1]]
        chosen = all_pairs[torch.randperm(all_pairs.shape[0], generator=g)[:30]]
        chosen = chosen[chosen[:, 0] != 3]  # anchor 3 has no pair (counts as 0 in the per-anchor mean)
        count, indices = chosen.shape[0], (chosen[:, 0], chosen[:, 1])
    else:
        count = 25
        indices = tuple(torch.randint(0, B, (count,), generator=g) for _ in range(3))
    values = torch.rand(count, dtype=torch.float64, generator=g) - 0.35
    values = torch.clamp(values, min=0)  # hinge: exact zeros
    values[:3] = 0.25  # ties
    return values, indices


def _pml_dict(losses: torch.Tensor, kind: str, indices: object) -> dict:
    return {"loss": {"losses": losses, "indices": indices, "reduction_type": kind}}


PAIRS = {
    "mean": (MeanReducer, pml_reducers.MeanReducer),
    "sum": (SumReducer, pml_reducers.SumReducer),
    "avg_non_zero": (AvgNonZeroReducer, pml_reducers.AvgNonZeroReducer),
    "threshold_low_high": (lambda: ThresholdReducer(low=0.1, high=0.5),
                           lambda: pml_reducers.ThresholdReducer(low=0.1, high=0.5)),
    "threshold_high": (lambda: ThresholdReducer(high=0.3), lambda: pml_reducers.ThresholdReducer(high=0.3)),
    "class_weighted": (lambda: ClassWeightedReducer(CLASS_WEIGHTS),
                       lambda: pml_reducers.ClassWeightedReducer(torch.tensor(CLASS_WEIGHTS))),
    "per_anchor": (PerAnchorReducer, pml_reducers.PerAnchorReducer),
    "per_anchor_avg_non_zero": (lambda: PerAnchorReducer(AvgNonZeroReducer()),
                                lambda: pml_reducers.PerAnchorReducer(pml_reducers.AvgNonZeroReducer())),
}


@pytest.mark.parametrize("kind", ["element", "pos_pair", "neg_pair", "triplet"])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_equal_to_pml_values_and_gradients_fp64(name, kind):
    if name.startswith("per_anchor") and kind == "triplet":
        with pytest.raises(ValueError, match="does not reduce triplets"):
            PAIRS[name][0]()(*_terms(kind)[:1], kind, _terms(kind)[1], _labels(), B)
        return
    ours, theirs = (make() for make in PAIRS[name])
    values, indices = _terms(kind)
    embeddings = torch.zeros(B, 3, dtype=torch.float64)  # pml reads the batch size from them
    mine = values.clone().requires_grad_(True)
    ref = values.clone().requires_grad_(True)
    value = ours(mine, kind, indices, _labels(), B)
    ref_value = theirs(_pml_dict(ref, kind, indices), embeddings, _labels())
    torch.testing.assert_close(value, ref_value, rtol=1e-13, atol=1e-15)
    (grad,) = torch.autograd.grad(value, mine)
    (ref_grad,) = torch.autograd.grad(ref_value, ref)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-13, atol=1e-15)
    assert float(value) != 0  # the comparison is not between two empty reductions


def test_already_reduced_is_returned_as_it_is():
    value = torch.tensor([1.5], dtype=torch.float64)
    for name in ("mean", "sum", "avg_non_zero"):
        assert float(build_reducer(name)(value, "already_reduced")) == 1.5


def test_no_terms_give_zero_with_a_graph_where_pml_gives_nan():
    empty = torch.zeros(0, dtype=torch.float64, requires_grad=True)
    for name, make in sorted(PAIRS.items()):
        value = make[0]()(empty, "pos_pair", (torch.zeros(0, dtype=torch.long),) * 2, _labels(), B)
        assert float(value) == 0 and value.requires_grad, name
    nan = pml_reducers.MeanReducer()(_pml_dict(empty, "element", torch.zeros(0, dtype=torch.long)),
                                     torch.zeros(B, 3), _labels())
    assert torch.isnan(nan)  # the documented difference


def test_all_terms_filtered_give_zero_as_pml():
    zeros = torch.zeros(6, dtype=torch.float64)
    assert float(AvgNonZeroReducer()(zeros)) == 0
    assert float(pml_reducers.AvgNonZeroReducer()(_pml_dict(zeros, "element", torch.arange(6)),
                                                  torch.zeros(6, 3), torch.arange(6))) == 0


def test_per_anchor_counts_a_repeated_pair_twice():
    losses = torch.tensor([1.0, 3.0, 5.0], dtype=torch.float64)
    anchors, others = torch.tensor([0, 0, 1]), torch.tensor([1, 1, 0])
    # anchor 0: (1 + 3) / 2, anchor 1: 5, anchor 2: none (0); mean over the 3 anchors
    assert float(PerAnchorReducer()(losses, "pos_pair", (anchors, others), batch_size=3)) == pytest.approx(7 / 3)
    # without batch_size or labels: the anchors 0 .. largest anchor (here 0 and 1)
    assert float(PerAnchorReducer()(losses, "pos_pair", (anchors, others))) == pytest.approx(7 / 2)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ThresholdReducer(), "needs low or high"),
        (lambda: ThresholdReducer(low=1, high=0.5), "needs low < high"),
        (lambda: ThresholdReducer(low=0.5, high=0.5), "needs low < high"),
        (lambda: ClassWeightedReducer([]), "non-empty 1-D list of finite weights"),
        (lambda: build_reducer("avg_nonzero"), r"unknown reducer 'avg_nonzero'.*Did you mean 'avg_non_zero'"),
    ],
)
def test_bad_settings_are_named(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_bad_terms_are_named():
    losses = torch.ones(4)
    with pytest.raises(ValueError, match="pos_pair losses need a tuple of 2 index tensors"):
        MeanReducer()(losses, "pos_pair", torch.arange(4))
    with pytest.raises(ValueError, match="kind must be one of"):
        MeanReducer()(losses, "pairs")
    with pytest.raises(ValueError, match="a label outside 0 .. 1 has none"):
        ClassWeightedReducer([1.0, 2.0])(losses, "element", torch.arange(4), torch.arange(4))
    with pytest.raises(ValueError, match="needs the batch's labels"):
        ClassWeightedReducer([1.0, 2.0])(losses)
    assert issubclass(type(pytest.raises(UserInputError, build_reducer, "nope").value), ValueError)


def test_registry_names_pml_reducers():
    assert sorted(REDUCERS) == ["avg_non_zero", "class_weighted", "mean", "per_anchor", "sum", "threshold"]
    assert isinstance(PerAnchorReducer("avg_non_zero").reducer, AvgNonZeroReducer)


# ----------------------------------------------------------------------- the losses' reducer= option
def _supcon_batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """12 rows: classes of 3 and two singletons (anchors without positives); random or clustered (trained-like)."""
    g = torch.Generator().manual_seed(3)
    labels = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 4, 5])[torch.randperm(12, generator=g)]
    x = torch.randn(12, 5, dtype=torch.float64, generator=g)
    if kind == "clustered":
        centres = torch.randn(6, 5, dtype=torch.float64, generator=g) * 3
        x = centres[labels] + 0.2 * x
    return x, labels


SUPCON_REDUCERS = {
    "mean": (MeanReducer, pml_reducers.MeanReducer),
    "sum": (SumReducer, pml_reducers.SumReducer),
    "avg_non_zero": (AvgNonZeroReducer, pml_reducers.AvgNonZeroReducer),
    "threshold": (lambda: ThresholdReducer(high=3.0), lambda: pml_reducers.ThresholdReducer(high=3.0)),
    "class_weighted": (lambda: ClassWeightedReducer([0.5, 2.0, 1.0, 3.0, 1.5, 0.25]),
                       lambda: pml_reducers.ClassWeightedReducer(torch.tensor([0.5, 2.0, 1.0, 3.0, 1.5, 0.25]))),
    "per_anchor": (PerAnchorReducer, pml_reducers.PerAnchorReducer),
}


def _losses(loss: str, reducer, pml_reducer):
    """(ours, pml's) of ``loss`` with the two reducers."""
    from pytorch_metric_learning import losses as pml_losses

    from lightning_dml.losses import NCALoss, SupConLoss

    if loss == "supcon":
        return SupConLoss(temperature=0.1, reducer=reducer), pml_losses.SupConLoss(temperature=0.1, reducer=pml_reducer)
    return NCALoss(scale=2.0, reducer=reducer), pml_losses.NCALoss(softmax_scale=2.0, reducer=pml_reducer)


@pytest.mark.parametrize("batch", ["random", "clustered"])
@pytest.mark.parametrize("name", sorted(SUPCON_REDUCERS))
@pytest.mark.parametrize("loss", ["supcon", "nca"])
def test_a_loss_with_a_reducer_equals_pml_loss_with_it(loss, name, batch):
    ours, theirs = _losses(loss, *(make() for make in SUPCON_REDUCERS[name]))
    x, labels = _supcon_batch(batch)
    mine, ref = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    value = ours(mine, labels)
    ref_value = theirs(ref, labels)
    torch.testing.assert_close(value, ref_value, rtol=1e-12, atol=1e-14)
    (grad,) = torch.autograd.grad(value, mine)
    (ref_grad,) = torch.autograd.grad(ref_value, ref)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)
    if name != "class_weighted":  # the autograd path (closed_form=False) reduces the same terms
        ours.closed_form = False
        torch.testing.assert_close(ours(x, labels), ref_value.detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("loss", ["supcon", "nca"])
def test_default_is_unchanged_and_a_reducer_name_is_accepted(loss):
    from lightning_dml.losses import build_loss

    x, labels = _supcon_batch("random")
    plain = build_loss(loss)(x, labels)
    valid_mean = build_loss(loss, reducer=SumReducer())(x, labels) / 9  # 9 anchors have positives, 3 singletons
    torch.testing.assert_close(plain, valid_mean)  # the library's mean over the anchors with positives
    assert isinstance(build_loss(loss, reducer="avg_non_zero").reducer, AvgNonZeroReducer)
    chunked = build_loss(loss, reducer="avg_non_zero", anchor_chunk_size=5)(x, labels)
    torch.testing.assert_close(chunked, build_loss(loss, reducer="avg_non_zero")(x, labels))


# ------------------------------------------------------------- reducer= on ContrastiveLoss and TripletLoss
def _pair_losses(loss: str, reducer, pml_reducer):
    """(ours, pml's) contrastive / triplet losses with the two reducers (batch-hard: pml's loss on its miner's
    triplets)."""
    from pytorch_metric_learning import losses as pml_losses
    from pytorch_metric_learning import miners as pml_miners

    from lightning_dml.losses import ContrastiveLoss, TripletLoss

    if loss == "contrastive":
        return ContrastiveLoss(0.1, 0.8, reducer=reducer), pml_losses.ContrastiveLoss(0.1, 0.8, reducer=pml_reducer)
    theirs = pml_losses.TripletMarginLoss(margin=0.2, reducer=pml_reducer)
    if loss == "triplet_all":
        return TripletLoss(margin=0.2, reducer=reducer), theirs
    miner = pml_miners.BatchHardMiner()
    return TripletLoss(margin=0.2, mining="batch_hard", reducer=reducer), lambda x, y: theirs(x, y, miner(x, y))


def _pair_batch(kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """18 unit rows in 6 classes of 3, random or clustered (class centres plus noise: pairs near the margins)."""
    from tests.test_miners import miner_batch

    return miner_batch(kind, seed=1, per_class=3)


PAIR_LOSS_CASES = [(loss, name) for loss in ("contrastive", "triplet_all", "triplet_batch_hard")
                   for name in sorted(SUPCON_REDUCERS) if not (loss != "contrastive" and name == "per_anchor")]


def _value_and_grad(loss, x, labels, **kwargs):
    x = x.clone().requires_grad_(True)
    value = loss(x, labels, **kwargs)
    (grad,) = torch.autograd.grad(value, x)
    return value.detach(), grad


@pytest.mark.parametrize("batch", ["random", "clustered"])
@pytest.mark.parametrize("loss,name", PAIR_LOSS_CASES)
def test_contrastive_and_triplet_with_a_reducer_equal_pml_with_it(loss, name, batch):
    """pml hands its reducer the pairs' (contrastive: positive and negative pairs reduced apart and added) or the
    triplets' terms, zero terms included: the same value and gradients in fp64, singletons and ties included."""
    ours, theirs = _pair_losses(loss, *(make() for make in SUPCON_REDUCERS[name]))
    x, labels = _pair_batch(batch)
    value, grad = _value_and_grad(ours, x, labels)
    ref_value, ref_grad = _value_and_grad(theirs, x, labels)
    assert value.abs() > 0
    torch.testing.assert_close(value, ref_value, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("name", ["mean", "sum", "avg_non_zero", "threshold"])
@pytest.mark.parametrize("loss", ["contrastive", "triplet"])
def test_contrastive_and_triplet_reducer_on_a_miners_tuple_equal_pml(loss, name):
    """The mined path (indices_tuple) reduces the listed pairs' / triplets' terms with the reducer as pml does."""
    from pytorch_metric_learning import losses as pml_losses

    from lightning_dml.losses import ContrastiveLoss, TripletLoss
    from lightning_dml.miners import PairMarginMiner, TripletMarginMiner

    reducer, pml_reducer = (make() for make in SUPCON_REDUCERS[name])
    x, labels = _pair_batch("clustered")
    if loss == "contrastive":
        ours = ContrastiveLoss(0.1, 0.8, reducer=reducer)
        theirs = pml_losses.ContrastiveLoss(0.1, 0.8, reducer=pml_reducer)
        tuples = PairMarginMiner(0.3, 0.9)(x, labels)
    else:
        ours, theirs = TripletLoss(margin=0.2, reducer=reducer), pml_losses.TripletMarginLoss(0.2, reducer=pml_reducer)
        tuples = TripletMarginMiner(0.3, "all")(x, labels)
    assert tuples[0].numel() > 0
    value, grad = _value_and_grad(ours, x, labels, indices_tuple=tuples)
    ref_value, ref_grad = _value_and_grad(lambda e, y: theirs(e, y, tuples), x, labels)
    torch.testing.assert_close(value, ref_value, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("loss,kwargs", [("contrastive", {}), ("contrastive", {"squared_hinge": True}),
                                         ("triplet", {}), ("triplet", {"mining": "batch_hard"})])
def test_reducers_equal_the_reduction_strings_and_both_at_once_are_refused(loss, kwargs):
    """avg_non_zero / mean / sum are the reductions mean_nonzero / mean / sum (the closed forms); anchor chunks
    give the same value; reduction and reducer together, or PerAnchorReducer on triplets, are one-line errors."""
    from lightning_dml.losses import build_loss

    x, labels = _supcon_batch("random")
    for reducer, reduction in (("avg_non_zero", "mean_nonzero"), ("mean", "mean"), ("sum", "sum")):
        expected = build_loss(loss, reduction=reduction, **kwargs)(x, labels)
        torch.testing.assert_close(build_loss(loss, reducer=reducer, **kwargs)(x, labels), expected)
        chunked = build_loss(loss, reducer=reducer, anchor_chunk_size=5, **kwargs)(x, labels)
        torch.testing.assert_close(chunked, expected)
    with pytest.raises(ValueError, match=r"takes reduction='mean' or reducer='sum', not both"):
        build_loss(loss, reduction="mean", reducer="sum", **kwargs)
    with pytest.raises(ValueError, match=r"reduction must be one of"):
        build_loss(loss, reduction="avg_non_zero", **kwargs)
    assert "reducer=SumReducer()" in repr(build_loss(loss, reducer="sum", **kwargs))
    if loss == "triplet":
        with pytest.raises(ValueError, match=r"TripletLoss cannot take PerAnchorReducer"):
            build_loss(loss, reducer="per_anchor", **kwargs)
