"""Data modules, datasets, samplers and the input convention."""

from __future__ import annotations

import importlib
from typing import Any

# name -> module: imported on first use (PEP 562), so that `import lightning_dml.data.image_list` (search,
# serve) does not import Lightning's training stack through lightning_dml.data.base; the input convention belongs
# to the backbones (lightning_dml.models) and is re-exported for existing imports
_WHERE: dict[str, str] = {
    "DMLDataModule": "lightning_dml.data.base",
    "TensorImageDataset": "lightning_dml.data.base",
    "Cars196DataModule": "lightning_dml.data.cars",
    "CUB200DataModule": "lightning_dml.data.cub",
    "CSVDataModule": "lightning_dml.data.csv_table",
    "DatasetLayoutError": "lightning_dml.data.files",
    "ImageFilesDataModule": "lightning_dml.data.files",
    "ImageFolderDataModule": "lightning_dml.data.folder",
    "GlyphsDataModule": "lightning_dml.data.glyphs",
    "CorruptImageError": "lightning_dml.data.image_list",
    "ImageListDataset": "lightning_dml.data.image_list",
    "InShopDataModule": "lightning_dml.data.inshop",
    "BalancedClassSampler": "lightning_dml.data.samplers",
    "CategoryBalancedSampler": "lightning_dml.data.samplers",
    "EvalShardSampler": "lightning_dml.data.samplers",
    "LabelSetSampler": "lightning_dml.data.samplers",
    "NPairSampler": "lightning_dml.data.samplers",
    "RESOURCES": "lightning_dml.data.resources",
    "SOPDataModule": "lightning_dml.data.sop",
    "TableError": "lightning_dml.data.table",
    "ToInputSpec": "lightning_dml.data.transforms",
    "eval_transform": "lightning_dml.data.transforms",
    "train_transform": "lightning_dml.data.transforms",
    "BNINCEPTION": "lightning_dml.models.input_spec",
    "TORCHVISION_IMAGENET": "lightning_dml.models.input_spec",
    "InputSpec": "lightning_dml.models.input_spec",
}

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


def __getattr__(name: str) -> Any:
    if name in _WHERE:
        value = getattr(importlib.import_module(_WHERE[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_WHERE})
