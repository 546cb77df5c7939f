"""The library's errors for a user's mistakes: one clear message, no traceback through the CLI.

Everything a user can fix (a missing dataset or weights file, a refused or failed download, a checksum that does
not match, a corrupt file) raises a :class:`UserInputError`. The ``lightning-dml`` command prints such an error as
one message and exits with status 1; any other exception is a bug and keeps its traceback (``--debug`` or
``LIGHTNING_DML_DEBUG=1`` shows the traceback of a user error too).

Each class also derives from the built-in exception that fits, so code that catches ``FileNotFoundError``,
``ValueError`` or ``OSError`` keeps working.
"""

from __future__ import annotations

__all__ = [
    "ChecksumError",
    "CorruptFileError",
    "DownloadError",
    "ManualDownloadError",
    "MissingFileError",
    "NotEnoughDiskSpaceError",
    "OfflineError",
    "UserInputError",
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
