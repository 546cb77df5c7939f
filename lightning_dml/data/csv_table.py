"""``CSVDataModule``: your own retrieval task as one table (CSV or Parquet), open-metric-learning's format included.

One row per image: ``path``, ``label`` (or ``labels``, a label set ``12;40``), ``split`` (``train``,
``validation``, ``test``) and optionally ``is_query``, ``is_gallery``, ``category``, ``sequence`` and a crop box
``x_1, y_1, x_2, y_2``; every column, the checks and the errors: :mod:`lightning_dml.data.table` and
``docs/datasets.md``. open-metric-learning's tables (``label, path, split, is_query, is_gallery`` with ``train`` and
``validation`` rows, ``category``, ``sequence``, ``x_1, x_2, y_1, y_2``) load unchanged.

Evaluation items are ``(image, label(s), index, is_query, is_gallery, sequence, category)``, which
:class:`~lightning_dml.metrics.RetrievalMetrics` reads as they come (:func:`~lightning_dml.metrics.retrieval.eval_batch_targets`):
queries ranked against the gallery, gallery items of the query's sequence ignored, metrics per category.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from pytorch_lightning.utilities import rank_zero_info, rank_zero_only, rank_zero_warn

from lightning_dml.data.files import DatasetLayoutError, ImageFilesDataModule, SplitFiles
from lightning_dml.data.table import (
    SPLITS,
    ImageTable,
    TableError,
    compact_labels,
    encode_label_sets,
    encode_names,
    parse_image_table,
    queries_without_relevant_item,
    read_raw_table,
)

TABLE_LAYOUT = """\
  a CSV (or Parquet) file, root=<table>.csv, one row per image, with a header naming the columns:
    path      the image, relative to the table's folder (or to images_root) or absolute
    label     its class (text or integer); or labels: a label set, labels separated by ';' (12;40)
    split     train, validation or test
  optional: is_query, is_gallery (true/false; default both true: all-vs-all), category, sequence,
            x_1, y_1, x_2, y_2 (crop box: left, top, right, bottom in pixels, right/bottom exclusive)"""


class CSVDataModule(ImageFilesDataModule):
    """Your own retrieval task from one table: training, validation and test splits, query/gallery roles,
    categories, sequences, crop boxes and label sets (``docs/datasets.md``, a worked example in
    ``docs/own_task.md``).

    Splits: ``train`` rows train (at least one). ``validation`` rows validate when the table has them; ``test``
    rows are tested; a table without ``test`` rows is tested on its ``validation`` rows (open-metric-learning's
    tables have ``train`` and ``validation`` only), and a table without ``validation`` rows validates as every data
    module does (on the test rows, or on training classes held out by ``val_classes_fraction`` / ``num_folds``,
    which a table with both ``validation`` and ``test`` rows does not take). At least one of ``validation`` and
    ``test`` must be given.

    Names: labels, categories and sequences may be text or integers; each column's distinct values get ids
    0, 1, ... in sorted order (integers numerically, then text), and :attr:`class_names`,
    :attr:`category_names` and :attr:`sequence_names` give the value of each id (``class_names[label]``), as the
    table wrote it (``12.0`` read as ``12``). A split whose rows all have one label yields plain labels ``[N]``;
    a split with label sets (a row with several labels, or an evaluation row without any) yields ``[N, L]``
    padded with -1 (``L`` the split's largest set), which ``sampler: label_sets`` draws for training and
    :class:`~lightning_dml.metrics.RetrievalMetrics` evaluates (relevant: the sets intersect).

    Checks at set-up: every problem of the table in one error naming the rows and columns (unknown split, missing
    file, duplicate rows, bad box, unparsable label set, missing column: :mod:`lightning_dml.data.table`); boxes
    are checked against the image sizes (``check_boxes``: one header read per boxed image, in threads with a
    progress bar); a warning gives the number of queries no gallery item is relevant to (their label absent from
    the gallery, or only on items of their own sequence).

    Args:
        root: the table file (``.csv``, ``.tsv``, ``.parquet``).
        images_root: the folder the relative ``path`` values start from (open-metric-learning's
            ``dataset_root``); default the table's folder.
        check_boxes: check every crop box against its image's size at set-up.
        sampler: ``"balanced"`` (P x K), ``"category"`` (C categories x P classes x K items, with
            ``categories_per_batch``: the training rows need a category each), ``"label_sets"`` (P labels x K
            items; needed for training rows with label sets), ``"npair"``.
        **kwargs: see :class:`~lightning_dml.data.files.ImageFilesDataModule` (``classes_per_batch``,
            ``samples_per_class``, ``categories_per_batch``, ``image_size``, ``num_workers``, ...).
    """

    dataset_name = "image table"
    layout = TABLE_LAYOUT
    expected_counts: dict[str, int] = {}

    def __init__(self, root: str | os.PathLike, *args: Any, images_root: str | None = None, check_boxes: bool = True,
                 **kwargs: Any) -> None:
        # ``root`` declared here, not passed through ``*args``: ``--data.help CSVDataModule`` then documents it from
        # this class's docstring (the table file), not as the benchmarks' dataset folder
        super().__init__(root, *args, **kwargs)
        self.images_root = None if images_root is None else Path(images_root).expanduser()
        self.check_boxes = bool(check_boxes)
        #: the value of each class id, category id and sequence id (set when the table is read)
        self.class_names: list[str] = []
        self.category_names: list[str] = []
        self.sequence_names: list[str] = []
        #: whether the table has validation rows apart from its test rows (they validate)
        self.has_validation_split = False
        self.table: ImageTable | None = None

    @property
    def test_as_val(self) -> bool:
        return super().test_as_val and not getattr(self, "has_validation_split", False)

    def find_top(self) -> Path:
        if not self.root.is_file():
            raise DatasetLayoutError(
                f"{self.dataset_name}: {self.root} is not a file; root must be the table. Expected:\n{self.layout}"
            )
        return self.root.parent

    # ------------------------------------------------------------------ reading
    def _read_table(self) -> ImageTable:
        trainer = getattr(self, "trainer", None)
        rank = trainer.global_rank if trainer is not None else getattr(rank_zero_only, "rank", 0)
        began = time.perf_counter()
        table = parse_image_table(
            read_raw_table(self.root), SPLITS, self.images_root, check_files=self.check_files,
            check_boxes=self.check_boxes, progress=rank == 0,
        )
        boxed = 0 if table.boxes is None else int((~np.isnan(table.boxes[:, 0])).sum())
        if boxed and self.check_boxes and time.perf_counter() - began > 2.0:  # say what a slow check costs
            rank_zero_info(
                f"{self.dataset_name} {self.root}: {len(table):,} rows checked, {boxed:,} boxes against their image "
                f"sizes ({time.perf_counter() - began:.1f} s; check_boxes: false skips the size check)"
            )
        return table

    def read_splits(self, top: Path) -> dict[str, SplitFiles]:
        table = self.table = self._read_table()
        label_ids, self.class_names = encode_label_sets(table.label_sets)
        category, self.category_names = encode_names(table.category)
        sequence, self.sequence_names = encode_names(table.sequence)
        rows = {name: np.flatnonzero(table.split == name) for name in SPLITS}
        where = f"{self.dataset_name} {self.root}"
        if rows["train"].size == 0:
            raise TableError(f"{where}: no train rows; a table needs training images (split: train)")
        if rows["validation"].size == 0 and rows["test"].size == 0:
            raise TableError(f"{where}: no validation or test rows: nothing to evaluate")
        self.has_validation_split = bool(rows["validation"].size and rows["test"].size)
        if self.has_validation_split and not super().test_as_val:
            chosen = "num_folds/fold" if self.num_folds is not None else f"val_classes_fraction={self.val_classes_fraction}"
            raise TableError(
                f"{where} has validation rows, and {chosen} would validate on held-out training classes instead: "
                "use one of them (remove the option, or relabel the validation rows as train or test)"
            )
        if (self.num_folds is not None or self.val_classes_fraction > 0) and (label_ids[rows["train"]] >= 0).sum(1).max() > 1:
            raise TableError(
                f"{where}: val_classes_fraction and num_folds hold out whole classes of the training rows, which "
                "label sets (rows with several labels) do not partition; give the table validation rows instead"
            )

        def split_files(name: str, idx: np.ndarray) -> SplitFiles:
            evaluation = name != "train"
            return SplitFiles(
                [table.paths[i] for i in idx],
                compact_labels(label_ids[idx]),
                boxes=None if table.boxes is None else table.boxes[idx],
                query_mask=table.is_query[idx] if evaluation else None,
                gallery_mask=table.is_gallery[idx] if evaluation else None,
                sequence=sequence[idx],
                category=category[idx],
            )

        # the test split: the test rows, else the validation rows (open-metric-learning's tables)
        tested = "test" if rows["test"].size else "validation"
        out = {"train": split_files("train", rows["train"]), "test": split_files("test", rows[tested])}
        self._warn_unanswerable(out["test"], tested)
        if self.has_validation_split:
            out["validation"] = split_files("validation", rows["validation"])
            self._warn_unanswerable(out["validation"], "validation")
        self._warn_shared_classes(out)
        return out

    def _warn_unanswerable(self, files: SplitFiles, name: str) -> None:
        labels = np.asarray(files.labels)
        count = queries_without_relevant_item(labels, files.query_mask, files.gallery_mask, files.sequence)
        if count:
            queries = int(np.sum(files.query_mask))
            rank_zero_warn(
                f"{self.dataset_name} {self.root}: {count} of {queries} {name} queries have no relevant gallery item "
                "(their label is absent from the gallery, or only on items of their own sequence); they count as "
                "misses in recall@K and as 0 in precision@K and mrr (docs/metrics.md)"
            )

    def _warn_shared_classes(self, splits: dict[str, SplitFiles]) -> None:
        train = np.asarray(splits["train"].labels)
        train_classes = set(train[train >= 0].ravel().tolist())
        for name in ("validation", "test"):
            if name not in splits:
                continue
            labels = np.asarray(splits[name].labels)
            shared = train_classes & set(labels[labels >= 0].ravel().tolist())
            if shared:
                shown = [self.class_names[c] for c in sorted(shared)[:3]]
                rank_zero_warn(
                    f"{self.dataset_name} {self.root}: {len(shared)} classes of the {name} rows are also training "
                    f"classes (e.g. {shown}); zero-shot retrieval expects disjoint classes"
                )

    # ------------------------------------------------------------------ set-up
    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        validation = self.split_datasets.get("validation")
        if validation is not None and self.val_dataset is not validation:
            self.val_dataset = validation
        self.hparams["test_as_val"] = self.test_as_val

    @property
    def train_class_ids(self) -> torch.Tensor:
        ids = super().train_class_ids
        return ids[ids >= 0]


__all__ = ["CSVDataModule", "TABLE_LAYOUT"]
