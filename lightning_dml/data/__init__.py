"""Data modules and samplers."""

from lightning_dml.data.base import DMLDataModule, TensorImageDataset
from lightning_dml.data.glyphs import GlyphsDataModule
from lightning_dml.data.samplers import BalancedClassSampler

__all__ = ["BalancedClassSampler", "DMLDataModule", "GlyphsDataModule", "TensorImageDataset"]
