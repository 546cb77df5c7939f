"""Every registered loss under DDP with ``gather_distributed``: equal to one process holding the global batch (gloo
subprocesses, 2 and 3 processes), rejected where the loss declares it cannot gather, and the parameters of a loss
with proxies identical across processes after DDP steps."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.test_distributed_callbacks import _env  # the subprocess environment (no launcher variables)

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo")


@pytest.mark.parametrize("world", [2, 3])
def test_every_loss_and_reduction_gathered_equals_single_process(world):
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_gather_loss.py"), str(world)],
        capture_output=True, text=True, timeout=300, env=_env(),
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-5000:]
    assert f"GATHER-OK world={world}" in proc.stdout


@pytest.mark.slow
def test_proxies_and_model_identical_across_ddp_processes(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_proxy_ddp.py")],
        capture_output=True, text=True, timeout=300, env=_env(PYTHONWARNINGS="ignore"), cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "PROXY-DDP-OK" in proc.stdout


@pytest.mark.parametrize(
    "name, needle",
    [("npair", "batch structure is fixed"), ("arcface", "per-sample"), ("proxy_nca", "per-sample")],
)
def test_gather_distributed_rejected_for_losses_that_cannot_gather(name, needle):
    from lightning_dml.checks import check_gather_combination
    from lightning_dml.losses import build_loss

    loss = build_loss(name)
    check_gather_combination(loss, False)  # without gathering: fine
    with pytest.raises(ValueError, match="gather_distributed=True") as err:
        check_gather_combination(loss, True)
    assert type(loss).__name__ in str(err.value) and needle in str(err.value)


def test_gather_modes_are_declared_not_inferred():
    from lightning_dml.checks import check_gather_combination
    from lightning_dml.losses import LOSSES, LiftedStructureLoss
    from lightning_dml.losses.base import GATHER_MODES

    for name, cls in LOSSES.items():
        assert cls.gather_mode in GATHER_MODES + (None,), name
    for name in ("contrastive", "triplet", "multi_similarity", "proxy_anchor", "fastap", "smooth_ap"):
        check_gather_combination(LOSSES[name](), True)  # no error
    assert LiftedStructureLoss(variant="star").gather_mode == "references"
    assert LiftedStructureLoss(variant="original").gather_mode == "global_batch"


def test_dml_module_rejects_gather_with_npair_when_fit_starts():
    import pytorch_lightning as pl

    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule
    from tests.random_images import RandomImages

    dm = RandomImages(classes_per_batch=3, samples_per_class=2, eval_batch_size=8, train_classes=6, test_classes=4)
    model = DMLModule(SmallConvNet(in_channels=1, width=4), loss="npair", embedding_dim=8, gather_distributed=True)
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    with pytest.raises(ValueError, match="gather_distributed=True cannot be used with NPairLoss"):
        trainer.fit(model, datamodule=dm)
    assert trainer.global_step == 0
