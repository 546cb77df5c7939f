"""Which LightningModule and data module ``lightning-dml fit`` builds for a config: the re-ranker's or the library's.

The ``lightning-dml`` CLI builds :class:`~lightning_dml.module.DMLModule` and a
:class:`~lightning_dml.data.base.DMLDataModule` (``model:`` holds DMLModule's arguments, without ``class_path``).
A config whose ``model`` section has a ``reranker`` key (``configs/rerank/*.yaml``) trains a pairwise re-ranker
instead: :class:`~lightning_dml.rerank.module.PairwiseRerankerModule` on
:class:`~lightning_dml.rerank.data.PairwiseRerankDataModule` (``model:`` and ``data:`` hold their arguments, without
``class_path``). :func:`reranker_fit_classes` reads the ``--config`` files of a command line to decide.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["config_files", "reranker_fit_classes"]


def config_files(args: Sequence[str]) -> list[str]:
    """The values of ``--config PATH`` / ``--config=PATH`` in ``args``, in order."""
    found, words = [], list(args)
    for i, word in enumerate(words):
        if word == "--config" and i + 1 < len(words):
            found.append(words[i + 1])
        elif word.startswith("--config="):
            found.append(word.split("=", 1)[1])
    return found


def _is_reranker_config(path: str) -> bool:
    import yaml

    try:
        data: Any = yaml.safe_load(Path(os.path.expanduser(path)).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return False  # LightningCLI reports an unreadable config itself
    model = data.get("model") if isinstance(data, dict) else None
    return isinstance(model, dict) and "reranker" in model


def reranker_fit_classes(args: Sequence[str]) -> tuple[type, type] | None:
    """``(PairwiseRerankerModule, PairwiseRerankDataModule)`` when a ``--config`` of ``args`` trains a re-ranker
    (module docstring), else ``None``."""
    if not any(_is_reranker_config(path) for path in config_files(args)):
        return None
    from lightning_dml.rerank.data import PairwiseRerankDataModule
    from lightning_dml.rerank.module import PairwiseRerankerModule

    return PairwiseRerankerModule, PairwiseRerankDataModule
