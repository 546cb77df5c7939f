"""DMLModule training tricks: frozen BatchNorm, backbone-freeze epochs, head lr multiplier, schedules, fusion."""

from __future__ import annotations

import copy
import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_dml.data import BalancedClassSampler, TensorImageDataset
from lightning_dml.losses import MultiSimilarityLoss, RankedListLoss
from lightning_dml.models import SmallConvNet, build_backbone
from lightning_dml.module import DMLModule

P, K = 4, 3


def _loader(num_classes: int = 6, per_class: int = 6, size: int = 16, seed: int = 0) -> DataLoader:
    g = torch.Generator().manual_seed(seed)
    images = torch.randint(0, 256, (num_classes * per_class, 3, size, size), dtype=torch.uint8, generator=g)
    labels = torch.arange(num_classes).repeat_interleave(per_class)
    dataset = TensorImageDataset(images, labels, mean=0.5, std=0.25)
    return DataLoader(dataset, batch_sampler=BalancedClassSampler(dataset.labels, P, K, seed=seed))


def _module(**kwargs) -> DMLModule:
    kwargs.setdefault("backbone", SmallConvNet(in_channels=3, width=4))
    kwargs.setdefault("loss", MultiSimilarityLoss())
    kwargs.setdefault("embedding_dim", 8)
    kwargs.setdefault("optimizer", partial(torch.optim.SGD, lr=0.1, momentum=0.9))
    kwargs.setdefault("clustering", False)
    return DMLModule(**kwargs)


def _trainer(**kwargs) -> pl.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
    )
    defaults.update(kwargs)
    return pl.Trainer(**defaults)


def _accelerator(device: torch.device) -> str:
    """The Trainer's accelerator for the ``device`` fixture's device."""
    return "gpu" if device.type == "cuda" else "cpu"


def _bn_layers(module: nn.Module) -> list[nn.BatchNorm2d]:
    return [m for m in module.modules() if isinstance(m, nn.BatchNorm2d)]


def _snapshot(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}


# ----------------------------------------------------------------------------------------- frozen BN
class _ModeProbe(pl.Callback):
    def __init__(self) -> None:
        self.bn_training: list[bool] = []
        self.conv_training: list[bool] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self.bn_training += [m.training for m in _bn_layers(pl_module.backbone)]
        self.conv_training += [m.training for m in pl_module.backbone.modules() if isinstance(m, nn.Conv2d)]


@pytest.mark.parametrize("freeze_bn", [True, False])
def test_frozen_bn_keeps_running_stats_and_affine_params(freeze_bn, device):
    model = _module(freeze_bn=freeze_bn, optimizer=partial(torch.optim.AdamW, lr=0.05, weight_decay=0.1))
    # non-trivial BN state, so weight decay or a momentum update would show
    for bn in _bn_layers(model.backbone):
        nn.init.uniform_(bn.weight, 0.5, 1.5)
        nn.init.uniform_(bn.bias, -0.5, 0.5)
    before = _snapshot(model.backbone)
    probe = _ModeProbe()
    _trainer(max_steps=4, callbacks=[probe], accelerator=_accelerator(device)).fit(model, train_dataloaders=_loader())
    after = _snapshot(model.backbone)
    bn_keys = [k for k in before if any(k.endswith(s) for s in ("running_mean", "running_var", ".weight", ".bias"))
               and k.rsplit(".", 1)[0] in {n for n, m in model.backbone.named_modules() if isinstance(m, nn.BatchNorm2d)}]
    assert len(bn_keys) == 4 * len(_bn_layers(model.backbone))
    conv_keys = [k for k in before if k not in bn_keys and not k.endswith("num_batches_tracked")]
    assert conv_keys
    # the convolutions train either way
    assert all(not torch.equal(before[k], after[k]) for k in conv_keys)
    assert all(probe.conv_training)
    if freeze_bn:
        for k in bn_keys:
            torch.testing.assert_close(after[k], before[k], rtol=0, atol=0, msg=k)
        assert not any(probe.bn_training)
    else:  # control: without the option the same run changes them
        assert all(not torch.equal(before[k], after[k]) for k in bn_keys)
        assert all(probe.bn_training)


def test_frozen_bn_parameters_are_not_optimised():
    model = _module(freeze_bn=True, head_norm="batch")
    groups = model.parameter_groups()
    grouped = {id(p) for g in groups for p in g["params"]}
    for bn in _bn_layers(model.backbone):
        assert id(bn.weight) not in grouped and not bn.weight.requires_grad
    # the head's own BatchNorm is new and trains
    assert model.head.norm.weight.requires_grad and id(model.head.norm.weight) in grouped


def test_eval_mode_still_switches_everything():
    model = _module(freeze_bn=True)
    model.eval()
    assert not any(m.training for m in model.modules())
    model.train()
    assert model.head.training and not any(bn.training for bn in _bn_layers(model.backbone))


