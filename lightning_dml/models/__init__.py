"""Backbones and embedding heads.

Backbones by class path (``lightning_dml.models.BNInception``) or by name (``build_backbone("bninception")``,
names in :data:`BACKBONES`).
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

__all__ = [
    "BACKBONES",
    "BNInception",
    "Backbone",
    "GlobalPool",
    "GoogLeNet",
    "LinearEmbedding",
    "MultiLevelEmbedding",
    "ResNet101",
    "ResNet50",
    "SmallConvNet",
    "build_backbone",
]
