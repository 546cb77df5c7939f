#!/usr/bin/env python
"""Mutation check of the library's numerical core: ``make mutants`` (docs/testing.md).

Small AST mutants of ``lightning_dml/losses/``, ``lightning_dml/metrics/``, ``lightning_dml/miners/``,
``lightning_dml/data/samplers.py``, ``lightning_dml/retrieval/`` and ``lightning_dml/index/rerank.py`` are run against
the matching fast tests; a mutant that no test notices
*survives*. The report (``logs/mutants/report.md`` and ``report.json``) lists the survivors, those declared
equivalent in ``tools/mutants_equivalent.toml`` (with the reason), and the survivor rate.

How it runs, and why it is trustworthy on a small machine:

* **Never touches the working tree.** The tracked and untracked-but-not-ignored files are copied into a temporary
  folder (one copy per parallel job, a "slot"); mutants are written into a slot's copy, pytest runs there with the
  slot first on ``sys.path`` and in ``PYTHONPATH`` (so subprocess tests see the mutant too), and every run checks
  that the mutated module was imported from the slot. Byte code is compiled in ``checked-hash`` mode, so a stale
  ``.pyc`` can never stand in for a mutant.
* **Fast and exact test selection.** One baseline run of the fast tests (``-m "not slow"``) records, with a line
  tracer, which test executes which line of the mutated files. A mutant runs only the tests that execute its line
  (tests are deterministic: a test that never reaches the line cannot tell the mutant apart), fastest first, with
  ``-x``; a mutant of import-time code (module or class level, defaults) runs every test of its group. Tests that
  run the library in subprocesses (their lines are not traced) are declared per group and run for every mutant the
  in-process tests leave alive. Tests that fail in the baseline are left out (and listed), so they cannot "kill"
  anything.
* **One import, many mutants.** The parent imports the third-party stack once (torch, Lightning, ...; about 7 s)
  and forks one child per mutant; the child imports ``lightning_dml`` (with the mutant) and the tests afresh.
* **Bounded.** A per-mutant timeout (``--timeout-factor`` times the baseline time of its tests plus
  ``--timeout-base`` seconds) counts as *killed by timeout*, reported apart. ``--sample N`` (seeded) runs a
  uniform sample; ``--budget-minutes`` stops starting new mutants after that time. The fixed list ``TARGETED``
  (the mutants issue 19 found surviving) always runs, and the exit status is 1 when one of them survives.

Usage (from the repository root, ``make mutants`` runs the first line under ``nice -n 19``)::

    python tools/mutants.py                          # everything, 2 jobs
    python tools/mutants.py --sample 400 --seed 1    # a seeded uniform sample (+ the targeted mutants)
    python tools/mutants.py --only 'lightning_dml/data/samplers.py'
    python tools/mutants.py --survivors-of logs/mutants/report.json   # rerun the last run's survivors only
    python tools/mutants.py --list                   # count the mutants, run nothing
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: The mutated files, by group, with the test files that may notice their mutants. ``tests`` run in-process
#: (selected per mutant by line coverage); ``subprocess_tests`` run the library in other processes (untraced):
#: each runs for the mutants that the in-process tests leave alive in the source files it names (``file`` or
#: ``file::function``, fnmatch patterns).
GROUPS: dict[str, dict] = {
    "losses": {
        "sources": ["lightning_dml/losses/*.py"],
        "tests": ["tests/test_losses_*.py", "tests/test_softmax_pairs.py", "tests/test_docs.py", "tests/test_reducers.py",
                  "tests/test_hyperbolic.py", "tests/test_miners_losses.py"],
        # every loss gathered under DDP (gloo, 2 and 3 processes): for the code that only DDP runs
        "subprocess_tests": {
            "tests/distributed/test_distributed_loss.py": [
                "lightning_dml/losses/distributed.py", "lightning_dml/losses/base.py::batch_normaliser",
                "lightning_dml/losses/base.py::global_reduction",
            ],
        },
    },
    "miners": {
        "sources": ["lightning_dml/miners/*.py"],
        "tests": ["tests/test_miners*.py", "tests/test_losses_*.py"],
        "subprocess_tests": {},
    },
    "regularizers": {
        "sources": ["lightning_dml/regularizers/*.py"],
        "tests": ["tests/test_regularizers.py"],
        "subprocess_tests": {},
    },
    "metrics": {
        "sources": ["lightning_dml/metrics/*.py"],
        "tests": ["tests/test_metrics*.py", "tests/test_retrieval_results.py"],
        "subprocess_tests": {"tests/test_metrics_ddp.py": ["lightning_dml/metrics/*.py"]},
    },
    # issue 26: the per-query results and the score histogram (built on the metrics engine), and re-ranking
    "retrieval": {
        "sources": ["lightning_dml/retrieval/*.py"],
        "tests": ["tests/test_retrieval_*.py", "tests/test_report.py"],
        "subprocess_tests": {},
    },
    "rerank": {
        "sources": ["lightning_dml/index/rerank.py"],
        "tests": ["tests/test_rerank*.py"],
        "subprocess_tests": {},
    },
    "samplers": {
        "sources": ["lightning_dml/data/samplers.py"],
        "tests": ["tests/test_samplers*.py", "tests/test_resume.py", "tests/test_data_mining.py"],
        "subprocess_tests": {},
    },
}

#: Files of the groups that are not mutated, with the reason (printed in the report).
EXCLUDED_FILES: dict[str, str] = {
    "lightning_dml/metrics/_progress.py": "opt-in tqdm progress bars: display only, no result depends on it",
}

#: The hand mutants issue 19 found surviving (section 2): always run, must be killed. (label, file, function
#: qualname, text, replacement): every occurrence of ``text`` inside the function is replaced.
TARGETED: list[tuple[str, str, str, str, str]] = [
    (
        "count_true: byte-lane chunk 255 -> 256",
        "lightning_dml/metrics/_candidates.py", "count_true", "255", "256",
    ),
    (
        "cosine error bound without its 2*eta term",
        "lightning_dml/metrics/_scores.py", "Scorer.error_bound", "dot_err + 2 * eta + eta * eta",
        "dot_err + eta * eta",
    ),
    (
        "sub-centre ArcFace: the last sub-centre on a tie (> -> >=)",
        "lightning_dml/losses/proxies.py", "_nearest_center", "cos[..., k] > best", "cos[..., k] >= best",
    ),
    (
        "BalancedClassSampler: a class may appear twice in a batch (no in-batch check)",
        "lightning_dml/data/samplers.py", "take_distinct", "if c in chosen:", "if False:",
    ),
    (
        "BalancedClassSampler: a class of exactly K items sampled with replacement (< -> <=)",
        "lightning_dml/data/samplers.py", "BalancedClassSampler._items",
        "len(items) < self.samples_per_class", "len(items) <= self.samples_per_class",
    ),
]

EQUIVALENTS_FILE = ROOT / "tools" / "mutants_equivalent.toml"
#: the kinds of tools/mutants_equivalent.toml entries (its header explains them)
EQUIVALENT_KINDS = ("equivalent", "rounding", "contract")

# ------------------------------------------------------------------------------------------------ operators
_CMP = {
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.Is: ast.IsNot, ast.IsNot: ast.Is, ast.In: ast.NotIn, ast.NotIn: ast.In,
}
_BIN = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult, ast.FloorDiv: ast.Div,
    ast.Mod: ast.Div, ast.Pow: ast.Mult, ast.LShift: ast.RShift, ast.RShift: ast.LShift, ast.BitAnd: ast.BitOr,
    ast.BitOr: ast.BitAnd, ast.BitXor: ast.BitOr,
}
#: method / function names swapped for their counterpart (``x.add_(y)`` -> ``x.sub_(y)``, ``max(a)`` -> ``min(a)``)
_SWAP = {
    **{a: b for a, b in [("add", "sub"), ("add_", "sub_"), ("mul", "div"), ("mul_", "div_"), ("amax", "amin"),
                         ("max", "min"), ("maximum", "minimum"), ("clamp_min", "clamp_max"),
                         ("clamp_min_", "clamp_max_"), ("argmax", "argmin"), ("cummax", "cummin"), ("any", "all"),
                         ("ge", "gt"), ("le", "lt"), ("floor", "ceil")]},
}
_SWAP.update({b: a for a, b in list(_SWAP.items())})
#: tensor methods whose call is a dropped term when removed (``x.clamp_(min=0)`` -> ``x``)
_DROP = {
    "add", "add_", "sub", "sub_", "mul", "mul_", "div", "div_", "addcmul", "addcmul_", "addcdiv", "addcdiv_", "clamp",
    "clamp_", "clamp_min", "clamp_min_", "clamp_max", "clamp_max_", "neg", "neg_", "masked_fill", "masked_fill_",
    "abs", "abs_",
}
#: calls whose arguments are messages, not results
_MESSAGE_CALLS = {"warn", "warning", "info", "debug", "print", "rank_zero_warn", "rank_zero_info"}
_DISPLAY_FUNCTIONS = {"__repr__", "__str__", "extra_repr"}


@dataclass
class Mutant:
    file: str  # relative path
    line: int
    end_line: int
    function: str  # qualname of the enclosing function or class ("<module>" at module level)
    op: str
    before: str  # the mutated expression (ast.unparse), before ...
    after: str  # ... and after
    import_time: bool  # module or class level: executed at import, observable by any test of the group
    start: int = 0  # character offsets of the replaced source span
    end: int = 0
    replacement: str = ""
    label: str = ""  # the targeted mutants' label
    key: str = ""
    source_line: str = ""
    mutated_line: str = ""
    #: the lines whose execution by a test makes it a candidate to kill the mutant (default: the mutant's own lines;
    #: a default argument's: its function's body, the only place the default is used)
    cover: tuple[int, int] | None = None

    def mutated_source(self, source: str) -> str:
        return source[: self.start] + self.replacement + source[self.end :]


def _char_offsets(source: str) -> tuple[list[str], list[int]]:
    lines = source.splitlines(keepends=True)
    starts, pos = [], 0
    for line in lines:
        starts.append(pos)
        pos += len(line)
    return lines, starts


class _Collector:
    """Walks one file's AST and lists its mutants."""

    def __init__(self, rel: str, source: str) -> None:
        self.rel, self.source = rel, source
        self.lines, self.starts = _char_offsets(source)
        self.no_mutate = {i + 1 for i, line in enumerate(self.lines) if "pragma: no mutate" in line}
        self.mutants: list[Mutant] = []

    def pos(self, lineno: int, col: int) -> int:
        return self.starts[lineno - 1] + len(self.lines[lineno - 1].encode()[:col].decode())

    def add(self, node: ast.AST, op: str, new: ast.AST | str, ctx: dict, statement: bool = False) -> None:
        if node.lineno in self.no_mutate:
            return
        text = new if isinstance(new, str) else ast.unparse(new)
        replacement = text if statement else f"({text})"
        before = ast.unparse(node)
        if before == text:
            return
        start, end = self.pos(node.lineno, node.col_offset), self.pos(node.end_lineno, node.end_col_offset)
        self.mutants.append(
            Mutant(self.rel, node.lineno, node.end_lineno, ctx["qualname"], op, before, text, ctx["import_time"],
                   start, end, replacement, cover=ctx.get("cover"))
        )

    # -------------------------------------------------------------- traversal
    def run(self) -> list[Mutant]:
        tree = ast.parse(self.source)
        self.visit_body(tree.body, {"qualname": "<module>", "import_time": True, "names": []})
        return self.mutants

    def visit_body(self, body: list[ast.stmt], ctx: dict) -> None:
        for stmt in body:
            self.visit_stmt(stmt, ctx)

    def visit_stmt(self, stmt: ast.stmt, ctx: dict) -> None:
        if isinstance(stmt, (ast.Raise, ast.Assert, ast.Import, ast.ImportFrom, ast.Global, ast.Nonlocal)):
            return  # messages of errors and internal invariants: not results
        if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Constant):
            return  # docstring
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if stmt.name in _DISPLAY_FUNCTIONS:
                return
            names = ctx["names"] + [stmt.name]
            # decorators are registration / caching (skipped); a default is evaluated at import and used by calls
            body = (stmt.body[0].lineno, stmt.end_lineno)
            for default in [*stmt.args.defaults, *(d for d in stmt.args.kw_defaults if d is not None)]:
                self.visit_expr(default, {"qualname": ".".join(names), "import_time": False, "names": names,
                                          "cover": body})
            self.visit_body(stmt.body, {"qualname": ".".join(names), "import_time": False, "names": names})
            return
        if isinstance(stmt, ast.ClassDef):
            names = ctx["names"] + [stmt.name]
            self.visit_body(stmt.body, {"qualname": ".".join(names), "import_time": ctx["import_time"],
                                        "names": names})
            return
        if isinstance(stmt, ast.If) and _is_type_checking(stmt.test):
            return
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets):
            return
        if isinstance(stmt, ast.AugAssign):
            swap = _BIN.get(type(stmt.op))
            if swap is not None:
                self.add(stmt, "augassign", ast.AugAssign(stmt.target, swap(), stmt.value), ctx, statement=True)
            if isinstance(stmt.op, (ast.Add, ast.Sub)):
                self.add(stmt, "drop-term", "pass", ctx, statement=True)
            self.visit_expr(stmt.value, ctx)
            return
        if isinstance(stmt, ast.AnnAssign):
            if stmt.value is not None:
                self.visit_expr(stmt.value, ctx)
            return
        for name, value in ast.iter_fields(stmt):
            if isinstance(value, list):
                if value and isinstance(value[0], ast.stmt):
                    self.visit_body(value, ctx)
                else:
                    for item in value:
                        if isinstance(item, ast.expr):
                            self.visit_expr(item, ctx)
                        elif isinstance(item, (ast.excepthandler, ast.withitem, ast.match_case, ast.keyword)):
                            self.visit_other(item, ctx)
            elif isinstance(value, ast.expr):
                if name == "target" and isinstance(stmt, (ast.For, ast.AsyncFor)):
                    continue
                self.visit_expr(value, ctx)

    def visit_other(self, node: ast.AST, ctx: dict) -> None:
        if isinstance(node, ast.excepthandler):
            self.visit_body(node.body, ctx)
        elif isinstance(node, ast.withitem):
            self.visit_expr(node.context_expr, ctx)
        elif isinstance(node, ast.keyword):
            self.visit_expr(node.value, ctx)
        elif isinstance(node, ast.match_case):
            self.visit_body(node.body, ctx)

    def visit_expr(self, node: ast.expr, ctx: dict) -> None:
        if isinstance(node, ast.JoinedStr):
            return  # f-strings: messages
        if isinstance(node, ast.Call) and _call_name(node) in _MESSAGE_CALLS:
            return
        if isinstance(node, ast.Lambda):
            self.visit_expr(node.body, dict(ctx, import_time=False))
            return
        self.mutate(node, ctx)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant):
            return  # a negative literal is mutated as a whole
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.expr):
                self.visit_expr(child, ctx)
            elif isinstance(child, ast.keyword):
                self.visit_expr(child.value, ctx)
            elif isinstance(child, ast.comprehension):
                self.visit_expr(child.iter, ctx)
                for cond in child.ifs:
                    self.visit_expr(cond, ctx)
            elif isinstance(child, ast.arguments):
                pass  # a lambda's defaults: none in the code base

    def mutate(self, node: ast.expr, ctx: dict) -> None:
        copy = _copy
        if isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                swap = _CMP.get(type(op))
                if swap is not None:
                    new = copy(node)
                    new.ops = list(node.ops)
                    new.ops[i] = swap()
                    self.add(node, "compare", new, ctx)
        elif isinstance(node, ast.BoolOp):
            new = copy(node)
            new.op = ast.Or() if isinstance(node.op, ast.And) else ast.And()
            self.add(node, "boolop", new, ctx)
        elif isinstance(node, ast.BinOp):
            swap = _BIN.get(type(node.op))
            if swap is not None:
                new = copy(node)
                new.op = swap()
                self.add(node, "binop", new, ctx)
            if isinstance(node.op, ast.Add):
                self.add(node, "drop-term", node.left, ctx)
                self.add(node, "drop-term", node.right, ctx)
            elif isinstance(node.op, ast.Sub):
                self.add(node, "drop-term", node.left, ctx)
        elif isinstance(node, ast.UnaryOp):
            if isinstance(node.op, (ast.USub, ast.Not, ast.Invert)):
                if not (isinstance(node.op, ast.USub) and isinstance(node.operand, ast.Constant)):
                    self.add(node, "unary", node.operand, ctx)
                else:  # a negative literal: -c -> -(c +- 1) and c
                    self.add(node, "unary", node.operand, ctx)
                    for delta in (1, -1):
                        value = node.operand.value + delta
                        if isinstance(node.operand.value, (int, float)) and not isinstance(node.operand.value, bool):
                            self.add(node, "constant", ast.UnaryOp(ast.USub(), ast.Constant(value)), ctx)
        elif isinstance(node, ast.Constant):
            if isinstance(node.value, bool):
                self.add(node, "constant", ast.Constant(not node.value), ctx)
            elif isinstance(node.value, (int, float)):
                for delta in (1, -1):
                    self.add(node, "constant", ast.Constant(node.value + delta), ctx)
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute):
                if func.attr in _SWAP:
                    new = copy(node)
                    new.func = ast.Attribute(func.value, _SWAP[func.attr], ast.Load())
                    self.add(node, "swap", new, ctx)
                if func.attr in _DROP and not _is_module(func.value):
                    self.add(node, "drop-term", func.value, ctx)
                if func.attr in ("clamp", "clamp_") and len(node.keywords) == 1 and node.keywords[0].arg in (
                    "min", "max"
                ):
                    new = copy(node)
                    kw = node.keywords[0]
                    new.keywords = [ast.keyword("max" if kw.arg == "min" else "min", kw.value)]
                    self.add(node, "swap", new, ctx)
            elif isinstance(func, ast.Name) and func.id in ("max", "min", "any", "all"):
                new = copy(node)
                new.func = ast.Name(_SWAP[func.id], ast.Load())
                self.add(node, "swap", new, ctx)


