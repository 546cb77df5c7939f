"""Image tables in open-metric-learning's documented dataframe format, for the CSVDataModule tests.

OML's format (docs ``oml/data.rst``, "Dataset format"; ``oml.utils.dataframe_format.check_retrieval_dataframe_format``):
required columns ``label`` (integer), ``path`` (relative to ``dataset_root``, where OML's pipelines keep ``df.csv``),
``split`` (``train`` or ``validation``), ``is_query``, ``is_gallery`` (empty where ``split == train``, ``True`` /
``False`` where ``split == validation``; both true: "1 vs rest"); optional ``category`` (groups labels, e.g.
``furniture``), ``sequence`` (frames of one video: excluded from each other's retrieval) and ``x_1, x_2, y_1, y_2``
(integers: left, right, top, bottom; empty in the rows without a box). :func:`make_oml_table` writes such a file as
pandas' ``DataFrame.to_csv(index=False)`` would: the columns in OML's order, ``True``/``False`` flags, empty cells for
None/NaN, and box columns as floats (``4.0``) because a column with empty cells is a float column in pandas.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from tests.fixtures_data import write_jpeg

#: OML's column order (``oml.const``: LABELS, PATHS, SPLIT, IS_QUERY, IS_GALLERY, CATEGORIES, SEQUENCE, X1, X2, Y1, Y2)
OML_COLUMNS = ("label", "path", "split", "is_query", "is_gallery", "category", "sequence", "x_1", "x_2", "y_1", "y_2")

#: image size of the table fixtures (width, height)
SIZE = (24, 20)


def color_of(label: int, k: int) -> tuple[int, int, int]:
    """Images of one label share a colour (a trivially learnable task), with a small per-image shift."""
    return (37 * label % 200 + 20, 91 * label % 200 + 20, (53 * label + 3 * k) % 200 + 20)


@dataclass
class TableRows:
    """What :func:`make_oml_table` wrote: the file and, per data row, its values (for the tests' expectations)."""

    file: Path
    rows: list[dict[str, object]]


def make_oml_table(
    root: Path | str,
    train_labels: int = 8,
    validation_labels: int = 6,
    per_label: int = 4,
    categories: tuple[str, ...] = ("dresses", "shoes"),
    boxes: bool = True,
    filename: str = "df.csv",
    image_folder: str = "images",
) -> TableRows:
    """Write images and an OML-format ``df.csv`` under ``root``; return the file and its rows.

    Labels ``0 .. train_labels - 1`` train, the next ``validation_labels`` validate; label ``l`` is in category
    ``categories[l % len(categories)]``. Each label has ``per_label`` images in 2 sequences (``seq<l>_a``,
    ``seq<l>_b``, half of its images each); validation images with an even ``k`` are queries, every validation
    image is in the gallery (so queries are also gallery items: OML's "1 vs rest" where both are true). Every
    other image has a box (the rest have empty box cells); paths are relative to ``root``.
    """
    root = Path(root)
    rows: list[dict[str, object]] = []
    for label in range(train_labels + validation_labels):
        split = "train" if label < train_labels else "validation"
        for k in range(per_label):
            rel = f"{image_folder}/{label:03d}_{k}.jpg"
            write_jpeg(root / rel, color_of(label, k), SIZE)
            row: dict[str, object] = {
                "label": label,
                "path": rel,
                "split": split,
                "is_query": None if split == "train" else k % 2 == 0,
                "is_gallery": None if split == "train" else True,
                "category": categories[label % len(categories)],
                "sequence": f"seq{label}_{'a' if k < per_label // 2 else 'b'}",
            }
            box = (2, 3, SIZE[0] - 1 - k % 3, SIZE[1] - 2) if boxes and k % 2 == 1 else None  # x_1, y_1, x_2, y_2
            row.update(dict(zip(("x_1", "y_1", "x_2", "y_2"), box or (None,) * 4)))
            rows.append(row)
    write_rows(root / filename, rows, OML_COLUMNS if boxes else OML_COLUMNS[:7])
    return TableRows(root / filename, rows)


def pandas_cell(value: object, float_column: bool = False) -> str:
    """A cell as ``DataFrame.to_csv`` writes it: None/NaN empty, booleans ``True``/``False``, numbers of a column
    with empty cells as floats."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if float_column and isinstance(value, int):
        return f"{float(value)}"
    return str(value)


def write_rows(file: Path, rows: list[dict[str, object]], columns: tuple[str, ...]) -> Path:
    """Write ``rows`` with a header of ``columns`` (pandas' cell format)."""
    file.parent.mkdir(parents=True, exist_ok=True)
    with_empty = {c for c in columns if any(r.get(c) is None for r in rows)}
    with file.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns)
        for row in rows:
            writer.writerow([pandas_cell(row.get(c), c in with_empty and c.startswith(("x_", "y_"))) for c in columns])
    return file


__all__ = ["OML_COLUMNS", "SIZE", "TableRows", "color_of", "make_oml_table", "pandas_cell", "write_rows"]
