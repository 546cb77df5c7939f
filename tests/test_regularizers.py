"""Regularizers (issue 29 s.2): each equal to pytorch-metric-learning 2.9's (values and gradients in fp64, random
and clustered rows), SphericalEmbedding against the paper's formula and the authors' running mean, degenerate
inputs finite, and the weighted terms of DMLModule (``regularizers=[...]``, ``--model.regularizers`` in a config)."""

from __future__ import annotations

from functools import partial

import pytest
import pytorch_lightning as pl
import torch
from pytorch_metric_learning import regularizers as pml_regularizers
from torch.utils.data import DataLoader

from lightning_dml.data import BalancedClassSampler, TensorImageDataset
from lightning_dml.errors import UserInputError
from lightning_dml.losses import MultiSimilarityLoss, ProxyAnchorLoss, SoftTripleLoss
from lightning_dml.models import SmallConvNet
from lightning_dml.module import DMLModule
from lightning_dml.regularizers import (
    REGULARIZERS,
    CenterInvariantRegularizer,
    LpRegularizer,
    RegularFaceRegularizer,
    RegularizationTerms,
    RegularizerSpecError,
    SparseCentersRegularizer,
    SphericalEmbeddingRegularizer,
    ZeroMeanRegularizer,
    build_regularizer,
)

# 4 classes x 3 centres: SparseCenters reads the 12 rows as class blocks
CLASSES, PER_CLASS, WIDTH = 4, 3, 6


