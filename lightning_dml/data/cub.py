"""CUB-200-2011 (Wah et al. 2011) in the zero-shot retrieval protocol of Song et al. (CVPR 2016).

Classes 1-100 (5,864 images) train, classes 101-200 (5,924 images) test (SPEC 1.1); the release's own
``train_test_split.txt`` (a closed-set split) is not used. ``crop_to_box=True`` crops every image to its
``bounding_boxes.txt`` box (the "cropped" rows of the tuplet margin paper); RLL uses whole images.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lightning_dml.data.files import (
    ImageFilesDataModule,
    SplitFiles,
    find_top_folder,
    read_whitespace_table,
    require_file,
)

CUB_LAYOUT = """\
  <root>/CUB_200_2011/          (or root pointing at this folder)
    images.txt                  <image_id> <class folder>/<file>.jpg
    image_class_labels.txt      <image_id> <class_id 1..200>
    classes.txt                 <class_id> <class folder name>
    bounding_boxes.txt          <image_id> <x> <y> <width> <height>   (needed with crop_to_box)
    images/<class folder>/<file>.jpg"""


class CUB200DataModule(ImageFilesDataModule):
    """CUB-200-2011: classes 1-100 train, 101-200 test (zero-shot); optional bounding-box crops.

    Args:
        *args, **kwargs: see :class:`~lightning_dml.data.files.ImageFilesDataModule` (``root``: the folder
            holding ``CUB_200_2011/`` or that folder itself; ``classes_per_batch``, ``samples_per_class``,
            ``num_workers``, ``image_size``, ``input_spec``, ...).
        crop_to_box: crop each image to its bounding box before the transforms.
    """

    dataset_name = "CUB-200-2011"
    layout = CUB_LAYOUT
    resource_name = "cub200"
    expected_counts = {"train": 5864, "test": 5924, "train classes": 100, "test classes": 100}
    #: classes 1..last_train_class train, the rest test
    last_train_class = 100

    def __init__(self, *args: Any, crop_to_box: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.crop_to_box = crop_to_box

    def find_top(self) -> Path:
        return find_top_folder(self.root, ["CUB_200_2011"], ["images.txt"], self.dataset_name, self.layout)

    def read_splits(self, top: Path) -> dict[str, SplitFiles]:
        name = self.dataset_name
        images = read_whitespace_table(require_file(top / "images.txt", name, self.layout), 2, name)
        labels = dict(read_whitespace_table(require_file(top / "image_class_labels.txt", name, self.layout), 2, name))
        boxes: dict[str, list[str]] = {}
        if self.crop_to_box:
            rows = read_whitespace_table(require_file(top / "bounding_boxes.txt", name, self.layout), 5, name)
            boxes = {row[0]: row[1:] for row in rows}
        split: dict[str, dict[str, list]] = {s: {"paths": [], "labels": [], "boxes": []} for s in ("train", "test")}
        for image_id, relative in images:
            if image_id not in labels:
                raise ValueError(f"{name}: image id {image_id} ({relative}) has no line in image_class_labels.txt")
            label = int(labels[image_id])
            part = split["train" if label <= self.last_train_class else "test"]
            part["paths"].append(top / "images" / relative)
            part["labels"].append(label)
            if self.crop_to_box:
                if image_id not in boxes:
                    raise ValueError(f"{name}: image id {image_id} ({relative}) has no line in bounding_boxes.txt")
                x, y, w, h = (float(v) for v in boxes[image_id])
                part["boxes"].append((x, y, x + w, y + h))
        return {
            s: SplitFiles(
                v["paths"],
                np.asarray(v["labels"], dtype=np.int64),
                np.asarray(v["boxes"], dtype=np.float64) if self.crop_to_box else None,
            )
            for s, v in split.items()
        }
