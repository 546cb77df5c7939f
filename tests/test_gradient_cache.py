"""Gradient caching (``DMLModule(embedding_chunk_size=N)``, :mod:`lightning_dml.gradient_cache`): one training step
with chunks equals the unchunked step (loss and every parameter's gradient), dropout / drop-path draws are replayed,
BatchNorm running statistics are updated once per chunk (not again in the replay), and a fit ends with the same
weights. The DDP cases (2 gloo processes, ``gather_distributed``) run tests/distributed/run_gradient_cache_ddp.py (one
step against the global batch) and run_gradient_cache_fit_ddp.py (a fit under Lightning's DDP strategy).
"""

from __future__ import annotations

import subprocess
import sys
import warnings
from functools import partial
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_dml import gradient_cache
from lightning_dml.data import BalancedClassSampler, TensorImageDataset
from lightning_dml.losses import build_loss
from lightning_dml.models import SmallConvNet, TimmBackbone
from lightning_dml.module import DMLModule
from tests.distributed.test_distributed_callbacks import _env  # the subprocess environment (no launcher variables)

P, K = 4, 2  # 8 images per batch, chunks of 3: 3 + 3 + 2 (a ragged last chunk)
CHUNK = 3
LOSSES = ["multi_similarity", "supcon", "ntxent", "contrastive", "triplet", "proxy_anchor", "arcface"]
#: fp32: the chunked and the unchunked step run the same operations on row blocks of other sizes, so their
#: matrix products (and the weight gradients summed over chunks) round differently (~1e-7 relative per product);
#: measured worst relative gradient difference over the 7 losses x 2 models of the fp64 test run in fp32: 5.7e-6
#: (triplet, small CNN; the loss values were equal); stated bound, with a margin of ~17:
FP32_RTOL = 1e-4


def _vit(drop_path_rate: float = 0.0) -> TimmBackbone:
    return TimmBackbone(
        "vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2, embed_dim=24, num_heads=2,
        drop_path_rate=drop_path_rate,
    )


def _cnn() -> SmallConvNet:
    return SmallConvNet(in_channels=3, width=4)


def _module(backbone: nn.Module, loss: str, dtype: torch.dtype, chunk: int | None, **kwargs) -> DMLModule:
    """``backbone`` is a factory, called after seeding: every module of a test starts from the same weights."""
    torch.manual_seed(0)
    backbone = backbone()
    loss_module = build_loss(loss, num_classes=P, embedding_dim=8) if loss in ("proxy_anchor", "arcface") else (
        build_loss(loss)
    )
    module = DMLModule(backbone, loss=loss_module, embedding_dim=8, clustering=False, embedding_chunk_size=chunk,
                       **kwargs)
    return module.to(dtype).train()


