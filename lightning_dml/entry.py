"""The ``lightning-dml`` console script: answers what needs no model at once, then hands over to
:func:`lightning_dml.cli.main`.

Importing torch and Lightning takes seconds, so this module imports neither (standard library and
:mod:`lightning_dml.cli_parsing` only):

* ``lightning-dml``, ``lightning-dml --help``: the list of commands, written here from :data:`COMMANDS`;
* a misspelt command (``lightning-dml fitt``): one error line naming the closest commands;
* ``lightning-dml <command> --help``: the text shipped in the package (``lightning_dml/help_texts/<command>.txt``,
  written from the real parsers at :data:`HELP_WIDTH` columns by ``tools/help_texts.py``, which a test runs to
  fail when a shipped text differs from what the parser prints) when the installed Python and the distributions
  of :data:`HELP_DISTRIBUTIONS` have the versions the texts were written with (``help_texts/versions.json``).
  Otherwise the command prints its help itself the first time (which imports what it needs) and it is kept in
  the cache folder (``$LIGHTNING_DML_CACHE/help``, by default ``~/.cache/lightning-dml/help``), keyed by those
  versions, every source file's size and modification time and the terminal width; later calls print the kept
  text without importing torch. ``LIGHTNING_DML_HELP_CACHE=0`` turns the cache off.

Every other command line runs the command: :data:`COMMANDS` by their module's ``main(argv)`` (these modules
import only what their command needs: ``search`` does not import Lightning), ``fit``, ``validate``, ``test`` and
``predict`` by :func:`lightning_dml.cli.build_cli`.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import io
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from lightning_dml import __version__
from lightning_dml.cli_parsing import suggest
from lightning_dml.download import env_flag, set_offline
from lightning_dml.errors import UserInputError, user_error_message

#: The commands of ``lightning-dml`` beside LightningCLI's ``fit``, ``validate``, ``test`` and ``predict``: name ->
#: (module whose ``main(argv)`` runs it, one line of help). The one place to register a command:
#: :func:`lightning_dml.cli.main` dispatches ``lightning-dml <name> ...`` to the module and ``lightning-dml --help``
#: lists it.
COMMANDS: dict[str, tuple[str, str]] = {
    "cv": (
        "lightning_dml.protocol.cv",
        "class-disjoint cross-validation of a config: k folds, R repeats, test table with 95% intervals",
    ),
    "sweep": (
        "lightning_dml.protocol.sweep",
        "hyper-parameter search (optuna) on the mean validation MAP@R over class-disjoint folds",
    ),
    "report": (
        "lightning_dml.report.command",
        "retrieval report (DIR/index.html, offline): metrics, worst queries with their top-k, confused classes",
    ),
    "index": (
        "lightning_dml.index.command",
        "embedding index (faiss) of an image gallery: index build|add|evaluate|status",
    ),
    "search": (
        "lightning_dml.index.search",
        "top-k gallery items of query images from an index folder (JSON Lines or CSV)",
    ),
    "serve": (
        "lightning_dml.index.server",
        "HTTP search service (LitServe) over an index folder: POST /search with an image, GET /health",
    ),
}

#: LightningCLI's commands (``Trainer`` methods), with their help line
TRAINER_COMMANDS: dict[str, str] = {
    "fit": "train a model (a config: model, data, trainer), checkpoints and config.yaml in the run's folder",
    "validate": "validation metrics of a checkpoint (--ckpt_path)",
    "test": "test metrics of a checkpoint (--ckpt_path)",
    "predict": "embeddings of a data set with a checkpoint (--ckpt_path), written to a file",
}

#: The switches :func:`lightning_dml.cli.main` takes anywhere on the command line
GLOBAL_SWITCHES = ("--offline", "--debug")

HELP_CACHE_ENV = "LIGHTNING_DML_HELP_CACHE"
#: Distributions whose version changes a command's help (jsonargparse's signatures extra reads the docstrings with
#: docstring-parser and the stubs with typeshed-client; Lightning, torch and torchvision give the trainer's,
#: optimisers' and models' options)
HELP_DISTRIBUTIONS = ("jsonargparse", "docstring-parser", "typeshed-client", "pytorch-lightning", "torch",
                      "torchvision", "timm", "torchmetrics")
_HELP_DISTRIBUTIONS = ("lightning-dml", *HELP_DISTRIBUTIONS)
#: Width (terminal columns) of the shipped help texts: they are printed as written, whatever the terminal
HELP_WIDTH = 80
#: The shipped help texts: ``<command>.txt`` and ``versions.json`` (:func:`help_versions` when they were written)
HELP_TEXTS = Path(__file__).resolve().parent / "help_texts"


def help_text() -> str:
    """``lightning-dml --help``: what the library is and every command, one a line."""
    rows = [*TRAINER_COMMANDS.items(), *((name, text) for name, (_, text) in COMMANDS.items())]
    width = max(len(name) for name, _ in rows) + 2
    commands = "\n".join(f"  {name:<{width}}{text}" for name, text in rows)
    return (
        "usage: lightning-dml [--offline] [--debug] <command> [options]\n\n"
        f"lightning-dml {__version__}: deep metric learning with PyTorch Lightning (the lightning_dml library).\n\n"
        f"commands (`lightning-dml <command> --help` shows a command's options):\n{commands}\n\n"
        "switches (anywhere on the command line):\n"
        "  --offline  forbid every download (as LIGHTNING_DML_OFFLINE=1 does)\n"
        "  --debug    show the traceback of a user error (as LIGHTNING_DML_DEBUG=1 does)\n"
    )


def command_names() -> list[str]:
    return [*TRAINER_COMMANDS, *COMMANDS]


def _help_cache_folder() -> Path:
    # the cache root of lightning_dml.data.cache_dir.cache_root, which cannot be imported here: the
    # lightning_dml.data package imports torch
    given = os.environ.get("LIGHTNING_DML_CACHE")
    if given:
        return Path(given).expanduser() / "help"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "lightning-dml" / "help"


def help_cache_key(words: Sequence[str]) -> str:
    """What the help of ``lightning-dml <words>`` depends on, hashed: the words, the terminal width, the Python and
    package versions, and the size and modification time of every source file of lightning_dml."""
    from importlib import metadata

    parts = [repr(list(words)), str(shutil.get_terminal_size().columns), sys.version]
    for name in _HELP_DISTRIBUTIONS:
        try:
            parts.append(f"{name}=={metadata.version(name)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{name} absent")
    package = Path(__file__).resolve().parent
    for folder, subfolders, files in sorted(os.walk(package)):
        subfolders.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                stat = os.stat(path)
                parts.append(f"{os.path.relpath(path, package)}:{stat.st_size}:{stat.st_mtime_ns}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def help_versions() -> dict[str, str]:
    """What a command's help text depends on beside lightning-dml's own code: the Python version (argparse's
    layout) and the version of each distribution of :data:`HELP_DISTRIBUTIONS` (``"absent"`` when not installed)."""
    from importlib import metadata

    versions = {"python": "{}.{}".format(*sys.version_info[:2])}
    for name in HELP_DISTRIBUTIONS:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "absent"
    return versions


def shipped_help(command: str) -> str | None:
    """The help of ``lightning-dml <command>`` shipped in :data:`HELP_TEXTS`, or ``None`` when there is none or
    it was written with other versions than the installed ones (:func:`help_versions`)."""
    import json

    path = HELP_TEXTS / f"{command}.txt"
    try:
        written = json.loads((HELP_TEXTS / "versions.json").read_text(encoding="utf-8"))
        if written != help_versions() or command not in command_names():
            return None
        return path.read_text(encoding="utf-8")
    except (OSError, ValueError):
        return None


class _Tee(io.TextIOBase):
    """Writes to a stream and keeps a copy."""

    def __init__(self, stream: io.TextIOBase) -> None:
        self.stream, self.copy = stream, io.StringIO()

    def write(self, text: str) -> int:
        self.copy.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()


def _write_text_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise


def cached_help(args: Sequence[str] | None, argv: list[str]) -> None:
    """Print the help of ``lightning-dml <argv>`` (a command and ``--help``) from the cache, or run the
    command (:func:`run` with ``args`` and ``argv``) and keep what it printed when it exits with status 0."""
    use_cache = os.environ.get(HELP_CACHE_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
    path = _help_cache_folder() / f"{help_cache_key(argv)}.txt" if use_cache else None
    if path is not None and path.is_file():
        sys.stdout.write(path.read_text(encoding="utf-8"))
        sys.stdout.flush()
        raise SystemExit(0)
    tee = _Tee(sys.stdout)
    try:
        with contextlib.redirect_stdout(tee):
            run(args, argv)
    except SystemExit as done:
        if path is not None and done.code in (0, None) and tee.copy.getvalue():
            with contextlib.suppress(OSError):  # a read-only cache folder only costs the next call its start-up
                _write_text_atomic(path, tee.copy.getvalue())
        raise


def run(args: Sequence[str] | None, argv: list[str]) -> None:
    """Run the command ``argv`` (the switches removed; ``args`` is ``None`` when it comes from ``sys.argv``):
    a :data:`COMMANDS` module's ``main``, else LightningCLI (:func:`lightning_dml.cli.build_cli`)."""
    if argv[:1] and argv[0] in COMMANDS:
        importlib.import_module(COMMANDS[argv[0]][0]).main(argv[1:])
    else:
        from lightning_dml import cli

        cli.build_cli(None if args is None else argv)


