"""The library's errors for a user's mistakes: one clear message, no traceback through the CLI.

Everything a user can fix (a missing dataset or weights file, a refused or failed download, a checksum that does
not match, a corrupt file) raises a :class:`UserInputError`. The ``lightning-dml`` command prints such an error as
one message and exits with status 1; any other exception is a bug and keeps its traceback (``--debug`` or
``LIGHTNING_DML_DEBUG=1`` shows the traceback of a user error too).

Each class also derives from the built-in exception that fits, so code that catches ``FileNotFoundError``,
``ValueError`` or ``OSError`` keeps working.

A user error raised in a DataLoader worker process (a corrupt image) reaches the main process re-raised by torch
with the worker's whole traceback in its message; :func:`user_error_message` gives back the original message.
"""

from __future__ import annotations

import re

__all__ = [
    "ChecksumError",
    "CorruptFileError",
    "DownloadError",
    "ManualDownloadError",
    "MissingFileError",
    "NotEnoughDiskSpaceError",
    "OfflineError",
    "UserInputError",
    "user_error_message",
]


class UserInputError(Exception):
    """Base class of the errors a user can fix; the CLI prints them as a message without traceback."""


class MissingFileError(UserInputError, FileNotFoundError):
    """A file or folder the run needs (dataset, weights) is not where it should be."""


class OfflineError(MissingFileError):
    """A file is missing and downloads are switched off (``LIGHTNING_DML_OFFLINE=1`` or ``--offline``)."""


class ManualDownloadError(MissingFileError):
    """A dataset that cannot be downloaded automatically (dead official URL, web drive): place the files by hand."""


class CorruptFileError(UserInputError, ValueError):
    """A file exists but cannot be read as what it should be (a truncated or foreign weights file)."""


class DownloadError(UserInputError, OSError):
    """A download failed (network error, HTTP error) after its retries."""


class ChecksumError(DownloadError, ValueError):
    """A downloaded file does not have the published checksum or size; it was deleted."""


class NotEnoughDiskSpaceError(DownloadError):
    """The target file system has less free space than the download and its extraction need."""


#: torch's ``ExceptionWrapper.reraise`` message: ``Caught <Type> in DataLoader worker process <n>.`` (or ``in pin
#: memory thread ...``), a newline, then ``Original `` and the worker's ``traceback.format_exception`` text.
_WRAPPED = re.compile(r"\ACaught (?P<type>\w+) (?P<where>[^\n]*)\.\nOriginal (?P<traceback>Traceback .*)\Z", re.DOTALL)


def user_error_message(error: BaseException) -> str:
    """The message the CLI prints for the user error ``error``: ``str(error)``, or, for an error that a DataLoader
    worker raised and torch re-raised in the main process (``Caught CorruptImageError in DataLoader worker process
    0.`` followed by the worker's traceback), the original error's own message without the traceback: a corrupt
    image read by a worker prints the same line as one read in the main process.

    The original message is the text after the last ``<module>.<Type>: `` line of the worker's formatted traceback
    (the last exception of a chain is the one raised); if no such line is found, the traceback's last line.
    """
    text = str(error)
    wrapped = _WRAPPED.match(text)
    if wrapped is None or wrapped["type"] != type(error).__name__:
        return text
    body = wrapped["traceback"].rstrip("\n")
    kind = type(error)
    name = kind.__qualname__
    if kind.__module__ not in ("builtins", "__main__"):  # how traceback.format_exception names the type
        name = f"{kind.__module__}.{name}"
    start = body.rfind(f"\n{name}: ")
    if start < 0:
        return body.rsplit("\n", 1)[-1].strip()
    return body[start + len(name) + 3 :].strip()