def _batch(dtype: torch.dtype, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(P * K, 3, 32, 32, generator=g, dtype=dtype)
    return images, torch.arange(P).repeat_interleave(K)


def _step(module: DMLModule, images: torch.Tensor, labels: torch.Tensor, seed: int = 7) -> tuple:
    """Loss and every parameter's gradient of one ``training_step`` (no trainer: logging is a no-op)."""
    module.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = module.training_step((images, labels), 1)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_same(a: tuple, b: tuple, rtol: float) -> None:
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert grads_a.keys() == grads_b.keys() and grads_a
    torch.testing.assert_close(loss_a, loss_b, rtol=rtol, atol=0)
    for name in grads_a:
        scale = grads_b[name].abs().max().clamp_min(1e-30)
        err = (grads_a[name] - grads_b[name]).abs().max() / scale
        assert err <= rtol, f"{name}: relative difference {float(err):.3g} > {rtol}"


@pytest.fixture(autouse=True)
def _quiet(monkeypatch):
    monkeypatch.setattr(pl.LightningModule, "log", lambda *args, **kwargs: None)


@pytest.mark.parametrize("loss", LOSSES)
@pytest.mark.parametrize("arch", ["vit", "cnn_frozen_bn"])
def test_chunked_step_equals_unchunked_step_fp64(arch, loss):
    backbone, kwargs = (_vit, {}) if arch == "vit" else (_cnn, {"freeze_bn": True})
    images, labels = _batch(torch.float64)
    reference = _step(_module(backbone, loss, torch.float64, None, **kwargs), images, labels)
    chunked = _step(_module(backbone, loss, torch.float64, CHUNK, **kwargs), images, labels)
    _assert_same(chunked, reference, rtol=1e-12)


@pytest.mark.parametrize("loss", ["multi_similarity", "arcface"])
def test_chunked_step_equals_unchunked_step_fp32(loss):
    images, labels = _batch(torch.float32)
    reference = _step(_module(_vit, loss, torch.float32, None), images, labels)
    chunked = _step(_module(_vit, loss, torch.float32, CHUNK), images, labels)
    _assert_same(chunked, reference, rtol=FP32_RTOL)


def _chunks_with_graph(module: DMLModule, monkeypatch) -> None:
    """The reference of a step with random layers: the unchunked step (one graph, one backward) whose embeddings
    are computed chunk after chunk, so that it draws the same dropout / drop-path masks as the chunked first pass."""
    monkeypatch.setattr(
        module, "_training_embeddings", lambda embed, images: torch.cat([embed(c) for c in images.split(CHUNK)])
    )


@pytest.mark.parametrize("loss", ["multi_similarity", "supcon", "proxy_anchor"])
def test_drop_path_draws_are_replayed(loss, monkeypatch):
    images, labels = _batch(torch.float64)
    reference_module = _module(partial(_vit, drop_path_rate=0.5), loss, torch.float64, None)
    _chunks_with_graph(reference_module, monkeypatch)
    reference = _step(reference_module, images, labels)
    chunked = _step(_module(partial(_vit, drop_path_rate=0.5), loss, torch.float64, CHUNK), images, labels)
    _assert_same(chunked, reference, rtol=1e-12)
    # control: without the replay the second pass draws other masks and the gradients differ
    monkeypatch.setattr(
        gradient_cache, "checkpoint",
        partial(lambda *a, _ckpt=gradient_cache.checkpoint, **k: _ckpt(*a, **{**k, "preserve_rng_state": False})),
    )
    unreplayed = _step(_module(partial(_vit, drop_path_rate=0.5), loss, torch.float64, CHUNK), images, labels)
    with pytest.raises(AssertionError):
        _assert_same(unreplayed, reference, rtol=1e-6)


def test_autocast_is_replayed():
    """Under bf16 autocast (CPU; a precision plugin's context) the second pass runs in bf16 as the first did: the
    chunked step equals the step that embeds the same chunks with their graphs."""
    images, labels = _batch(torch.float32)

    def step(chunk_in_graph: bool) -> tuple:
        module = _module(_vit, "multi_similarity", torch.float32, None if chunk_in_graph else CHUNK)
        if chunk_in_graph:
            module._training_embeddings = lambda embed, x: torch.cat([embed(c) for c in x.split(CHUNK)])
        module.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = module.training_step((images, labels), 1)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}

    _assert_same(step(False), step(True), rtol=1e-6)


def test_fusion_per_level_chunks_every_level():
    images, labels = _batch(torch.float64)
    make = partial(_module, loss="multi_similarity", dtype=torch.float64, freeze_bn=True, fusion="per_level")
    _assert_same(_step(make(_cnn, chunk=CHUNK), images, labels), _step(make(_cnn, chunk=None), images, labels),
                 rtol=1e-12)


def test_batch_norm_running_statistics_updated_once_per_chunk(monkeypatch):
    """BatchNorm that trains: the running statistics move once per chunk (as the first pass saw the chunks), not a
    second time in the replay; ``num_batches_tracked`` counts the chunks."""
    images, labels = _batch(torch.float64)
    reference = _module(_cnn, "multi_similarity", torch.float64, None)
    _chunks_with_graph(reference, monkeypatch)
    _step(reference, images, labels)
    chunked = _module(_cnn, "multi_similarity", torch.float64, CHUNK)
    _step(chunked, images, labels)
    buffers = dict(reference.named_buffers())
    for name, value in chunked.named_buffers():
        torch.testing.assert_close(value, buffers[name], rtol=1e-12, atol=0, msg=name)
    tracked = [b for n, b in chunked.named_buffers() if n.endswith("num_batches_tracked")]
    assert tracked and all(int(b) == 3 for b in tracked)  # 8 images in chunks of 3: three chunks