def _copy(node: ast.AST) -> ast.AST:
    new = type(node)()
    for name, value in ast.iter_fields(node):
        setattr(new, name, value)
    return new


def _call_name(node: ast.Call) -> str:
    func = node.func
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


def _is_module(node: ast.expr) -> bool:
    """``torch.add(a, b)`` / ``np.maximum(...)``: the receiver is a module, not a tensor term."""
    return isinstance(node, ast.Name) and node.id in ("torch", "np", "numpy", "math", "F")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _function_node(tree: ast.Module, qualname: str) -> ast.AST | None:
    parts = qualname.split(".")
    nodes: list[ast.stmt] = tree.body
    found = None
    for part in parts:
        found = next(
            (n for n in nodes if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
             and n.name == part), None,
        )
        if found is None:
            return None
        nodes = found.body
    return found


def _finish(m: Mutant, source: str) -> Mutant:
    """Fill in the display lines and the stable key of a mutant."""
    lines = source.splitlines()
    m.source_line = lines[m.line - 1].strip()
    mutated = m.mutated_source(source).splitlines()
    m.mutated_line = mutated[m.line - 1].strip() if m.line == m.end_line else m.after
    m.key = f"{m.file}::{m.function}::{m.op}::{m.before} => {m.after}"
    return m


def collect(rel: str, source: str) -> list[Mutant]:
    mutants = [_finish(m, source) for m in _Collector(rel, source).run()]
    seen: dict[str, int] = {}
    for m in mutants:  # the same change twice in one function: number the later ones
        seen[m.key] = seen.get(m.key, 0) + 1
        if seen[m.key] > 1:
            m.key += f" #{seen[m.key]}"
    return mutants


