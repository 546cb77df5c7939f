"""The image table reader shared by :class:`~lightning_dml.data.CSVDataModule` and the CSV branch of
:class:`~lightning_dml.data.ImageFolderDataModule`: one CSV or Parquet file, one row per image.

Columns (a header row names them; case and surrounding spaces are ignored, other columns are ignored):

* ``path``: the image file, relative to ``images_root`` (default: the table's folder) or absolute.
* ``split``: one of the reader's splits (``train``, ``validation``, ``test`` for :class:`CSVDataModule`).
* ``label``: the class, any text or integer; or ``labels``: a label set, labels separated by ``;`` (``12;40``).
  With both, a row's ``labels`` (when not empty) must contain its ``label``.
* ``is_query``, ``is_gallery`` (optional, evaluation rows only; empty or absent: true): ``true``/``false``,
  ``1``/``0``, ``yes``/``no``. An evaluation row that is neither is an error.
* ``category``, ``sequence`` (optional; empty: none): any text or integer.
* ``x_1``, ``y_1``, ``x_2``, ``y_2`` (optional, all four or none; a row may leave all four empty): a crop box in
  pixels, left, top, right, bottom, with PIL's convention (``x_2``, ``y_2`` exclusive: the box ``0, 0, W, H`` is
  the whole image), as open-metric-learning's tables give it.

Every problem is collected and reported in ONE :class:`TableError` naming the file, the row (as a spreadsheet
shows it: the header is row 1, the first image row 2; in a Parquet file the 0-based row index) and the column:
an unknown split, an empty path or label, an unparsable label set or flag or box coordinate, a box with
``x_2 <= x_1``, a negative coordinate, a missing file, two rows of the same file and box, a missing required column
(naming the columns found). Boxes are checked against the image size, read from each boxed file's header (PIL
reads the header only; in threads, with a progress bar).

Values of ``label``/``labels``/``category``/``sequence`` are text; integers written as floats (``12.0``, what
pandas writes for an integer column with an empty cell) are read as the integer. Text that tools write for a missing
value (``nan``, ``NaN``, ``None``, ``null``, ``NA``, ``N/A``, ``#N/A``, ``<NA>``: :data:`MISSING_VALUES`) is an error
naming the rows and the column, not a class: an empty cell is how a value is left out.

Two rows name the same image when their paths resolve to the same file (symbolic links followed,
:func:`resolved_paths`): a folder reached through a link is the same folder, and such rows are the duplicate error.
"""

from __future__ import annotations

import csv
import math
import os
import re
from collections import defaultdict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from lightning_dml.errors import UserInputError

#: the splits of :class:`~lightning_dml.data.CSVDataModule`'s tables
SPLITS = ("train", "validation", "test")
#: the crop box columns: left, top, right, bottom (PIL's convention: right and bottom exclusive)
BOX_COLUMNS = ("x_1", "y_1", "x_2", "y_2")
#: every column the reader knows
COLUMNS = ("path", "split", "label", "labels", "is_query", "is_gallery", "category", "sequence", *BOX_COLUMNS)
#: the separator of the labels of a label set
LABEL_SEPARATOR = ";"

#: what tools write for a missing value (pandas ``nan``/``NaN``/``None``/``<NA>``, R ``NA``, spreadsheets ``#N/A``),
#: compared in lower case: in a ``label``, ``labels``, ``category`` or ``sequence`` cell such text is an error naming
#: the row and column, never a class (or category, or sequence) of that name; an empty cell is the missing value
MISSING_VALUES = frozenset({"nan", "none", "null", "na", "n/a", "#n/a", "<na>"})

_TRUE = frozenset({"true", "1", "1.0", "yes", "y", "t"})
_FALSE = frozenset({"false", "0", "0.0", "no", "n", "f"})
#: how many problems one error lists
_SHOWN = 10


class TableError(UserInputError, ValueError):
    """An image table that cannot be used: the message names the file, the rows and the columns."""


@dataclass
class RawTable:
    """A table as text: ``values[column][i]`` is the cell of data row ``i`` (``""`` when empty)."""

    file: Path
    columns: list[str]
    values: dict[str, list[str]]
    rows: list[int]
    kind: str = "csv"

    def __len__(self) -> int:
        return len(self.rows)

    def where(self, i: int) -> str:
        """Where data row ``i`` is, as the user finds it: ``"row 7"`` (CSV, header = row 1) or ``"row index 5"``
        (Parquet, 0-based as pandas shows it)."""
        return f"row {self.rows[i]}" if self.kind == "csv" else f"row index {self.rows[i]}"


