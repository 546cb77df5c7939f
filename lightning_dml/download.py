"""Downloads of datasets and pretrained weights: verified, resumed, locked, extracted atomically; offline switch.

* :func:`download_file` fetches one :class:`RemoteFile` into a ``<name>.part`` file, resuming an interrupted
  transfer with an HTTP ``Range`` request, checks the free disk space first, verifies the result (md5 or sha256,
  and the size where published) and renames it into place; a file that fails verification is deleted.
* :func:`extract_archive` unpacks a ``.tgz``/``.tar``/``.zip`` into a temporary folder next to the target and
  renames its top-level entries into place (plain files first, folders last), so a crash leaves either nothing
  or complete folders.
* :func:`fetch_dataset` does both for a dataset's archives under a :class:`filelock.FileLock` in the dataset
  root: the processes of a job, and several nodes sharing a file system, download a dataset once and never see
  a half-written file.
* :func:`fetch_weights` downloads a weights file into the torch hub cache with :func:`torch.hub.download_url_to_file`
  (the function ``torch.hub.load_state_dict_from_url`` uses: progress bar, sha256 prefix checked, atomic
  rename), under a file lock next to the file.
* :func:`fetch_url` downloads a file named only by its URL (a ``--ckpt_path https://...`` checkpoint) the same
  way, into a cache path the caller chooses.
* Offline: ``LIGHTNING_DML_OFFLINE=1`` in the environment, ``--offline`` on the command line or
  :func:`set_offline` forbid every download (a missing file raises :class:`~lightning_dml.errors.OfflineError`
  naming it); the switch also sets ``HF_HUB_OFFLINE=1`` for Hugging Face Hub.
* ``LIGHTNING_DML_RESOURCES`` names a YAML or JSON file whose ``weights:`` and ``datasets:`` mappings override
  entries of :data:`lightning_dml.models.WEIGHTS` and :data:`lightning_dml.data.RESOURCES` (see
  :func:`load_overrides`), so a mirror, a cluster job or a test redirects downloads without editing code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from filelock import FileLock

from lightning_dml.errors import (
    ChecksumError,
    DownloadError,
    ManualDownloadError,
    NotEnoughDiskSpaceError,
    OfflineError,
    UserInputError,
)

__all__ = [
    "OFFLINE_ENV",
    "RESOURCES_ENV",
    "DatasetResource",
    "RemoteFile",
    "apply_override",
    "download_file",
    "env_flag",
    "extract_archive",
    "fetch_dataset",
    "fetch_url",
    "fetch_weights",
    "is_offline",
    "load_overrides",
    "resolve_entry",
    "set_offline",
    "verify_file",
]

#: environment variable that forbids every download when set to 1 / true / yes / on
OFFLINE_ENV = "LIGHTNING_DML_OFFLINE"
#: environment variable naming a YAML or JSON file that overrides entries of ``WEIGHTS`` and ``RESOURCES``
RESOURCES_ENV = "LIGHTNING_DML_RESOURCES"

_CHUNK = 1 << 20
_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".tar", ".zip")


# ---------------------------------------------------------------------------------------------- offline switch
def env_flag(name: str) -> bool:
    """Whether the environment variable ``name`` is 1, true, yes or on."""
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def is_offline() -> bool:
    """Whether downloads are forbidden (``LIGHTNING_DML_OFFLINE`` is 1, true, yes or on)."""
    return env_flag(OFFLINE_ENV)


def set_offline(offline: bool = True) -> None:
    """Forbid (or allow again) every download of this process and of the processes it starts.

    Sets ``LIGHTNING_DML_OFFLINE`` (inherited by DDP processes) and, when going offline, ``HF_HUB_OFFLINE=1``.
    """
    os.environ[OFFLINE_ENV] = "1" if offline else "0"
    if offline:
        os.environ["HF_HUB_OFFLINE"] = "1"


def _refuse_offline(what: str, target: Path, hint: str) -> None:
    if is_offline():
        raise OfflineError(
            f"{what}: {target} does not exist, and downloads are switched off ({OFFLINE_ENV}=1 or --offline). {hint}"
        )


# ---------------------------------------------------------------------------------------------- table entries
@dataclass(frozen=True)
class RemoteFile:
    """One downloadable file: where it is, the name it is stored under, and how it is verified.

    Args:
        url: where the file is downloaded from.
        file_name: the name it is stored under (the torch hub cache name for weights, the archive's name for
            datasets).
        md5: published md5 of the file (full hex digest).
        sha256: published sha256, full or a prefix of at least 8 hex digits (torch hub's file-name convention).
        size: size in bytes; checked where given, and the only check where no checksum is published.
        mirrors: further URLs tried in order when ``url`` fails; only for files with a checksum.
    """

    url: str
    file_name: str
    md5: str | None = None
    sha256: str | None = None
    size: int | None = None
    mirrors: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.md5 is None and self.sha256 is None and self.size is None:
            raise UserInputError(f"{self.file_name} ({self.url}): give md5, sha256 or size, so the download can be verified")
        if self.mirrors and self.md5 is None and self.sha256 is None:
            raise UserInputError(f"{self.file_name}: mirrors need a checksum (md5 or sha256) to verify their file")
        if self.sha256 is not None and len(self.sha256) < 8:
            raise UserInputError(f"{self.file_name}: sha256 needs at least 8 hex digits, got {self.sha256!r}")
        object.__setattr__(self, "mirrors", tuple(self.mirrors))

    @property
    def is_archive(self) -> bool:
        return self.file_name.lower().endswith(_ARCHIVE_SUFFIXES)


@dataclass(frozen=True)
class DatasetResource:
    """The archives of a dataset and the page they come from.

    Args:
        dataset: the dataset's name in messages.
        page: the official page (cited in messages and docs).
        archives: the files ``download: true`` fetches and unpacks into ``root``; empty where no automatic
            download exists (then ``manual`` says which files to place where).
        manual: instructions for a dataset that cannot be downloaded automatically.
    """

    dataset: str
    page: str
    archives: tuple[RemoteFile, ...] = ()
    manual: str | None = None

    def __post_init__(self) -> None:
        archives = tuple(a if isinstance(a, RemoteFile) else RemoteFile(**a) for a in self.archives)
        object.__setattr__(self, "archives", archives)


# ---------------------------------------------------------------------------------------------- overrides
def load_overrides(section: str) -> dict[str, dict[str, Any]]:
    """The ``section`` (``"weights"`` or ``"datasets"``) of the file named by ``LIGHTNING_DML_RESOURCES``.

    The file (YAML or JSON) maps names to the fields to replace, e.g.::

        weights:
          bninception: {url: "https://mirror.example/bn_inception-52deb4733.pth"}
        datasets:
          cub200:
            archives:
              - {url: "https://mirror.example/CUB_200_2011.tgz", file_name: CUB_200_2011.tgz,
                 md5: 97eceeb196236b17998738112f37df78}
    """
    name = os.environ.get(RESOURCES_ENV)
    if not name:
        return {}
    path = Path(name).expanduser()
    if not path.is_file():
        raise UserInputError(f"{RESOURCES_ENV}={name}: no such file")
    text = path.read_text(encoding="utf-8")
    try:
        if path.suffix.lower() == ".json":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
    except Exception as error:  # noqa: BLE001 - name the file in the message
        raise UserInputError(f"{RESOURCES_ENV}={path}: cannot parse it ({type(error).__name__}: {error})") from error
    data = data or {}
    if not isinstance(data, dict) or not set(data) <= {"weights", "datasets"}:
        raise UserInputError(f"{RESOURCES_ENV}={path}: expected a mapping with keys 'weights' and/or 'datasets'")
    entries = data.get(section) or {}
    if not isinstance(entries, dict) or not all(isinstance(v, dict) for v in entries.values()):
        raise UserInputError(f"{RESOURCES_ENV}={path}: '{section}' must map names to mappings of fields")
    return entries


def apply_override(entry: Any, override: Mapping[str, Any] | None, where: str) -> Any:
    """``entry`` (a :class:`RemoteFile` or :class:`DatasetResource`) with the fields of ``override`` replaced."""
    if not override:
        return entry
    known = {f.name for f in fields(entry)}
    unknown = set(override) - known
    if unknown:
        raise UserInputError(f"{RESOURCES_ENV}: {where}: unknown fields {sorted(unknown)} (known: {sorted(known)})")
    try:
        return replace(entry, **override)
    except TypeError as error:
        raise UserInputError(f"{RESOURCES_ENV}: {where}: {error}") from error


def resolve_entry(table: Mapping[str, Any], name: str, section: str, cls: type) -> Any:
    """``table[name]`` with the ``LIGHTNING_DML_RESOURCES`` override of ``section``/``name`` applied (or a new
    ``cls`` entry built from the override alone)."""
    override = load_overrides(section).get(name)
    if name in table:
        return apply_override(table[name], override, f"{section} {name!r}")
    if override is None:
        raise KeyError(f"no {section} entry named {name!r}; known: {', '.join(sorted(table))}")
    try:
        return cls(**override)
    except TypeError as error:
        raise UserInputError(f"{RESOURCES_ENV}: {section} {name!r}: {error}") from error


# ---------------------------------------------------------------------------------------------- verification
def verify_file(path: Path, remote: RemoteFile) -> str | None:
    """``None`` if ``path`` has ``remote``'s size and checksums, else a sentence saying what differs."""
    size = path.stat().st_size
    if remote.size is not None and size != remote.size:
        return f"size {size:,} bytes instead of {remote.size:,}"
    digests = {}
    if remote.md5 is not None:
        digests["md5"] = hashlib.md5()
    if remote.sha256 is not None:
        digests["sha256"] = hashlib.sha256()
    if digests:
        with open(path, "rb") as handle:
            while chunk := handle.read(_CHUNK):
                for digest in digests.values():
                    digest.update(chunk)
    if "md5" in digests and digests["md5"].hexdigest() != remote.md5.lower():
        return f"md5 {digests['md5'].hexdigest()} instead of {remote.md5}"
    if "sha256" in digests and not digests["sha256"].hexdigest().startswith(remote.sha256.lower()):
        return f"sha256 {digests['sha256'].hexdigest()} does not start with {remote.sha256}"
    return None


def _check_disk_space(folder: Path, needed: int, what: str) -> None:
    free = shutil.disk_usage(folder).free
    if needed > free:
        raise NotEnoughDiskSpaceError(
            f"{what} needs about {needed / 1e9:.2f} GB in {folder}, which has {free / 1e9:.2f} GB free. Free some "
            "space or choose another folder."
        )


# ---------------------------------------------------------------------------------------------- download
def _expected_total(response: Any, offset: int) -> int | None:
    """The full file size from a ``Content-Range`` (resumed) or ``Content-Length`` header."""
    content_range = response.headers.get("Content-Range")
    if content_range and "/" in content_range and content_range.rsplit("/", 1)[1].strip().isdigit():
        return int(content_range.rsplit("/", 1)[1])
    length = response.headers.get("Content-Length")
    return offset + int(length) if length and length.isdigit() else None


def _fetch(url: str, part: Path, remote: RemoteFile, extra_space: int, progress: bool, timeout: float) -> None:
    """Append the rest of ``url`` to ``part`` (resuming from its size); one attempt."""
    offset = part.stat().st_size if part.exists() else 0
    if remote.size is not None and offset == remote.size:
        return
    headers = {"User-Agent": "lightning-dml"}
    if offset:
        headers["Range"] = f"bytes={offset}-"
    try:
        response = urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout)
    except urllib.error.HTTPError as error:
        if error.code == 416 and offset:  # the .part file is not a prefix of this file: start again
            part.unlink()
            raise ConnectionError(f"HTTP 416 for a resumed download of {url}; restarting") from error
        raise
    with response:
        if offset and getattr(response, "status", None) != 206:
            offset = 0  # the server ignored the Range request: rewrite from the start
        total = _expected_total(response, offset) or remote.size
        if total is not None:
            _check_disk_space(part.parent, total - offset + extra_space, f"downloading {remote.file_name}")
        from tqdm.auto import tqdm

        with open(part, "ab" if offset else "wb") as handle, tqdm(
            total=total, initial=offset, unit="B", unit_scale=True, desc=remote.file_name, disable=not progress,
            file=sys.stderr,
        ) as bar:
            while chunk := response.read(_CHUNK):
                handle.write(chunk)
                bar.update(len(chunk))
    written = part.stat().st_size
    if total is not None and written < total:
        raise ConnectionError(f"connection closed after {written:,} of {total:,} bytes")


