"""An index folder as one unit: written whole beside the old one and swapped in, locked, recovered after a crash.

Every write of an index folder ``P`` (:meth:`~lightning_dml.index.EmbeddingIndex.save`, ``lightning-dml index
build`` and ``index add``) follows one protocol, so that a reader sees the complete old folder or the complete new
one, never a mix, and a writer killed at any instant (Ctrl-C, ``SIGKILL``, a crash) leaves the old folder whole:

1. **Lock** (:func:`locked`): the file lock ``.P.lock`` *beside* the folder (``P``'s parent; not inside: the folder
   itself is replaced), with the holder's pid, host, command and start time in ``.P.lock.json`` while it is held.
   A second writer waits, saying who holds it (one line on stderr), for at most ``timeout`` seconds, then stops with
   an :class:`IndexBusyError` naming the holder. The lock is re-entrant within a thread: ``index add`` holds it from
   loading the index to saving it (its embedding included), and the save inside takes it again; ``index build``
   takes it only to write the folder, after embedding its gallery.
2. **Write** every file into a fresh sibling ``.P.building-<pid>-<token>`` (:func:`replacing`).
3. **Swap**: rename ``P`` to ``.P.old-<pid>-<token>``, rename the new folder to ``P``, rename the old one to
   ``.P.trash-<pid>-<token>`` and delete it. Python's standard library has no atomic exchange of two directories,
   so between the first two renames ``P`` does not exist; ``SIGINT``, ``SIGTERM`` and ``SIGHUP`` are held back
   during the three renames (they take effect right after), so only a ``SIGKILL`` or a crash can stop a writer
   there. The second rename is the commit point: a writer stopped before it leaves the old folder, one stopped after
   it the new one.
4. **Recover** (:func:`recover`, under the lock): when ``P`` is missing and a ``.P.old-*`` sibling exists, a swap was
   stopped between its renames and that sibling is the complete old folder: it is renamed back to ``P``. Every other
   ``.P.building-*``, ``.P.old-*`` and ``.P.trash-*`` sibling is a leftover of a stopped writer (no writer runs while
   the lock is held by another) and is deleted. Writers recover before they write; readers
   (:meth:`~lightning_dml.index.EmbeddingIndex.load`) recover only when ``P`` is missing (:func:`settle`), and
   otherwise ignore the siblings.

A reader that loads while a writer swaps may read files of two folders: ``manifest.json`` carries a random ``uid``
written by each save, and :meth:`~lightning_dml.index.EmbeddingIndex.load` reads it again after the other files
and starts over when it changed. The protocol guards against killed and concurrent processes on one machine (the
lock is ``filelock``'s, an ``flock`` on Unix); it does not ``fsync``, so it does not promise the new folder after a
power loss.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import signal
import socket
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from filelock import FileLock, Timeout

from lightning_dml.errors import MissingFileError, UserInputError
from lightning_dml.index.manifest import IndexFolderError

__all__ = ["DEFAULT_LOCK_TIMEOUT", "IndexBusyError", "holder", "locked", "lock_file", "real_folder", "recover",
           "replacing", "settle", "swap"]

#: Seconds a writer waits for another writer of the same index folder before it stops (``--lock_timeout``)
DEFAULT_LOCK_TIMEOUT = 600.0

_SIBLING = re.compile(r"^\.(?P<name>.+)\.(?P<what>building|old|trash)-\d+-[0-9a-f]+$")
_HELD: dict[tuple[str, int], int] = {}  # (lock file, thread id) -> depth of the holds of this thread
_HELD_GUARD = threading.Lock()


class IndexBusyError(UserInputError, TimeoutError):
    """Another process holds the lock of an index folder for longer than the timeout, or saved the folder since
    this process loaded it."""


def real_folder(folder: str | os.PathLike) -> Path:
    """The absolute path of ``folder`` with symbolic links resolved: the folder that is locked and replaced (a link
    to an index folder stays a link; the folder it points to is replaced)."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(folder))))


