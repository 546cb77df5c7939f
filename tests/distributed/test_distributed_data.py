"""Runs the 2-process gloo data script: P x K batches per process, disjoint across processes, every test item
evaluated exactly once (In-Shop query vs gallery), metric equal to one process's."""

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "run_data_ddp.py")


@pytest.mark.skipif(sys.platform == "win32", reason="gloo")
def test_ddp_training_batches_and_exact_evaluation(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "DATA-DDP-OK" in proc.stdout