def download_file(
    remote: RemoteFile,
    dest: Path,
    what: str,
    hint: str,
    extra_space: int = 0,
    retries: int = 3,
    progress: bool = True,
    timeout: float = 60.0,
) -> Path:
    """Download ``remote`` to ``dest`` (verified; resumed after an interruption) unless a verified copy is there.

    Args:
        remote: what to download and how to verify it.
        dest: the final path; the transfer goes to ``<dest>.part`` and is renamed when verified.
        what: the file's description in messages.
        hint: what the user can do instead (placing the file by hand), appended to error messages.
        extra_space: bytes needed on top of the file itself (its extraction), for the free-space check.
        retries: attempts after the first, each resuming where the last stopped, from each URL in turn.
        progress: show a progress bar on stderr.
        timeout: seconds without data before an attempt fails.
    """
    dest = Path(dest)
    if dest.is_file():
        problem = verify_file(dest, remote)
        if problem is None:
            return dest
        raise ChecksumError(f"{what}: {dest} exists but has {problem}. Delete it to download it again. {hint}")
    _refuse_offline(what, dest, hint)
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    failures: list[str] = []
    done = False
    for url in (remote.url, *remote.mirrors):
        for attempt in range(retries + 1):
            try:
                _fetch(url, part, remote, extra_space, progress, timeout)
            except NotEnoughDiskSpaceError:
                raise
            except (urllib.error.HTTPError, ValueError) as error:  # 404, 403, an unknown URL scheme: next URL
                failures.append(f"{url}: {error}")
                break
            except OSError as error:  # refused, reset, timed out, closed early: resume from where it stopped
                failures.append(f"{url} (attempt {attempt + 1}): {error}")
                time.sleep(0.5 * 2**attempt)
            else:
                done = True
                break
        if done:
            break
    if not done:
        tried = "\n  ".join(failures[-6:])
        raise DownloadError(f"could not download {what} to {dest}:\n  {tried}\n{hint}")
    problem = verify_file(part, remote)
    if problem is not None:
        part.unlink()
        raise ChecksumError(
            f"{what} downloaded from {remote.url} has {problem}; the file was deleted. The server sent a different "
            f"file (a changed release, a broken mirror or proxy). {hint}"
        )
    os.replace(part, dest)
    return dest