def _random(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(CLASSES * PER_CLASS, WIDTH, dtype=torch.float64, generator=g)


def _clustered(seed: int = 1) -> torch.Tensor:
    """Trained-like rows: tight class blocks of unequal norms (near-identical centres within a class)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, WIDTH, dtype=torch.float64, generator=g)
    rows = centres.repeat_interleave(PER_CLASS, 0) + 0.05 * torch.randn(CLASSES * PER_CLASS, WIDTH,
                                                                        dtype=torch.float64, generator=g)
    scales = 0.5 + torch.rand(CLASSES * PER_CLASS, 1, dtype=torch.float64, generator=g)
    return rows * scales


BATCHES = {"random": _random, "clustered": _clustered}

# (ours, pml's): each with the same settings
PAIRS = {
    "lp": (lambda: LpRegularizer(), lambda: pml_regularizers.LpRegularizer()),
    "lp_p1_power2": (lambda: LpRegularizer(p=1, power=2), lambda: pml_regularizers.LpRegularizer(p=1, power=2)),
    "lp_p3_power0.5": (lambda: LpRegularizer(p=3, power=0.5),
                       lambda: pml_regularizers.LpRegularizer(p=3, power=0.5)),
    "zero_mean": (ZeroMeanRegularizer, pml_regularizers.ZeroMeanRegularizer),
    "center_invariant": (CenterInvariantRegularizer, pml_regularizers.CenterInvariantRegularizer),
    "regular_face": (RegularFaceRegularizer, pml_regularizers.RegularFaceRegularizer),
    "sparse_centers": (lambda: SparseCentersRegularizer(CLASSES, PER_CLASS),
                       lambda: pml_regularizers.SparseCentersRegularizer(CLASSES, PER_CLASS)),
}


def _value_and_grad(regularizer, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    value = regularizer(x)
    (grad,) = torch.autograd.grad(value, x)
    return value.detach(), grad


@pytest.mark.parametrize("batch", sorted(BATCHES))
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_equal_to_pml_values_and_gradients_fp64(name, batch):
    ours, theirs = (make() for make in PAIRS[name])
    x = BATCHES[batch]()
    value, grad = _value_and_grad(ours, x)
    ref_value, ref_grad = _value_and_grad(theirs, x)
    assert value.dtype == torch.float64
    torch.testing.assert_close(value, ref_value, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)
    assert grad.abs().sum() > 0  # the comparison is not between two zero gradients


def _sec_paper(x: torch.Tensor) -> torch.Tensor:
    """Zhang et al. 2020, Eq. 5 as written: mean squared deviation of the norms from their (batch) mean."""
    norms = torch.sqrt((x * x).sum(dim=1))
    return ((norms - norms.mean()) ** 2).mean()


@pytest.mark.parametrize("batch", sorted(BATCHES))
def test_spherical_embedding_is_the_papers_formula(batch):
    x = BATCHES[batch]()
    value, grad = _value_and_grad(SphericalEmbeddingRegularizer(), x)
    ref_value, ref_grad = _value_and_grad(_sec_paper, x)
    torch.testing.assert_close(value, ref_value, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)
    assert grad.abs().sum() > 0


def test_spherical_embedding_running_mean_follows_the_authors_code():
    """Dyfine/SphericalEmbedding learner.py: the first batch's mean norm, then
    ``mu = (1 - m) mu + m mean``, without gradient; in eval mode the running mean is used, not updated."""
    momentum = 0.3
    ours = SphericalEmbeddingRegularizer(momentum=momentum)
    record = None
    for step in range(3):
        x = _random(step) * (1 + step)  # the norms drift, as in training
        norms_mean = x.norm(dim=1).mean()
        record = norms_mean if record is None else (1 - momentum) * record + momentum * norms_mean

        def reference(y: torch.Tensor, mu: torch.Tensor = record) -> torch.Tensor:
            return ((y.norm(dim=1) - mu) ** 2).mean()

        value, grad = _value_and_grad(ours, x)
        ref_value, ref_grad = _value_and_grad(reference, x)
        torch.testing.assert_close(value, ref_value, rtol=1e-12, atol=1e-14)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(ours.running_norm, record)
    ours.eval()
    ours(_random(7) * 10)
    torch.testing.assert_close(ours.running_norm, record)  # not updated in eval mode
    state = ours.state_dict()  # saved with the model: a resumed run keeps its mean
    assert set(state) == {"running_norm", "has_running_norm"} and bool(state["has_running_norm"])


def _degenerate() -> dict[str, torch.Tensor]:
    row = torch.tensor([[0.3, -1.2, 0.5, 2.0, 0.1, -0.7]], dtype=torch.float64)
    return {
        "identical": row.repeat(CLASSES * PER_CLASS, 1),
        "zeros": torch.zeros(CLASSES * PER_CLASS, WIDTH, dtype=torch.float64),
        "zero_and_nonzero": torch.cat([torch.zeros(6, WIDTH, dtype=torch.float64), row.repeat(6, 1)]),
        "one_row": row,
    }


@pytest.mark.parametrize("case", sorted(_degenerate()))
@pytest.mark.parametrize("name", sorted(REGULARIZERS))
def test_degenerate_inputs_are_finite(name, case):
    x = _degenerate()[case]
    init = {"num_classes": CLASSES, "centers_per_class": PER_CLASS} if name == "sparse_centers" else {}
    regularizer = build_regularizer(name, **init)
    if case == "one_row" and name in ("regular_face", "sparse_centers"):
        with pytest.raises(ValueError, match="2 rows|takes \\[12, D\\]"):
            regularizer(x)
        return
    value, grad = _value_and_grad(regularizer, x)
    assert torch.isfinite(value) and torch.isfinite(grad).all(), (value, grad)
    if case in ("identical", "one_row") and name in ("center_invariant", "spherical_embedding"):
        assert float(value) < 1e-20 and grad.abs().max() < 1e-12  # one norm: nothing to even out (up to rounding)


def test_sparse_centers_identical_and_nearly_identical_centres_as_pml():
    """Cosine 1: value 0 and gradient 0 (pml's, through torch 2.14's clamp bound); centres a hair apart: pml's
    value and gradient."""
    row = _degenerate()["identical"]
    near = row.clone()
    near[1::PER_CLASS, 0] += 1e-7  # each class's second centre a hair off the others
    for x in (row, near):
        value, grad = _value_and_grad(SparseCentersRegularizer(CLASSES, PER_CLASS), x)
        ref_value, ref_grad = _value_and_grad(pml_regularizers.SparseCentersRegularizer(CLASSES, PER_CLASS), x)
        assert torch.isfinite(grad).all()
        torch.testing.assert_close(value, ref_value, rtol=1e-9, atol=0)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=0)
    assert float(ref_value) > 0 and grad.abs().max() > 0  # the near case is not the identical one


def test_half_precision_inputs_give_fp32_values_and_autocast_is_off():
    x = _random().to(torch.bfloat16)
    for name in sorted(REGULARIZERS):
        init = {"num_classes": CLASSES, "centers_per_class": PER_CLASS} if name == "sparse_centers" else {}
        regularizer = build_regularizer(name, **init)
        value = regularizer(x)
        assert value.dtype == torch.float32 and torch.isfinite(value), name
        with torch.autocast(device_type="cpu", dtype=torch.bfloat16):  # a bf16-mixed training step
            mixed = regularizer(x.float())
        assert mixed.dtype == torch.float32 and float(mixed) == float(regularizer(x.float())), name


# ------------------------------------------------------------------------------------------ the module's terms
def _proxy_anchor() -> ProxyAnchorLoss:
    return ProxyAnchorLoss(num_classes=6, embedding_dim=8)


@pytest.mark.parametrize(
    ("specs", "loss", "message"),
    [
        ([{"regularizer": "lpp"}], None, r"regularizers\[0\]: unknown regularizer 'lpp'.*Did you mean 'lp'"),
        ([{"weight": 1.0}], None, r"regularizers\[0\] has no 'regularizer'"),
        ([{"regularizer": "lp", True: "embeddings"}], None, r"YAML reads a bare 'on' as true.*'target"),
        ([{"regularizer": "lp", "target": "proxies"}], None, r"'target' must be one of \['embeddings', 'loss_w"),
        ([{"regularizer": "regular_face"}], None, r"target 'loss_weights' but the loss MultiSimilarityLoss has no"),
        ([{"regularizer": "lp", "weight": -1}], None, r"regularizers\[0\]: weight must be a finite number >= 0"),
        ([{"regularizer": "lp", "wieght": 1}], None, r"unknown key\(s\) \['wieght'\]"),
        ([{"regularizer": "lp", "init_args": {"q": 2}}], None, r"regularizers\[0\] \('lp'\): .*'q'"),
        ([{"regularizer": "lp", "name": "a"}, {"regularizer": "zero_mean", "name": "a"}], None,
         r"regularizers\[1\]: the name 'a' is already taken"),
        ([{"regularizer": "spherical_embedding", "init_args": {"momentum": 0.5}}], "per_level",
         r"running statistic.*per_level"),
        ([{"regularizer": "sparse_centers"}], "proxy_anchor", r"at least 2 centres per class"),
        ([{"regularizer": "regular_face"}], "sharded", r"sharded=True: each process holds only its block"),
        ("lp", None, "must be a list of terms"),
        ([{"regularizer": LpRegularizer()}], None, r"must be a registry name .*got LpRegularizer: the terms are saved"),
    ],
)
def test_a_bad_term_is_one_user_error_naming_it(specs, loss, message):
    with pytest.raises(RegularizerSpecError, match=message) as error:
        if loss == "per_level":
            RegularizationTerms(specs, MultiSimilarityLoss(), per_level=True)
        elif loss == "sharded":
            RegularizationTerms(specs, ProxyAnchorLoss(num_classes=6, embedding_dim=8, sharded=True))
        else:
            RegularizationTerms(specs, _proxy_anchor() if loss == "proxy_anchor" else MultiSimilarityLoss())
    assert isinstance(error.value, UserInputError)


@pytest.mark.parametrize(
    ("name", "init", "message"),
    [
        ("lp", {"p": 0}, "p must be > 0"),
        ("lp", {"p": True}, "p must be > 0"),
        ("center_invariant", {"p": -1}, "p must be > 0"),
        ("spherical_embedding", {"momentum": 0}, r"momentum must be in \(0, 1\]"),
        ("spherical_embedding", {"momentum": -0.5}, r"momentum must be in \(0, 1\]"),
        ("spherical_embedding", {"momentum": 1.5}, r"momentum must be in \(0, 1\]"),
        ("sparse_centers", {"num_classes": 0}, "num_classes must be an integer >= 1"),
        ("sparse_centers", {"centers_per_class": 1}, "centers_per_class must be an integer >= 2"),
    ],
)
def test_bad_settings_are_named(name, init, message):
    with pytest.raises(ValueError, match=message):
        build_regularizer(name, **init)


@pytest.mark.parametrize("init", [{"num_classes": CLASSES}, {"centers_per_class": PER_CLASS}])
def test_sparse_centers_called_without_a_size_names_both(init):
    with pytest.raises(ValueError, match="needs num_classes and centers_per_class"):
        SparseCentersRegularizer(**init)(_random())


@pytest.mark.parametrize("p", [1, 3])
def test_other_norm_orders_equal_pml(p):
    from pytorch_metric_learning.distances import LpDistance

    x = _clustered()
    value, grad = _value_and_grad(CenterInvariantRegularizer(p=p), x)
    pml = pml_regularizers.CenterInvariantRegularizer(distance=LpDistance(p=p, power=1, normalize_embeddings=False))
    ref_value, ref_grad = _value_and_grad(pml, x)
    torch.testing.assert_close(value, ref_value, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-10, atol=1e-13)
    lp_value, _ = _value_and_grad(LpRegularizer(p=p, power=2), x)
    torch.testing.assert_close(lp_value, (x.norm(p=p, dim=1) ** 2).mean())


def test_repeated_regularizers_get_the_next_free_name():
    terms = RegularizationTerms([{"regularizer": "lp"}, {"regularizer": "zero_mean", "name": "lp_2"},
                                 {"regularizer": "lp", "init_args": {"p": 1}}], MultiSimilarityLoss())
    assert terms.names == ["lp", "lp_2", "lp_3"]


def test_terms_are_weighted_named_and_read_the_loss_sizes():
    loss = SoftTripleLoss(num_classes=CLASSES, embedding_dim=WIDTH, centers_per_class=PER_CLASS)
    terms = RegularizationTerms(
        [{"regularizer": "lp", "weight": 0.5}, {"regularizer": "lp", "weight": 2.0, "init_args": {"p": 1}},
         {"regularizer": "sparse_centers", "weight": 3.0}],
        loss,
    )
    assert terms.names == ["lp", "lp_2", "sparse_centers"] and terms.targets[2] == "loss_weights"
    x = _random()
    out = terms(x, [loss])
    torch.testing.assert_close(out["lp"], 0.5 * x.norm(dim=1).mean())
    torch.testing.assert_close(out["lp_2"], 2.0 * x.norm(p=1, dim=1).mean())
    reference = pml_regularizers.SparseCentersRegularizer(CLASSES, PER_CLASS)(loss.proxies.detach())
    torch.testing.assert_close(out["sparse_centers"], 3.0 * reference)


def test_per_level_terms_sum_over_the_levels_and_their_losses():
    """fusion="per_level": an embeddings term over each level's embeddings, a weights term over each level's loss."""
    losses = [SoftTripleLoss(num_classes=CLASSES, embedding_dim=WIDTH, centers_per_class=PER_CLASS) for _ in range(2)]
    with torch.no_grad():
        losses[1].proxies.mul_(-2.0).add_(0.3)  # the levels' proxies differ
    terms = RegularizationTerms([{"regularizer": "zero_mean", "weight": 2.0}, {"regularizer": "regular_face"}],
                                losses[0], per_level=True)
    levels = [_random(0), _clustered(1)]
    out = terms(levels, losses)
    zero_mean, regular_face = pml_regularizers.ZeroMeanRegularizer(), pml_regularizers.RegularFaceRegularizer()
    torch.testing.assert_close(out["zero_mean"], 2.0 * (zero_mean(levels[0]) + zero_mean(levels[1])))
    expected = regular_face(losses[0].proxies) + regular_face(losses[1].proxies)
    torch.testing.assert_close(out["regular_face"], expected.detach(), check_dtype=False)


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (36, 3, 16, 16), dtype=torch.uint8, generator=g)
    labels = torch.arange(6).repeat_interleave(6)
    dataset = TensorImageDataset(images, labels, mean=0.5, std=0.25)
    return DataLoader(dataset, batch_sampler=BalancedClassSampler(dataset.labels, 4, 3, seed=0))


_SPECS = [
    {"regularizer": "spherical_embedding", "weight": 0.5},
    {"regularizer": "regular_face", "weight": 0.25},
    {"regularizer": "lp", "weight": 1e-3, "init_args": {"power": 2}, "name": "l2"},
]


def test_training_step_adds_the_weighted_terms_to_the_pair_loss():
    model = DMLModule(SmallConvNet(in_channels=3, width=4), loss=_proxy_anchor(), embedding_dim=8,
                      clustering=False, regularizers=_SPECS)
    images, labels = next(iter(_loader()))[:2]
    objective = model.training_step((images, labels), batch_idx=1)
    embeddings = model(images)
    norms = embeddings.norm(dim=1)
    expected = (
        model.loss(embeddings, labels)
        + 0.5 * ((norms - norms.mean()) ** 2).mean()
        + 0.25 * pml_regularizers.RegularFaceRegularizer()(model.loss.proxies)
        + 1e-3 * (norms**2).mean()
    )
    torch.testing.assert_close(objective, expected)
    grads = torch.autograd.grad(objective, model.loss.proxies)[0]
    expected_grads = torch.autograd.grad(expected, model.loss.proxies)[0]
    torch.testing.assert_close(grads, expected_grads)


def test_fit_logs_each_term_under_train_reg():
    model = DMLModule(SmallConvNet(in_channels=3, width=4), loss=_proxy_anchor(), embedding_dim=8, clustering=False,
                      regularizers=_SPECS, optimizer=partial(torch.optim.SGD, lr=0.1))
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0, max_steps=1)
    trainer.fit(model, train_dataloaders=_loader())
    logged = trainer.callback_metrics
    assert {"train/reg/spherical_embedding", "train/reg/regular_face", "train/reg/l2"} <= set(logged)
    assert all(float(logged[f"train/reg/{n}"]) > 0 for n in ("spherical_embedding", "regular_face", "l2"))


def test_regularizers_in_a_config(tmp_path):
    from lightning_dml.cli import build_cli

    config = tmp_path / "config.yaml"
    config.write_text(
        "model:\n"
        "  loss: soft_triple\n"
        "  regularizers:\n"
        "    - regularizer: spherical_embedding\n"
        "      weight: 0.5\n"
        "    - {regularizer: sparse_centers, weight: 2, target: loss_weights}\n"
        "    - {regularizer: lp, weight: 0.001, init_args: {p: 2, power: 2}, name: l2}\n"
    )
    args = [f"--config={config}", "--trainer.logger=false", "--model.backbone=lightning_dml.models.SmallConvNet",
            "--data=lightning_dml.data.GlyphsDataModule"]
    cli = build_cli(args, run=False)
    terms = cli.model.regularization
    assert terms.names == ["spherical_embedding", "sparse_centers", "l2"]
    assert terms.weights == [0.5, 2.0, 0.001] and terms.targets == ["embeddings", "loss_weights", "embeddings"]
    assert (terms.regularizers[2].p, terms.regularizers[2].power) == (2.0, 2.0)
    assert terms.regularizers[1].centers_per_class == cli.model.loss.proxies_per_class
    assert cli.model.hparams.regularizers[2]["name"] == "l2"  # saved with the checkpoint's hyper-parameters
