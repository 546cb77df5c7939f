"""Determinism: ``seed_everything`` + ``Trainer(deterministic=True)`` gives identical metrics and weights across two
CPU runs of the ``lightning-dml`` CLI on the Glyphs data; another seed gives different ones (so the comparison can
fail). With random augmentation, the number of DataLoader worker processes does not change the run either."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from lightning_dml.cli import build_cli
from tests import glyph_cache
from tests.test_resume import GLYPHS, noise_folder_args, noise_image_folder


@pytest.fixture(scope="session")
def glyph_renders(tmp_path_factory) -> Path:
    path = tmp_path_factory.getbasetemp() / glyph_cache.FILENAME
    glyph_cache.install(path)
    return path


def _fit(tmp_path: Path, seed: int, data_args: list[str] = GLYPHS, max_epochs: int = 2) -> tuple[dict[str, float], str]:
    args = [
        "fit",
        f"--seed_everything={seed}",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.deterministic=true",
        f"--trainer.max_epochs={max_epochs}",
        "--trainer.limit_train_batches=4",
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--model.backbone=lightning_dml.models.SmallConvNet",
        "--model.backbone.init_args.width=8",
        "--model.embedding_dim=16",
        "--model.optimizer=torch.optim.Adam",
        "--model.optimizer.init_args.lr=0.003",
        *data_args,
    ]
    cli = build_cli(args)
    digest = hashlib.sha256()
    for name, tensor in sorted(cli.model.state_dict().items()):
        digest.update(name.encode() + tensor.detach().cpu().contiguous().numpy().tobytes())
    return {k: float(v) for k, v in cli.trainer.callback_metrics.items()}, digest.hexdigest()


@pytest.mark.slow
def test_two_seeded_runs_are_identical(tmp_path, glyph_renders):
    metrics_a, weights_a = _fit(tmp_path / "a", seed=0)
    metrics_b, weights_b = _fit(tmp_path / "b", seed=0)
    assert {"val/recall@1", "val/map@r", "val/nmi", "train/loss"} <= set(metrics_a)
    assert metrics_a == metrics_b  # exact, including NMI of the k-means clustering
    assert weights_a == weights_b

    metrics_c, weights_c = _fit(tmp_path / "c", seed=1)
    assert weights_c != weights_a
    assert metrics_c != metrics_a


@pytest.mark.slow
def test_worker_processes_do_not_change_the_run(tmp_path):
    """Random resized crops and flips on noise images: 0 and 2 DataLoader workers train bit-identical models (each
    batch's augmentation is drawn from its own seed, not from the generators of the process that loads it)."""
    root = noise_image_folder(tmp_path / "images")

    def folder(num_workers: int) -> list[str]:
        return [*noise_folder_args(root, num_workers), "--model.clustering=false"]

    metrics_0, weights_0 = _fit(tmp_path / "w0", seed=0, data_args=folder(0), max_epochs=1)
    metrics_2, weights_2 = _fit(tmp_path / "w2", seed=0, data_args=folder(2), max_epochs=1)
    assert {"val/recall@1", "train/loss"} <= set(metrics_0)
    assert weights_2 == weights_0
    assert metrics_2 == metrics_0