# ---------------------------------------------------------------------------------------------- extraction
def _safe_zip_members(archive: zipfile.ZipFile, path: Path) -> None:
    for name in archive.namelist():
        target = Path(name)
        if target.is_absolute() or ".." in target.parts:
            raise UserInputError(f"{path}: refusing to extract {name!r} (outside the target folder)")


def extract_archive(archive: Path, root: Path) -> list[Path]:
    """Unpack ``archive`` into ``root`` atomically per top-level entry; return the entries placed in ``root``.

    The archive is extracted into a temporary folder inside ``root`` (same file system), then each top-level
    entry is renamed into ``root``, plain files first and folders last. A failure (a corrupt archive, a full
    disk) removes the temporary folder and leaves ``root`` as it was.
    """
    root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".extracting-", dir=root))
    try:
        try:
            if archive.name.lower().endswith(".zip"):
                with zipfile.ZipFile(archive) as handle:
                    _safe_zip_members(handle, archive)
                    handle.extractall(staging)
            else:
                with tarfile.open(archive, "r:*") as handle:
                    handle.extractall(staging, filter="data")
        except (tarfile.TarError, zipfile.BadZipFile, EOFError, OSError) as error:
            raise DownloadError(f"cannot extract {archive}: {type(error).__name__}: {error}") from error
        entries = sorted(staging.iterdir(), key=lambda p: (p.is_dir(), p.name))
        for entry in entries:
            target = root / entry.name
            if target.is_dir():
                raise UserInputError(
                    f"{target} already exists but is not a complete copy of what {archive.name} holds (the dataset "
                    f"check failed). Remove it, or point root at another folder."
                )
        placed = []
        for entry in entries:
            os.replace(entry, root / entry.name)
            placed.append(root / entry.name)
        return placed
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- datasets
def fetch_dataset(
    resource: DatasetResource, root: Path, is_present: Callable[[], bool], layout: str, progress: bool = True
) -> bool:
    """Download and unpack ``resource`` into ``root`` unless ``is_present()``; ``True`` if something was fetched.

    Runs under a file lock in ``root`` (``.lightning_dml.lock``): concurrent callers (the nodes of a job on one
    file system) wait, then find the dataset present. Files are downloaded into ``root/.downloads/``; archives
    are extracted into ``root`` (see :func:`extract_archive`) and deleted, then plain files are renamed into
    ``root``, so the files a data module looks for appear last.
    """
    root = Path(root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / ".lightning_dml.lock")):
        if is_present():
            return False
        what = resource.dataset
        if not resource.archives:
            raise ManualDownloadError(
                f"{what} cannot be downloaded automatically: {resource.manual}\nOfficial page: {resource.page}\n"
                f"Place the files so that {root} has this layout, then run without download: true:\n{layout}"
            )
        urls = ", ".join(a.url for a in resource.archives)
        hint = f"You can also download {urls} yourself (see {resource.page}) and unpack it into {root}."
        if is_offline():
            raise OfflineError(
                f"{what} is not in {root}, and downloads are switched off ({OFFLINE_ENV}=1 or --offline). {hint}"
                f"\nExpected layout:\n{layout}"
            )
        sizes = [a.size for a in resource.archives if a.size is not None]
        if len(sizes) == len(resource.archives):
            _check_disk_space(root, 2 * sum(sizes), f"{what} (download and extraction)")
        downloads = root / ".downloads"
        paths = []
        for remote in resource.archives:
            extra = (remote.size or 0) if remote.is_archive else 0
            paths.append(download_file(remote, downloads / remote.file_name, f"{what} ({remote.file_name})", hint,
                                       extra, progress=progress))
        for remote, path in zip(resource.archives, paths):
            if remote.is_archive:
                extract_archive(path, root)
                path.unlink()
        for remote, path in zip(resource.archives, paths):
            if not remote.is_archive:
                os.replace(path, root / remote.file_name)
        if not any(downloads.iterdir()):
            downloads.rmdir()
        return True


