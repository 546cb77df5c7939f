"""RetrievalMetrics under 2-process DDP (gloo) equals the single-process result exactly (subprocess)."""

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed", "metrics_ddp_script.py")


def test_ddp_two_processes_equal_single_process() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DDP-METRICS-OK" in proc.stdout
