"""Fault tolerance: a run killed after a mid-epoch checkpoint and resumed with ``--ckpt_path last`` ends exactly as
an uninterrupted run with the same seed (model, optimizer, step-wise scheduler, sampler position, epoch seed and
the backbone-freeze schedule).

The end-to-end test runs the real ``lightning-dml fit`` in subprocesses (tests/scripts/resume_run.py): one
uninterrupted run, and one that blocks just after its step-8 checkpoint (epoch 1, batch 2 of 6) and is killed there
with SIGKILL, then resumed. Twice: on the Glyphs data in the main process (``num_workers=0``), and on an image
folder of noise images with random resized crops and flips loaded by two worker processes (``num_workers=2``),
where every batch's augmentation must be redrawn identically by the resumed run's new workers.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from lightning_fabric.utilities.data import _set_sampler_epoch
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from lightning_dml.data.resumable import ResumableDataLoader, seeded_generators
from lightning_dml.data.samplers import BalancedClassSampler, SeededBatch, batch_seed
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
    "--periodic_checkpoint.every_n_train_steps=4",
    # backbone frozen in epochs 0 and 1: the kill falls inside the frozen phase, the last epoch trains it
    "--model.freeze_backbone_epochs=2",
]
GLYPHS = ["--data=lightning_dml.data.GlyphsDataModule", "--data.init_args.image_size=16",
          "--data.init_args.classes_per_batch=8"]


def noise_image_folder(root: Path, train_classes: int = 8, test_classes: int = 4, per_class: int = 12) -> Path:
    """``root/train/<class>/*.png`` + ``root/test/<class>/*.png``: 24 x 20 RGB noise around a class colour, so that
    every random crop and flip changes the pixels (flat-colour images would hide the augmentation)."""
    rng = np.random.default_rng(0)
    for split, count in (("train", train_classes), ("test", test_classes)):
        for c in range(count):
            base = rng.integers(0, 256, size=3)
            folder = root / split / f"{split}_{c}"
            folder.mkdir(parents=True)
            for k in range(per_class if split == "train" else per_class // 2):
                pixels = np.clip(base + rng.normal(0, 60, size=(20, 24, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(folder / f"{k}.png")
    return root


def noise_folder_args(root: Path, num_workers: int) -> list[str]:
    """CLI arguments training the RGB SmallConvNet on :func:`noise_image_folder` ``root`` with ``num_workers``."""
    return [
        "--model.backbone.init_args.in_channels=3",
        "--data=lightning_dml.data.ImageFolderDataModule",
        f"--data.init_args.root={root}",
        "--data.init_args.image_size=16",
        "--data.init_args.classes_per_batch=4",
        "--data.init_args.samples_per_class=4",  # 96 training images: 6 batches of 16
        "--data.init_args.eval_batch_size=8",
        f"--data.init_args.num_workers={num_workers}",
        "--data.init_args.check_counts=false",
    ]


def _data_args(num_workers: int, tmp_path: Path) -> list[str]:
    return GLYPHS if num_workers == 0 else noise_folder_args(noise_image_folder(tmp_path / "images"), num_workers)


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


# ---------------------------------------------------------------------------------------------- augmentation
class RandomItems(Dataset):
    """Items ``(index, torch draw, NumPy draw, random draw)``: what a random augmentation would draw."""

    def __len__(self) -> int:
        return 120

    def __getitem__(self, index: int) -> tuple[int, float, float, float]:
        return int(index), float(torch.rand(())), float(np.random.rand()), random.random()


def _random_loader(num_workers: int, loader_class: type = ResumableDataLoader) -> DataLoader:
    labels = torch.arange(120) % 12
    sampler = BalancedClassSampler(labels, classes_per_batch=4, samples_per_class=3, seed=0, augmentation_seed=7)
    return loader_class(RandomItems(), batch_sampler=sampler, num_workers=num_workers,
                        persistent_workers=num_workers > 0)


def _epochs(loader: DataLoader, epochs: list[int], stop_after: int | None = None) -> list[torch.Tensor]:
    """Batches of ``epochs`` as ``[4, batch]`` float64 tensors; stop after ``stop_after`` batches of the last."""
    out = []
    for epoch in epochs:
        loader.batch_sampler.set_epoch(epoch)
        for i, batch in enumerate(loader):
            out.append(torch.stack([b.double() for b in batch]))
            if stop_after is not None and epoch == epochs[-1] and i + 1 == stop_after:
                break
    return out


def test_batches_carry_seeds_of_seed_epoch_and_batch_number():
    labels = torch.arange(120) % 12
    sampler = BalancedClassSampler(labels, 4, 3, seed=0, augmentation_seed=7, num_replicas=2, rank=1)
    sampler.set_epoch(2)
    batches = list(sampler)
    assert all(isinstance(b, SeededBatch) for b in batches)
    # rank 1 takes the odd global batches
    assert [b.seed for b in batches] == [batch_seed(7, 2, step) for step in range(1, 10, 2)]
    assert len({b.seed for b in batches} | {batch_seed(7, 3, 1), batch_seed(8, 2, 1)}) == len(batches) + 2
    assert 0 <= min(b.seed for b in batches) and max(b.seed for b in batches) < 2**63
    # the default augmentation seed is torch's initial seed (the one seed_everything set), and it is resumed
    torch.manual_seed(1234)
    default = BalancedClassSampler(labels, 4, 3)
    assert default.augmentation_seed == 1234 and default.state_dict()["augmentation_seed"] == 1234
    torch.manual_seed(99)
    resumed = BalancedClassSampler(labels, 4, 3)
    resumed.load_state_dict(default.state_dict())
    assert resumed.augmentation_seed == 1234


def test_seeded_generators_restore_the_outer_streams():
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    expected = torch.rand(2), np.random.rand(2), random.random()
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    with seeded_generators(2**62 + 3):
        inner = torch.rand(2), np.random.rand(2), random.random()
    with seeded_generators(2**62 + 3):
        assert torch.equal(torch.rand(2), inner[0]) and np.array_equal(np.random.rand(2), inner[1])
        assert random.random() == inner[2]
    after = torch.rand(2), np.random.rand(2), random.random()
    assert torch.equal(after[0], expected[0]) and np.array_equal(after[1], expected[1]) and after[2] == expected[2]
    assert not torch.equal(inner[0], expected[0])


def test_augmentation_does_not_depend_on_the_worker_and_resumes_exactly():
    """Per-batch seeds: 0 or 2 workers draw the same augmentation; a run stopped mid-epoch and resumed into new
    worker processes draws exactly what the uninterrupted run draws."""
    torch.manual_seed(0)
    reference = _epochs(_random_loader(0), [0, 1, 2])
    assert len(reference) == 30
    # the draws change from batch to batch and from epoch to epoch (the seeds are not constant)
    assert len({float(b[1, 0]) for b in reference}) == 30

    uninterrupted = _random_loader(2)
    assert [torch.equal(a, b) for a, b in zip(_epochs(uninterrupted, [0, 1, 2]), reference)] == [True] * 30

    interrupted = _random_loader(2)
    seen = _epochs(interrupted, [0, 1], stop_after=3)  # the workers have prefetched beyond batch 3 of epoch 1
    state = interrupted.state_dict()
    assert state["batch_sampler"]["position"] == 3 and state["batch_sampler"]["epoch"] == 1
    resumed = _random_loader(2)
    resumed.load_state_dict(state)
    rest = _epochs(resumed, [1, 2])
    assert len(seen) + len(rest) == 30
    assert all(torch.equal(a, b) for a, b in zip(seen + rest, reference))


def test_a_plain_loader_depends_on_the_worker_process():
    """The control: without the per-batch seeds (a plain DataLoader over the same sampler) the draws of 0 and 2
    workers differ, so the test above can fail."""
    torch.manual_seed(0)
    plain0 = _epochs(_random_loader(0, DataLoader), [0])
    torch.manual_seed(0)
    plain2 = _epochs(_random_loader(2, DataLoader), [0])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(plain0, plain2))  # the same indices
    assert not all(torch.equal(a[1:], b[1:]) for a, b in zip(plain0, plain2))


def test_loader_generator_state_is_resumed():
    labels = torch.arange(120) % 12
    loader = ResumableDataLoader(torch.arange(120), generator=torch.Generator().manual_seed(3),
                                 batch_sampler=BalancedClassSampler(labels, 4, 3))
    next(iter(loader))
    state = loader.state_dict()
    expected = torch.rand(4, generator=loader.generator)
    resumed = ResumableDataLoader(torch.arange(120), generator=torch.Generator().manual_seed(11),
                                  batch_sampler=BalancedClassSampler(labels, 4, 3))
    resumed.load_state_dict(state)
    iter(resumed)
    assert torch.equal(torch.rand(4, generator=resumed.generator), expected)


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
@pytest.mark.parametrize("num_workers", [0, 2])
def test_killed_run_resumes_to_identical_metrics(tmp_path, glyph_renders, num_workers):
    cache = glyph_renders
    args = [*ARGS, *_data_args(num_workers, tmp_path)]

    marker = tmp_path / "blocked"
    killed_dir, full_dir = tmp_path / "killed", tmp_path / "full"
    killed = subprocess.Popen(
        [sys.executable, str(SCRIPT), str(tmp_path / "never.json"), "--block-at-step", str(KILL_AFTER_STEP),
         str(marker), "--", *args, f"--trainer.default_root_dir={killed_dir}"],
        cwd=tmp_path, env=_env(cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    try:
        # the uninterrupted reference runs meanwhile
        full = subprocess.run(
            [sys.executable, str(SCRIPT), str(tmp_path / "full.json"), "--", *args,
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
        [sys.executable, str(SCRIPT), str(tmp_path / "resumed.json"), "--", *args,
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
