"""A loss on a miner's tuples under ``gather_distributed``: the miner sees the global batch, equal to one process
(gloo subprocesses: 3 processes with unequal batches; ``python tests/distributed/run_miners_ddp.py 2`` runs the
2-process case, left out of the suite for its wall time)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.distributed.test_distributed_callbacks import _env  # the subprocess environment (no launcher variables)

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="gloo")


@pytest.mark.slow
def test_mined_losses_gathered_equal_single_process(world=3):
    proc = subprocess.run(
        [sys.executable, str(HERE / "run_miners_ddp.py"), str(world)],
        capture_output=True, text=True, timeout=300, env=_env(),
    )
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-5000:]
    assert f"MINERS-OK world={world}" in proc.stdout
