"""Stanford Online Products (Song et al., CVPR 2016): the standard ``Ebay_train.txt`` / ``Ebay_test.txt`` split.

11,318 classes (59,551 images) train, 11,316 classes (60,502 images) test (SPEC 1.1). List lines are
``image_id class_id super_class_id path`` after a header line; ``path`` is relative to the top folder. The 12
super-classes (bicycle, cabinet, chair, ...; every product belongs to one) are the training items' categories, for
the category-balanced sampler (``sampler: category``, as open-metric-learning trains on SOP).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from lightning_dml.data.files import (
    ImageFilesDataModule,
    SplitFiles,
    find_top_folder,
    read_whitespace_table,
    require_file,
)

SOP_LAYOUT = """\
  <root>/Stanford_Online_Products/   (or root pointing at this folder)
    Ebay_train.txt              header, then: <image_id> <class_id> <super_class_id> <super>_final/<file>.JPG
    Ebay_test.txt               same syntax (test classes follow the train classes)
    bicycle_final/ cabinet_final/ ... (the 12 super-class folders of images)"""


class SOPDataModule(ImageFilesDataModule):
    """Stanford Online Products: ``Ebay_train.txt`` classes train, ``Ebay_test.txt`` classes test.

    The training items carry their ``super_class_id`` as category (``train_dataset.category``, ids 0..11 for
    super-classes 1..12; :attr:`category_names` the super-class folder names without ``_final``: ``bicycle``,
    ``cabinet``, ...), so ``sampler: category`` with ``categories_per_batch: C`` draws C super-classes x P products x
    K images (:class:`~lightning_dml.data.samplers.CategoryBalancedSampler`). Evaluation is unchanged (the papers'
    protocol: every test image against all others, no per-category metrics).

    Args:
        root: folder holding ``Stanford_Online_Products/`` or that folder itself.
        **kwargs: see :class:`~lightning_dml.data.files.ImageFilesDataModule`.
    """

    dataset_name = "Stanford Online Products"
    layout = SOP_LAYOUT
    resource_name = "sop"
    expected_counts = {"train": 59551, "test": 60502, "train classes": 11318, "test classes": 11316}

    def find_top(self) -> Path:
        return find_top_folder(self.root, ["Stanford_Online_Products"], ["Ebay_train.txt"], self.dataset_name, self.layout)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: the super-class of each category id (``bicycle``, ...), read with the list files
        self.category_names: list[str] = []

    def read_splits(self, top: Path) -> dict[str, SplitFiles]:
        out = {}
        super_names: dict[int, str] = {}
        for split, filename in (("train", "Ebay_train.txt"), ("test", "Ebay_test.txt")):
            path = require_file(top / filename, self.dataset_name, self.layout)
            rows = read_whitespace_table(path, 4, self.dataset_name)
            if rows and not rows[0][0].isdigit():  # the header line
                rows = rows[1:]
            try:
                labels = np.asarray([int(r[1]) for r in rows], dtype=np.int64)
            except ValueError as error:
                raise ValueError(f"{self.dataset_name}: {path}: class_id must be an integer ({error})") from error
            try:
                supers = np.asarray([int(r[2]) for r in rows], dtype=np.int64)
            except ValueError as error:
                raise ValueError(f"{self.dataset_name}: {path}: super_class_id must be an integer ({error})") from error
            for r, super_id in zip(rows, supers.tolist()):
                super_names.setdefault(super_id, r[3].split("/", 1)[0].removesuffix("_final"))
            out[split] = SplitFiles([top / r[3] for r in rows], labels)
            out[split].category = supers  # super-class ids; renumbered below
        ids = sorted(super_names)
        self.category_names = [super_names[i] for i in ids]
        position = {super_id: i for i, super_id in enumerate(ids)}
        out["train"].category = np.asarray([position[s] for s in out["train"].category.tolist()], dtype=np.int64)
        out["test"].category = None  # evaluation as in the papers (no per-category metrics)
        overlap = np.intersect1d(out["train"].labels, out["test"].labels)
        if overlap.size:
            raise ValueError(
                f"{self.dataset_name} at {top}: {overlap.size} classes appear in both Ebay_train.txt and "
                f"Ebay_test.txt (e.g. {overlap[:3].tolist()}): the zero-shot split needs disjoint classes"
            )
        return out
