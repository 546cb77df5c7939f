"""Render the Glyphs fonts once per test session and share the renderings with subprocesses and notebooks.

Rendering every (font, character) pair takes tens of seconds on a busy 2-core machine; the resume, determinism
and notebook tests start several fresh Python processes that would each pay it. ``install(path)`` replaces
``lightning_dml.data.glyphs._clean_renderings`` by a pickle of its result (written on first use), so the
images are the same as without the cache: only the clean renderings are cached, the per-image variation is
still computed by ``render_glyphs``.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

ENV = "LIGHTNING_DML_TEST_GLYPH_CACHE"
FILENAME = "glyph_renderings.pkl"


def install(path: str | os.PathLike) -> None:
    """Serve the clean glyph renderings from ``path`` (rendered and written there if it does not exist)."""
    from lightning_dml.data import glyphs

    path = Path(path)
    if path.exists():
        renders = pickle.loads(path.read_bytes())
    else:
        renders = glyphs._clean_renderings()
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(pickle.dumps(renders))
        tmp.replace(path)
    glyphs._clean_renderings = lambda: renders


def install_from_env() -> None:
    """``install`` the cache named by ``$LIGHTNING_DML_TEST_GLYPH_CACHE``, if set."""
    if os.environ.get(ENV):
        install(os.environ[ENV])