# ----------------------------------------------------------------------------------------- backbone freeze
class _EpochSnapshots(pl.Callback):
    def __init__(self) -> None:
        self.backbone: list[dict[str, torch.Tensor]] = []
        self.head: list[dict[str, torch.Tensor]] = []

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.backbone.append(_snapshot(pl_module.backbone))
        self.head.append(_snapshot(pl_module.head))


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


def test_backbone_frozen_for_first_epochs_then_trains(device):
    model = _module(freeze_backbone_epochs=2, optimizer=partial(torch.optim.Adam, lr=0.01, weight_decay=0.01))
    initial_backbone, initial_head = _snapshot(model.backbone), _snapshot(model.head)
    snaps = _EpochSnapshots()
    _trainer(max_epochs=3, callbacks=[snaps], accelerator=_accelerator(device)).fit(model, train_dataloaders=_loader())
    assert len(snaps.backbone) == 3
    # epochs 0 and 1: weights, BN statistics and BN affine parameters unchanged; the head trains
    assert _changed(initial_backbone, snaps.backbone[0]) == []
    assert _changed(initial_backbone, snaps.backbone[1]) == []
    assert _changed(initial_head, snaps.head[0]) and _changed(snaps.head[0], snaps.head[1])
    # epoch 2: the backbone trains (weights and BN statistics)
    changed = _changed(snaps.backbone[1], snaps.backbone[2])
    assert any(k.endswith("running_mean") for k in changed)
    assert any(k.startswith("stages.0.0.0.weight") for k in changed)
    assert all(p.requires_grad for p in model.backbone.parameters())


def test_backbone_freeze_released_when_fit_ends_early():
    model = _module(freeze_backbone_epochs=5)
    _trainer(max_epochs=1).fit(model, train_dataloaders=_loader())
    assert all(p.requires_grad for p in model.backbone.parameters())
    model.train()
    assert model.backbone.training


def test_backbone_freeze_with_frozen_bn_keeps_bn_frozen_afterwards():
    model = _module(freeze_backbone_epochs=1, freeze_bn=True)
    _trainer(max_epochs=2).fit(model, train_dataloaders=_loader())
    for bn in _bn_layers(model.backbone):
        assert not bn.weight.requires_grad and not bn.training
    assert model.backbone.stages[0][0][0].weight.requires_grad