def test_whole_batch_or_no_grad_is_not_chunked():
    calls = []

    def embed(x):
        calls.append(x.shape[0])
        return x.flatten(1)

    x = torch.randn(5, 2)
    gradient_cache.chunked_embeddings(embed, x, 5, nn.Identity())
    with torch.no_grad():
        gradient_cache.chunked_embeddings(embed, x, 2, nn.Identity())
    assert calls == [5, 5]


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "8"])
def test_invalid_chunk_size(bad):
    with pytest.raises(ValueError, match="embedding_chunk_size must be a positive integer"):
        DMLModule(_cnn(), embedding_chunk_size=bad)


def _loader(dtype: torch.dtype) -> DataLoader:
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (6 * 20, 3, 16, 16), dtype=torch.uint8, generator=g)  # 10 batches an epoch
    dataset = TensorImageDataset(images, torch.arange(6).repeat_interleave(20), mean=0.5, std=0.25)
    return DataLoader(dataset, batch_sampler=BalancedClassSampler(dataset.labels, 4, 3, seed=0))


def _fit(chunk: int | None, freeze_bn: bool = True, steps: int = 20, accumulate: int = 1) -> DMLModule:
    torch.manual_seed(0)
    module = DMLModule(
        _cnn(), loss="multi_similarity", embedding_dim=8, clustering=False, freeze_bn=freeze_bn,
        optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9), embedding_chunk_size=chunk,
        lr_scheduler=partial(torch.optim.lr_scheduler.StepLR, step_size=5, gamma=0.5), scheduler_interval="step",
    )
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=steps, precision="64-true", gradient_clip_val=1.0,
        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
    )
    trainer.fit(module, train_dataloaders=_loader(torch.float64))
    return module


@pytest.mark.slow
def test_twenty_step_fit_ends_with_the_same_weights(monkeypatch):
    """20 optimizer steps (gradient clipping, a per-step schedule) in fp64: every weight equal to 1e-9 relative.
    Each step's gradients agree to ~1e-15 relative; SGD with momentum and clipping is Lipschitz in the gradients,
    so 20 steps grow that by a bounded factor, far below 1e-9 (a real difference, such as chunk statistics of
    BatchNorm or other dropout masks, moves the weights by far more than 1e-9)."""
    monkeypatch.undo()  # real logging
    plain, chunked = _fit(None), _fit(5)
    assert plain.global_step == chunked.global_step == 20
    start = DMLModule(_cnn(), embedding_dim=8).state_dict()  # init is seeded: the weights must have moved
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(chunked.state_dict()[name], value, rtol=1e-9, atol=1e-12, msg=name)
    moved = [n for n, v in plain.state_dict().items() if n in start and not torch.equal(v.to(start[n]), start[n])]
    assert moved


