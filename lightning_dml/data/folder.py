"""A user's own images: ``train/<class>/*`` + ``test/<class>/*`` folders, or a CSV of ``path,label,split``.

The same samplers, transforms and evaluation as the benchmarks. For zero-shot retrieval the train and test
classes should be disjoint (a warning says when they are not). A CSV may instead split the evaluation set into
``query`` and ``gallery`` rows (In-Shop style: queries are ranked against the gallery). The CSV is read and
checked by the table reader :class:`~lightning_dml.data.CSVDataModule` uses (:mod:`lightning_dml.data.table`):
the same errors naming rows and columns; for categories, sequences, boxes, label sets and validation rows use
:class:`~lightning_dml.data.CSVDataModule`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from pytorch_lightning.utilities import rank_zero_warn

from lightning_dml.data.files import DatasetLayoutError, ImageFilesDataModule, SplitFiles
from lightning_dml.data.image_names import IMAGE_EXTENSIONS, SKIPPED_FOLDERS, is_hidden  # re-exported here
from lightning_dml.data.table import TableError, parse_image_table, read_raw_table, resolved_paths

#: the splits of the CSV branch (``query``/``gallery``: the evaluation rows of an In-Shop style split)
CSV_SPLITS = ("train", "test", "query", "gallery")

#: validation folder names a class-folder tree may have beside ``train/`` and ``test/``: not read (one warning says so)
VALIDATION_FOLDERS = ("val", "valid", "validation")

FOLDER_LAYOUT = """\
  either  <root>/train/<class name>/<image>.jpg ... and <root>/test/<class name>/<image>.jpg ...
  or      a CSV file (root=<file>.csv, or csv_file=...) with rows  path,label,split
          (optional header; path relative to the CSV's folder or absolute; label any class name;
          split train, test, or query/gallery instead of test)"""


class ImageFolderDataModule(ImageFilesDataModule):
    """Own images from class folders or a CSV list, with the benchmarks' samplers, transforms and evaluation.

    Labels are the class names mapped to 0..C-1 in sorted order over all splits (a name in both splits gets one
    label). Image extensions recognised in folders: ``IMAGE_EXTENSIONS`` (case-insensitive). Hidden files and
    folders (names starting with ``.``, e.g. macOS's ``._<name>.jpg`` AppleDouble files, which carry an image
    extension but no image) and ``__MACOSX`` folders are skipped (:func:`is_hidden`); a class folder without any
    image file is not a class, and one warning names every such folder. An image reached twice (a class folder or file
that is a symbolic link to another listed one) is an error naming both. A ``val/`` (``valid/``, ``validation/``) folder beside
    ``train/`` and ``test/`` is not read, and one warning says so and why (for a validation split of one's own:
    :class:`~lightning_dml.data.CSVDataModule`'s ``validation`` rows).

    Args:
        *args, **kwargs: see :class:`~lightning_dml.data.files.ImageFilesDataModule` (``root``: the folder with
            ``train/`` and ``test/``, or a CSV file).
        csv_file: a CSV file (relative to ``root`` or absolute); overrides the folder layout.
    """

    dataset_name = "image folder"
    layout = FOLDER_LAYOUT
    expected_counts: dict[str, int] = {}

    def __init__(self, *args: Any, csv_file: str | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.csv_file = csv_file
        self.class_names: list[str] = []

    def _csv_path(self) -> Path | None:
        if self.csv_file is not None:
            path = Path(self.csv_file).expanduser()
            return path if path.is_absolute() else self.root / path
        if self.root.suffix.lower() == ".csv":
            return self.root
        return None

    def find_top(self) -> Path:
        csv_path = self._csv_path()
        if csv_path is not None:
            if not csv_path.is_file():
                raise DatasetLayoutError(f"{self.dataset_name}: CSV file {csv_path} does not exist. Expected layout:\n{self.layout}")
            return csv_path.parent
        for split in ("train", "test"):
            if not (self.root / split).is_dir():
                raise DatasetLayoutError(
                    f"{self.dataset_name}: folder {self.root / split} does not exist. Expected layout:\n{self.layout}"
                )
        return self.root

    def _read_folders(self, top: Path) -> dict[str, list[tuple[Path, str]]]:
        out: dict[str, list[tuple[Path, str]]] = {}
        empty: list[str] = []
        for split in ("train", "test"):
            items = []
            for class_dir in sorted(p for p in (top / split).iterdir() if p.is_dir() and not is_hidden(p.name)):
                found = 0
                for dirpath, dirnames, filenames in os.walk(class_dir):
                    dirnames[:] = sorted(d for d in dirnames if not is_hidden(d))  # not walked into
                    for filename in sorted(filenames):
                        if not is_hidden(filename) and filename.lower().endswith(IMAGE_EXTENSIONS):
                            items.append((Path(dirpath) / filename, class_dir.name))
                            found += 1
                if not found:
                    empty.append(f"{split}/{class_dir.name}")
            out[split] = items
        self._check_same_files(top, out)
        ignored = [name for name in VALIDATION_FOLDERS if (top / name).is_dir()]
        if ignored:
            rank_zero_warn(
                f"{self.dataset_name} at {top}: folder {', '.join(n + '/' for n in ignored)} is ignored: "
                "ImageFolderDataModule reads train/ and test/ only and validates on test/ (the papers' protocol) or on "
                "held-out training classes (val_classes_fraction, num_folds); for a validation split of your own, "
                "list the images in a table with split 'validation' rows (CSVDataModule, docs/datasets.md)"
            )
        if empty:
            rank_zero_warn(
                f"{self.dataset_name} at {top}: {len(empty)} class folder(s) without any image file are ignored "
                f"(no class): {', '.join(empty)}. Image files: {', '.join(IMAGE_EXTENSIONS)} (any case), hidden "
                "files and folders skipped"
            )
        return out

    def _check_same_files(self, top: Path, items: dict[str, list[tuple[Path, str]]]) -> None:
        """One error naming every image reached twice through a symbolic link (a linked class folder, a linked
        file): the same item listed twice, counted twice by every metric (as a table's duplicate rows are)."""
        listed = [path for rows in items.values() for path, _ in rows]
        first: dict[str, Path] = {}
        same = []
        for path, real in zip(listed, resolved_paths(listed)):
            if real in first:
                same.append(f"{path.relative_to(top)} is {first[real].relative_to(top)}")
            else:
                first[real] = path
        if same:
            shown = "; ".join(same[:5]) + (f"; ... and {len(same) - 5} more" if len(same) > 5 else "")
            raise DatasetLayoutError(
                f"{self.dataset_name} at {top}: {len(same)} image(s) reached twice through a symbolic link ({shown}); "
                "every image must be listed once: remove the link or the copy"
            )

    def _read_csv(self, path: Path) -> dict[str, list[tuple[Path, str]]]:
        """The CSV's rows per split as ``(image path, class name)``, read by the shared table reader: a header
        ``path,label,split`` (any order, other columns ignored) or none (then the three fields in that order)."""
        table = parse_image_table(
            read_raw_table(path, headerless=("path", "label", "split")), CSV_SPLITS,
            columns=("path", "label", "split"), check_files=self.check_files, check_boxes=False,
        )
        out: dict[str, list[tuple[Path, str]]] = {name: [] for name in CSV_SPLITS}
        for i, (image, split) in enumerate(zip(table.paths, table.split)):
            (label,) = table.label_sets[i] or ("",)
            if not label:
                raise TableError(f"image table {path}: {table.raw.where(i)}, column 'label': empty label")
            out[split].append((image, label))
        if out["test"] and (out["query"] or out["gallery"]):
            raise TableError(f"image table {path} mixes 'test' rows with 'query'/'gallery' rows; use one or the other")
        if bool(out["query"]) != bool(out["gallery"]):
            raise TableError(f"image table {path} has 'query' rows without 'gallery' rows or the reverse")
        return out

    def read_splits(self, top: Path) -> dict[str, SplitFiles]:
        csv_path = self._csv_path()
        items = self._read_csv(csv_path) if csv_path is not None else self._read_folders(top)
        names = sorted({label for rows in items.values() for _, label in rows})
        self.class_names = names
        index = {name: i for i, name in enumerate(names)}

        def split_files(rows: list[tuple[Path, str]]) -> tuple[list[Path], np.ndarray]:
            return [p for p, _ in rows], np.asarray([index[label] for _, label in rows], dtype=np.int64)

        train_paths, train_labels = split_files(items["train"])
        if items.get("query"):
            q_paths, q_labels = split_files(items["query"])
            g_paths, g_labels = split_files(items["gallery"])
            test = SplitFiles(
                q_paths + g_paths,
                np.concatenate([q_labels, g_labels]),
                query_mask=np.arange(len(q_paths) + len(g_paths)) < len(q_paths),
                gallery_mask=np.arange(len(q_paths) + len(g_paths)) >= len(q_paths),
            )
        else:
            test_paths, test_labels = split_files(items["test"])
            test = SplitFiles(test_paths, test_labels)
        shared = np.intersect1d(train_labels, test.labels)
        if shared.size:
            rank_zero_warn(
                f"{self.dataset_name} at {top}: {shared.size} classes are in both train and test "
                f"(e.g. {[names[i] for i in shared[:3]]}); zero-shot retrieval expects disjoint classes"
            )
        return {"train": SplitFiles(train_paths, train_labels), "test": test}
