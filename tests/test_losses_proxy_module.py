"""Losses with parameters in DMLModule: sizes filled in at fit, label mapping, per-level instances, optimizer
group, checkpoint round trip, and training through the CLI from a config that never names ``num_classes``."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml

from lightning_dml.cli import build_cli
from lightning_dml.data.base import DMLDataModule, TensorImageDataset
from lightning_dml.losses import ArcFaceLoss, CrossBatchMemory, MultiSimilarityLoss, ProxyAnchorLoss, SoftTripleLoss
from lightning_dml.models import SmallConvNet
from lightning_dml.module import DMLModule

ROOT = Path(__file__).resolve().parents[1]
GLYPHS = ROOT / "configs" / "glyphs.yaml"
#: a few CPU seconds of the demo config: no logger, no callbacks, no validation, a tiny network
FAST = [
    "--trainer.logger=false", "--trainer.callbacks=[]", "--trainer.limit_val_batches=0",
    "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
    "--model.backbone.init_args.width=8", "--model.embedding_dim=16", "--model.clustering=false",
    "--data.init_args.image_size=16",
]

#: training labels that are neither contiguous nor from 0 (as CUB's 1..100 or a held-out split's)
TRAIN_CLASSES = [3, 4, 7, 10, 11, 20]


class _TinyData(DMLDataModule):
    def __init__(self, classes=TRAIN_CLASSES, per_class: int = 4, **kwargs) -> None:
        kwargs.setdefault("classes_per_batch", 3)
        kwargs.setdefault("samples_per_class", 2)
        kwargs.setdefault("eval_batch_size", 16)
        super().__init__(**kwargs)
        self.classes, self.per_class = list(classes), per_class

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        labels = torch.tensor(self.classes).repeat_interleave(self.per_class)
        images = torch.randint(0, 256, (labels.numel(), 3, 16, 16), dtype=torch.uint8, generator=g)
        test_labels = torch.tensor([100, 101]).repeat_interleave(3)
        test = torch.randint(0, 256, (6, 3, 16, 16), dtype=torch.uint8, generator=g)
        return TensorImageDataset(images, labels, 0.5, 0.25), TensorImageDataset(test, test_labels, 0.5, 0.25)


def _module(**kwargs) -> DMLModule:
    kwargs.setdefault("backbone", SmallConvNet(in_channels=3, width=4))
    kwargs.setdefault("loss", ProxyAnchorLoss())
    kwargs.setdefault("embedding_dim", 8)
    kwargs.setdefault("optimizer", partial(torch.optim.SGD, lr=0.01))
    kwargs.setdefault("clustering", False)
    return DMLModule(**kwargs)


def _fit(
    model: DMLModule,
    data: pl.LightningDataModule | None = None,
    steps: int = 2,
    ckpt_path: str | None = None,
    **trainer_kwargs,
) -> pl.Trainer:
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, max_steps=steps,
        **trainer_kwargs,
    )
    trainer.fit(model, datamodule=data if data is not None else _TinyData(), ckpt_path=ckpt_path)
    return trainer


def test_data_module_reports_the_classes_trained_on():
    data = _TinyData()
    assert data.num_train_classes == 6
    assert data.train_class_ids.tolist() == TRAIN_CLASSES
    held_out = _TinyData(classes=list(range(10, 20)), val_classes_fraction=0.3)
    assert held_out.num_train_classes == 7  # 3 of the 10 classes held out for validation
    assert set(held_out.train_class_ids.tolist()).isdisjoint(held_out.val_dataset.labels.tolist())


def test_sizes_are_filled_in_from_the_data_and_the_head():
    model = _module()
    assert model.loss.proxies is None
    _fit(model)
    assert (model.loss.num_classes, model.loss.embedding_dim) == (6, 8)
    assert model.hparams["loss_sizes"] == {"num_classes": 6, "embedding_dim": 8}
    assert model.train_class_ids.tolist() == TRAIN_CLASSES
    # labels map to the proxies' indices in the order of train_class_ids
    assert model._class_indices(torch.tensor([20, 3, 7])).tolist() == [5, 0, 2]
    with pytest.raises(ValueError, match="training label 5 is not one of the 6 classes"):
        model._class_indices(torch.tensor([3, 5]))


def test_held_out_validation_classes_get_no_proxy():
    model = _module()
    _fit(model, _TinyData(classes=list(range(10, 20)), val_classes_fraction=0.3))
    assert model.loss.num_classes == 7


def test_concat_fusion_gives_the_loss_three_times_the_width():
    model = _module(fusion="concat", loss=SoftTripleLoss(centers_per_class=2))
    _fit(model)
    assert (model.loss.num_classes, model.loss.embedding_dim) == (6, 24)
    assert model.loss.proxies.shape == (12, 24)


def test_per_level_fusion_gives_each_level_its_own_loss():
    model = _module(fusion="per_level")
    assert len(model.trained_losses()) == 3 and model.trained_losses()[0] is model.loss
    _fit(model)
    proxies = [f.proxies for f in model.trained_losses()]
    assert all(p.shape == (6, 8) for p in proxies)
    assert len({id(p) for p in proxies}) == 3
    assert not torch.equal(proxies[0], proxies[1])
    group = {g["name"]: g for g in model.configure_optimizers().param_groups}["loss"]
    assert {id(p) for p in group["params"]} == {id(p) for p in proxies}


def test_per_level_fusion_with_sizes_given_reinitialises_the_copies():
    model = _module(fusion="per_level", loss=ArcFaceLoss(num_classes=6, embedding_dim=8))
    a, b, c = (f.proxies for f in model.trained_losses())
    assert not torch.equal(a, b) and not torch.equal(b, c)


def test_loss_parameters_have_their_own_group():
    model = _module(
        loss=ProxyAnchorLoss(num_classes=6, embedding_dim=8),
        head_lr_multiplier=10.0,
        loss_lr_multiplier=100.0,
        optimizer=partial(torch.optim.SGD, lr=0.003, momentum=0.9, weight_decay=1e-4),
    )
    optimizer = model.configure_optimizers()
    by_name = {g["name"]: g for g in optimizer.param_groups}
    assert by_name["backbone"]["lr"] == pytest.approx(0.003) and by_name["backbone"]["weight_decay"] == 1e-4
    assert by_name["head"]["lr"] == pytest.approx(0.03) and by_name["head"]["weight_decay"] == 1e-4
    assert by_name["loss"]["lr"] == pytest.approx(0.3) and by_name["loss"]["weight_decay"] == 0.0
    assert [id(p) for p in by_name["loss"]["params"]] == [id(model.loss.proxies)]
    ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == sum(1 for p in model.parameters() if p.requires_grad)
    decayed = _module(loss=ProxyAnchorLoss(num_classes=6, embedding_dim=8), loss_weight_decay=5e-4)
    groups = {g["name"]: g for g in decayed.configure_optimizers().param_groups}
    assert groups["loss"]["weight_decay"] == 5e-4 and groups["loss"]["lr"] == pytest.approx(0.01)
    # a loss without parameters: no loss group
    assert "loss" not in {g["name"] for g in _module(loss=MultiSimilarityLoss()).configure_optimizers().param_groups}
    with pytest.raises(ValueError, match="loss_lr_multiplier > 0"):
        _module(loss_lr_multiplier=0.0)


def test_proxies_train_at_the_loss_learning_rate():
    """One SGD step: the proxies move by lr x loss_lr_multiplier x their gradient."""
    model = _module(loss_lr_multiplier=50.0)
    captured = {}

    class _Probe(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            captured["before"] = pl_module.loss.proxies.detach().clone()
            captured["grad"] = pl_module.loss.proxies.grad.detach().clone()

    _fit(model, steps=1, callbacks=[_Probe()])
    step = captured["before"] - model.loss.proxies.detach()
    torch.testing.assert_close(step, 0.01 * 50.0 * captured["grad"])
    assert captured["grad"].abs().sum() > 0


def test_configured_sizes_that_disagree_with_the_data_are_an_error():
    with pytest.raises(ValueError, match="configured with num_classes=5, but the model gives num_classes=6"):
        _fit(_module(loss=ProxyAnchorLoss(num_classes=5)))
    with pytest.raises(ValueError, match="configured with embedding_dim=16, but the model gives embedding_dim=8"):
        _fit(_module(loss=ProxyAnchorLoss(embedding_dim=16)))


def test_without_a_data_module_num_classes_must_be_given():
    data = _TinyData()
    data.setup("fit")
    loader = data.train_dataloader()
    trainer = pl.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, max_steps=1, limit_val_batches=0)
    with pytest.raises(ValueError, match="needs num_classes and it cannot be filled in \\(no data module\\)"):
        trainer.fit(_module(), train_dataloaders=loader)
    # given, with labels already class indices: trains
    indices = torch.searchsorted(data.train_class_ids, data.train_dataset.labels)
    indexed = TensorImageDataset(data.train_dataset.images, indices)
    loader = torch.utils.data.DataLoader(indexed, batch_size=8, shuffle=True)
    model = _module(loss=ProxyAnchorLoss(num_classes=6))
    trainer.fit(model, train_dataloaders=loader)
    assert model.loss.embedding_dim == 8 and torch.isfinite(trainer.callback_metrics["train/loss"])


def test_checkpoint_rebuilds_the_loss(tmp_path):
    model = _module(fusion="per_level", loss=SoftTripleLoss(centers_per_class=2))
    trainer = _fit(model)
    path = tmp_path / "proxy.ckpt"
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["hyper_parameters"]["loss_sizes"] == {"num_classes": 6, "embedding_dim": 8}
    # Lightning's route: sizes from the hyper-parameters (on_load_checkpoint), then the weights
    restored = DMLModule.load_from_checkpoint(
        path, backbone=SmallConvNet(in_channels=3, width=4), loss=SoftTripleLoss(centers_per_class=2)
    )
    for ours, theirs in zip(restored.trained_losses(), model.trained_losses()):
        torch.testing.assert_close(ours.proxies, theirs.proxies)
    assert restored.hparams["loss_sizes"] == {"num_classes": 6, "embedding_dim": 8}
    # a plain load_state_dict into a module built from the config (as lightning_dml.export does)
    fresh = _module(fusion="per_level", loss=SoftTripleLoss(centers_per_class=2))
    fresh.load_state_dict(checkpoint["state_dict"])
    for ours, theirs in zip(fresh.trained_losses(), model.trained_losses()):
        torch.testing.assert_close(ours.proxies, theirs.proxies)
    # resuming the fit restores the proxies and their optimizer state
    resumed = _module(fusion="per_level", loss=SoftTripleLoss(centers_per_class=2))
    _fit(resumed, steps=3, ckpt_path=str(path))
    assert resumed.global_step == 3


def test_cli_trains_a_proxy_loss_from_a_config_without_num_classes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = yaml.safe_load(GLYPHS.read_text())
    config["model"]["loss"] = {"class_path": "lightning_dml.losses.ProxyAnchorLoss", "init_args": {"alpha": 32.0}}
    config["model"]["loss_lr_multiplier"] = 100.0
    path = tmp_path / "proxy_anchor.yaml"
    path.write_text(yaml.safe_dump(config))
    assert "num_classes" not in path.read_text() and "embedding_size" not in path.read_text()
    cli = build_cli(["fit", "--config", str(path), "--trainer.max_epochs=1", "--trainer.limit_train_batches=3", *FAST])
    loss, data = cli.model.loss, cli.datamodule
    assert isinstance(loss, ProxyAnchorLoss)
    assert loss.proxies.shape == (data.num_train_classes, 16)
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])
    optimizer = cli.trainer.optimizers[0]
    group = {g["name"]: g for g in optimizer.param_groups}["loss"]
    assert group["initial_lr"] == pytest.approx(100.0 * 0.001) and group["weight_decay"] == 0.0  # before the schedule
    assert optimizer.state[loss.proxies]  # the proxies were stepped


@pytest.mark.slow
def test_cli_accepts_a_proxy_loss_by_registry_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli = build_cli(["fit", "--config", str(GLYPHS), "--model.loss=normalized_softmax", "--trainer.max_steps=2", *FAST])
    assert cli.model.loss.proxies.shape == (cli.datamodule.num_train_classes, 16)
    assert torch.isfinite(cli.trainer.callback_metrics["train/loss"])


def test_proxy_losses_train_without_positive_pairs():
    """A proxy loss learns from one image per class per batch (the positive-pair checks do not apply to it)."""
    model = _module(loss=ArcFaceLoss())
    trainer = _fit(model, _TinyData(classes_per_batch=6, samples_per_class=1))
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    with pytest.raises(ValueError, match="MultiSimilarityLoss needs positive pairs"):
        _fit(_module(loss=MultiSimilarityLoss()), _TinyData(classes_per_batch=6, samples_per_class=1))


def test_cross_batch_memory_gets_the_head_width_and_a_checkpoint_rebuilds_it(tmp_path):
    """The memory's width is left out (the registry default), filled in from the head at fit start."""
    model = _module(loss=CrossBatchMemory("contrastive", memory_size=8), embedding_dim=8)
    assert model.loss.embedding_size is None
    trainer = _fit(model)
    assert model.loss.memory_embeddings.shape == (8, 8) and int(model.loss.num_filled) > 0
    assert model.hparams["loss_sizes"] == {"embedding_dim": 8}
    assert model.train_class_ids is None  # labels are not mapped: the memory holds no per-class parameter
    path = tmp_path / "xbm.ckpt"
    trainer.save_checkpoint(path)
    restored = DMLModule.load_from_checkpoint(
        path, backbone=SmallConvNet(in_channels=3, width=4), loss=CrossBatchMemory("contrastive", memory_size=8)
    )
    torch.testing.assert_close(restored.loss.memory_embeddings, model.loss.memory_embeddings)


def test_cross_batch_memory_width_that_disagrees_with_the_head_is_an_error():
    model = _module(loss=CrossBatchMemory("contrastive", embedding_size=512, memory_size=8), embedding_dim=8)
    with pytest.raises(ValueError, match="embedding_size=512, but the model gives embedding_dim=8"):
        _fit(model)


def test_cross_batch_memory_alone_takes_the_width_of_its_first_batch():
    xbm = CrossBatchMemory("contrastive", memory_size=4)
    g = torch.Generator().manual_seed(0)
    value = xbm(torch.randn(6, 5, generator=g), torch.tensor([0, 0, 1, 1, 2, 2]))
    assert torch.isfinite(value) and xbm.memory_embeddings.shape == (4, 5)