# ----------------------------------------------------------------------------------------- param groups
def test_parameter_groups_carry_the_multiplied_lr():
    model = _module(head_lr_multiplier=10.0, loss=RankedListLoss(),
                    optimizer=partial(torch.optim.SGD, lr=0.003, momentum=0.9, weight_decay=1e-4))
    optimizer = model.configure_optimizers()
    by_name = {g["name"]: g for g in optimizer.param_groups}
    assert by_name["backbone"]["lr"] == pytest.approx(0.003)
    assert by_name["head"]["lr"] == pytest.approx(0.03)
    assert all(g["momentum"] == 0.9 and g["weight_decay"] == 1e-4 for g in optimizer.param_groups)
    # every trainable parameter in exactly one group, each in the right one
    ids = [id(p) for g in optimizer.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == sum(1 for p in model.parameters() if p.requires_grad)
    assert {id(p) for p in model.head.parameters()} <= {id(p) for p in by_name["head"]["params"]}
    assert {id(p) for p in model.backbone.parameters()} == {id(p) for p in by_name["backbone"]["params"]}


@pytest.mark.parametrize("interval,expected_halvings", [("step", 6), ("epoch", 3)])
def test_iteration_and_epoch_schedules(interval, expected_halvings):
    # 3 epochs of 2 steps: a StepLR(1, 0.5) halves the lr per step or per epoch
    model = _module(
        head_lr_multiplier=10.0,
        optimizer=partial(torch.optim.SGD, lr=0.1),
        lr_scheduler=partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
        scheduler_interval=interval,
    )
    trainer = _trainer(max_epochs=3, limit_train_batches=2)
    trainer.fit(model, train_dataloaders=_loader())
    lrs = {g["name"]: g["lr"] for g in trainer.optimizers[0].param_groups}
    assert lrs["backbone"] == pytest.approx(0.1 * 0.5**expected_halvings)
    assert lrs["head"] == pytest.approx(1.0 * 0.5**expected_halvings)


def test_invalid_options():
    with pytest.raises(ValueError, match="fusion must be one of"):
        _module(fusion="sum")
    with pytest.raises(ValueError, match="freeze_backbone_epochs"):
        _module(freeze_backbone_epochs=-1)
    with pytest.raises(ValueError, match="no multi-level features"):
        bad = nn.Linear(3, 3)
        bad.out_features = 3
        _module(backbone=bad, fusion="concat")


def test_backbone_by_name():
    model = DMLModule(backbone=build_backbone("small_convnet"), embedding_dim=4)
    assert isinstance(model.backbone, SmallConvNet)
    assert model(torch.randn(2, 1, 16, 16)).shape == (2, 4)


# ----------------------------------------------------------------------------------------- fusion
def test_concat_fusion_forward_and_loss(device):
    model = _module(fusion="concat", embedding_dim=5).to(device)
    images, labels, _ = next(iter(_loader()))
    images, labels = images.to(device), labels.to(device)
    levels = model.embed_levels(images)
    assert [e.shape[1] for e in levels] == [5, 5, 5]
    fused = model(images)
    torch.testing.assert_close(fused, torch.cat(levels, 1))
    # levels from the backbone's pooled stage outputs, through each level's own linear map
    feats = model.backbone.forward_levels(images)
    for f, head, e in zip(feats, model.head.levels, levels):
        torch.testing.assert_close(e, head(f))
    torch.testing.assert_close(model.training_step((images, labels), 0), model.loss(fused, labels))


def test_per_level_fusion_sums_one_loss_per_level(device):
    model = _module(fusion="per_level", embedding_dim=5, normalize_levels=True, loss=RankedListLoss()).to(device)
    images, labels, _ = next(iter(_loader()))
    images, labels = images.to(device), labels.to(device)
    levels = model.embed_levels(images)
    for e in levels:
        torch.testing.assert_close(e.norm(dim=1), torch.ones(e.shape[0], device=device))
    expected = sum(RankedListLoss()(e, labels) for e in levels)
    torch.testing.assert_close(model.training_step((images, labels), 0), expected)
    # gradients reach every level's head
    model.training_step((images, labels), 0).backward()
    assert all(h.fc.weight.grad is not None and h.fc.weight.grad.abs().sum() > 0 for h in model.head.levels)
    # evaluation embeds the concatenation
    assert model(images).shape == (images.shape[0], 15)


def test_embed_levels_requires_fusion():
    with pytest.raises(ValueError, match="fusion"):
        _module().embed_levels(torch.randn(2, 3, 16, 16))


def test_state_dict_round_trip_keeps_options(device):
    model = _module(fusion="concat", freeze_bn=True)
    clone = _module(fusion="concat", freeze_bn=True).to(device)
    clone.load_state_dict(copy.deepcopy(model.state_dict()))  # CPU tensors into a module on `device`
    model.to(device)
    x = torch.randn(2, 3, 16, 16, device=device)
    model.eval(), clone.eval()
    torch.testing.assert_close(model(x), clone(x))


@pytest.mark.parametrize("precision", ["bf16-mixed", "32-true"])
def test_mixed_precision_and_gradient_clipping_train(precision, device):
    model = _module(fusion="concat", freeze_bn=True, optimizer=partial(torch.optim.AdamW, lr=0.01))
    before = _snapshot(model.head)
    trainer = _trainer(max_steps=2, precision=precision, gradient_clip_val=0.5, accelerator=_accelerator(device))
    trainer.fit(model, train_dataloaders=_loader())
    assert trainer.global_step == 2
    assert torch.isfinite(trainer.callback_metrics["train/loss"])
    assert _changed(before, _snapshot(model.head))


# ----------------------------------------------------------------------------------------- what a user sees
def test_fit_without_logger_shows_recall_and_map_at_r_on_the_progress_bar(capsys):
    model = _module(clustering=True)
    train = _loader()
    val = DataLoader(train.dataset, batch_size=12)  # (image, label, index) items in order
    trainer = _trainer(max_epochs=1, limit_val_batches=None, enable_progress_bar=True, logger=False)
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
    assert {"val/recall@1", "val/map@r"} <= set(trainer.progress_bar_metrics)
    # only those two: NMI, F1, Recall@2.. are logged but stay off the bar
    assert not {"val/nmi", "val/f1", "val/recall@2"} & set(trainer.progress_bar_metrics)
    assert {"val/nmi", "val/f1", "val/recall@2"} <= set(trainer.callback_metrics)
    shown = capsys.readouterr().out  # Lightning's TQDM bar writes to stdout
    for name in ("val/recall@1", "val/map@r"):
        printed = re.findall(rf"{re.escape(name)}=([0-9.e+-]+)", shown)
        assert printed, shown[-2000:]
        assert float(printed[-1]) == pytest.approx(float(trainer.progress_bar_metrics[name]), rel=1e-2)  # 3 digits


@pytest.mark.slow
def test_ddp_logging_is_global_without_sync_dist_warning(tmp_path):
    """2 gloo processes: no 'sync_dist=True' recommendation, the same logged values on both ranks."""
    script = Path(__file__).parent / "distributed" / "run_module_logging_ddp.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "MODULE-LOGGING-DDP-OK" in proc.stdout
