"""Partial FC / sharded proxies (issue 28 s.3; :mod:`lightning_dml.losses.partial_fc`).

* one process: ``sharded=True`` is the plain loss; ``sample_rate < 1`` is the plain loss over the sampled classes
  (positives kept, ``int(rate C)`` classes in all), unsampled weights get no gradient; the split rule; options
  validated by name.
* 2 and 3 gloo processes (tests/distributed/run_sharded_losses.py): values and gradients equal the unsharded loss of
  the global batch in fp64 to 1e-12 for the softmax family, ProxyNCA and Proxy-Anchor, with 7 classes and uneven
  batches; a checkpoint saved under 2 processes loads under 3 and under 1 with the same loss value; DMLModule's
  checkpoint hooks gather and split the centres' momentum; a step with the backbone in DistributedDataParallel and
  the loss outside equals one process's step.
* DMLModule: under DDP the sharded loss is held outside the module tree, options that cannot go with it are refused
  by name, and a 2-process Lightning fit (tests/distributed/run_sharded_fit_ddp.py) equals the unsharded fit.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dml.losses import LOSSES, partial_fc

SCRIPT = Path(__file__).resolve().parent / "distributed" / "run_sharded_losses.py"
SHARDED = ["normalized_softmax", "cosface", "arcface", "subcenter_arcface", "proxy_nca", "proxy_anchor"]
SAMPLED = ["normalized_softmax", "cosface", "arcface", "subcenter_arcface"]


def _batch(seed: int = 0, n: int = 12, d: int = 6):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, 4, (n,), generator=g)


def _value_and_grads(loss, x, y):
    x = x.clone().requires_grad_(True)
    value = loss(x, y)
    value.backward()
    return value.detach(), x.grad, loss.proxies.grad


@pytest.mark.parametrize("name", SHARDED)
def test_one_process_sharded_is_the_plain_loss(name):
    x, y = _batch()
    plain = LOSSES[name](num_classes=9, embedding_dim=6).double()
    sharded = LOSSES[name](num_classes=9, embedding_dim=6, sharded=True).double()
    sharded.load_state_dict(plain.state_dict())
    assert (sharded.shard_world, sharded.shard_start, sharded.shard_stop) == (1, 0, 9)
    for got, want in zip(_value_and_grads(sharded, x, y), _value_and_grads(plain, x, y)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("name", SAMPLED)
def test_sampling_is_the_plain_loss_over_the_sampled_classes(name, monkeypatch):
    """The estimator of Partial FC's sampling: the softmax over the positives and the drawn negatives only."""
    x, y = _batch(1)
    num_classes, rate = 20, 0.3
    loss = LOSSES[name](num_classes=num_classes, embedding_dim=6, sharded=True, sample_rate=rate).double()
    kept_log: list[torch.Tensor] = []
    real = partial_fc.sample_classes
    monkeypatch.setattr(partial_fc, "sample_classes", lambda *a: kept_log.append(real(*a)) or kept_log[-1])
    got, got_x, got_p = _value_and_grads(loss, x, y)
    (kept,) = kept_log
    assert set(y.tolist()) <= set(kept.tolist()) and len(kept) == int(rate * num_classes)  # 4 positives < 6
    assert torch.equal(kept, kept.sort().values)
    k = loss.proxies_per_class
    rows = (kept[:, None] * k + torch.arange(k)).reshape(-1)
    sub = LOSSES[name](num_classes=len(kept), embedding_dim=6).double()
    sub.load_state_dict({"proxies": loss.proxies.detach()[rows].clone()})
    want, want_x, want_p = _value_and_grads(sub, x, torch.searchsorted(kept, y))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_x, want_x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_p[rows], want_p, rtol=1e-12, atol=1e-12)
    others = torch.ones(num_classes * k, dtype=torch.bool)
    others[rows] = False
    assert torch.count_nonzero(got_p[others]) == 0  # unsampled centres are not updated this step


def test_sampling_keeps_every_positive_when_they_exceed_the_rate():
    positive = torch.tensor([3, 0, 7, 3, 9])
    torch.testing.assert_close(partial_fc.sample_classes(positive, 10, 0.2), torch.tensor([0, 3, 7, 9]))
    drawn = partial_fc.sample_classes(positive, 10, 0.8)
    assert len(drawn) == 8 and {0, 3, 7, 9} <= set(drawn.tolist())


def test_sampling_draws_differently_between_steps():
    draws = {tuple(partial_fc.sample_classes(torch.tensor([0]), 50, 0.1).tolist()) for _ in range(5)}
    assert len(draws) > 1 and all(d[0] == 0 for d in draws)


