"""Galleries and queries as lists of image files with labels: an image folder of class folders, a CSV (or
Parquet) table, image files.

* A **folder**: every image file under it (:data:`~lightning_dml.data.image_names.IMAGE_EXTENSIONS`, any case;
  hidden files and folders skipped as the data modules skip them), in sorted order; an image's label is the name of the
  first-level folder it is in (``<gallery>/<class>/.../<image>``), empty for an image directly in the folder.
* A **table** (``.csv``, ``.tsv``, ``.parquet``, ``.pq``): read by the data modules' table reader
  (:func:`~lightning_dml.data.table.read_raw_table`): a header naming a ``path`` column and optionally ``label``
  (other columns ignored), or no header and the fields ``path,label``; relative paths start from the table's
  folder. ``split``: with a ``split`` column, only the rows of that split are read.
* An **image file**: itself, without a label.

Every missing file is reported in one error naming the rows; an empty gallery is an error.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from lightning_dml.data.image_names import IMAGE_EXTENSIONS, is_hidden
from lightning_dml.data.table import TableError, normalise_name, read_raw_table
from lightning_dml.errors import MissingFileError, UserInputError

__all__ = ["GalleryError", "GalleryItems", "TABLE_SUFFIXES", "read_items", "read_sources"]

#: file suffixes read as tables
TABLE_SUFFIXES = (".csv", ".tsv", ".parquet", ".pq")
_SHOWN = 10


class GalleryError(UserInputError, ValueError):
    """A gallery or query source that cannot be read (no such path, no image, a bad table)."""


@dataclass
class GalleryItems:
    """Image files (absolute paths) and their labels (``""``: none), in order; ``queries``: the text each was given
    by (the path as given or as the table wrote it)."""

    paths: list[Path] = field(default_factory=list)
    labels: list[str] = field(default_factory=list)
    names: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.paths)

    def extend(self, other: "GalleryItems") -> None:
        self.paths.extend(other.paths)
        self.labels.extend(other.labels)
        self.names.extend(other.names)


def _is_image(name: str) -> bool:
    return not is_hidden(name) and name.lower().endswith(IMAGE_EXTENSIONS)


def _read_folder(root: Path) -> GalleryItems:
    items = GalleryItems()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not is_hidden(d))
        here = Path(dirpath)
        relative = here.relative_to(root).parts
        label = relative[0] if relative else ""
        for name in sorted(filenames):
            if _is_image(name):
                path = here / name
                items.paths.append(path.absolute())
                items.labels.append(label)
                items.names.append(str(path))
    if not items.paths:
        raise GalleryError(
            f"no image file in folder {root} (image files: {', '.join(IMAGE_EXTENSIONS)}, any case; hidden files "
            "skipped); a gallery is a folder of class folders <gallery>/<class>/<image>, or a CSV table path,label"
        )
    return items


def _read_table(file: Path, split: str | None) -> GalleryItems:
    raw = read_raw_table(file, headerless=("path", "label"))
    if "path" not in raw.columns:
        raise TableError(f"image table {file}: no 'path' column (the columns found are {', '.join(raw.columns)})")
    if split is not None and "split" not in raw.columns:
        raise TableError(f"image table {file}: split {split!r} asked for, but the table has no 'split' column")
    items = GalleryItems()
    missing: list[str] = []
    for i in range(len(raw)):
        if split is not None and raw.values["split"][i].strip().lower() != split.lower():
            continue
        text = raw.values["path"][i]
        if not text:
            missing.append(f"{raw.where(i)}: empty path")
            continue
        path = Path(text).expanduser()
        path = path if path.is_absolute() else file.parent / path
        if not path.is_file():
            missing.append(f"{raw.where(i)}: no file {path}")
            continue
        items.paths.append(path.absolute())
        items.labels.append(normalise_name(raw.values["label"][i]) if "label" in raw.columns else "")
        items.names.append(text)
    if missing:
        shown = "\n  ".join(missing[:_SHOWN])
        more = f"\n  ... and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
        raise TableError(f"image table {file}: {len(missing)} row(s) without an image file:\n  {shown}{more}\n"
                         "(relative paths start from the table's folder)")
    if not items.paths:
        which = f" of split {split!r}" if split is not None else ""
        raise TableError(f"image table {file} has no rows{which}")
    return items


def read_items(source: str | os.PathLike, split: str | None = None) -> GalleryItems:
    """The images of one source: a folder, a table or an image file (module docstring)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise MissingFileError(f"{source} does not exist (expected an image file, a folder of images or a CSV table)")
    if path.is_dir():
        return _read_folder(path)
    if path.suffix.lower() in TABLE_SUFFIXES:
        return _read_table(path, split)
    if path.suffix.lower() in IMAGE_EXTENSIONS:
        return GalleryItems([path.absolute()], [""], [str(source)])
    raise GalleryError(
        f"{source} is neither an image file ({', '.join(IMAGE_EXTENSIONS)}), a folder nor a table "
        f"({', '.join(TABLE_SUFFIXES)})"
    )


def read_sources(sources: list[str] | tuple[str, ...], split: str | None = None) -> GalleryItems:
    """The images of several sources, in the order given."""
    items = GalleryItems()
    for source in sources:
        items.extend(read_items(source, split))
    return items
