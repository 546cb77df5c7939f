"""Cars196 (Krause et al. 2013) in the zero-shot retrieval protocol of Song et al. (CVPR 2016).

Classes 1-98 (8,054 images) train, classes 99-196 (8,131 images) test (SPEC 1.1), all images of the release
(its own train/test halves are a closed-set split and are merged). Two official layouts are read:

* ``cars_annos.mat`` + ``car_ims/`` (the all-in-one release);
* ``devkit/`` (``cars_meta.mat``, ``cars_train_annos.mat``) + ``cars_train/`` + ``cars_test/``, with the test
  labels from ``cars_test_annos_withlabels.mat`` (released separately; in ``devkit/`` or next to it).

``.mat`` files are read with ``scipy.io.loadmat``. Boxes are MATLAB 1-based inclusive pixel coordinates;
``crop_to_box=True`` crops to them (the "cropped" rows of the tuplet margin paper).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from lightning_dml.data.files import DatasetLayoutError, ImageFilesDataModule, SplitFiles, find_top_folder, require_file

CARS_LAYOUT = """\
  either  <root>/cars_annos.mat + <root>/car_ims/000001.jpg ...
  or      <root>/devkit/cars_meta.mat, <root>/devkit/cars_train_annos.mat,
          <root>/devkit/cars_test_annos_withlabels.mat (or <root>/cars_test_annos_withlabels.mat),
          <root>/cars_train/00001.jpg ..., <root>/cars_test/00001.jpg ...
  (<root> may also be a folder holding one of: stanford_cars/, cars196/, Cars196/, CARS196/, cars/)"""

_TOP_NAMES = ["stanford_cars", "cars196", "Cars196", "CARS196", "cars"]


def _annotations(path: Path, dataset: str) -> np.ndarray:
    from scipy.io import loadmat

    try:
        mat = loadmat(path, squeeze_me=True)
    except Exception as error:  # noqa: BLE001 - name the file in the message
        raise ValueError(f"{dataset}: cannot read {path}: {type(error).__name__}: {error}") from error
    if "annotations" not in mat:
        raise ValueError(f"{dataset}: {path} has no 'annotations' struct (keys: {sorted(k for k in mat if not k.startswith('__'))})")
    return np.atleast_1d(mat["annotations"])


def _field(annos: np.ndarray, name: str, path: Path, dataset: str) -> np.ndarray:
    if annos.dtype.names is None or name not in annos.dtype.names:
        raise ValueError(f"{dataset}: {path} annotations have no field {name!r} (fields: {annos.dtype.names})")
    return np.asarray([annos[i][name] for i in range(len(annos))])


def _boxes(annos: np.ndarray, path: Path, dataset: str) -> np.ndarray:
    x1, y1, x2, y2 = (_field(annos, f"bbox_{c}", path, dataset).astype(np.float64) for c in ("x1", "y1", "x2", "y2"))
    # 1-based inclusive -> PIL (left, top, right, bottom) with exclusive right/bottom
    return np.stack([x1 - 1, y1 - 1, x2, y2], axis=1)


class Cars196DataModule(ImageFilesDataModule):
    """Cars196: classes 1-98 train, 99-196 test (zero-shot), from either official layout.

    Args:
        *args, **kwargs: see :class:`~lightning_dml.data.files.ImageFilesDataModule` (``root``: the folder
            holding the Cars files, ``cars_annos.mat`` or ``devkit/``, or its parent).
        crop_to_box: crop each image to its bounding box before the transforms.
    """

    dataset_name = "Cars196"
    layout = CARS_LAYOUT
    resource_name = "cars196"
    expected_counts = {"train": 8054, "test": 8131, "train classes": 98, "test classes": 98}
    #: classes 1..last_train_class train, the rest test
    last_train_class = 98

    def __init__(self, *args: Any, crop_to_box: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.crop_to_box = crop_to_box
        self.layout_found: str | None = None

    def find_top(self) -> Path:
        markers = ["cars_annos.mat", "devkit/cars_train_annos.mat"]
        return find_top_folder(self.root, _TOP_NAMES, markers, self.dataset_name, self.layout)

    def _read_annos_layout(self, top: Path) -> tuple[list[Path], np.ndarray, np.ndarray]:
        path = top / "cars_annos.mat"
        annos = _annotations(path, self.dataset_name)
        relative = _field(annos, "relative_im_path", path, self.dataset_name)
        labels = _field(annos, "class", path, self.dataset_name).astype(np.int64)
        return [top / str(r) for r in relative], labels, _boxes(annos, path, self.dataset_name)

    def _read_devkit_layout(self, top: Path) -> tuple[list[Path], np.ndarray, np.ndarray]:
        name = self.dataset_name
        train_path = require_file(top / "devkit" / "cars_train_annos.mat", name, self.layout)
        test_path = next(
            (p for p in (top / "devkit" / "cars_test_annos_withlabels.mat", top / "cars_test_annos_withlabels.mat") if p.is_file()),
            None,
        )
        if test_path is None:
            raise DatasetLayoutError(
                f"{name}: missing cars_test_annos_withlabels.mat (the test labels, released separately from the "
                f"devkit) in {top / 'devkit'} or {top}. Expected layout:\n{self.layout}"
            )
        paths: list[Path] = []
        labels, boxes = [], []
        for path, folder in ((train_path, "cars_train"), (test_path, "cars_test")):
            annos = _annotations(path, name)
            paths += [top / folder / str(f) for f in _field(annos, "fname", path, name)]
            labels.append(_field(annos, "class", path, name).astype(np.int64))
            boxes.append(_boxes(annos, path, name))
        return paths, np.concatenate(labels), np.concatenate(boxes)

    def read_splits(self, top: Path) -> dict[str, SplitFiles]:
        if (top / "cars_annos.mat").is_file():
            self.layout_found = "annos"
            paths, labels, boxes = self._read_annos_layout(top)
        else:
            self.layout_found = "devkit"
            paths, labels, boxes = self._read_devkit_layout(top)
        out = {}
        for split, keep in (("train", labels <= self.last_train_class), ("test", labels > self.last_train_class)):
            idx = np.flatnonzero(keep)
            out[split] = SplitFiles([paths[i] for i in idx], labels[idx], boxes[idx] if self.crop_to_box else None)
        return out