@pytest.mark.parametrize("num_classes", [2, 7, 9, 10, 1000003])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_split_rule_covers_every_class_once_balanced(num_classes, world):
    if num_classes < world:
        with pytest.raises(ValueError, match="num_classes >= the number of processes"):
            partial_fc.shard_range(num_classes, world, 0)
        return
    ranges = [partial_fc.shard_range(num_classes, world, r) for r in range(world)]
    assert ranges[0][0] == 0 and ranges[-1][1] == num_classes
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [stop - start for start, stop in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize(
    "name, kwargs, match",
    [
        ("arcface", {"sample_rate": 0.5}, "needs sharded=True"),
        ("arcface", {"sharded": True, "sample_rate": 0.0}, r"sample_rate must be a number in \(0, 1\]"),
        ("cosface", {"sharded": True, "sample_rate": 1.5}, r"sample_rate must be a number in \(0, 1\]"),
        ("normalized_softmax", {"sharded": "yes"}, "sharded must be true or false"),
    ],
)
def test_bad_options_are_named(name, kwargs, match):
    with pytest.raises(ValueError, match=match):
        LOSSES[name](num_classes=4, embedding_dim=3, **kwargs)


@pytest.mark.parametrize("name", ["proxy_anchor", "proxy_nca"])
def test_sampling_is_refused_where_it_is_not_defined(name):
    with pytest.raises(TypeError):
        LOSSES[name](num_classes=4, embedding_dim=3, sharded=True, sample_rate=0.5)


@pytest.mark.slow  # two launches of 2 and 3 processes (~15 s of process start-up on a quiet 2-core machine)
@pytest.mark.skipif(sys.platform == "win32", reason="gloo")
def test_sharded_losses_under_2_and_3_processes_equal_one_process_and_resume_at_any_world(tmp_path):
    from tests.distributed.test_distributed_callbacks import _env

    checkpoint = tmp_path / "sharded.pt"
    for world, phase in ((2, "save"), (3, "load")):
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), str(world), str(checkpoint), phase],
            capture_output=True, text=True, timeout=300, env=_env(),
        )
        assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-5000:]
        assert f"SHARDED-OK world={world}" in proc.stdout
    # ... and under one process, sharded or not: the value the 2-process run saved
    from tests.distributed.run_sharded_losses import build, data

    saved = torch.load(checkpoint, weights_only=True)
    x, y = data()
    for sharded in (True, False):
        loss = build("arcface", {}, sharded)
        loss.load_state_dict(saved["state_dict"])
        torch.testing.assert_close(loss(x, y), saved["value"], rtol=1e-12, atol=0)


def _setup_under(world: int, monkeypatch, loss: str = "arcface", **options):
    """``DMLModule.setup("fit")`` with a sharded proxy loss and a trainer that reports ``world`` processes."""
    import pytorch_lightning as pl

    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule

    model = DMLModule(
        SmallConvNet(in_channels=1, width=4), loss=LOSSES[loss](num_classes=4, embedding_dim=8, sharded=True),
        embedding_dim=8, clustering=False, **options,
    )
    model.trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False)
    monkeypatch.setattr(pl.Trainer, "world_size", property(lambda self: world))
    model.setup("fit")
    return model


def test_dml_module_holds_a_sharded_loss_outside_ddp(monkeypatch):
    """Under DDP (a trainer that reports 2 processes) the sharded loss leaves the module's tree (Lightning's DDP
    wrapper would broadcast and average the shards) and its shard stays in the optimizer's loss group; on one
    process it stays a submodule."""
    one = _setup_under(1, monkeypatch)
    assert "loss.proxies" in dict(one.named_parameters())
    two = _setup_under(2, monkeypatch)
    assert not any(name.startswith("loss.") for name, _ in two.named_parameters())
    (group,) = [g for g in two.parameter_groups() if g["name"] == "loss"]
    assert group["params"] == [two.loss.proxies]


@pytest.mark.parametrize(
    "loss, options, match",
    [
        ("proxy_anchor", {"gather_distributed": True}, "gather_distributed=True"),
        ("arcface", {"embedding_chunk_size": 4}, "embedding_chunk_size"),
    ],
)
def test_dml_module_refuses_options_that_cannot_go_with_shards(monkeypatch, loss, options, match):
    _setup_under(1, monkeypatch, loss, **options)  # one process: the plain loss, every option passes
    with pytest.raises(ValueError, match=rf"Loss\(sharded=True\) under DDP \(2 processes\).*{match}"):
        _setup_under(2, monkeypatch, loss, **options)


@pytest.mark.slow  # two 2-process Lightning fits (~10 s of process start-up on a quiet 2-core machine)
@pytest.mark.skipif(sys.platform == "win32", reason="gloo")
def test_lightning_ddp_fit_with_sharded_loss_equals_unsharded_and_resumes_on_one_process(tmp_path):
    """tests/distributed/run_sharded_fit_ddp.py: 3 fp64 SGD-momentum steps under Lightning's DDP with the sharded
    ArcFace end with the unsharded fit's weights, centres and centre momentum (1e-9); its checkpoint then resumes
    into one process with the unsharded run's centres and momentum."""
    from tests.distributed.run_sharded_fit_ddp import fit_setup
    from tests.distributed.test_distributed_callbacks import _env

    script = Path(__file__).resolve().parent / "distributed" / "run_sharded_fit_ddp.py"
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=tmp_path, env=_env(PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0 and "SHARDED-FIT-DDP-OK" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-5000:]
    plain = torch.load(tmp_path / "plain.pt")
    # one process restores it as Lightning does (on_load_checkpoint, the state dict, the optimizer's state); the P x K
    # sampler's own state refuses another number of processes, so no Trainer(ckpt_path=...) here
    checkpoint = torch.load(tmp_path / "sharded.ckpt", weights_only=False)
    model, _, _ = fit_setup(sharded=True)
    model.double()  # the run's precision="64-true"
    model.on_load_checkpoint(checkpoint)
    model.load_state_dict(checkpoint["state_dict"])
    optimizer = torch.optim.SGD(model.parameter_groups(), lr=0.05, momentum=0.9)
    optimizer.load_state_dict(checkpoint["optimizer_states"][0])
    assert model.loss.proxies.shape[0] == 6
    torch.testing.assert_close(model.loss.proxies.detach(), plain["centres"], rtol=1e-9, atol=1e-12)
    momentum = optimizer.state[model.loss.proxies]["momentum_buffer"]
    torch.testing.assert_close(momentum, plain["momentum"], rtol=1e-9, atol=1e-12)
