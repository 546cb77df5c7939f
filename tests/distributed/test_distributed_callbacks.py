"""Subprocess gloo tests of the DDP collectives, the callbacks' gathers, and the demo command with every callback
under 2-process DDP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import glyph_cache

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo")


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline", **extra)
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def test_collectives_gather_uneven_blocks_objects_and_gradients():
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_collectives.py")], capture_output=True, text=True, timeout=600, env=_env()
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "COLLECTIVES-OK" in proc.stdout


@pytest.mark.slow
def test_class_embedding_refresh_and_prediction_writer_gather_every_process(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_callbacks_ddp.py"), str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=_env(PYTHONWARNINGS="ignore"), cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "CALLBACKS-DDP-OK" in proc.stdout


@pytest.mark.slow
def test_demo_config_with_every_callback_under_two_process_ddp(tmp_path, tmp_path_factory):
    """Regression: rank 0 died in RetrievalComparison.on_fit_end (``trainer.log_dir`` is a collective that only
    rank 0 reached). The demo config with its RetrievalComparison, the training diagnostics, the retrieval grid,
    both checkpoints and the default (W&B offline) logger, 2 processes: exit 0, one table, no warning asking for
    ``sync_dist``."""
    cache = tmp_path_factory.getbasetemp() / glyph_cache.FILENAME
    glyph_cache.install(cache)
    args = [
        "fit", "--config", str(ROOT / "configs" / "glyphs.yaml"),
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp",
        "--trainer.max_epochs=1", "--trainer.check_val_every_n_epoch=1", "--trainer.limit_train_batches=4",
        "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        "--trainer.enable_checkpointing=true", f"--trainer.default_root_dir={tmp_path / 'run'}",
        "--model.backbone.init_args.width=8", "--model.embedding_dim=16", "--data.init_args.image_size=16",
        "--trainer.callbacks+=lightning_dml.callbacks.RecallCurve",
        "--trainer.callbacks+=lightning_dml.callbacks.PairSimilarityHistogram",
        "--trainer.callbacks.every_n_steps=2",
        "--trainer.callbacks+=lightning_dml.callbacks.RetrievalGridLogger",
        "--trainer.callbacks.sample_size=64",
    ]
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_demo_ddp.py"), *args], capture_output=True, text=True, timeout=540,
        env=_env(**{glyph_cache.ENV: str(cache)}), cwd=tmp_path,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-8000:]
    assert "Traceback" not in output, output[-8000:]
    assert proc.stdout.count("Retrieval on the test classes") == 1, proc.stdout[-4000:]
    assert "Last validation" not in proc.stdout  # the comparison is the demo's one table
    assert "sync_dist" not in output, [line for line in output.splitlines() if "sync_dist" in line]
    assert list(tmp_path.glob("logs/**/retrieval_comparison.txt")), sorted(map(str, tmp_path.rglob("*")))[:50]
    assert list(tmp_path.glob("logs/**/recall_curve.csv"))
    assert (tmp_path / "run" / "checkpoints" / "last.ckpt").exists()