class Problems:
    """Problems found in a table, raised together as one :class:`TableError`."""

    def __init__(self, table: RawTable) -> None:
        self.table = table
        self.found: list[str] = []

    def add(self, i: int | None, column: str | None, message: str) -> None:
        where = [] if i is None else [self.table.where(i)]
        if column is not None:
            where.append(f"column {column!r}")
        self.found.append(f"{', '.join(where)}: {message}" if where else message)

    def raise_if_any(self, hint: str = "") -> None:
        if not self.found:
            return
        count = len(self.found)
        shown = "\n  ".join(self.found[:_SHOWN])
        more = f"\n  ... and {count - _SHOWN} more" if count > _SHOWN else ""
        what = "a problem" if count == 1 else f"{count} problems"
        raise TableError(f"image table {self.table.file}: {what}:\n  {shown}{more}" + (f"\n{hint}" if hint else ""))


# --------------------------------------------------------------------------------------------------- reading
def _cell_text(value: Any) -> str:
    """A Parquet cell as the text a CSV would hold (``None``/NaN empty, integral floats as integers, lists joined
    with ``;``)."""
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return ""
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, (list, tuple)):
        return LABEL_SEPARATOR.join(_cell_text(v) for v in value)
    return str(value)


def _read_parquet(file: Path) -> RawTable:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TableError(
            f"image table {file}: reading Parquet needs pyarrow: pip install 'lightning-dml[parquet]' "
            "(or pip install pyarrow), or save the table as CSV"
        ) from None
    try:
        data = pq.read_table(file).to_pydict()
    except Exception as error:  # noqa: BLE001 - any reader failure names the file
        raise TableError(f"image table {file}: not a readable Parquet file ({type(error).__name__}: {error})") from error
    names = [str(name).strip().lower() for name in data]
    _check_header(file, names)
    values = {name: [_cell_text(v) for v in column] for name, column in zip(names, data.values())}
    count = len(next(iter(values.values()), []))
    return RawTable(file, names, values, list(range(count)), kind="parquet")


