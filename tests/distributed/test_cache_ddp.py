"""A 2-process DDP fit with ``cache="decoded"`` builds the decoded-image cache once (``run_cache_ddp.py``)."""

import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "run_cache_ddp.py")


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="gloo")
def test_ddp_fit_builds_the_cache_once_and_trains_from_it(tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "CACHE-DDP-OK" in proc.stdout
