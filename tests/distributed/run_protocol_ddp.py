"""``lightning-dml`` as its console script runs it, for the DDP tests of ``cv`` and ``sweep``:
``python run_protocol_ddp.py ARGS...`` runs ``lightning_dml.cli.main()`` on ``sys.argv``, so that Lightning's DDP
launcher, which runs ``sys.argv`` again in a fit's other processes, starts them through this script too.

Each process prints one line ``PROTOCOL-PROCESS <command> LOCAL_RANK=<rank or None>`` first, so that a test can
count which commands ran in how many processes. The glyph renderings are served from
``$LIGHTNING_DML_TEST_GLYPH_CACHE`` when set (tests/glyph_cache.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_dml.cli import main  # noqa: E402
from tests.glyph_cache import install_from_env  # noqa: E402

if __name__ == "__main__":
    print(f"PROTOCOL-PROCESS {sys.argv[1]} LOCAL_RANK={os.environ.get('LOCAL_RANK')}", flush=True)
    install_from_env()
    main()