def main(args: Sequence[str] | None = None) -> None:
    """Entry point of the ``lightning-dml`` console script and of ``python -m lightning_dml`` (``args`` replaces
    ``sys.argv[1:]``).

    Two switches of its own, anywhere on the command line: ``--offline`` forbids every download (as
    ``LIGHTNING_DML_OFFLINE=1`` does; DDP processes inherit it), ``--debug`` shows the traceback of a user error.
    A user error (:class:`~lightning_dml.errors.UserInputError`: a missing dataset or weights file, a failed or
    refused download, a checksum mismatch, a corrupt file) prints ``lightning-dml: error: <message>`` on stderr
    and exits with status 1, without traceback unless ``--debug`` or ``LIGHTNING_DML_DEBUG=1``. Every other
    exception is a bug and keeps its traceback. A command-line or config error exits with status 2
    (:mod:`lightning_dml.cli_parsing`). The help, a misspelt command and the commands' help are answered without
    importing torch (see the module docstring).
    """
    argv = list(sys.argv[1:] if args is None else args)
    if "--offline" in argv:
        set_offline(True)
    if "--debug" in argv:
        os.environ["LIGHTNING_DML_DEBUG"] = "1"  # inherited by the DDP processes Lightning starts
    debug = env_flag("LIGHTNING_DML_DEBUG")
    argv = [a for a in argv if a not in GLOBAL_SWITCHES]
    if args is None:
        sys.argv[1:] = argv  # Lightning's DDP launcher restarts the command from sys.argv
    if not argv or argv[0] in ("-h", "--help"):
        sys.stdout.write(help_text())
        raise SystemExit(0 if argv else 2)
    first = argv[0]
    if not first.startswith("-") and first not in command_names():
        sys.stderr.write(
            f"lightning-dml: error: unknown command {first!r}{suggest(first, command_names())}; the commands are "
            f"{', '.join(command_names())}\n"
        )
        raise SystemExit(2)
    try:
        if len(argv) == 2 and argv[1] in ("-h", "--help"):
            text = shipped_help(first)
            if text is not None:
                sys.stdout.write(text)
                sys.stdout.flush()
                raise SystemExit(0)
            cached_help(args, argv)
        else:
            run(args, argv)
    except UserInputError as error:
        if debug:
            raise
        print(f"lightning-dml: error: {user_error_message(error)}", file=sys.stderr)
        raise SystemExit(1) from None


__all__ = [
    "COMMANDS",
    "GLOBAL_SWITCHES",
    "HELP_DISTRIBUTIONS",
    "HELP_TEXTS",
    "HELP_WIDTH",
    "TRAINER_COMMANDS",
    "cached_help",
    "help_cache_key",
    "help_text",
    "help_versions",
    "main",
    "run",
    "shipped_help",
]
