"""Fault tolerance: a run killed after a mid-epoch checkpoint and resumed with ``--ckpt_path last`` ends exactly as
an uninterrupted run with the same seed (model, optimizer, step-wise scheduler, sampler position, epoch seed and
the backbone-freeze schedule).

The end-to-end test runs the real ``lightning-dml fit`` in subprocesses (tests/scripts/resume_run.py) on the Glyphs
data: one uninterrupted run, and one that blocks just after its step-8 checkpoint (epoch 1, batch 2 of 6) and is
killed there with SIGKILL, then resumed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning_fabric.utilities.data import _set_sampler_epoch

from lightning_dml.data.resumable import ResumableDataLoader
from lightning_dml.data.samplers import BalancedClassSampler
from tests import glyph_cache

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tests" / "scripts" / "resume_run.py"
STEPS_PER_EPOCH = 6
KILL_AFTER_STEP = 8  # epoch 1, after its 2nd batch: a mid-epoch checkpoint (every 4 steps)
ARGS = [
    "--seed_everything=0",
    "--trainer.accelerator=cpu",
    "--trainer.devices=1",
    "--trainer.max_epochs=3",
    f"--trainer.limit_train_batches={STEPS_PER_EPOCH}",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--trainer.enable_model_summary=false",
    "--model.backbone=lightning_dml.models.SmallConvNet",
    "--model.backbone.init_args.width=8",
    "--model.embedding_dim=16",
    "--model.clustering=false",
    "--model.optimizer=torch.optim.Adam",
    "--model.optimizer.init_args.lr=0.003",
    # a per-step schedule: a wrongly restored scheduler changes every later step
    "--model.lr_scheduler=torch.optim.lr_scheduler.CosineAnnealingLR",
    "--model.lr_scheduler.init_args.T_max=24",
    "--model.scheduler_interval=step",
    "--data=lightning_dml.data.GlyphsDataModule",
    "--data.init_args.image_size=16",
    "--data.init_args.classes_per_batch=8",
    "--periodic_checkpoint.every_n_train_steps=4",
    # backbone frozen in epochs 0 and 1: the kill falls inside the frozen phase, the last epoch trains it
    "--model.freeze_backbone_epochs=2",
]


# ---------------------------------------------------------------------------------------------- unit level
def _loader(seed: int = 0) -> ResumableDataLoader:
    labels = torch.arange(120) % 12
    sampler = BalancedClassSampler(labels, classes_per_batch=4, samples_per_class=3, seed=seed)
    return ResumableDataLoader(torch.arange(120), batch_sampler=sampler)


def test_lightning_sets_the_epoch_of_the_batch_sampler():
    loader = _loader()
    _set_sampler_epoch(loader, 5)  # what Lightning's fit loop calls at every epoch start
    assert loader.batch_sampler.epoch == 5
    first = [b.tolist() for b in loader]
    _set_sampler_epoch(loader, 6)
    assert [b.tolist() for b in loader] != first


def test_loader_state_continues_the_epoch_where_it_stopped():
    full = _loader()
    full.batch_sampler.set_epoch(3)
    expected = [b.tolist() for b in full]
    assert len(expected) == 10

    interrupted = _loader()
    interrupted.batch_sampler.set_epoch(3)
    iterator = iter(interrupted)
    seen = [next(iterator).tolist() for _ in range(4)]
    torch.manual_seed(123)
    state = interrupted.state_dict()
    after_state = torch.rand(3)  # what the interrupted run would have drawn next
    assert state["batch_sampler"]["position"] == 4 and state["batch_sampler"]["epoch"] == 3

    resumed = _loader()
    resumed.load_state_dict(state)
    resumed.batch_sampler.set_epoch(3)  # Lightning sets the (same) epoch again after loading
    torch.manual_seed(999)  # the resumed process's generator starts elsewhere...
    rest = [b.tolist() for b in resumed]
    assert seen + rest == expected
    # ...and is restored to the checkpoint's state once the epoch iterator exists
    resumed2 = _loader()
    resumed2.load_state_dict(state)
    iter(resumed2)
    assert torch.equal(torch.rand(3), after_state)
    # a following epoch is complete again
    resumed.batch_sampler.set_epoch(4)
    assert len(list(resumed)) == 10


def test_loader_state_is_loadable_with_weights_only(tmp_path):
    loader = _loader()
    np.random.seed(3)
    next(iter(loader))
    torch.save({"state": loader.state_dict()}, tmp_path / "s.pt")
    state = torch.load(tmp_path / "s.pt", weights_only=True)["state"]
    other = _loader()
    other.load_state_dict(state)
    iter(other)
    np.random.seed(3)  # the same numpy state as at save time
    expected = np.random.rand()
    np.random.seed(0)
    other.load_state_dict(state)
    iter(other)
    assert np.random.rand() == expected


def test_loader_rejects_a_sampler_without_state():
    with pytest.raises(ValueError, match="state_dict"):
        ResumableDataLoader(torch.arange(10), batch_sampler=[[0, 1], [2, 3]])


# ---------------------------------------------------------------------------------------------- end to end
def _env(cache: Path) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", glyph_cache.ENV: str(cache)}


@pytest.fixture(scope="session")
def glyph_renders(tmp_path_factory) -> Path:
    """The fonts rendered once per session, shared with the subprocesses."""
    path = tmp_path_factory.getbasetemp() / glyph_cache.FILENAME
    glyph_cache.install(path)
    return path


@pytest.mark.slow
def test_killed_run_resumes_to_identical_metrics(tmp_path, glyph_renders):
    cache = glyph_renders

    marker = tmp_path / "blocked"
    killed_dir, full_dir = tmp_path / "killed", tmp_path / "full"
    killed = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path / "never.json"), "--block-at-step", str(KILL_AFTER_STEP),
         str(marker), "--", *ARGS, f"--trainer.default_root_dir={killed_dir}"],
        cwd=tmp_path, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        # the uninterrupted reference runs meanwhile
        full = subprocess.run(
            [sys.executable, str(SCRIPT), str(tmp_path / "full.json"), "--", *ARGS,
             f"--trainer.default_root_dir={full_dir}"],
            cwd=tmp_path, env=_env(cache), capture_output=True, text=True, timeout=300,
        )
        assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-3000:]
        deadline = time.monotonic() + 240
        while not marker.exists():
            assert killed.poll() is None, killed.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "the run to kill never reached its checkpoint"
            time.sleep(0.5)
        os.kill(killed.pid, signal.SIGKILL)  # a real, unannounced kill
        killed.wait(timeout=30)
    finally:
        if killed.poll() is None:
            killed.kill()
    assert killed.returncode == -signal.SIGKILL
    assert not (tmp_path / "never.json").exists()

    # The newest checkpoint is the mid-epoch one: epoch 1, 2 of its 6 batches consumed.
    ckpt = torch.load(killed_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == KILL_AFTER_STEP and ckpt["epoch"] == 1
    loader_state = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["batch_sampler"]
    assert loader_state["epoch"] == 1 and loader_state["position"] == KILL_AFTER_STEP - STEPS_PER_EPOCH

    resumed = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "resumed.json"), "--", *ARGS,
         f"--trainer.default_root_dir={killed_dir}", "--ckpt_path=last"],
        cwd=tmp_path, env=_env(cache), capture_output=True, text=True, timeout=300,
    )
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert "dataloader is not resumable" not in resumed.stderr

    a = json.loads((tmp_path / "full.json").read_text())
    b = json.loads((tmp_path / "resumed.json").read_text())
    assert b["global_step"] == a["global_step"] == 3 * STEPS_PER_EPOCH
    assert b["lrs"] == a["lrs"]
    assert b["digest"] == a["digest"], "parameters and buffers differ after resuming"
    assert set(a["metrics"]) >= {"val/recall@1", "val/map@r", "train/loss"}
    assert b["metrics"] == a["metrics"]  # bit-identical floats
