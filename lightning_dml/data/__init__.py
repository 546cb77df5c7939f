"""Data modules, datasets, samplers and the input convention."""

from lightning_dml.data.base import DMLDataModule, TensorImageDataset
from lightning_dml.data.cars import Cars196DataModule
from lightning_dml.data.cub import CUB200DataModule
from lightning_dml.data.csv_table import CSVDataModule
from lightning_dml.data.files import DatasetLayoutError, ImageFilesDataModule
from lightning_dml.data.folder import ImageFolderDataModule
from lightning_dml.data.glyphs import GlyphsDataModule
from lightning_dml.data.image_list import CorruptImageError, ImageListDataset
from lightning_dml.data.inshop import InShopDataModule
from lightning_dml.data.samplers import (
    BalancedClassSampler,
    CategoryBalancedSampler,
    EvalShardSampler,
    LabelSetSampler,
    NPairSampler,
)
from lightning_dml.data.resources import RESOURCES
from lightning_dml.data.sop import SOPDataModule
from lightning_dml.data.table import TableError
from lightning_dml.data.transforms import ToInputSpec, eval_transform, train_transform

# the input convention belongs to the backbones (lightning_dml.models); re-exported for existing imports
from lightning_dml.models.input_spec import BNINCEPTION, TORCHVISION_IMAGENET, InputSpec

__all__ = [
    "BNINCEPTION",
    "TORCHVISION_IMAGENET",
    "BalancedClassSampler",
    "CSVDataModule",
    "CUB200DataModule",
    "Cars196DataModule",
    "CategoryBalancedSampler",
    "CorruptImageError",
    "DMLDataModule",
    "DatasetLayoutError",
    "EvalShardSampler",
    "GlyphsDataModule",
    "ImageFilesDataModule",
    "ImageFolderDataModule",
    "ImageListDataset",
    "InShopDataModule",
    "InputSpec",
    "LabelSetSampler",
    "NPairSampler",
    "RESOURCES",
    "SOPDataModule",
    "TableError",
    "TensorImageDataset",
    "ToInputSpec",
    "eval_transform",
    "train_transform",
]
