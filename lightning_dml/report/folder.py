"""Which folders a report may be written into: a new or empty one, an earlier report, or any with ``overwrite``.

A report replaces files of fixed names (``index.html``, ``report.css``, ``report.js``, ``data/*.js``,
``results.npz``): written into someone's own folder it would destroy their ``index.html`` without a word. So a
folder that is not empty must be recognised as a report (:func:`is_report_folder`) before anything is written:

* by its marker, ``report.json`` (``{"written_by": "lightning-dml report", ...}``), which :func:`claim_report_folder`
  writes first, before any other file: a report run killed midway leaves a folder that is still recognised;
* or, for a report written before the marker existed, by its files: ``index.html``, ``report.js`` and a
  ``data/summary.js`` that starts with the call every report's summary makes (``DMLReport.summary(``).

Anything else that is not empty is refused with one :class:`ReportFolderError` naming what it holds, unless
``overwrite`` is given: the report's files are then written into it (replacing those of the same names; other
files are left alone) and the marker makes it a report folder from then on.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from lightning_dml.data.cache_dir import write_json_atomic
from lightning_dml.errors import UserInputError

__all__ = ["LOCK", "MARKER", "ReportFolderError", "check_report_folder", "claim_report_folder", "is_report_folder"]

#: the marker file of a report folder
MARKER = "report.json"
#: the lock file held while a report is written into the folder (``filelock``): not content of the folder
LOCK = ".report.lock"
#: what the marker says
WRITTEN_BY = "lightning-dml report"
#: the first characters of every report's ``data/summary.js`` (``writer._js("DMLReport.summary", ...)``)
SUMMARY_START = b"DMLReport.summary("


class ReportFolderError(UserInputError, FileExistsError):
    """A report folder that cannot be written: a file, or a folder with other content (without ``overwrite``)."""


def _has_marker(folder: Path) -> bool:
    try:
        data = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("written_by") == WRITTEN_BY


def _has_report_files(folder: Path) -> bool:
    try:
        with open(folder / "data" / "summary.js", "rb") as handle:
            start = handle.read(len(SUMMARY_START))
    except OSError:
        return False
    return start == SUMMARY_START and (folder / "index.html").is_file() and (folder / "report.js").is_file()


def is_report_folder(folder: str | os.PathLike) -> bool:
    """Whether ``folder`` holds a report (see the module docstring: its marker, or an earlier report's files)."""
    folder = Path(folder)
    return folder.is_dir() and (_has_marker(folder) or _has_report_files(folder))


def check_report_folder(folder: str | os.PathLike, overwrite: bool = False, option: str = "--overwrite") -> None:
    """Raise :class:`ReportFolderError` unless a report may be written into ``folder``: it does not exist, is an
    empty folder, is a report (:func:`is_report_folder`), or ``overwrite`` is set. Writes nothing. ``option``: how
    the message names the way to overwrite (``--overwrite``, ``overwrite=True``)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise ReportFolderError(f"report folder {folder} is a file, not a folder")
    if overwrite or not folder.is_dir() or is_report_folder(folder):
        return
    entries = sorted(entry.name for entry in folder.iterdir() if entry.name != LOCK)
    if not entries:
        return
    shown = ", ".join(entries[:3]) + (f" and {len(entries) - 3} more" if len(entries) > 3 else "")
    raise ReportFolderError(
        f"report folder {folder} is not empty and holds no earlier report (it holds {shown}): give a new or empty "
        f"folder, or {option} to write the report into it (its index.html, report.css, report.js, data/, thumbs/ "
        "and results.npz are replaced; other files are left alone)"
    )


def claim_report_folder(folder: str | os.PathLike, overwrite: bool = False, option: str = "--overwrite") -> Path:
    """:func:`check_report_folder`, then create ``folder`` and write its marker (atomically, before any other
    file of the report): from now on it is a report folder. Returns the folder."""
    folder = Path(folder)
    check_report_folder(folder, overwrite, option)
    if not _has_marker(folder):
        write_json_atomic(folder / MARKER, {"written_by": WRITTEN_BY, "format": 1})
    return folder
