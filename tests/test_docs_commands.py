"""Every shell command of README.md and docs/*.md runs as written (issue 27 s.2), against a tiny fitted Glyphs run.

The convention (docs/testing.md, "Documented commands"):

* the commands are the lines of the fenced blocks tagged ``bash`` (or ``sh``, ``shell``, ``console``); a line
  ending in ``\\`` continues on the next one, ``#`` starts a comment, ``NAME=value`` before the program sets an
  environment variable. Output samples go in untagged blocks;
* each page runs in its own fresh folder holding ``configs/`` and ``examples/``, its commands in their order (a
  command may use what an earlier one of the same page wrote); the run folders the pages name without fitting
  them (:data:`RUN_FOLDERS`: ``logs/glyphs``, ``runs/cub-ms``) hold a copy of one tiny fitted Glyphs run (its
  ``config.yaml`` as ``fit`` saved it and ``checkpoints/last.ckpt``);
* ``fit``, ``test`` and ``predict`` get trainer options appended that keep them to a few steps and batches
  (:data:`FAST`: no model option, so a checkpoint still fits the page's later commands; the logger stays the
  default, W&B offline, whose run folder a page may read), and ``report`` from a checkpoint embeds two batches of
  the test split; file commands between them (``cp``, ``mkdir``, ...: :data:`SHELL_PROGRAMS`) run in bash;
* a command that cannot run here matches a rule of :data:`NOT_RUN`, which says why (a cluster, a download,
  minutes of work, a placeholder of a synopsis); every other command is run, so a new or changed command of the
  docs is tested.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import runpy
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import glyph_cache

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL_TAGS = ("bash", "sh", "shell", "console")

#: the run folders pages name without fitting them: each holds a copy of the tiny fitted Glyphs run
RUN_FOLDERS = ("logs/glyphs", "runs/cub-ms")

#: appended to a documented command of the trainer (trainer options only: the model stays the config's; ``fit``
#: drops the config's callbacks, the demo's RetrievalComparison, which embeds the whole test split twice)
FAST: dict[str, list[str]] = {
    "fit": ["--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
            "--trainer.enable_model_summary=false", "--trainer.callbacks=[]"],
    "test": ["--trainer.limit_test_batches=1", "--trainer.enable_progress_bar=false"],
    "predict": ["--trainer.limit_predict_batches=1", "--trainer.enable_progress_bar=false"],
}

#: programs run by bash as written (file commands a page uses between two commands of the library)
SHELL_PROGRAMS = ("cp", "mv", "mkdir", "ls", "cat", "head", "tail", "rm")

#: (pattern searched in the command, why it is not run here); the first match wins
NOT_RUN: list[tuple[str, str]] = [
    (r"\b(sbatch|srun)\b|SLURM_", "needs a SLURM cluster"),
    (r"^make\b", "a Makefile target (make demo/test/mutants/compare take minutes to hours; the lead runs make test)"),
    (r"^wandb\b|logger\.init_args\.offline false", "needs a Weights & Biases account and the internet"),
    (r"\bbench/", "a benchmark (minutes; its figures are in docs/benchmarks.md)"),
    (r"^git\b", "changes the repository (git worktree)"),
    (r"configs/(cub200|cars196|sop|inshop)/", "needs a downloaded benchmark dataset (CUB, Cars, SOP, In-shop)"),
    (r"\[--|\b(CONFIG|CKPT|DIR|PATH|URI|IMAGE_OR_FOLDER_OR_CSV)\b|<[a-z' ]+>|--config \.\.\.",
     "a synopsis: placeholders (UPPERCASE, <...>, [optional]) that the page's examples fill in"),
    (r"\b(my|ms|ms_space|space|budget)\.yaml\b", "the user's own files, which the page shows but does not write"),
    (r"^lightning-dml cv --aggregate", "aggregates the folds of the SLURM array above it"),
    (r"cv --config configs/glyphs.yaml --num_folds 4 --repeats 3",
     "12 fits (minutes); tests/test_protocol_cv.py runs cv on a tiny config"),
    (r"\bserve\b|^curl\b|^kill\b", "starts a long-running server (tests/test_serve*.py start one on 127.0.0.1)"),
]


@dataclass(frozen=True)
class DocCommand:
    """One command of a page: where it is, the text as written (continuations joined), its words."""

    page: str
    line: int
    text: str
    argv: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict, hash=False)

    def __str__(self) -> str:
        return f"{self.page}:{self.line}: {self.text}"


def commands_of(markdown: str, page: str) -> list[DocCommand]:
    """The commands of the shell-tagged fenced blocks of ``markdown`` (see the module docstring)."""
    commands: list[DocCommand] = []
    lines = markdown.splitlines()
    i = 0
    while i < len(lines):
        fence = re.match(r"^\s*```\s*(\S*)", lines[i])
        i += 1
        if not fence:
            continue
        tag = fence.group(1).lower()
        block: list[tuple[int, str]] = []
        while i < len(lines) and not re.match(r"^\s*```\s*$", lines[i]):
            block.append((i + 1, lines[i]))
            i += 1
        i += 1
        if tag not in SHELL_TAGS:
            continue
        pending, start = "", 0
        for number, line in block:
            start = start or number
            if line.rstrip().endswith("\\"):
                pending += line.rstrip()[:-1] + " "
                continue
            text = " ".join((pending + line).split())
            pending, first, start = "", start, 0
            try:
                words = shlex.split(text, comments=True)
            except ValueError:  # an unbalanced quote: a placeholder such as <the loss's class>
                words = text.split(" #")[0].split()
            if not words:
                continue
            env = {}
            while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
                name, _, value = words.pop(0).partition("=")
                env[name] = value
            if words:
                shown = text.split(" #")[0].strip()
                commands.append(DocCommand(page, first, shown, tuple(words), env))
    return commands


def documented_commands() -> list[DocCommand]:
    return [c for p in PAGES for c in commands_of(p.read_text(), str(p.relative_to(ROOT)))]


def why_not_run(command: DocCommand) -> str | None:
    """The reason of the first :data:`NOT_RUN` rule the command matches (``None``: it is run)."""
    line = " ".join([command.argv[0].removeprefix(".venv/bin/"), *command.argv[1:]])
    full = " ".join([*(f"{k}={v}" for k, v in command.env.items()), line])
    return next((reason for pattern, reason in NOT_RUN if re.search(pattern, line) or re.search(pattern, full)), None)


def _runner(command: DocCommand):
    """``(callable, argv)`` running ``command`` in this process, or ``None`` when no runner knows its program."""
    program, *args = command.argv
    program = program.removeprefix(".venv/bin/")
    if program == "lightning-dml":
        if args and args[0] in FAST:
            args = [*args, *FAST[args[0]]]
        elif args[:1] == ["report"] and "--ckpt_path" in args:  # its extra options go to the predict it runs
            args = [*args, "--trainer.limit_predict_batches=2"]
        from lightning_dml.cli import main

        return (lambda: main(args)), ["lightning-dml", *args]
    if program in SHELL_PROGRAMS:
        text = command.text
        return (lambda: subprocess.run(["bash", "-c", text], check=True, timeout=60)), [program, *args]
    if program in ("python", "python3"):
        if args[:1] == ["-m"] and len(args) > 1:
            module = args[1]
            return (lambda: runpy.run_module(module, run_name="__main__", alter_sys=True)), [module, *args[2:]]
        if args and args[0].endswith(".py") and (ROOT / args[0]).is_file():
            script = str(ROOT / args[0])
            return (lambda: runpy.run_path(script, run_name="__main__")), [script, *args[1:]]
    return None


def run_command(command: DocCommand, monkeypatch: pytest.MonkeyPatch) -> None:
    found = _runner(command)
    assert found is not None, f"{command}: no runner for {command.argv[0]!r}; add one or a NOT_RUN rule with the reason"
    run, argv = found
    with monkeypatch.context() as patch:
        for name, value in command.env.items():
            patch.setenv(name, value)
        patch.setattr(sys, "argv", argv)
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                run()
        except SystemExit as error:
            assert error.code in (0, None), f"{command}: exit status {error.code}: {err.getvalue()[-2000:]}"


def fitted_folders(commands: list[DocCommand]) -> set[str]:
    """The run folders the ``fit`` commands a page runs write (``--trainer.default_root_dir``)."""
    folders = set()
    for command in commands:
        if why_not_run(command) is None and "fit" in command.argv and "--trainer.default_root_dir" in command.argv:
            folders.add(command.argv[command.argv.index("--trainer.default_root_dir") + 1])
    return folders


@pytest.fixture(scope="module")
def fitted_run(tmp_path_factory):
    """A tiny fit of configs/glyphs.yaml with checkpoints: ``config.yaml`` and ``checkpoints/last.ckpt``."""
    from lightning_dml.cli import main

    glyph_cache.install(tmp_path_factory.getbasetemp() / glyph_cache.FILENAME)
    run = tmp_path_factory.mktemp("fitted") / "run"
    cwd = os.getcwd()
    os.chdir(run.parent)
    try:
        main(["fit", "--config", str(ROOT / "configs" / "glyphs.yaml"), *FAST["fit"], "--trainer.callbacks=[]",
              "--trainer.enable_checkpointing=true", f"--trainer.default_root_dir={run}"])
    finally:
        os.chdir(cwd)
    assert (run / "config.yaml").is_file() and (run / "checkpoints" / "last.ckpt").is_file()
    return run


def test_commands_are_read_from_the_shell_blocks():
    page = (
        "```bash\n.venv/bin/lightning-dml fit --config a.yaml \\\n    --trainer.max_epochs 2   # a comment\n"
        "# a whole comment\nOMP_NUM_THREADS=1 python -m x --y 'two words'\n```\n"
        "```\nlightning-dml output sample\n```\n```python\nprint('code')\n```\n"
    )
    commands = commands_of(page, "p.md")
    assert [(c.line, c.argv, c.env) for c in commands] == [
        (2, (".venv/bin/lightning-dml", "fit", "--config", "a.yaml", "--trainer.max_epochs", "2"), {}),
        (5, ("python", "-m", "x", "--y", "two words"), {"OMP_NUM_THREADS": "1"}),
    ]


def test_every_documented_command_is_run_or_says_why_not():
    """Fast: each command has a runner or a reason; the commands issue 27 found broken are among those run."""
    commands = documented_commands()
    assert len(commands) > 30
    run = [c for c in commands if why_not_run(c) is None]
    without_runner = [str(c) for c in run if _runner(c) is None]
    assert not without_runner, without_runner
    texts = [" ".join(c.argv) for c in run]
    assert any("python -m lightning_dml.export --config runs/cub-ms/config.yaml" in t for t in texts)
    assert any("lightning-dml index build --config" in t for t in texts)
    assert any("lightning-dml report" in t for t in texts)


def pages_with_commands() -> list[str]:
    pages = []
    for page in PAGES:
        name = str(page.relative_to(ROOT))
        if any(why_not_run(c) is None for c in commands_of(page.read_text(), name)):
            pages.append(name)
    return pages


@pytest.mark.slow
@pytest.mark.parametrize("page", pages_with_commands())
def test_documented_commands_run(page, fitted_run, tmp_path, monkeypatch, capsys):
    commands = commands_of((ROOT / page).read_text(), page)
    work = tmp_path / "work"
    work.mkdir()
    for name in ("configs", "examples"):
        (work / name).symlink_to(ROOT / name)
    for folder in set(RUN_FOLDERS) - fitted_folders(commands):
        shutil.copytree(fitted_run, work / folder, symlinks=True)
    monkeypatch.chdir(work)
    monkeypatch.setenv("WANDB_MODE", "offline")
    skipped = []
    for command in commands:
        reason = why_not_run(command)
        if reason is not None:
            skipped.append(f"{command}  [not run: {reason}]")
            continue
        run_command(command, monkeypatch)
    with capsys.disabled():
        for line in skipped:
            print(f"\n  {line}", end="")