# ---------------------------------------------------------------------------------------------- weights
def fetch_weights(remote: RemoteFile, folder: Path, what: str, hint: str, progress: bool = True) -> Path:
    """``folder/remote.file_name``, downloaded first with ``torch.hub.download_url_to_file`` if missing.

    The download runs under a file lock next to the file (``<file name>.lock``), so processes of one job or of
    several nodes sharing the cache download it once; ``download_url_to_file`` writes a temporary file, checks the
    sha256 prefix and renames it into place. An md5 or size in the table is checked afterwards.
    """
    import torch

    folder = Path(folder).expanduser()
    path = folder / remote.file_name
    if path.is_file():
        return path
    _refuse_offline(f"pretrained weights for {what}", path, hint)
    folder.mkdir(parents=True, exist_ok=True)
    failures = []
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return path
        for url in (remote.url, *remote.mirrors):
            try:
                torch.hub.download_url_to_file(url, str(path), hash_prefix=remote.sha256, progress=progress)
                break
            except RuntimeError as error:  # torch reports a hash mismatch as RuntimeError('invalid hash value ...')
                if "hash" in str(error):
                    raise ChecksumError(
                        f"pretrained weights for {what} downloaded from {url} do not have the published sha256 "
                        f"prefix {remote.sha256} ({error}); nothing was saved. {hint}"
                    ) from error
                failures.append(f"{url}: {error}")
            except (urllib.error.URLError, OSError, ValueError) as error:
                failures.append(f"{url}: {error}")
        else:
            tried = "\n  ".join(failures)
            raise DownloadError(f"could not download pretrained weights for {what} to {path}:\n  {tried}\n{hint}")
        problem = verify_file(path, remote) if remote.md5 or remote.size else None
        if problem is not None:
            path.unlink()
            raise ChecksumError(f"pretrained weights for {what} downloaded from {url} have {problem}; deleted. {hint}")
    return path


