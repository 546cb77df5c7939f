"""Write (or check) the help texts shipped in ``lightning_dml/help_texts/``: ``lightning-dml <command> --help`` of
every command, printed by the command's real parser at a fixed width, so that the console script answers a
command's help on its first call without importing torch (:func:`lightning_dml.entry.shipped_help`).

::

    python tools/help_texts.py          # rewrite lightning_dml/help_texts/ (after changing a command's options)
    python tools/help_texts.py --check  # exit status 1 naming each command whose shipped help is out of date

Every help is printed in this one process, as ``lightning-dml <command> --help`` prints it
(:func:`lightning_dml.entry.run` with ``sys.argv`` set), with ``COLUMNS`` set to
:data:`lightning_dml.entry.HELP_WIDTH`; ``versions.json`` records :func:`lightning_dml.entry.help_versions`, the
versions the texts are valid for.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_dml import entry  # noqa: E402
from lightning_dml.data.cache_dir import write_text_atomic  # noqa: E402

VERSIONS = "versions.json"


def render(command: str) -> str:
    """What ``lightning-dml <command> --help`` prints when the command's parser writes it, at
    :data:`~lightning_dml.entry.HELP_WIDTH` columns."""
    argv = [command, "--help"]
    saved_argv, saved_columns = sys.argv, os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(entry.HELP_WIDTH)
    sys.argv = ["lightning-dml", *argv]
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.suppress(SystemExit):
            entry.run(None, argv)
    finally:
        sys.argv = saved_argv
        if saved_columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = saved_columns
    if not out.getvalue().startswith("usage: "):
        raise RuntimeError(f"lightning-dml {command} --help printed no usage: {out.getvalue()[:300]!r}")
    return out.getvalue()


def render_all() -> dict[str, str]:
    """File name -> text of every shipped file: ``<command>.txt`` for each command and ``versions.json``."""
    files = {f"{command}.txt": render(command) for command in entry.command_names()}
    files[VERSIONS] = json.dumps(entry.help_versions(), indent=2, sort_keys=True) + "\n"
    return files


def out_of_date(folder: Path, files: dict[str, str]) -> list[str]:
    """The names of ``files`` whose text differs from (or is missing in) ``folder``, and of the ``.txt`` files of
    ``folder`` that no command prints any more."""
    stale = [name for name, text in files.items()
             if not (folder / name).is_file() or (folder / name).read_text(encoding="utf-8") != text]
    return stale + sorted(p.name for p in folder.glob("*.txt") if p.name not in files)


def first_difference(path: Path, text: str) -> str:
    """``NAME line N: shipped '...', now '...'`` for the first line where ``path`` and ``text`` differ."""
    shipped = path.read_text(encoding="utf-8").splitlines() if path.is_file() else []
    now = text.splitlines()
    for number, (old, new) in enumerate(zip(shipped + [""] * len(now), now + [""] * len(shipped)), 1):
        if old != new:
            return f"{path.name} line {number}: shipped {old!r}, now {new!r}"
    return f"{path.name}: differs"


def write(folder: Path, files: dict[str, str]) -> None:
    """Write ``files`` into ``folder`` (each file atomically) and delete the ``.txt`` files of gone commands."""
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        write_text_atomic(folder / name, text)
    for path in folder.glob("*.txt"):
        if path.name not in files:
            path.unlink()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare; exit status 1 when a text differs")
    parser.add_argument("--folder", type=Path, default=entry.HELP_TEXTS, help="default: lightning_dml/help_texts")
    args = parser.parse_args(argv)
    files = render_all()
    stale = out_of_date(args.folder, files)
    if args.check:
        if stale:
            print(f"out of date in {args.folder}: {', '.join(stale)} (run python tools/help_texts.py)",
                  file=sys.stderr)
            for name in stale[:3]:
                print(first_difference(args.folder / name, files.get(name, "")), file=sys.stderr)
            return 1
        print(f"{len(files)} help files up to date in {args.folder}")
        return 0
    write(args.folder, files)
    print(f"wrote {args.folder}: {', '.join(stale) or 'nothing changed'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
