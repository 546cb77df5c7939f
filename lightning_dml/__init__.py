"""lightning-dml: deep metric learning with PyTorch Lightning.

Pair losses (``lightning_dml.losses``), miners (``lightning_dml.miners``), data modules and samplers
(``lightning_dml.data``), backbones and heads (``lightning_dml.models``), retrieval metrics
(``lightning_dml.metrics``), the :class:`DMLModule` that ties them together and the ``lightning-dml`` CLI.
"""

import os
from typing import Any

from lightning_dml.download import is_offline
from lightning_dml.errors import UserInputError

__version__ = "0.1.0"

__all__ = ["DMLModule", "UserInputError", "__version__"]

# LIGHTNING_DML_OFFLINE=1 forbids every download; Hugging Face Hub (timm's weights) reads its own switch on import
if is_offline():
    os.environ.setdefault("HF_HUB_OFFLINE", "1")


def __getattr__(name: str) -> Any:
    # Imported on first use, so `import lightning_dml.data` does not pull in Lightning's training stack.
    if name == "DMLModule":
        from lightning_dml.module import DMLModule

        return DMLModule
    raise AttributeError(f"module 'lightning_dml' has no attribute {name!r}")
