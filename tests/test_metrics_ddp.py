"""RetrievalMetrics under DDP (gloo, 2 and 3 processes) equals the single-process result exactly (subprocess)."""

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed", "metrics_ddp_script.py")


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_ddp_processes_equal_single_process(world: int) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, str(world)], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DDP-METRICS-OK" in proc.stdout


@pytest.mark.slow
def test_ddp_disagreeing_precisions_are_rejected_on_every_rank() -> None:
    """Rank 0 asks for bf16, ranks 1-2 for fp32: one clear ValueError on every rank, never a mixed search."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, "3", "mixed"], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("DDP-PRECISION-REJECTED") == 3, proc.stdout


@pytest.mark.slow
def test_ddp_auto_precision_agreed_when_one_rank_resolves_differently() -> None:
    """"auto" resolving to bf16 on rank 0 only: all ranks use fp32, figures equal one process."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, "3", "auto-probe"], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DDP-METRICS-OK" in proc.stdout


@pytest.mark.slow
@pytest.mark.parametrize("world, mode", [(2, "tasks"), (3, "tasks"), (3, "tasks-repair")])
def test_ddp_own_tasks_equal_single_process(world: int, mode: str) -> None:
    """Label sets, sequences, categories, overlapping query/gallery sets and every opt-in metric (FNMR@FMR's pair
    windows merged across processes, and their exact repair when the sample misses, included): == one process
    under 2 and 3 gloo processes."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT, str(world), mode], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DDP-METRICS-OK" in proc.stdout and "fnmr@fmr=0.001" in proc.stdout and "category/a/map" in proc.stdout
    # per rank: the all-vs-all metric at full width and at its nested width 16, and the query/gallery metric
    assert proc.stdout.count("REPAIR-PASS") == (3 * world if mode == "tasks-repair" else 0)