def targeted(sources: dict[str, str]) -> tuple[list[Mutant], list[str]]:
    """The ``TARGETED`` mutants of the current sources, and an error line for each one that no longer applies."""
    out, errors = [], []
    for label, rel, qualname, text, replacement in TARGETED:
        source = sources.get(rel)
        node = _function_node(ast.parse(source), qualname) if source is not None else None
        if node is None:
            errors.append(f"targeted mutant {label!r}: {rel}::{qualname} not found")
            continue
        lines, starts = _char_offsets(source)
        begin, end = starts[node.lineno - 1], starts[node.end_lineno - 1] + len(lines[node.end_lineno - 1])
        segment = source[begin:end]
        if text not in segment:
            errors.append(f"targeted mutant {label!r}: {text!r} no longer occurs in {rel}::{qualname}")
            continue
        mutated_segment = segment.replace(text, replacement)
        first = segment.index(text)
        line = node.lineno + segment[:first].count("\n")
        m = Mutant(rel, line, line, qualname, "targeted", text, replacement, False, begin, end, mutated_segment,
                   label=label)
        m.source_line = lines[line - 1].strip()
        m.mutated_line = m.source_line.replace(text, replacement)
        m.key = f"{rel}::{qualname}::targeted::{label}"
        m.cover = (node.body[0].lineno, node.end_lineno)  # the tests that reach the function body decide
        out.append(m)
    return out, errors


