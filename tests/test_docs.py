"""The code of docs/adding_a_loss.md runs, and its example loss matches a loop written from the paper's equation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from lightning_dml.losses import LOSSES

DOC = Path(__file__).resolve().parents[1] / "docs" / "adding_a_loss.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


@pytest.fixture
def circle_namespace():
    namespace: dict = {}
    try:
        for block in _python_blocks():
            exec(compile(block, str(DOC), "exec"), namespace)
        yield namespace
    finally:
        LOSSES.pop("my_circle", None)  # leave the registry as the library defines it


def _circle_reference(embeddings: torch.Tensor, labels: torch.Tensor, margin: float, gamma: float) -> torch.Tensor:
    """Sun et al. 2020, Eqs. 5-6, anchor by anchor and pair by pair in float64; the weights a_p, a_n are
    stop-gradient constants (``.detach()``), as the paper specifies."""
    f = torch.nn.functional.normalize(embeddings.double(), dim=1)
    total = embeddings.new_zeros((), dtype=torch.float64)
    for i in range(len(labels)):
        sp = [f[i] @ f[j] for j in range(len(labels)) if j != i and labels[j] == labels[i]]
        sn = [f[i] @ f[j] for j in range(len(labels)) if labels[j] != labels[i]]
        if not sp or not sn:
            continue
        neg = sum(torch.exp(gamma * (s.detach() + margin).clamp(min=0) * (s - margin)) for s in sn)
        pos = sum(torch.exp(-gamma * (1 + margin - s.detach()).clamp(min=0) * (s - 1 + margin)) for s in sp)
        total = total + torch.log1p(neg * pos)
    return total / len(labels)


def test_adding_a_loss_page_runs_and_is_correct(circle_namespace):
    circle = circle_namespace["CircleLoss"]
    assert LOSSES["my_circle"] is circle
    torch.manual_seed(0)
    embeddings = torch.randn(12, 6)
    labels = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 3, 4, 4, 4])  # class 3 has no positive
    for margin, gamma in ((0.25, 64.0), (0.4, 8.0)):
        x = embeddings.double().requires_grad_()
        value = circle(margin=margin, gamma=gamma)(x, labels)
        (grad,) = torch.autograd.grad(value, x)
        y = embeddings.double().requires_grad_()
        expected = _circle_reference(y, labels, margin, gamma)
        (expected_grad,) = torch.autograd.grad(expected, y)
        assert float(value) == pytest.approx(float(expected), rel=1e-9)
        torch.testing.assert_close(grad, expected_grad, rtol=1e-7, atol=1e-9)
    with pytest.raises(ValueError, match="unknown loss 'cirle'; valid names: .*circle"):
        from lightning_dml.losses import build_loss

        build_loss("cirle")


@pytest.mark.slow
def test_slurm_example_builds_a_valid_ddp_command(tmp_path):
    """examples/slurm/train.sbatch, run with a stand-in `srun` that asks the CLI to validate and print the config
    instead of training: every option of the example exists and lands where docs/cluster.md says."""
    import os
    import subprocess

    import yaml

    root = DOC.parents[1]
    env = {
        **os.environ,
        "DATA_ROOT": str(tmp_path / "datasets"),
        "RUN_DIR": str(tmp_path / "run"),
        "SLURM_SUBMIT_DIR": str(root),
        "SLURM_JOB_NAME": "test",
        "SLURM_JOB_ID": "1",
        "SLURM_NNODES": "2",
        "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_CPUS_PER_TASK": "8",
    }
    script = f'srun() {{ "$@" --print_config; }}; source {root / "examples" / "slurm" / "train.sbatch"}'
    result = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    config = yaml.safe_load(result.stdout)
    trainer = config["trainer"]
    assert (trainer["num_nodes"], str(trainer["devices"]), trainer["strategy"], trainer["accelerator"]) == (2, "4", "ddp", "gpu")
    assert trainer["sync_batchnorm"] is True and trainer["default_root_dir"] == str(tmp_path / "run")
    assert config["model"]["gather_distributed"] is True
    assert config["data"]["init_args"]["root"] == str(tmp_path / "datasets")
    assert config["data"]["init_args"]["num_workers"] == 7
    assert config["periodic_checkpoint"]["every_n_train_steps"] == 500
    assert config["checkpoint"]["monitor"] == "val/recall@1"