def test_fit_warns_when_batch_norm_trains(monkeypatch):
    monkeypatch.undo()
    with pytest.warns(UserWarning, match="embedding_chunk_size=5 with 4 BatchNorm"):  # SmallConvNet's 4 blocks
        _fit(5, freeze_bn=False, steps=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(5, freeze_bn=True, steps=1)
    assert not [w for w in caught if "BatchNorm layer" in str(w.message)]


@pytest.mark.skipif(sys.platform == "win32", reason="gloo")
def test_ddp_gather_distributed_chunked_equals_global_unchunked_step():
    """2 gloo processes (tests/distributed/run_gradient_cache_ddp.py): MS, SupCon, NT-Xent, contrastive, triplet,
    Proxy-Anchor with gather_distributed and ArcFace with plain DDP, chunked, equal one process holding the global
    batch unchunked; DDP all-reduces once per bucket per step, as unchunked."""
    script = Path(__file__).resolve().parent / "distributed" / "run_gradient_cache_ddp.py"
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "GRADIENT-CACHE-DDP-OK" in proc.stdout


def test_first_pass_keeps_no_activations_and_backward_replays_one_chunk_at_a_time():
    """Memory: the first pass keeps the chunks' inputs and, besides them, what the loss saves for its backward (a
    small part of the unchunked step's activations); in the backward each chunk's second pass is followed by its
    backward before the next chunk's
    second pass starts (so one chunk's activations are live at a time)."""
    images, labels = _batch(torch.float64)

    def saved_bytes(chunk: int | None) -> int:
        module = _module(_vit, "multi_similarity", torch.float64, chunk)
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            module.training_step((images, labels), 1)
        return total[0]

    image_bytes = images.numel() * images.element_size()  # the chunks' inputs: kept for their second pass
    assert (saved_bytes(CHUNK) - image_bytes) * 100 < saved_bytes(None) - image_bytes
    module = _module(_vit, "multi_similarity", torch.float64, CHUNK)
    block = module.backbone.model.blocks[0]
    events: list[str] = []
    block.register_forward_pre_hook(lambda m, args: events.append("forward"))
    block.register_full_backward_hook(lambda m, gin, gout: events.append("backward"))
    loss = module.training_step((images, labels), 1)
    assert events == ["forward"] * 3
    events.clear()
    loss.backward()
    assert events == ["forward", "backward"] * 3


def test_supcon_4096_vit_config_builds(tmp_path, monkeypatch):
    """configs/sop_supcon_vit_4096.yaml: a 4096-image SupCon batch (P x K) on a ViT with both memory options."""
    from lightning_dml.cli import build_cli
    from tests.fixtures_data import make_sop

    make_sop(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dml"])
    config = Path(__file__).resolve().parents[1] / "configs" / "sop_supcon_vit_4096.yaml"
    cli = build_cli(["--config", str(config), "--data.init_args.root", str(tmp_path),
                     "--model.backbone.init_args.pretrained", "false", "--trainer.logger", "false"], run=False)
    assert cli.model.embedding_chunk_size == 128 and cli.model.loss.anchor_chunk_size == 512
    assert type(cli.model.loss).__name__ == "SupConLoss"
    assert cli.datamodule.classes_per_batch * cli.datamodule.samples_per_class == 4096


def test_resume_with_another_chunk_size(tmp_path, monkeypatch):
    """embedding_chunk_size changes how a step is computed, not what: a checkpoint of an unchunked run resumes with
    chunks (its other hyper-parameters are still compared) and continues from the restored step."""
    from lightning_dml.checkpoints import CheckpointMismatchError

    monkeypatch.undo()
    plain = _fit(None, steps=2, accumulate=2)
    path = tmp_path / "run.ckpt"
    plain.trainer.save_checkpoint(path)

    def resume(**kwargs) -> pl.Trainer:
        torch.manual_seed(0)
        module = DMLModule(_cnn(), loss="multi_similarity", embedding_dim=8, clustering=False, freeze_bn=True,
                           optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9),
                           lr_scheduler=partial(torch.optim.lr_scheduler.StepLR, step_size=5, gamma=0.5),
                           scheduler_interval="step", **kwargs)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, precision="64-true", gradient_clip_val=1.0,
                             accumulate_grad_batches=2, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        trainer.fit(module, train_dataloaders=_loader(torch.float64), ckpt_path=path)
        return trainer

    assert resume(embedding_chunk_size=4).global_step == 3
    with pytest.raises(CheckpointMismatchError, match="head_lr_multiplier"):  # other settings still compared
        resume(embedding_chunk_size=4, head_lr_multiplier=2.0)


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="gloo")
def test_lightning_ddp_fit_with_chunks_ends_with_the_same_weights(tmp_path):
    """Lightning's own DDP strategy (2 gloo processes, gather_distributed, gradient accumulation 2, fp64): 4 optimizer
    steps with chunks of 4 of each process's 6 images end with the weights of the unchunked fit (1e-9 relative)."""
    script = Path(__file__).resolve().parent / "distributed" / "run_gradient_cache_fit_ddp.py"
    weights = {}
    for chunk in ("none", "4"):
        out = tmp_path / f"{chunk}.pt"
        args = [sys.executable, str(script), str(out)] + ([] if chunk == "none" else [chunk])
        proc = subprocess.run(args, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                              env=_env(PYTHONWARNINGS="ignore"))
        output = proc.stdout[-3000:] + proc.stderr[-3000:]
        assert proc.returncode == 0 and "GRADIENT-CACHE-FIT-DDP-OK" in proc.stdout, output
        weights[chunk] = torch.load(out)
    assert weights["none"].keys() == weights["4"].keys()
    for name, value in weights["none"].items():
        torch.testing.assert_close(weights["4"][name], value, rtol=1e-9, atol=1e-12, msg=name)