# ------------------------------------------------------------------------------------------------ workspace
def _project_files() -> list[str]:
    out = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode()
    return sorted(f for f in out.split("\0") if f and (ROOT / f).is_file())


def make_slot(files: list[str], dest: Path) -> None:
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, target)
    # checked-hash byte code: a .pyc is used only when it matches its source's hash, never a stale one
    subprocess.run(
        [sys.executable, "-m", "compileall", "-q", "--invalidation-mode", "checked-hash", "lightning_dml", "tests"],
        cwd=dest, check=False, stdout=subprocess.DEVNULL,
    )


def module_name(rel: str) -> str:
    parts = list(Path(rel).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


# ------------------------------------------------------------------------------------------------ child processes
_CHILD_ENV = {
    "WANDB_MODE": "offline", "WANDB_SILENT": "true", "LIGHTNING_DML_OFFLINE": "1", "MPLBACKEND": "Agg",
    "PYTHONDONTWRITEBYTECODE": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
}


class _Recorder:
    """pytest plugin of a child run: reorders the tests, records the first failure, and (baseline) each test's
    lines of the mutated files, duration and outcome."""

    def __init__(self, order: dict[str, int] | None, trace_files: dict[str, str] | None) -> None:
        self.order = order
        self.failed: list[str] = []
        self.outcomes: dict[str, str] = {}
        self.durations: dict[str, float] = {}
        self.trace_files = trace_files  # absolute path -> relative path
        self.collect: set[tuple[str, int]] = set()
        self.current = self.collect
        self.lines: dict[str, list] = {}

    def pytest_collection_modifyitems(self, session, config, items):  # noqa: ARG002
        if self.order is not None:
            items.sort(key=lambda item: self.order.get(item.nodeid, 1 << 30))

    def pytest_collectreport(self, report):
        if report.failed:
            self.outcomes[report.nodeid or "<collection>"] = "collection error"

    def pytest_runtest_logreport(self, report):
        self.durations[report.nodeid] = self.durations.get(report.nodeid, 0.0) + report.duration
        if report.failed and report.nodeid not in self.failed:
            self.failed.append(report.nodeid)
        if report.failed:
            self.outcomes[report.nodeid] = "failed"
        elif report.when == "call" or (report.skipped and report.nodeid not in self.outcomes):
            self.outcomes.setdefault(report.nodeid, report.outcome)

    # line tracing (baseline only)
    def start_tracing(self) -> None:
        import threading

        files = self.trace_files

        def local(frame, event, arg):  # noqa: ARG001
            if event == "line":
                self.current.add((files[frame.f_code.co_filename], frame.f_lineno))
            return local

        def global_(frame, event, arg):  # noqa: ARG001
            name = frame.f_code.co_filename
            if name in files:
                self.current.add((files[name], frame.f_lineno))
                return local
            return None

        sys.settrace(global_)
        threading.settrace(global_)

    def pytest_runtest_logstart(self, nodeid, location):  # noqa: ARG002
        self.current = set()

    def pytest_runtest_logfinish(self, nodeid, location):  # noqa: ARG002
        if self.trace_files is not None:
            self.lines[nodeid] = sorted(self.current)
        self.current = self.collect


def _child(slot: Path, args: list[str], result_path: Path, log_path: Path, order, trace_files, modules) -> None:
    """Body of a forked child: run pytest in ``slot`` and write the result JSON; never returns."""
    code = 3
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.setpgid(0, 0)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # a background process group must never read a terminal
        os.chdir(slot)
        sys.path.insert(0, str(slot))
        os.environ.update(_CHILD_ENV)
        os.environ["PYTHONPATH"] = os.pathsep.join([str(slot), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        # a mutant's byte code is never written (a timestamp .pyc of a mutant could outlive it); the baseline may
        # write pytest's rewritten test modules, which never change in a slot
        sys.dont_write_bytecode = trace_files is None
        import pytest

        recorder = _Recorder(order, trace_files)
        if trace_files is not None:
            recorder.start_tracing()
        code = int(pytest.main(args, plugins=[recorder]))
        sys.settrace(None)
        imported = {}
        for name in modules:  # where each mutated (or traced) module was imported from: must be the slot
            mod = sys.modules.get(name)
            imported[name] = getattr(mod, "__file__", None) if mod is not None else None
        third_party = [
            n for n, m in list(sys.modules.items())
            if not str(getattr(m, "__file__", "") or "").startswith(str(slot)) and not n.startswith(("tests", "lightning_dml"))
            and n not in ("__main__", "__mp_main__")
        ]
        result = {
            "code": code, "failed": recorder.failed, "outcomes": recorder.outcomes, "durations": recorder.durations,
            "imported": imported,
        }
        if trace_files is not None:
            result["lines"] = recorder.lines
            result["collect_lines"] = sorted(recorder.collect)
            result["third_party"] = third_party
        result_path.write_text(json.dumps(result))
    except BaseException as error:  # noqa: BLE001
        try:
            result_path.write_text(json.dumps({"code": 3, "error": repr(error)}))
        except OSError:
            pass
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code if 0 <= code < 256 else 3)


def _pytest_args(nodeids: list[str], basetemp: Path, stop_first: bool) -> list[str]:
    args = ["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly", "-o", "addopts=",
            "--basetemp", str(basetemp), "--tb=short", "-m", "not slow", "-W", "ignore::DeprecationWarning"]
    if stop_first:
        args.append("-x")
    return args + nodeids


@dataclass
class _Job:
    pid: int
    mutant: Mutant | None
    slot: int
    started: float
    deadline: float
    result_path: Path
    stage: int
    tests: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ the run
class Runner:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(tempfile.gettempdir())  # the run's own folder is made in run(), after --list
        self.out = Path(args.out).resolve()
        self.out.mkdir(parents=True, exist_ok=True)
        self.files = _project_files()

    def log(self, text: str) -> None:
        print(text, flush=True)

    # -------------------------------------------------------------- set-up
    def groups_of_sources(self) -> dict[str, str]:
        group_of = {}
        for group, spec in GROUPS.items():
            for pattern in spec["sources"]:
                for rel in self.files:
                    if fnmatch.fnmatch(rel, pattern) and rel not in EXCLUDED_FILES:
                        group_of.setdefault(rel, group)
        if self.args.only:
            group_of = {r: g for r, g in group_of.items() if any(fnmatch.fnmatch(r, p) for p in self.args.only)}
        return group_of

    def test_files(self, group: str, key: str = "tests") -> list[str]:
        return sorted({rel for pattern in GROUPS[group][key] for rel in self.files if fnmatch.fnmatch(rel, pattern)})

    # -------------------------------------------------------------- forking
    def fork(self, slot: int, args: list[str], order, trace_files, modules, mutant: Mutant | None) -> tuple[int, Path]:
        result_path = self.work / f"result{slot}.json"
        result_path.unlink(missing_ok=True)
        log_path = self.work / f"log{slot}.txt"
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(self.slots[slot], args, result_path, log_path, order, trace_files, modules)
        return pid, result_path

    @staticmethod
    def kill(pid: int) -> None:
        try:
            os.killpg(pid, signal.SIGKILL)  # the child's own process group (it called setpgid)
        except ProcessLookupError:
            pass

    # -------------------------------------------------------------- baseline
    def baseline(self, group_of: dict[str, str]) -> dict:
        groups = sorted(set(group_of.values()))
        tests = sorted({t for g in groups for t in self.test_files(g) + self.test_files(g, "subprocess_tests")})
        slot = self.slots[0]
        trace_files = {str(slot / rel): rel for rel in group_of}
        modules = [module_name(rel) for rel in group_of]
        self.log(f"baseline: {len(tests)} test files, tracing {len(trace_files)} files ...")
        started = time.time()
        baseline_args = ["--continue-on-collection-errors", *_pytest_args(tests, self.work / "basetemp-baseline", False)]
        pid, result_path = self.fork(0, baseline_args, None,
                                     trace_files, modules, None)
        _, status = os.waitpid(pid, 0)
        if not result_path.exists():
            raise SystemExit(f"baseline run died (status {status}); see {self.work / 'log0.txt'}")
        result = json.loads(result_path.read_text())
        if "error" in result:
            raise SystemExit(f"baseline run failed: {result['error']}; see {self.work / 'log0.txt'}")
        wrong = {n: f for n, f in result["imported"].items() if f is not None and not f.startswith(str(slot))}
        if wrong:
            raise SystemExit(f"the baseline imported the library from outside the copy: {wrong}")
        result["seconds"] = time.time() - started
        failed = sorted(n for n, o in result["outcomes"].items() if o in ("failed", "collection error"))
        self.log(f"baseline: {len(result['outcomes'])} tests in {result['seconds']:.0f} s, {len(failed)} failed "
                 f"(left out)")
        shutil.copy(self.work / "log0.txt", self.out / "baseline.log")
        return result

    # -------------------------------------------------------------- main loop
    def run(self) -> int:
        args = self.args
        started_at = time.time()
        load_start = os.getloadavg()
        group_of = self.groups_of_sources()
        sources = {rel: (ROOT / rel).read_text() for rel in group_of}
        all_sources = {rel: (ROOT / rel).read_text() for rel in self.files if rel.endswith(".py")}
        mutants = [m for rel in sorted(group_of) for m in collect(rel, sources[rel])]
        hand, stale = targeted(all_sources)
        if args.only:
            hand = [m for m in hand if m.file in group_of]
        per_file = {}
        for m in mutants:
            per_file[m.file] = per_file.get(m.file, 0) + 1
        self.log(f"{len(mutants)} mutants in {len(group_of)} files, {len(hand)} targeted")
        if args.list:
            for rel, n in sorted(per_file.items()):
                self.log(f"  {n:5d}  {rel}")
            ops = {}
            for m in mutants:
                ops[m.op] = ops.get(m.op, 0) + 1
            self.log("  by operator: " + ", ".join(f"{k} {v}" for k, v in sorted(ops.items())))
            return 0
        self.work = Path(tempfile.mkdtemp(prefix="dml-mutants-"))
        self.slots = [self.work / f"slot{i}" for i in range(args.jobs)]
        selected = mutants
        if args.survivors_of:
            previous = json.loads(Path(args.survivors_of).read_text())
            keys = {s["key"] for s in previous["survivors"]}
            selected = [m for m in mutants if m.key in keys]
            self.log(f"rerunning the {len(selected)} of {len(keys)} previous survivors that still exist")
        elif args.sample and args.sample < len(mutants):
            selected = sorted(random.Random(args.seed).sample(mutants, args.sample),
                              key=lambda m: (m.file, m.start, m.op, m.after))
        # a seeded random order: a run cut short by --budget-minutes has run a uniform sample
        selected = list(selected)
        random.Random(args.seed).shuffle(selected)
        todo = hand + selected
        fingerprint = hashlib.sha256(
            "".join(sorted(f"{rel}:{hashlib.sha256((ROOT / rel).read_bytes()).hexdigest()}" for rel in self.files
                           if rel.startswith(("lightning_dml/", "tests/")) or rel == "setup.cfg")).encode()
        ).hexdigest()
        journal = self.out / "results.jsonl"
        previous: dict[str, dict] = {}
        if args.resume and journal.exists():
            lines = journal.read_text().splitlines()
            if lines and json.loads(lines[0]).get("fingerprint") == fingerprint:
                for line in lines[1:]:
                    record = json.loads(line)
                    previous[record["key"]] = record
                self.log(f"resuming: {len(previous)} results of the same sources and tests reused")
            else:
                self.log("resume: the sources or tests changed since that journal: starting afresh")
        journal.write_text(json.dumps({"fingerprint": fingerprint}) + "\n")
        for record in previous.values():
            with journal.open("a") as fh:
                fh.write(json.dumps(record) + "\n")

        for slot in self.slots:
            make_slot(self.files, slot)
        for rel in group_of:
            if (self.slots[0] / rel).read_text() != sources[rel]:
                raise SystemExit(f"{rel} changed while the copy was made: run again")
        base = self.baseline(group_of)
        self.preimport(base["third_party"])

        passed = {n for n, o in base["outcomes"].items() if o == "passed"}
        excluded = sorted(f"{n} ({o})" for n, o in base["outcomes"].items() if o in ("failed", "collection error"))
        durations = base["durations"]
        order = {n: i for i, n in enumerate(sorted(passed, key=lambda n: (durations.get(n, 0.0), n)))}
        by_line: dict[tuple[str, int], set[str]] = {}
        for nodeid, lines in base["lines"].items():
            if nodeid in passed:
                for rel, line in lines:
                    by_line.setdefault((rel, line), set()).add(nodeid)
        group_tests = {g: sorted(n for n in passed if n.split("::")[0] in set(self.test_files(g))) for g in GROUPS}
        sub_tests = {g: sorted(n for n in passed if n.split("::")[0] in set(self.test_files(g, "subprocess_tests")))
                     for g in GROUPS}
        def sub_for(m: Mutant) -> list[str]:
            """The subprocess tests that run for a survivor of the in-process tests."""
            group = group_of[m.file]
            wanted = {t for t, sources in GROUPS[group]["subprocess_tests"].items()
                      if any(fnmatch.fnmatch(f"{m.file}::{m.function}" if "::" in p else m.file, p) for p in sources)}
            return [n for n in sub_tests[group] if any(fnmatch.fnmatch(n.split("::")[0], t) for t in wanted)]

        def tests_for(m: Mutant) -> list[str]:
            group = group_of[m.file]
            if m.import_time:
                chosen = set(group_tests[group])
            else:
                first, last = m.cover or (m.line, m.end_line)
                chosen = set().union(*(by_line.get((m.file, ln), set()) for ln in range(first, last + 1)))
            chosen -= set(sub_tests[group])
            return sorted(chosen, key=lambda n: order[n])

        results: list[dict] = [previous[m.key] for m in todo if m.key in previous]
        queue = [(m, 1) for m in todo if m.key not in previous]
        jobs: dict[int, _Job] = {}
        free = list(range(args.jobs))
        deadline_all = started_at + args.budget_minutes * 60 if args.budget_minutes else None
        skipped_budget = 0
        done = len(results)
        total = len(todo)

        def start(m: Mutant, stage: int) -> None:
            slot = free.pop(0)
            tests = tests_for(m) if stage == 1 else sub_for(m)
            if not tests:
                free.append(slot)
                finish(m, stage, {"status": "no tests" if stage == 1 else "survived", "tests": 0, "seconds": 0.0})
                return
            path = self.slots[slot] / m.file
            path.write_text(m.mutated_source(sources[m.file]))
            budget = sum(durations.get(n, 1.0) for n in tests)
            timeout = args.timeout_base + args.timeout_factor * budget
            pid, result_path = self.fork(slot, _pytest_args(tests, self.work / f"basetemp{slot}", True),
                                         order, None, [module_name(m.file)], m)
            now = time.time()
            jobs[pid] = _Job(pid, m, slot, now, now + timeout, result_path, stage, tests)

        def finish(m: Mutant, stage: int, outcome: dict) -> None:
            nonlocal done
            if stage == 1 and outcome["status"] in ("survived", "no tests") and sub_for(m):
                outcome["stage1"] = outcome["status"]
                queue.insert(0, (m, 2))  # the subprocess tests decide
                pending_stage1[m.key] = outcome
                return
            if stage == 2:
                first = pending_stage1.pop(m.key, {})
                if outcome["status"] == "survived" and first.get("status") == "no tests":
                    outcome["status"] = "no tests"
                outcome["tests"] = outcome.get("tests", 0) + first.get("tests", 0)
                outcome["seconds"] = outcome.get("seconds", 0.0) + first.get("seconds", 0.0)
            record = {**asdict(m), **outcome}
            for name in ("start", "end", "replacement"):
                record.pop(name)
            results.append(record)
            with journal.open("a") as fh:
                fh.write(json.dumps(record) + "\n")
            done += 1
            status = outcome["status"]
            if args.verbose or status not in ("killed",):
                self.log(f"[{done}/{total}] {status:9s} {m.file}:{m.line} {m.function}: {m.source_line[:70]!r} "
                         f"{m.op} {m.before[:50]!r} -> {m.after[:50]!r} ({outcome.get('seconds', 0):.1f} s, "
                         f"{outcome.get('tests', 0)} tests)")
            elif done % 50 == 0:
                self.log(f"[{done}/{total}] ... {sum(r['status'] == 'killed' for r in results)} killed so far, "
                         f"{time.time() - started_at:.0f} s")

        pending_stage1: dict[str, dict] = {}

        def stop(signum, frame):  # noqa: ARG001 - killed or interrupted: end the children, keep the journal
            for pid in list(jobs):
                self.kill(pid)
            if not args.keep:
                shutil.rmtree(self.work, ignore_errors=True)
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        while queue or jobs:
            while queue and free:
                if deadline_all is not None and time.time() > deadline_all:
                    skipped_budget += sum(1 for _, stage in queue if stage == 1)
                    queue.clear()
                    break
                m, stage = queue.pop(0)
                start(m, stage)
            if not jobs:
                continue
            time.sleep(0.02)
            for pid, job in list(jobs.items()):
                finished, status = os.waitpid(pid, os.WNOHANG)
                timed_out = not finished and time.time() > job.deadline
                if timed_out:
                    self.kill(pid)
                    os.waitpid(pid, 0)
                if not finished and not timed_out:
                    continue
                del jobs[pid]
                m = job.mutant
                (self.slots[job.slot] / m.file).write_text(sources[m.file])  # restore the slot's copy
                free.append(job.slot)
                seconds = time.time() - job.started
                outcome = {"tests": len(job.tests), "seconds": round(seconds, 2)}
                if timed_out:
                    outcome["status"] = "timeout"
                else:
                    outcome.update(self.judge(job, status, m))
                finish(m, job.stage, outcome)

        # a slot is a copy: the working tree was never touched; check the copies are back to the original
        for slot in self.slots:
            for rel in group_of:
                assert (slot / rel).read_text() == sources[rel], f"{slot / rel} not restored"
        report = self.report(results, stale, excluded, base, started_at, load_start, len(mutants), skipped_budget,
                             group_of)
        if not args.keep:
            shutil.rmtree(self.work, ignore_errors=True)
        else:
            self.log(f"work folder kept: {self.work}")
        targeted_alive = [r for r in results if r["op"] == "targeted" and r["status"] not in ("killed", "timeout")]
        return 1 if (targeted_alive or stale) else 0

    def judge(self, job: _Job, status: int, m: Mutant) -> dict:
        """Turn a finished child's status and result file into ``{"status": ..., "killed_by": ...}``."""
        if os.WIFSIGNALED(status):
            return {"status": "killed", "killed_by": f"crash (signal {os.WTERMSIG(status)})"}
        code = os.WEXITSTATUS(status)
        result = json.loads(job.result_path.read_text()) if job.result_path.exists() else {}
        where = result.get("imported", {}).get(module_name(m.file))
        if code == 0:
            # in-process tests must have imported the mutant from the slot (the subprocess tests of stage 2 import it
            # in their own processes, through PYTHONPATH)
            if job.stage == 1 and (where is None or not where.startswith(str(self.slots[job.slot]))):
                return {"status": "error", "error": f"mutated module imported from {where}, not from the copy"}
            return {"status": "survived"}
        if code == 1:
            return {"status": "killed", "killed_by": (result.get("failed") or ["?"])[0]}
        if code in (2, 3, 4):
            # 2: interrupted by an import / collection error; 3: internal error; 4: "not found": a test id of the
            # baseline no longer exists (the mutant changed what the test modules collect, e.g. parametrisations
            # built from the library at import). The arguments are those the baseline accepted.
            return {"status": "killed", "killed_by": f"import or collection error (pytest exit {code})"}
        return {"status": "error", "error": f"pytest exit status {code}: {result.get('error', '')}"}

    def preimport(self, names: list[str]) -> None:
        """Import the third-party modules the tests use, once, in the parent (the forked children inherit them)."""
        started = time.time()
        for name in ("WANDB_MODE", "WANDB_SILENT", "LIGHTNING_DML_OFFLINE", "MPLBACKEND"):
            os.environ.setdefault(name, _CHILD_ENV[name])
        import importlib
        import threading

        ok = 0
        for name in names:
            if name in sys.modules:
                continue
            try:
                importlib.import_module(name)
                ok += 1
            except BaseException:  # noqa: BLE001 - a module that imports only in its own context
                pass
        if threading.active_count() != 1:
            self.log(f"warning: {threading.active_count()} threads after the imports (forking anyway)")
        self.log(f"pre-imported {ok} modules in {time.time() - started:.0f} s")

    # -------------------------------------------------------------- report
    def report(self, results, stale, excluded, base, started_at, load_start, total_mutants, skipped_budget,
               group_of) -> dict:
        equivalents = load_equivalents()
        for r in results:
            if r["status"] in ("survived", "no tests"):
                reason = match_equivalent(r, equivalents)
                if reason is not None:
                    r["equivalent"] = reason
        counts = _counts(results)
        per_file = {}
        for r in results:
            per_file.setdefault(r["file"], []).append(r)
        seconds = time.time() - started_at
        report = {
            "summary": {
                **counts,
                "mutants_in_scope": total_mutants,
                "skipped_over_budget": skipped_budget,
                "seconds": round(seconds),
                "baseline_seconds": round(base["seconds"]),
                "baseline_tests": len(base["outcomes"]),
                "jobs": self.args.jobs,
                "sample": self.args.sample,
                "seed": self.args.seed,
                "survivors_of": self.args.survivors_of,
                "only": self.args.only,
                "load_average_start": [round(v, 2) for v in load_start],
                "load_average_end": [round(v, 2) for v in os.getloadavg()],
                "commit": _commit(),
                "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            },
            "per_file": {f: _counts(rs) for f, rs in sorted(per_file.items())},
            "targeted": [r for r in results if r["op"] == "targeted"],
            "stale_targeted": stale,
            "excluded_tests": excluded,
            "excluded_files": EXCLUDED_FILES,
            "survivors": [r for r in results if r["status"] in ("survived", "no tests") and "equivalent" not in r],
            "equivalent": [r for r in results if "equivalent" in r],
            "timeouts": [r for r in results if r["status"] == "timeout"],
            "errors": [r for r in results if r["status"] == "error"],
        }
        (self.out / "report.json").write_text(json.dumps(report, indent=1))
        (self.out / "report.md").write_text(render_markdown(report))
        self.log((self.out / "report.md").read_text().split("\n## Survivors")[0])
        self.log(f"report: {self.out / 'report.md'} and report.json")
        return report


def _counts(results: list[dict]) -> dict:
    c = {s: sum(r["status"] == s for r in results) for s in ("killed", "timeout", "survived", "no tests", "error")}
    equivalent = sum("equivalent" in r for r in results)
    kinds = {k: sum(r.get("equivalent", "").startswith(k + ":") for r in results) for k in EQUIVALENT_KINDS}
    run = len(results) - c["error"]
    alive = c["survived"] + c["no tests"] - equivalent
    return {
        "mutants": len(results), "killed": c["killed"], "killed_by_timeout": c["timeout"],
        "survived": c["survived"], "not_covered": c["no tests"], "equivalent": equivalent,
        "equivalent_kinds": kinds, "errors": c["error"],
        "survivors_not_equivalent": alive,
        "survivor_rate": round(alive / run, 4) if run else 0.0,
    }


def _commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True).stdout
        return head + ("+uncommitted changes" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load_equivalents() -> list[dict]:
    if not EQUIVALENTS_FILE.exists():
        return []
    entries = tomllib.loads(EQUIVALENTS_FILE.read_text()).get("equivalent", [])
    for e in entries:
        missing = {"file", "function", "kind", "why"} - set(e)
        if missing or e["kind"] not in EQUIVALENT_KINDS:
            raise SystemExit(f"{EQUIVALENTS_FILE}: entry {e} lacks {sorted(missing)} or has a kind other than "
                             f"{' / '.join(EQUIVALENT_KINDS)}")
    return entries


def match_equivalent(r: dict, equivalents: list[dict]) -> str | None:
    """The ``kind: why`` of the first entry of ``tools/mutants_equivalent.toml`` that matches the mutant: its file
    and function (``fnmatch`` patterns: ``*`` for any), and, where the entry gives them, the same ``before`` /
    ``after`` expression, operator, and a source line that contains ``line``."""
    for e in equivalents:
        if not fnmatch.fnmatch(r["file"], e["file"]) or not fnmatch.fnmatch(r["function"], e["function"]):
            continue
        if e.get("before", r["before"]) != r["before"] or e.get("after", r["after"]) != r["after"]:
            continue
        if e.get("op", r["op"]) != r["op"] or e.get("line", "") not in r["source_line"]:
            continue
        return f"{e['kind']}: {e['why']}"
    return None


def render_markdown(report: dict) -> str:
    s = report["summary"]
    lines = [
        "# Mutation check",
        "",
        f"{s['date']}, commit {s['commit']}: {s['mutants']} mutants run ({s['mutants_in_scope']} generated in "
        f"scope + {len(report['targeted'])} targeted)"
        + (f" (seeded sample of {s['sample']}, seed {s['seed']})" if s["sample"] else "")
        + (f" (rerun of the survivors of {s['survivors_of']})" if s["survivors_of"] else "")
        + (f", only {s['only']}" if s["only"] else "")
        + (f", {s['skipped_over_budget']} not run (time budget)" if s["skipped_over_budget"] else "")
        + f"; {s['seconds'] / 60:.1f} min with {s['jobs']} jobs (baseline {s['baseline_tests']} tests, "
        f"{s['baseline_seconds']} s traced), load average {s['load_average_start'][0]} -> {s['load_average_end'][0]}.",
        "",
        f"**Survivor rate (not proven equivalent): {100 * s['survivor_rate']:.2f}%** "
        f"({s['survivors_not_equivalent']} of {s['mutants'] - s['errors']}); killed {s['killed']}, "
        f"killed by timeout {s['killed_by_timeout']}, survived {s['survived']}, no covering test "
        f"{s['not_covered']}, equivalent {s['equivalent']} ("
        + ", ".join(f"{k} {v}" for k, v in s["equivalent_kinds"].items()) + f"), errors {s['errors']}.",
        "",
        "| file | mutants | killed | timeout | survived | no test | equivalent | rate |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for f, c in report["per_file"].items():
        lines.append(f"| `{f}` | {c['mutants']} | {c['killed']} | {c['killed_by_timeout']} | {c['survived']} | "
                     f"{c['not_covered']} | {c['equivalent']} | {100 * c['survivor_rate']:.1f}% |")
    lines += ["", "## Targeted mutants (issue 19)", ""]
    for r in report["targeted"]:
        lines.append(f"* {r['status']}: {r['label']} (`{r['file']}::{r['function']}`)"
                     + (f" by `{r.get('killed_by')}`" if r.get("killed_by") else ""))
    for e in report["stale_targeted"]:
        lines.append(f"* **stale**: {e}")
    if report["excluded_tests"]:
        lines += ["", f"Tests left out (failed in the baseline): {', '.join(report['excluded_tests'])}"]
    lines += ["", "## Survivors", ""]
    for r in report["survivors"]:
        lines.append(f"* `{r['file']}:{r['line']}` {r['function']} ({r['op']}{', no covering test' if r['status'] == 'no tests' else ''}): "
                     f"`{r['source_line']}` -> `{r['mutated_line']}`")
    if report["timeouts"]:
        lines += ["", "## Killed by timeout", ""]
        for r in report["timeouts"]:
            lines.append(f"* `{r['file']}:{r['line']}` {r['function']}: `{r['before']}` -> `{r['after']}`")
    if report["errors"]:
        lines += ["", "## Errors", ""]
        for r in report["errors"]:
            lines.append(f"* `{r['file']}:{r['line']}` {r['function']}: {r.get('error')}")
    if report["equivalent"]:
        lines += ["", "## Equivalent (tools/mutants_equivalent.toml)", ""]
        for r in report["equivalent"]:
            lines.append(f"* `{r['file']}:{r['line']}` {r['function']}: `{r['before']}` -> `{r['after']}`: "
                         f"{r['equivalent']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=2, help="mutants run at the same time (default 2)")
    parser.add_argument("--sample", type=int, default=0, help="run a seeded uniform sample of this many mutants")
    parser.add_argument("--seed", type=int, default=0, help="seed of --sample (default 0)")
    parser.add_argument("--only", action="append", default=[], help="glob of the files to mutate (repeatable)")
    parser.add_argument("--survivors-of", default=None, help="rerun only the survivors of this report.json")
    parser.add_argument("--budget-minutes", type=float, default=0, help="start no new mutant after this time")
    parser.add_argument("--timeout-factor", type=float, default=4.0, help="x the baseline time of a mutant's tests")
    parser.add_argument("--timeout-base", type=float, default=60.0, help="+ seconds (start-up, collection)")
    parser.add_argument("--out", default=str(ROOT / "logs" / "mutants"), help="report folder (default logs/mutants)")
    parser.add_argument("--list", action="store_true", help="count the mutants per file and operator, run nothing")
    parser.add_argument("--keep", action="store_true", help="keep the temporary work folder")
    parser.add_argument("--verbose", action="store_true", help="print every mutant, not only the survivors")
    parser.add_argument("--resume", action="store_true",
                        help="reuse the results in <out>/results.jsonl when sources and tests are unchanged")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error("--jobs must be >= 1")
    return Runner(args).run()


if __name__ == "__main__":
    sys.exit(main())