def _check_header(file: Path, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise TableError(f"image table {file}: column {name!r} appears twice in the header")
        seen.add(name)


def read_raw_table(file: str | os.PathLike, headerless: Sequence[str] | None = None) -> RawTable:
    """Read a CSV (``,``; ``.tsv``: tab) or Parquet (``.parquet``, ``.pq``) table as text.

    The first non-empty CSV row is the header when it names a ``path`` column; otherwise, with ``headerless``
    column names given, every row is data in that column order, else it is an error. Rows are numbered as a
    spreadsheet numbers them (the header is row 1; empty rows count and are skipped). A row with another number of
    fields than the header is an error naming it.
    """
    file = Path(file)
    if not file.is_file():
        raise TableError(f"image table {file} does not exist")
    if file.suffix.lower() in (".parquet", ".pq"):
        return _read_parquet(file)
    delimiter = "\t" if file.suffix.lower() == ".tsv" else ","
    try:
        with open(file, newline="", encoding="utf-8-sig") as handle:
            records = list(csv.reader(handle, delimiter=delimiter))
    except UnicodeDecodeError as error:
        raise TableError(f"image table {file}: not UTF-8 text ({error}); a CSV or Parquet table is expected") from None
    except csv.Error as error:
        raise TableError(f"image table {file}: not a readable CSV file ({error})") from None
    numbered = [(n, rec) for n, rec in enumerate(records, start=1) if rec and any(f.strip() for f in rec)]
    if not numbered:
        raise TableError(f"image table {file} is empty")
    first_number, first = numbered[0]
    header = [f.strip().lower() for f in first]
    if "path" in header:
        _check_header(file, header)
        data = numbered[1:]
    elif headerless is not None:
        header = list(headerless)
        data = numbered
    else:
        raise TableError(
            f"image table {file}: row {first_number} must be a header naming the columns (path, split, label, ...); "
            f"it is {first}"
        )
    values: dict[str, list[str]] = {name: [] for name in header}
    rows: list[int] = []
    bad = []
    for number, record in data:
        if len(record) != len(header):
            bad.append(f"row {number}: {len(record)} fields, the header has {len(header)} ({', '.join(header)})")
            continue
        for name, cell in zip(header, record):
            values[name].append(cell.strip())
        rows.append(number)
    if bad:
        shown = "\n  ".join(bad[:_SHOWN])
        more = f"\n  ... and {len(bad) - _SHOWN} more" if len(bad) > _SHOWN else ""
        raise TableError(f"image table {file}: rows with a wrong number of fields:\n  {shown}{more}")
    return RawTable(file, header, values, rows, kind="csv")


# --------------------------------------------------------------------------------------------------- parsing
@dataclass
class ImageTable:
    """The parsed rows of an image table (row ``i`` of every field is data row ``i`` of :attr:`raw`)."""

    raw: RawTable
    paths: list[Path]
    split: np.ndarray
    label_sets: list[tuple[str, ...]]
    is_query: np.ndarray
    is_gallery: np.ndarray
    category: list[str | None]
    sequence: list[str | None]
    boxes: np.ndarray | None
    columns: set[str] = field(default_factory=set)

    def __len__(self) -> int:
        return len(self.paths)


_INTEGER = re.compile(r"[+-]?\d+")
_INTEGRAL_FLOAT = re.compile(r"[+-]?\d+\.0*")


def normalise_name(text: str) -> str:
    """A label, category or sequence value as a name: stripped, and an integer written as a float (``12.0``, what
    pandas writes for an integer column with an empty cell) read as that integer (``12``). Other text is kept as
    written (``007`` stays ``007``)."""
    text = text.strip()
    if _INTEGRAL_FLOAT.fullmatch(text):
        return str(int(float(text)))
    return text


def is_missing_value(text: str) -> bool:
    """Whether a cell's text is what a tool writes for a missing value (:data:`MISSING_VALUES`)."""
    return text.strip().lower() in MISSING_VALUES


def _missing_value(i: int, column: str, text: str, problems: Problems, leave_empty: str) -> bool:
    """Record the problem of a missing value written as text in ``column`` of row ``i``; whether there was one."""
    if not is_missing_value(text):
        return False
    problems.add(i, column, f"{text.strip()!r} is a missing value written as text, not a {column.rstrip('s')} name: "
                 f"{leave_empty}")
    return True


def resolved_paths(paths: Sequence[str | os.PathLike]) -> list[str]:
    """Every path with its symbolic links followed (``os.path.realpath``): two paths of one file give one string.
    Each folder is resolved once and listed once (``os.scandir``: which of its entries are links, without a
    ``stat`` per file). Missing files resolve as far as their folders exist."""
    folders: dict[str, tuple[str, frozenset[str]]] = {}
    out = []
    for path in paths:
        text = os.fspath(path)
        text = text if os.path.isabs(text) else os.path.join(os.getcwd(), text)
        head, tail = os.path.split(text)
        if tail in ("", ".", ".."):
            out.append(os.path.realpath(text))
            continue
        folder = folders.get(head)
        if folder is None:
            try:
                with os.scandir(head) as entries:
                    links = frozenset(entry.name for entry in entries if entry.is_symlink())
            except OSError:  # a missing folder: no link in it
                links = frozenset()
            folder = folders[head] = (os.path.realpath(head), links)
        candidate = os.path.join(folder[0], tail)
        out.append(os.path.realpath(candidate) if tail in folder[1] else candidate)
    return out


def _flag(text: str) -> bool | None:
    lowered = text.strip().lower()
    if lowered in _TRUE:
        return True
    if lowered in _FALSE:
        return False
    return None


def parse_image_table(
    raw: RawTable,
    splits: Sequence[str] = SPLITS,
    images_root: str | os.PathLike | None = None,
    evaluation_splits: Sequence[str] | None = None,
    columns: Sequence[str] = COLUMNS,
    check_files: bool = True,
    check_boxes: bool = True,
    progress: bool = False,
) -> ImageTable:
    """Parse and check ``raw`` (see the module docstring); raise one :class:`TableError` listing every problem.

    Args:
        raw: the table as text (:func:`read_raw_table`).
        splits: the allowed values of ``split`` (lower case).
        images_root: the folder relative paths start from (default: the table's folder).
        evaluation_splits: the splits whose rows are evaluated (their ``is_query``/``is_gallery`` are read; the
            others' are ignored); default every split but ``train``.
        columns: the columns read (the others are ignored).
        check_files: check that every image file exists.
        check_boxes: check every box against its image's size (reads each boxed file's header).
        progress: show a progress bar while the image sizes are read.
    """
    file = raw.file
    root = Path(images_root).expanduser() if images_root is not None else file.parent
    present = {c for c in raw.columns if c in columns}
    missing = [c for c in ("path", "split") if c in columns and c not in present]
    if not ({"label", "labels"} & present):
        missing.append("label (or labels)")
    if missing:
        raise TableError(
            f"image table {file}: missing required column{'s' if len(missing) > 1 else ''} {', '.join(missing)}; "
            f"the columns found are {', '.join(raw.columns) or 'none'}"
        )
    given_boxes = [c for c in BOX_COLUMNS if c in present]
    if given_boxes and len(given_boxes) != 4:
        absent = [c for c in BOX_COLUMNS if c not in present]
        raise TableError(
            f"image table {file}: box columns {', '.join(given_boxes)} without {', '.join(absent)}: give all four "
            "(x_1, y_1, x_2, y_2: left, top, right, bottom) or none"
        )
    evaluation = set(s for s in splits if s != "train") if evaluation_splits is None else set(evaluation_splits)
    n = len(raw)
    problems = Problems(raw)
    cells = raw.values

    paths: list[Path] = []
    split = np.empty(n, dtype=object)
    label_sets: list[tuple[str, ...]] = []
    is_query = np.ones(n, dtype=bool)
    is_gallery = np.ones(n, dtype=bool)
    boxes = np.full((n, 4), np.nan) if given_boxes else None
    for i in range(n):
        text = cells["path"][i]
        if not text:
            problems.add(i, "path", "empty path")
        image = Path(text).expanduser()
        paths.append(image if image.is_absolute() else root / image)

        value = cells["split"][i].lower()
        if value not in splits:
            problems.add(i, "split", f"unknown split {cells['split'][i]!r}; expected {', '.join(splits)}")
        split[i] = value

        label_sets.append(_label_set(cells, i, present, value in evaluation, problems))

        if value in evaluation:
            for name, out in (("is_query", is_query), ("is_gallery", is_gallery)):
                if name in present and cells[name][i]:
                    flag = _flag(cells[name][i])
                    if flag is None:
                        problems.add(i, name, f"{cells[name][i]!r} is not a flag; expected true/false, 1/0 or yes/no")
                    else:
                        out[i] = flag
            if not (is_query[i] or is_gallery[i]):
                problems.add(i, "is_query", "is_query and is_gallery are both false: the row takes no part in "
                             "evaluation; remove it or set one of them")

        if boxes is not None:
            boxes[i] = _box(cells, i, problems)

    for name in ("category", "sequence"):
        if name in present:
            for i, text in enumerate(cells[name]):
                _missing_value(i, name, text, problems, f"leave the cell empty for a row without a {name}")
    category = [normalise_name(v) or None for v in cells["category"]] if "category" in present else [None] * n
    sequence = [normalise_name(v) or None for v in cells["sequence"]] if "sequence" in present else [None] * n
    problems.raise_if_any()

    # the same file and box twice (also through a symbolic link): one item listed twice, counted twice by every metric
    first: dict[tuple, int] = {}
    for i, (path, real) in enumerate(zip(paths, resolved_paths(paths))):
        key = (real, None if boxes is None or np.isnan(boxes[i, 0]) else tuple(boxes[i]))
        if key not in first:
            first[key] = i
            continue
        other = paths[first[key]]
        if os.path.normpath(other) == os.path.normpath(path):
            problems.add(i, "path", f"{path} is listed again (first at {raw.where(first[key])}) with the same box; "
                         "every image (or box of an image) must be listed once")
        else:
            problems.add(i, "path", f"{path} is the file {other} of {raw.where(first[key])} (both resolve to {real}, "
                         "through a symbolic link) with the same box; every image (or box of an image) must be listed "
                         "once")
    if check_files:
        for i, path in enumerate(paths):
            if not path.is_file():
                problems.add(i, "path", f"no file {path}")
        relative = "" if images_root is not None else " (relative paths start from the table's folder; set images_root otherwise)"
        missing = any(": no file " in found for found in problems.found)
        problems.raise_if_any(f"Image files are looked for under {root}{relative}." if missing else "")
    problems.raise_if_any()
    if check_boxes and boxes is not None:
        _check_boxes_inside(paths, boxes, problems, progress)
        problems.raise_if_any()
    return ImageTable(raw, paths, split, label_sets, is_query, is_gallery, category, sequence, boxes, present)


def _label_set(cells: dict[str, list[str]], i: int, present: set[str], evaluated: bool, problems: Problems) -> tuple[str, ...]:
    empty = ("leave the cell empty for an item without a label" if evaluated
             else "every training item needs a class")
    label = normalise_name(cells["label"][i]) if "label" in present else ""
    if label and _missing_value(i, "label", label, problems, empty):
        return ()
    names: tuple[str, ...] = (label,) if label else ()
    if "labels" in present and cells["labels"][i]:
        text = cells["labels"][i]
        if is_missing_value(text) or any(is_missing_value(p) for p in text.split(LABEL_SEPARATOR)):
            problems.add(i, "labels", f"{text!r} holds a missing value written as text, not a label name: "
                         f"{empty if evaluated else 'give the row its labels'}")
            return names
        if any(c in text for c in "[]{}(),"):
            problems.add(i, "labels", f"unparsable label set {text!r}: write the labels separated by "
                         f"'{LABEL_SEPARATOR}' (e.g. 12;40)")
            return names
        parts = [normalise_name(p) for p in text.split(LABEL_SEPARATOR)]
        if any(not p for p in parts):
            problems.add(i, "labels", f"unparsable label set {text!r}: an empty label between '{LABEL_SEPARATOR}'")
            return names
        unique = tuple(dict.fromkeys(parts))  # in the given order, once each
        if label and label not in unique:
            problems.add(i, "labels", f"the label set {text!r} does not contain the row's label {label!r}")
        names = unique
    if not names and not evaluated:
        column = "labels" if "labels" in present and "label" not in present else "label"
        problems.add(i, column, "empty label: every training item needs a class")
    return names


def _box(cells: dict[str, list[str]], i: int, problems: Problems) -> np.ndarray:
    texts = [cells[c][i] for c in BOX_COLUMNS]
    if not any(texts):
        return np.full(4, np.nan)  # no box: the whole image
    values = []
    for column, text in zip(BOX_COLUMNS, texts):
        try:
            value = float(text)
        except ValueError:
            problems.add(i, column, f"{text!r} is not a number" if text else "empty while other box columns are set")
            return np.full(4, np.nan)
        if not math.isfinite(value):
            problems.add(i, column, f"{text!r} is not a finite number")
            return np.full(4, np.nan)
        values.append(value)
    x1, y1, x2, y2 = values
    for column, value in zip(BOX_COLUMNS, values):
        if value < 0:
            problems.add(i, column, f"negative box coordinate {value:g}")
            return np.full(4, np.nan)
    if x2 <= x1:
        problems.add(i, "x_2", f"x_2 = {x2:g} is not right of x_1 = {x1:g} (the box is x_1, y_1, x_2, y_2: left, top, "
                     "right, bottom)")
    if y2 <= y1:
        problems.add(i, "y_2", f"y_2 = {y2:g} is not below y_1 = {y1:g} (the box is x_1, y_1, x_2, y_2: left, top, "
                     "right, bottom)")
    return np.asarray(values)


def image_sizes(paths: Sequence[Path], progress: bool = False, description: str = "image sizes") -> list[tuple[int, int] | str]:
    """``(width, height)`` of every file from its header (PIL opens the file lazily: the header only, no decode),
    or the reason it could not be read; in threads (file reads release the GIL), with a tqdm progress bar."""
    from tqdm.auto import tqdm

    def size(path: Path) -> tuple[int, int] | str:
        try:
            with Image.open(path) as image:
                return image.size
        except Exception as error:  # noqa: BLE001 - reported with the row
            return " ".join(f"{type(error).__name__}: {error}".split())

    workers = min(32, (os.cpu_count() or 1) + 4)
    out: list[tuple[int, int] | str] = []
    with ThreadPoolExecutor(max_workers=workers) as pool, tqdm(
        total=len(paths), desc=description, unit="file", disable=not progress, leave=False, dynamic_ncols=True,
        delay=1.0,  # shown when it takes more than a second
    ) as bar:
        for result in pool.map(size, paths, chunksize=64):
            out.append(result)
            bar.update(1)
    return out


def _check_boxes_inside(paths: list[Path], boxes: np.ndarray, problems: Problems, progress: bool) -> None:
    boxed = np.flatnonzero(~np.isnan(boxes[:, 0]))
    if boxed.size == 0:
        return
    sizes = image_sizes([paths[i] for i in boxed], progress, "checking boxes against image sizes")
    for i, found in zip(boxed.tolist(), sizes):
        if isinstance(found, str):
            problems.add(i, "path", f"cannot read the size of {paths[i]} to check its box: {found}")
            continue
        width, height = found
        x1, y1, x2, y2 = boxes[i]
        if x2 > width or y2 > height:
            column = "x_2" if x2 > width else "y_2"
            problems.add(i, column, f"the box ({x1:g}, {y1:g}, {x2:g}, {y2:g}) reaches outside the {width}x{height} "
                         f"image {paths[i].name} (x_2 <= width and y_2 <= height: right and bottom are exclusive)")


# --------------------------------------------------------------------------------------------------- encoding
def _sort_key(name: str) -> tuple:
    return (0, int(name), name) if _INTEGER.fullmatch(name) else (1, 0, name)


def encode_names(values: Sequence[str | None]) -> tuple[np.ndarray, list[str]]:
    """``(ids int64 [N], names)``: each distinct value gets the id of its position in ``names`` (integers in
    numeric order first, then text in sorted order); ``None`` is -1."""
    names = sorted({v for v in values if v is not None}, key=_sort_key)
    index = {name: i for i, name in enumerate(names)}
    return np.asarray([-1 if v is None else index[v] for v in values], dtype=np.int64), names


def encode_label_sets(label_sets: Sequence[tuple[str, ...]]) -> tuple[np.ndarray, list[str]]:
    """``(ids int64 [N, L], class_names)``: each row the class ids of its set in ascending order, padded with -1 to
    the largest set ``L`` (at least 1)."""
    names = sorted({n for s in label_sets for n in s}, key=_sort_key)
    index = {name: i for i, name in enumerate(names)}
    width = max(1, max((len(s) for s in label_sets), default=1))
    ids = np.full((len(label_sets), width), -1, dtype=np.int64)
    for row, names_of_row in enumerate(label_sets):
        ids[row, : len(names_of_row)] = sorted(index[n] for n in names_of_row)
    return ids, names


def compact_labels(ids: np.ndarray) -> np.ndarray:
    """Label sets ``[N, L]`` narrowed to the largest set of these rows; ``[N]`` when every row has exactly one
    label (plain class ids: every loss and sampler takes them)."""
    counts = (ids >= 0).sum(axis=1)
    width = max(1, int(counts.max(initial=0)))
    if bool((counts == 1).all()):
        return ids[:, 0].copy()
    return ids[:, :width].copy()


def queries_without_relevant_item(
    labels: np.ndarray, is_query: np.ndarray, is_gallery: np.ndarray, sequence: np.ndarray | None = None
) -> int:
    """The number of queries that no gallery item is relevant to: no other gallery item shares a label with them
    outside their own sequence (``labels`` ``[N]`` or ``[N, L]`` padded with -1; ``sequence`` -1: none). Such a
    query counts as a miss in Recall@K (``docs/metrics.md``). Exact, in O(number of labels)."""
    sets = labels[:, None] if labels.ndim == 1 else labels
    n = sets.shape[0]
    seq = np.full(n, -1, dtype=np.int64) if sequence is None else np.asarray(sequence, dtype=np.int64)
    gallery_count: defaultdict[int, int] = defaultdict(int)
    in_sequence: defaultdict[tuple[int, int], int] = defaultdict(int)
    for row in np.flatnonzero(is_gallery):
        for label in set(sets[row][sets[row] >= 0].tolist()):
            gallery_count[label] += 1
            if seq[row] >= 0:
                in_sequence[(label, int(seq[row]))] += 1
    without = 0
    for row in np.flatnonzero(is_query):
        found = False
        for label in set(sets[row][sets[row] >= 0].tolist()):
            others = gallery_count[label]
            if seq[row] >= 0:
                others -= in_sequence[(label, int(seq[row]))]  # its sequence, itself included
            elif is_gallery[row]:
                others -= 1  # itself
            if others > 0:
                found = True
                break
        without += not found
    return without


__all__ = [
    "BOX_COLUMNS",
    "COLUMNS",
    "ImageTable",
    "LABEL_SEPARATOR",
    "MISSING_VALUES",
    "RawTable",
    "SPLITS",
    "TableError",
    "compact_labels",
    "encode_label_sets",
    "encode_names",
    "image_sizes",
    "is_missing_value",
    "normalise_name",
    "parse_image_table",
    "queries_without_relevant_item",
    "read_raw_table",
    "resolved_paths",
]
