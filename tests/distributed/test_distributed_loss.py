"""Runs the 2-process gloo script: gathered loss and DDP gradients equal one process with the global batch."""

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "run_gather_loss.py")


@pytest.mark.skipif(sys.platform == "win32", reason="gloo file store")
def test_gathered_loss_and_gradients_equal_single_process():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "GATHER-OK" in proc.stdout
