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