def fetch_url(url: str, path: Path, what: str, hint: str, progress: bool = True, timeout: float = 60.0) -> Path:
    """``path``, downloaded first from ``url`` if missing (a file named only by its URL: no checksum is known, so
    the file is whole or absent, and what it holds is the caller's to check).

    The transfer goes to a temporary file beside ``path``, renamed into place when complete, under a file lock
    next to ``path`` (the processes of a job download it once); ``timeout``: seconds without data before it fails.
    Offline (``LIGHTNING_DML_OFFLINE=1``) a missing file is an :class:`~lightning_dml.errors.OfflineError`; a failed
    transfer a :class:`~lightning_dml.errors.DownloadError` naming the URL (nothing is left behind).
    """
    path = Path(path).expanduser()
    if path.is_file():
        return path
    _refuse_offline(what, path, hint)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if path.is_file():
            return path
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        try:
            from tqdm.auto import tqdm

            request = urllib.request.Request(url, headers={"User-Agent": "lightning-dml"})
            with os.fdopen(handle, "wb") as out, urllib.request.urlopen(request, timeout=timeout) as response:
                total = _expected_total(response, 0)
                if total is not None:
                    _check_disk_space(path.parent, total, f"downloading {what}")
                with tqdm(total=total, unit="B", unit_scale=True, desc=path.name, disable=not progress,
                          file=sys.stderr) as bar:
                    while chunk := response.read(_CHUNK):
                        out.write(chunk)
                        bar.update(len(chunk))
            written = Path(temporary).stat().st_size
            if total is not None and written < total:
                raise ConnectionError(f"connection closed after {written:,} of {total:,} bytes")
            os.replace(temporary, path)
        except NotEnoughDiskSpaceError:
            raise
        except (OSError, ValueError) as error:  # URLError, HTTPError, timeouts, resets are OSErrors
            raise DownloadError(f"could not download {what} to {path}: {error}. {hint}") from None
        finally:
            Path(temporary).unlink(missing_ok=True)
    return path
