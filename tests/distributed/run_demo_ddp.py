"""The ``lightning-dml`` command under 2-process DDP (gloo, CPU): ``python run_demo_ddp.py ARGS...`` runs
``lightning_dml.cli.main(ARGS)``; Lightning's ``ddp`` strategy re-launches this script for rank 1.

The glyph renderings are served from ``$LIGHTNING_DML_TEST_GLYPH_CACHE`` when set (tests/glyph_cache.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from lightning_dml.cli import main  # noqa: E402
from tests.glyph_cache import install_from_env  # noqa: E402

if __name__ == "__main__":
    install_from_env()
    main(sys.argv[1:])
