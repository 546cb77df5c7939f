"""Backbones and embedding heads."""

from lightning_dml.models.backbones import GlobalPool, ResNet50, SmallConvNet
from lightning_dml.models.heads import LinearEmbedding

__all__ = ["GlobalPool", "LinearEmbedding", "ResNet50", "SmallConvNet"]