def lock_file(folder: str | os.PathLike) -> Path:
    """The lock file of an index folder: ``.NAME.lock`` beside it."""
    path = real_folder(folder)
    return path.parent / f".{path.name}.lock"


def _holder_file(folder: Path) -> Path:
    return folder.parent / f".{folder.name}.lock.json"


def holder(folder: str | os.PathLike) -> str:
    """Who holds the lock of ``folder``, in words, from ``.NAME.lock.json`` (``"another process"`` without it)."""
    try:
        data = json.loads(_holder_file(real_folder(folder)).read_text())
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(data["since"])))
        return f"pid {int(data['pid'])} on {data['host']} ({data['what']}, since {since})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process"


def _say(message: str) -> None:
    print(f"lightning-dml: {message}", file=sys.stderr, flush=True)


def _write_holder(folder: Path, what: str) -> None:
    note = {"pid": os.getpid(), "host": socket.gethostname(), "what": what, "since": time.time(),
            "argv": sys.argv[:8]}
    target = _holder_file(folder)
    staged = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    try:
        staged.write_text(json.dumps(note))
        os.replace(staged, target)
    except OSError:  # only a courtesy to the waiters
        staged.unlink(missing_ok=True)


@contextmanager
def locked(folder: str | os.PathLike, timeout: float = DEFAULT_LOCK_TIMEOUT,
           what: str = "a write of the index") -> Iterator[Path]:
    """Hold the lock of the index folder ``folder`` (module docstring, step 1); yields :func:`real_folder`.

    Waits at most ``timeout`` seconds (a line on stderr names the holder when it has to wait), then raises
    :class:`IndexBusyError` naming the holder and the lock file. Re-entrant within a thread. ``what`` is what the
    holder does, for the others' messages. The folder's parent must exist."""
    path = real_folder(folder)
    if not path.parent.is_dir():
        raise MissingFileError(f"index folder {path} does not exist (nor its parent folder)")
    key = (str(lock_file(path)), threading.get_ident())
    with _HELD_GUARD:
        depth = _HELD.get(key, 0)
        if depth:
            _HELD[key] = depth + 1
    if depth:
        try:
            yield path
        finally:
            with _HELD_GUARD:
                _HELD[key] -= 1
        return
    lock = FileLock(key[0])
    try:
        lock.acquire(timeout=0)
    except Timeout:
        _say(f"index folder {path} is locked by {holder(path)}; waiting up to {timeout:g} s (lock file {key[0]})")
        try:
            lock.acquire(timeout=max(float(timeout), 0.0))
        except Timeout:
            raise IndexBusyError(
                f"index folder {path} is locked by {holder(path)} for more than {timeout:g} s (lock file {key[0]}): "
                "try again when it is done, or give a longer --lock_timeout"
            ) from None
    try:
        _write_holder(path, what)
        with _HELD_GUARD:
            _HELD[key] = 1
        yield path
    finally:
        with _HELD_GUARD:
            _HELD.pop(key, None)
        if holder(path).startswith(f"pid {os.getpid()} on "):
            _holder_file(path).unlink(missing_ok=True)
        lock.release()


def _siblings(path: Path) -> list[tuple[str, Path]]:
    """The ``.NAME.building-*``, ``.NAME.old-*`` and ``.NAME.trash-*`` siblings of ``path``: ``(what, sibling)``."""
    try:
        entries = list(os.scandir(path.parent))
    except OSError:
        return []
    found = []
    for entry in entries:
        match = _SIBLING.match(entry.name)
        if match and match["name"] == path.name:
            found.append((match["what"], Path(entry.path)))
    return found


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _sibling(path: Path, what: str) -> Path:
    return path.parent / f".{path.name}.{what}-{os.getpid()}-{secrets.token_hex(4)}"


