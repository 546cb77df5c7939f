"""Determinism: ``seed_everything`` + ``Trainer(deterministic=True)`` gives identical metrics and weights across two
CPU runs of the ``lightning-dml`` CLI on the Glyphs data; another seed gives different ones (so the comparison can
fail)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from lightning_dml.cli import build_cli
from tests import glyph_cache


@pytest.fixture(scope="session")
def glyph_renders(tmp_path_factory) -> Path:
    path = tmp_path_factory.getbasetemp() / glyph_cache.FILENAME
    glyph_cache.install(path)
    return path


def _fit(tmp_path: Path, seed: int) -> tuple[dict[str, float], str]:
    args = [
        "fit",
        f"--seed_everything={seed}",
        "--trainer.accelerator=cpu",
        "--trainer.devices=1",
        "--trainer.deterministic=true",
        "--trainer.max_epochs=2",
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
        "--data=lightning_dml.data.GlyphsDataModule",
        "--data.init_args.image_size=16",
        "--data.init_args.classes_per_batch=8",
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
