"""Backbones, embedding heads and the input convention (:class:`InputSpec`) a backbone declares.

Backbones by class path (``lightning_dml.models.BNInception``) or by name (``build_backbone("bninception")``,
names in :data:`BACKBONES`); any timm model: ``lightning_dml.models.TimmBackbone`` or ``build_backbone("timm:<name>")``.
"""

from lightning_dml.models.backbones import (
    BACKBONES,
    Backbone,
    BNInception,
    GlobalPool,
    GoogLeNet,
    ResNet50,
    ResNet101,
    SmallConvNet,
    build_backbone,
)
from lightning_dml.models.heads import LinearEmbedding, MultiLevelEmbedding
from lightning_dml.models.input_spec import (
    BNINCEPTION,
    TORCHVISION_IMAGENET,
    InputSpec,
    InputSpecMismatchError,
    backbone_input_spec,
)
from lightning_dml.models.weights import WEIGHTS

__all__ = [
    "BACKBONES",
    "BNINCEPTION",
    "BNInception",
    "Backbone",
    "GlobalPool",
    "GoogLeNet",
    "InputSpec",
    "InputSpecMismatchError",
    "LinearEmbedding",
    "MultiLevelEmbedding",
    "ResNet101",
    "ResNet50",
    "SmallConvNet",
    "TORCHVISION_IMAGENET",
    "TimmBackbone",
    "WEIGHTS",
    "backbone_input_spec",
    "build_backbone",
]


def __getattr__(name: str) -> object:
    """``TimmBackbone`` is imported on first use: importing timm takes seconds, and most runs do not need it."""
    if name == "TimmBackbone":
        from lightning_dml.models.timm_backbone import TimmBackbone

        return TimmBackbone
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