def recover(folder: str | os.PathLike) -> Path | None:
    """Under the lock (:func:`locked`): restore the old folder of a swap stopped between its renames, and delete
    the leftovers of stopped writers (module docstring, step 4). Returns the sibling restored, if any."""
    path = real_folder(folder)
    restored = None
    if not os.path.lexists(path):
        olds = [p for what, p in _siblings(path) if what == "old"]
        if olds:
            restored = max(olds, key=lambda p: p.stat().st_mtime_ns)  # only one, unless the protocol was bypassed
            os.rename(restored, path)
            _say(f"index folder {path} was missing (a replacement stopped halfway): restored the previous one from "
                 f"{restored.name}")
    for _, leftover in _siblings(path):
        _remove(leftover)
    return restored


def settle(folder: str | os.PathLike, timeout: float = DEFAULT_LOCK_TIMEOUT) -> None:
    """Before reading ``folder``: when it is missing but a stopped swap left the old folder beside it, restore it
    (under the lock). Does nothing, and takes no lock, in every other case."""
    path = real_folder(folder)
    if os.path.lexists(path) or not any(what == "old" for what, _ in _siblings(path)):
        return
    try:
        with locked(path, timeout, "recovery of a stopped replacement"):
            recover(path)
    except OSError as error:
        if isinstance(error, UserInputError):
            raise
        olds = [p for what, p in _siblings(path) if what == "old"]
        raise IndexFolderError(
            f"index folder {path} is missing: a replacement stopped halfway left the previous index in "
            f"{olds[0] if olds else 'a hidden sibling'}, which could not be renamed back ({error}); rename it back "
            f"to {path.name}"
        ) from None


@contextmanager
def _signals_held() -> Iterator[None]:
    """Hold back ``SIGINT``, ``SIGTERM`` and ``SIGHUP`` (delivered when the block ends) where the platform can."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def swap(staged: Path, folder: str | os.PathLike) -> None:
    """Put the complete folder ``staged`` in the place of ``folder`` (module docstring, step 3), under the lock.
    When the new folder cannot be renamed in, the old one is renamed back and the error raised."""
    path = real_folder(folder)
    old, trash = _sibling(path, "old"), _sibling(path, "trash")
    committed = False
    try:
        with _signals_held():  # a signal held back is raised when the block ends, after the commit
            had = os.path.lexists(path)
            if had:
                os.rename(path, old)
            try:
                os.rename(staged, path)
            except BaseException:
                if had:
                    os.rename(old, path)
                raise
            committed = True
            if had:
                os.rename(old, trash)
    finally:
        if committed and had:
            shutil.rmtree(trash, ignore_errors=True)


@contextmanager
def replacing(folder: str | os.PathLike, *, timeout: float = DEFAULT_LOCK_TIMEOUT, what: str = "a write of the index",
              check: Callable[[Path], None] | None = None) -> Iterator[Path]:
    """Lock ``folder``, recover it, and yield a fresh empty sibling folder to write the new index into; when the
    block ends normally the sibling is swapped in, when it raises (``KeyboardInterrupt`` included) the sibling is
    deleted and ``folder`` is left as it was. ``check``: a callable run on :func:`real_folder` under the lock,
    before the sibling is made (to refuse a target, e.g. an existing index without ``--overwrite``)."""
    target = real_folder(folder)
    cwd = Path.cwd()
    if cwd == target or target in cwd.parents:
        raise IndexFolderError(f"{folder} is the working folder or holds it: an index folder is replaced as a whole; "
                               "give another folder")
    target.parent.mkdir(parents=True, exist_ok=True)
    with locked(folder, timeout, what) as path:
        recover(path)
        if check is not None:
            check(path)
        staged = _sibling(path, "building")
        staged.mkdir()
        try:
            if path.is_dir():  # the new folder keeps the old one's permissions (a folder shared by a group)
                os.chmod(staged, stat.S_IMODE(path.stat().st_mode))
            yield staged
            swap(staged, path)
        except BaseException:
            _remove(staged)
            raise
