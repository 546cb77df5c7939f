"""The GPU check (issue 26 s.5, ``../shared/gpu-checks.md``): one prepared command for a lent GPU machine.

A GPU machine is lent rarely, for minutes, without network, with its own ``python3`` and torch (not the pinned
one). This script runs there as it is, from a copy of the working tree (never the ``.venv``)::

    python3 tools/gpu_check.py --out "$OUT"          # what `make gpu-check OUT=$OUT` runs (docs/gpu.md)

and, in order, each step with its own time cap inside one total budget (``--budget-seconds``, default 450):

1. ``install``: the wheels carried in ``gpu-wheels/`` (``make gpu-wheels`` downloads them here, for Python 3.12:
   :data:`WHEELS`, about 1 MiB) into a temporary folder with ``pip install --no-deps --no-index --target`` (a plain
   unzip where pip is missing); torch and the rest of the device's packages are never touched. The package itself
   is not installed: the repository is put on ``PYTHONPATH`` and the CLI runs as ``python3 -m lightning_dml``.
2. ``environment``: Python, torch, CUDA, the device and its memory, the version (and origin) of every package the
   checks use, and whether ``lightning_dml`` and its CLI import.
3. ``cuda-tests``: ``pytest -m cuda`` (the CUDA variants of the tests taking the ``device`` fixture). Test modules
   that need a package not carried (faiss, optuna, wandb, ...) fail to collect and are listed apart, as expected.
4. ``evaluation``: ``bench/evaluation.py --device cuda`` at 60,502 x 512, ours against a plain torch brute force.
5. ``losses``: ``bench/losses.py --device cuda``, ours against pytorch-metric-learning at batch 512 and 2048.
6. ``throughput``: images/s of a ``DMLModule`` training step (ViT-S/16 at 224, random weights, synthetic batches
   already on the GPU) in bf16-mixed and 32-true, against a plain PyTorch loop with the same model, loss and
   optimizer (this script's ``--worker throughput``).
7. ``fit-glyphs``: the demo's real fit on the GPU (``fit --config configs/glyphs.yaml --trainer.accelerator gpu
   --trainer.precision bf16-mixed --trainer.logger false``) and its printed table.
8. ``evaluation-precision``: the 60,502 x 512 evaluation in fp32, tf32 and bf16: the figures must be ``==``.
9. ``evaluation-1m``: the evaluation at 1,000,000 x 512 (the stretch: it gets what is left of the budget).

Every step's commands, wall time, exit status, figures and the tail of a failure's output go to
``OUT/gpu-check.json`` and ``OUT/gpu-check.md``, rewritten (atomically) before the first step, when each step
starts and when it ends: a run killed at any point leaves a summary of what finished. The output of each step is
in ``OUT/logs/``. A step that fails or runs out of time is recorded and the next one runs.

``--dry-run`` runs the same steps on the CPU at tiny sizes in the current environment (no install unless
``--install``), with the packages the GPU machine lacks and nobody carries (:data:`NOT_ON_DEVICE`) hidden from
every step, as they are there: ``tests/test_gpu_check.py`` runs it, so the check works the first time a GPU is lent.

``python tools/gpu_check.py --download-wheels gpu-wheels`` (``make gpu-wheels``) fills the wheel folder.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import resource
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: What the checks need and the GPU machine's ``python3`` lacks, pinned to the versions the test suite runs with
#: here: the CLI's argument parser (jsonargparse with its ``signatures`` extra) and pytorch-metric-learning (the
#: peer of ``bench/losses.py``). All pure Python (``py3-none-any``), about 1.1 MiB together. Left out on purpose:
#: faiss-cpu (~30 MiB; the evaluation's GPU peer is a plain torch brute force, and the index checks are not part of
#: this run), wandb (runs use ``--trainer.logger false``), pretrainedmodels (BN-Inception; PyPI has no wheel of it,
#: only a source archive), optuna (the protocol commands are not run here).
WHEELS = (
    "jsonargparse==4.53.0",
    "docstring-parser==0.18.0",
    "typeshed-client==2.15.0",
    "pytorch-metric-learning==2.9.0",
)
#: The GPU machine's Python and the platforms its wheels may be built for.
DEVICE_PYTHON = "3.12"
WHEEL_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux2014_x86_64", "manylinux_2_17_x86_64", "any")
#: The most the wheel folder may weigh (it travels with the run; the device tool carries 64 MiB in all).
MAX_WHEELS_MIB = 40.0

#: Packages the GPU machine lacks and nobody carries (top-level import names). The dry run hides them from every
#: step, so a step that would need one fails here as it would there.
NOT_ON_DEVICE = (
    "wandb", "faiss", "optuna", "pretrainedmodels", "munch", "litserve", "pyarrow", "simplejpeg", "playwright",
    "nbclient", "nbformat", "ipykernel", "tensorboard",
)
#: The distributions whose versions the environment step reports.
REPORTED_PACKAGES = (
    "torch", "torchvision", "pytorch-lightning", "lightning-utilities", "torchmetrics", "timm", "huggingface-hub",
    "safetensors", "scikit-learn", "scipy", "numpy", "matplotlib", "pillow", "pyyaml", "filelock", "pytest",
    "jsonargparse", "docstring-parser", "typeshed-client", "pytorch-metric-learning",
)


# ------------------------------------------------------------------------------------------------ the run's state
@dataclass
class Context:
    """What every step needs: the interpreter, the folders, the mode and the environment of its processes."""

    python: str
    out: Path
    dry_run: bool
    wheels: Path
    install: bool
    site: Path  # where the carried wheels are installed (a temporary folder)
    scratch: Path  # the steps' temporary files (outside OUT: nothing there comes back)
    hide_dir: Path | None = None  # the dry run's ``sitecustomize`` that hides NOT_ON_DEVICE
    env: dict[str, str] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return "cpu" if self.dry_run else "cuda"

    @property
    def logs(self) -> Path:
        return self.out / "logs"


@dataclass
class Result:
    """One step's record in the summary."""

    name: str
    title: str
    status: str = "pending"  # then running; passed, failed, timeout (killed at its cap), skipped or interrupted
    cap_s: float = 0.0
    wall_s: float | None = None
    cpu_s: float | None = None  # user + system time of its processes (what a loaded machine changes least)
    commands: list[str] = field(default_factory=list)
    returncodes: list[int | None] = field(default_factory=list)
    figures: dict = field(default_factory=dict)
    note: str = ""
    log: str = ""
    tail: str = ""


@dataclass
class Step:
    """A step: its commands (built from the context), how to read figures from their outputs and its caps.

    ``commands`` returns argv lists (run in turn, each with what is left of the step's time); ``parse`` gets each
    command with its output and returns the figures, with a one-line ``headline``; ``judge`` decides the status of
    a step whose commands all exited (default: passed when every exit status is 0). ``run`` replaces the whole
    command machinery (the install step).
    """

    name: str
    title: str
    gpu_cap_s: float
    dry_cap_s: float
    commands: Callable[[Context], list[list[str]]] = lambda ctx: []
    parse: Callable[[list[tuple[list[str], str]], Context], dict] = lambda outputs, ctx: {}
    judge: Callable[[list[int | None], dict], tuple[str, str]] | None = None
    run: Callable[[Context, float], Result] | None = None


class Interrupted(Exception):
    """The check was told to stop (SIGTERM, SIGINT): the running step is recorded as interrupted."""


def _on_signal(signum, frame) -> None:  # noqa: ARG001
    raise Interrupted(signal.Signals(signum).name)


# ------------------------------------------------------------------------------------------------ running commands
def run_command(argv: Sequence[str], log: Path, timeout: float, env: dict[str, str]) -> tuple[int | None, str]:
    """Run ``argv`` in the repository root, its output (stdout and stderr) appended to ``log`` as it comes.

    Returns the exit status (``None``: killed at ``timeout``, with its whole process group) and the output. A
    signal to this process kills the command's group too, then propagates.
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as fh:
        start = fh.tell()
        fh.write(f"$ {shlex.join(argv)}\n".encode())
        fh.flush()
        proc = subprocess.Popen(list(argv), cwd=ROOT, env=env, stdout=fh, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            code: int | None = proc.wait(timeout=max(timeout, 0.1))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            code = None
        except BaseException:
            _kill_group(proc)
            raise
    with open(log, "rb") as fh:
        fh.seek(start)
        text = fh.read().decode("utf-8", "replace")
    return code, text.split("\n", 1)[1] if "\n" in text else ""


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the command's process group; 5 s later (or when its leader is gone) SIGKILL to what is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            pass


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _tail(text: str, lines: int = 40, chars: int = 4000) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])[-chars:]


def run_step(step: Step, ctx: Context, cap: float, index: int) -> Result:
    """Run one step within ``cap`` seconds; any error of the step itself is recorded, never raised (but a signal)."""
    result = Result(step.name, step.title, "running", cap_s=round(cap, 1))
    if step.run is not None:
        try:
            return step.run(ctx, cap)
        except Interrupted:
            raise
        except Exception as exc:
            result.status, result.note = "failed", f"{type(exc).__name__}: {exc}"
            return result
    log = ctx.logs / f"{index:02d}-{step.name}.log"
    result.log = str(log.relative_to(ctx.out))
    start, cpu = time.monotonic(), _children_cpu()
    outputs: list[tuple[list[str], str]] = []
    try:
        for argv in step.commands(ctx):
            left = cap - (time.monotonic() - start)
            result.commands.append(shlex.join(_shown(argv)))
            code, text = run_command(argv, log, left, ctx.env)
            result.returncodes.append(code)
            outputs.append((argv, text))
            if code is None:
                break
        result.figures = step.parse(outputs, ctx)
        if None in result.returncodes:
            result.status, result.note = "timeout", f"killed at its cap of {cap:.0f} s; figures are what finished"
        elif step.judge is not None:
            result.status, result.note = step.judge(result.returncodes, result.figures)
        else:
            ok = all(code == 0 for code in result.returncodes)
            result.status = "passed" if ok else "failed"
            if not ok:
                result.note = f"exit status {result.returncodes}"
    except Interrupted:
        raise
    except Exception as exc:  # the step's own bug (a parser, a missing file): recorded, the check goes on
        result.status, result.note = "failed", f"{type(exc).__name__}: {exc}"
    result.wall_s, result.cpu_s = round(time.monotonic() - start, 1), round(_children_cpu() - cpu, 1)
    if result.status != "passed" and outputs:
        result.tail = _tail(outputs[-1][1])
    return result


def _shown(argv: Sequence[str]) -> list[str]:
    """``argv`` as the summary shows it: paths inside the repository relative to its root (where it runs)."""
    return [a.replace(str(ROOT) + os.sep, "") for a in argv]


# ------------------------------------------------------------------------------------------------ the steps
def _python(ctx: Context, *args: str) -> list[str]:
    return [ctx.python, *args]


def install_step(ctx: Context, cap: float) -> Result:
    """Install the carried wheels into ``ctx.site`` (pip ``--no-deps --no-index --target``; unzip without pip)."""
    result = Result("install", STEPS_BY_NAME["install"].title, cap_s=round(cap, 1))
    start = time.monotonic()
    wheels = sorted(ctx.wheels.glob("*.whl")) if ctx.wheels.is_dir() else []
    result.figures = {"wheels": [w.name for w in wheels],
                      "mib": round(sum(w.stat().st_size for w in wheels) / 2**20, 2)}
    if ctx.dry_run and not ctx.install:
        result.status, result.note = "skipped", "dry run: the current environment (--install installs the wheels)"
    elif not wheels:
        result.status = "failed"
        result.note = (f"no wheels in {ctx.wheels}: run `make gpu-wheels` here and carry gpu-wheels; the checks "
                       f"that need {', '.join(w.split('==')[0] for w in WHEELS)} fail")
        result.figures["headline"] = "no wheels carried"
    else:
        log = ctx.logs / "00-install.log"
        result.log = str(log.relative_to(ctx.out))
        argv = [ctx.python, "-m", "pip", "install", "--no-deps", "--no-index", "--no-compile", "--quiet",
                "--disable-pip-version-check", "--target", str(ctx.site), *map(str, wheels)]
        result.commands.append(shlex.join(_shown(argv)))
        code, text = run_command(argv, log, cap, ctx.env)
        result.returncodes.append(code)
        how = "pip"
        if code != 0:  # no pip on the machine (or it failed): a wheel of pure Python is installed by unzipping it
            how = "unzip (pip failed)"
            result.commands.append(f"unzip {len(wheels)} wheels into {ctx.site}")
            for wheel in wheels:
                with zipfile.ZipFile(wheel) as zf:
                    zf.extractall(ctx.site)
            result.tail = _tail(text, 10)
        installed = sorted(p.name.removesuffix(".dist-info") for p in ctx.site.glob("*.dist-info"))
        result.figures.update(method=how, installed=installed)
        result.figures["headline"] = f"{len(installed)} wheels ({result.figures['mib']} MiB) by {how}"
        result.status = "passed" if len(installed) == len(wheels) else "failed"
    result.wall_s = round(time.monotonic() - start, 1)
    return result


def environment_worker(args: argparse.Namespace) -> None:
    """Print ``ENV {json}``: Python, torch, CUDA, the device, the reported packages' versions (``carried``: those
    installed from the wheels, under ``--site``), and whether (and from where) the package, its CLI, jsonargparse and
    pml import."""
    import importlib
    import importlib.metadata as md
    import platform

    site = args.site or ""
    out: dict = {"python": platform.python_version(), "executable": sys.executable, "platform": platform.platform(),
                 "cpu_count": os.cpu_count(), "packages": {}, "carried": {}}
    for name in REPORTED_PACKAGES:
        try:
            out["packages"][name] = md.version(name)
        except md.PackageNotFoundError:
            out["packages"][name] = None
    if site:
        out["carried"] = {d.metadata["Name"]: d.version for d in md.distributions(path=[site])}
    try:
        import torch

        out.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            out.update(device=props.name, device_count=torch.cuda.device_count(),
                       capability=".".join(map(str, torch.cuda.get_device_capability(0))),
                       memory_gib=round(props.total_memory / 2**30, 1), cudnn=torch.backends.cudnn.version(),
                       bf16=torch.cuda.is_bf16_supported())
        else:
            out["device"] = "cpu"
    except Exception as exc:  # reported, not raised: the summary says what is wrong with the machine's torch
        out["torch_error"] = f"{type(exc).__name__}: {exc}"
    out["imports"], out["import_paths"] = {}, {}
    for module in ("lightning_dml", "lightning_dml.cli", "jsonargparse", "pytorch_metric_learning"):
        try:
            out["import_paths"][module] = importlib.import_module(module).__file__
            out["imports"][module] = "ok"
        except Exception as exc:
            out["imports"][module] = f"{type(exc).__name__}: {exc}"
    print("ENV " + json.dumps(out), flush=True)


def env_commands(ctx: Context) -> list[list[str]]:
    site = str(ctx.site) if ctx.install else ""
    return [_python(ctx, str(Path(__file__).resolve()), "--worker", "environment", "--site", site)]


def env_parse(outputs: list[tuple[list[str], str]], ctx: Context) -> dict:
    for line in outputs[-1][1].splitlines() if outputs else []:
        if line.startswith("ENV "):
            env = json.loads(line[4:])
            where = env.get("device", "?")
            if env.get("memory_gib"):
                where += f" ({env['memory_gib']} GiB, sm {env['capability']})"
            env["headline"] = (f"python {env['python']}, torch {env.get('torch', '-')} (CUDA {env.get('torch_cuda')}), "
                               f"{where}")
            return env
    return {"headline": "no environment line"}


def env_judge(codes: list[int | None], figures: dict) -> tuple[str, str]:
    bad = [f"{m}: {v}" for m, v in figures.get("imports", {}).items() if v != "ok"]
    if "torch_error" in figures:
        bad.append(f"torch: {figures['torch_error']}")
    if codes != [0]:
        bad.append(f"exit status {codes}")
    return ("failed", "; ".join(bad)) if bad else ("passed", "")


# pytest -v prints "tests/test_x.py::name[param] PASSED   [ 10%]" per test and "FAILED|ERROR nodeid - why" in the
# short summary (-rfE), then "=== 3 failed, 490 passed, 4 skipped in 30.1s ===".
_VERDICT = re.compile(r"^(tests/\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)\b")
_SUMMARY_ITEM = re.compile(r"^(FAILED|ERROR) (\S+)(?: - (.*))?$")
_FINAL = re.compile(r"^=+ (.*\d+ \w+.*) in [\d.]+s")
_COLLECTING = re.compile(r"^_+ ERROR collecting (\S+) _+$")
_MISSING = re.compile(r"No module named '([\w.]+)'|import of ([\w.]+) halted")


def parse_pytest(text: str) -> dict:
    """Counts, failed tests and collection errors of a ``pytest -v -rfE`` output (whole or cut off)."""
    counts: dict[str, int] = {}
    per_test: dict[str, int] = {}
    failed: list[str] = []
    errors: list[dict] = []
    reasons: dict[str, str] = {}  # collection errors have no reason in the short summary: their section's "E" line
    collecting = None
    for line in text.splitlines():
        if m := _COLLECTING.match(line):
            collecting = m.group(1)
        elif collecting and line.startswith("E   ") and collecting not in reasons:
            reasons[collecting] = line[1:].strip()
        elif m := _VERDICT.match(line):
            key = m.group(2).lower()
            per_test[key] = per_test.get(key, 0) + 1
        elif m := _SUMMARY_ITEM.match(line):
            kind, node = m.group(1), m.group(2)
            why = (m.group(3) or "").strip() or reasons.get(node, "")
            if kind == "FAILED":
                failed.append(node)
            else:
                missing = _MISSING.search(why)
                name = (missing.group(1) or missing.group(2)).split(".")[0] if missing else None
                errors.append({"node": node, "why": why[:300], "expected": name in NOT_ON_DEVICE})
        elif m := _FINAL.match(line):
            counts = {}
            for number, word in re.findall(r"(\d+) (\w+)", m.group(1)):
                counts[{"error": "errors"}.get(word, word)] = int(number)
    complete = bool(counts)
    if not complete:  # cut off before pytest's last line: what the per-test lines say
        counts = {("errors" if k == "error" else k): v for k, v in per_test.items()}
    return {"counts": counts, "complete": complete, "failed": failed, "errors": errors}


def tests_commands(ctx: Context) -> list[list[str]]:
    """The same command on the GPU and in the dry run, where every test it selects skips (no CUDA device)."""
    return [_python(ctx, "-m", "pytest", "-v", "-rfE", "-p", "no:cacheprovider", "--continue-on-collection-errors",
                    "-m", "cuda", "tests")]


def tests_parse(outputs: list[tuple[list[str], str]], ctx: Context) -> dict:
    runs = [parse_pytest(text) for _, text in outputs]
    counts: dict[str, int] = {}
    for run in runs:
        for k, v in run["counts"].items():
            counts[k] = counts.get(k, 0) + v
    failed = [f for run in runs for f in run["failed"]]
    errors = [e for run in runs for e in run["errors"]]
    expected = sorted({e["node"] for e in errors if e["expected"]})
    unexpected = [e for e in errors if not e["expected"]]
    shown = ", ".join(f"{v} {k}" for k, v in sorted(counts.items()) if k != "deselected")
    headline = shown or "no tests ran"
    if expected:
        headline += f"; {len(expected)} modules not collected (need packages not carried)"
    return {"counts": counts, "complete": all(r["complete"] for r in runs), "failed": failed,
            "unexpected_errors": unexpected, "not_collected_expected": expected, "headline": headline}


def tests_judge(codes: list[int | None], figures: dict) -> tuple[str, str]:
    """Passed when no test failed or errored, and every collection error is a module needing a package that is not
    carried (pytest's exit status is 1 for those; 2 and more: interrupted, internal or usage error, none collected)."""
    problems = []
    if figures["failed"]:
        problems.append(f"{len(figures['failed'])} failed: {', '.join(figures['failed'][:10])}")
    if figures["unexpected_errors"]:
        problems.append(f"{len(figures['unexpected_errors'])} errors: "
                        + ", ".join(e["node"] for e in figures["unexpected_errors"][:10]))
    if any(c not in (0, 1) for c in codes) or (1 in codes and not figures["not_collected_expected"]):
        problems.append(f"pytest exit status {codes}")
    if not figures["counts"].get("passed") and not figures["counts"].get("skipped"):
        problems.append("no test ran")
    return ("failed", "; ".join(problems)) if problems else ("passed", "")


def _sizes(ctx: Context, gpu: tuple[int, int], dry: tuple[int, int]) -> tuple[int, int]:
    return dry if ctx.dry_run else gpu


def evaluation_commands(ctx: Context) -> list[list[str]]:
    n, d = _sizes(ctx, (60502, 512), (600, 16))
    return [_python(ctx, "bench/evaluation.py", "--methods", "ours", "torch", "--n", str(n), "--d", str(d),
                    "--device", ctx.device)]


def evaluation_precision_commands(ctx: Context) -> list[list[str]]:
    n, d = _sizes(ctx, (60502, 512), (600, 16))
    return [_python(ctx, "bench/evaluation.py", "--methods", "ours", "--n", str(n), "--d", str(d), "--device",
                    ctx.device, "--precision", p) for p in ("fp32", "tf32", "bf16")]


def evaluation_1m_commands(ctx: Context) -> list[list[str]]:
    n, d = _sizes(ctx, (1_000_000, 512), (1500, 16))
    return [_python(ctx, "bench/evaluation.py", "--methods", "ours", "torch", "--n", str(n), "--d", str(d),
                    "--device", ctx.device)]


def _option(argv: Sequence[str], name: str, default: str = "") -> str:
    return argv[argv.index(name) + 1] if name in argv else default


def _methods(argv: Sequence[str]) -> list[str]:
    """The values of ``--methods`` in ``argv``."""
    if "--methods" not in argv:
        return []
    rest = list(argv[argv.index("--methods") + 1:])
    return rest[: next((i for i, a in enumerate(rest) if a.startswith("--")), len(rest))]


def evaluation_parse(outputs: list[tuple[list[str], str]], ctx: Context) -> dict:
    """The JSON line of each method ``bench/evaluation.py`` ran (it prints one per finished method)."""
    rows = []
    missing = []
    for argv, text in outputs:
        done = set()
        for line in text.splitlines():
            if not line.startswith('{"method"'):
                continue
            done.add(json.loads(line)["method"])
            rec = json.loads(line)
            res = rec.get("result", {})
            rows.append({
                "method": rec["method"], "n": int(_option(argv, "--n")), "d": int(_option(argv, "--d")),
                "precision": _option(argv, "--precision", "auto"), "seconds": round(rec["seconds"], 3),
                "peak_gpu_mib_above_inputs": (round(res["peak_gpu_mb_above_embeddings"], 1)
                                              if "peak_gpu_mb_above_embeddings" in res else None),
                "peak_rss_mib": round(rec["peak_rss_mb"]),
                "recall@1": res.get("recall@1"), "map@r": res.get("map@r"),
                "metrics": {k: v for k, v in res.items() if k != "peak_gpu_mb_above_embeddings"},
            })
        missing += [f"{m} ({_option(argv, '--precision', 'auto')})" for m in _methods(argv) if m not in done]
    figures: dict = {"rows": rows, "missing": missing}
    ours = [r for r in rows if r["method"] == "ours"]
    peer = [r for r in rows if r["method"] == "torch"]
    parts = [f"ours {r['seconds']:.2f} s ({r['precision']})" for r in ours]
    if peer:
        parts.append(f"torch top-1000 {peer[0]['seconds']:.2f} s")
    if len({r["precision"] for r in ours}) > 1:  # the precision step: every figure must be the same
        same = all(r["metrics"] == ours[0]["metrics"] for r in ours)
        figures["identical_across_precisions"] = same
        parts.append("figures identical" if same else "FIGURES DIFFER")
    if rows:
        parts.append(f"N={rows[0]['n']:,} D={rows[0]['d']}")
    figures["headline"] = ", ".join(parts) or "no method finished"
    return figures


def needs(key: str) -> Callable[[list[int | None], dict], tuple[str, str]]:
    """A judge: passed when every command exited 0 and the figures hold a non-empty ``key``."""

    def judge(codes: list[int | None], figures: dict) -> tuple[str, str]:
        if any(c != 0 for c in codes):
            return "failed", f"exit status {codes}"
        if not figures.get(key):
            return "failed", f"no {key} in its output"
        return "passed", ""

    return judge


def evaluation_judge(codes: list[int | None], figures: dict) -> tuple[str, str]:
    """Passed when every method ran (``bench/evaluation.py`` exits 0 when one of its workers fails)."""
    if any(c != 0 for c in codes):
        return "failed", f"exit status {codes}"
    if figures["missing"]:
        return "failed", f"failed: {', '.join(figures['missing'])}"
    return "passed", ""


def evaluation_precision_judge(codes: list[int | None], figures: dict) -> tuple[str, str]:
    status, note = evaluation_judge(codes, figures)
    if status == "passed" and not figures.get("identical_across_precisions"):
        return "failed", "the figures differ between precisions (they must be ==)"
    return status, note


def losses_commands(ctx: Context) -> list[list[str]]:
    if ctx.dry_run:
        return [_python(ctx, "bench/losses.py", "--device", "cpu", "--cases", "multi_similarity", "contrastive",
                        "--batch", "16", "--dim", "8", "--repeats", "1", "--num-classes", "32", "--no-memory")]
    return [_python(ctx, "bench/losses.py", "--device", "cuda", "--cases", "seed", "--batch", "512", "2048",
                    "--repeats", "5", "--no-memory")]


def losses_parse(outputs: list[tuple[list[str], str]], ctx: Context) -> dict:
    """The rows of ``bench/losses.py``'s table (printed, and flushed, one per case and batch)."""
    rows = []
    for _, text in outputs:
        for line in text.splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if len(cells) < 5 or not cells[1].isdigit():
                continue
            rows.append({"case": cells[0].rstrip(" *"), "batch": int(cells[1]), "ours_ms": float(cells[2]),
                         "pml_ms": float(cells[3]), "ours/pml": float(cells[4])})
    ratios = sorted(r["ours/pml"] for r in rows if r["ours/pml"] == r["ours/pml"])  # not nan (pml not run)
    headline = f"{len(rows)} rows"
    if ratios:
        headline += f", ours/pml {ratios[0]:.2f}-{ratios[-1]:.2f} (median {ratios[len(ratios) // 2]:.2f})"
    return {"rows": rows, "headline": headline}


def throughput_commands(ctx: Context) -> list[list[str]]:
    if ctx.dry_run:
        args = ["--model", "small", "--image-size", "32", "--classes", "4", "--per-class", "4", "--timed-steps",
                "2", "--warmup", "1"]
    else:
        args = ["--model", "vit_small_patch16_224", "--image-size", "224", "--classes", "32", "--per-class", "4",
                "--timed-steps", "20", "--warmup", "5"]
    return [_python(ctx, str(Path(__file__).resolve()), "--worker", "throughput", "--device", ctx.device, *args)]


def jsonl_parse(outputs: list[tuple[list[str], str]], ctx: Context) -> dict:
    rows = [json.loads(line[4:]) for _, text in outputs for line in text.splitlines() if line.startswith("ROW {")]
    parts = [f"{r['impl']} {r['precision']} {r['images_per_s']:.0f}/s" for r in rows]
    return {"rows": rows, "headline": ", ".join(parts) or "no row"}


def fit_commands(ctx: Context) -> list[list[str]]:
    argv = _python(ctx, "-m", "lightning_dml", "fit", "--config", "configs/glyphs.yaml", "--trainer.logger", "false",
                   "--trainer.enable_progress_bar", "false",
                   "--trainer.default_root_dir", str(ctx.scratch / "fit-glyphs"))
    if ctx.dry_run:
        return [[*argv, "--trainer.accelerator", "cpu", "--trainer.precision", "bf16-mixed", "--trainer.max_epochs",
                 "1", "--trainer.limit_train_batches", "2", "--trainer.check_val_every_n_epoch", "1"]]
    return [[*argv, "--trainer.accelerator", "gpu", "--trainer.precision", "bf16-mixed"]]


def fit_parse(outputs: list[tuple[list[str], str]], ctx: Context) -> dict:
    """The table ``RetrievalComparison`` prints: a title line, a header of metric names, one row per model."""
    lines = outputs[-1][1].splitlines() if outputs else []
    table: dict[str, dict[str, float]] = {}
    for i, line in enumerate(lines):
        if line.startswith("Retrieval on the test classes"):
            header = lines[i + 1].split()
            for row in lines[i + 2:]:
                cells = row.split()
                if len(cells) <= len(header):
                    break
                try:
                    values = [float(c) for c in cells[-len(header):]]
                except ValueError:
                    break
                table[" ".join(cells[: -len(header)])] = dict(zip(header, values))
    trained = table.get("trained network", {})
    headline = ", ".join(f"{k} {v}" for k, v in trained.items()) if trained else "no table"
    return {"table": table, "headline": f"trained: {headline}" if trained else headline}


#: The steps in order of priority (the last ones get what is left of the budget). Caps in seconds: on the GPU, and
#: in the dry run, whose CPU seconds (about 80 in all) a machine shared with other jobs stretches several times.
STEPS: tuple[Step, ...] = (
    Step("install", "carried wheels", 60, 120, run=install_step),
    Step("environment", "Python, torch, CUDA, device, packages", 60, 120, env_commands, env_parse, env_judge),
    Step("cuda-tests", "pytest -m cuda", 200, 300, tests_commands, tests_parse, tests_judge),
    Step("evaluation", "bench/evaluation.py, 60,502 x 512: ours vs torch brute force", 90, 180, evaluation_commands,
         evaluation_parse, evaluation_judge),
    Step("losses", "bench/losses.py, seed losses at B=512, 2048: ours vs pml", 90, 120, losses_commands, losses_parse,
         needs("rows")),
    Step("throughput", "DMLModule images/s vs a plain loop, ViT-S/16 224, bf16-mixed and 32-true", 90, 180,
         throughput_commands, jsonl_parse, needs("rows")),
    Step("fit-glyphs", "lightning-dml fit --config configs/glyphs.yaml on the GPU, bf16-mixed", 150, 300, fit_commands,
         fit_parse, needs("table")),
    Step("evaluation-precision", "60,502 x 512 in fp32, tf32, bf16: identical figures", 90, 240,
         evaluation_precision_commands, evaluation_parse, evaluation_precision_judge),
    Step("evaluation-1m", "bench/evaluation.py, 1,000,000 x 512: ours vs torch brute force", 240, 180,
         evaluation_1m_commands, evaluation_parse, evaluation_judge),
)
STEPS_BY_NAME = {s.name: s for s in STEPS}


# ------------------------------------------------------------------------------------------------ the summary
def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to a temporary sibling, then rename it over ``path``: a reader never sees half a summary.

    (Not ``lightning_dml.data.cache_dir.write_json_atomic``: this script must report even where the package does not
    import, which is one of the things it checks.)
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_summary(ctx: Context, meta: dict, results: list[Result]) -> None:
    data = {**meta, "steps": [asdict(r) for r in results]}
    write_atomic(ctx.out / "gpu-check.json", json.dumps(data, indent=1, default=str) + "\n")
    write_atomic(ctx.out / "gpu-check.md", render_markdown(data))


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, dict):
        return ", ".join(f"{k} {_cell(v)}" for k, v in value.items())
    return "" if value is None else str(value)


def _table(rows: list[dict]) -> list[str]:
    keys = [k for k in rows[0] if k != "metrics"]
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_cell(r.get(k)) for k in keys) + " |" for r in rows]
    return lines


def render_markdown(data: dict) -> str:
    env = next((s["figures"] for s in data["steps"] if s["name"] == "environment" and s["figures"]), {})
    mode = "dry run on the CPU (tiny sizes: not figures)" if data["dry_run"] else "on the GPU"
    lines = [f"# GPU check: {mode}", "",
             f"{data['started']} · budget {data['budget_s']:.0f} s · elapsed {data['elapsed_s']:.0f} s · "
             f"{data['state']}", ""]
    if env.get("headline"):
        lines += [f"Figures from: {env['headline']}; {env.get('cpu_count')} CPUs; carried: "
                  + (", ".join(f"{k} {v}" for k, v in env.get("carried", {}).items()) or "none"), ""]
    lines += ["| step | status | wall (s) | CPU (s) | result |", "|---|---|---:|---:|---|"]
    for s in data["steps"]:
        headline = s["figures"].get("headline", "") if s["figures"] else ""
        result = "; ".join(x for x in (headline, s["note"]) if x).replace("|", "/")
        lines.append(f"| {s['name']} | {s['status']} | {_cell(s['wall_s'])} | {_cell(s['cpu_s'])} | {result} |")
    for s in data["steps"]:
        if s["status"] in ("pending", "skipped") and not s["commands"]:
            continue
        lines += ["", f"## {s['name']}: {s['title']}", "", f"Status **{s['status']}**"
                  + (f" ({s['note']})" if s["note"] else "") + (f"; output in `{s['log']}`" if s["log"] else ""), ""]
        lines += [f"    {c}" for c in s["commands"]]
        figures = s["figures"] or {}
        if figures.get("rows"):
            lines += [""] + _table(figures["rows"])
        if figures.get("table"):
            lines += [""] + _table([{"model": k, **v} for k, v in figures["table"].items()])
        for key in ("failed", "unexpected_errors", "not_collected_expected"):
            if figures.get(key):
                lines += ["", f"{key.replace('_', ' ')}:", ""]
                lines += [f"* `{e['node']}`: {e['why']}" if isinstance(e, dict) else f"* `{e}`" for e in figures[key]]
        if s["tail"]:
            lines += ["", "Last lines of its output:", "", "```", s["tail"], "```"]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ the whole check
#: The dry run's ``sitecustomize``: what the GPU machine lacks is not importable (``None`` in ``sys.modules``), and
#: what the carried wheels installed (``--install``) imports from them only, never from this environment.
HIDE_TEMPLATE = '''"""The GPU check's dry run (tools/gpu_check.py): import as on the GPU machine."""
import os
import sys
from importlib.machinery import PathFinder

for _name in {hidden!r}:
    sys.modules.setdefault(_name, None)
_SITE = {site!r}
_CARRIED = {{n.split(".")[0] for n in (os.listdir(_SITE) if os.path.isdir(_SITE) else ())
            if not n.endswith((".dist-info", ".data")) and n not in ("__pycache__", "bin")}}


class _CarriedOnly:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in _CARRIED:  # submodules: found by the normal machinery in their parent's folder
            return None
        spec = PathFinder.find_spec(name, [_SITE])
        if spec is None:
            raise ModuleNotFoundError(f"No module named {{name!r}} in the carried wheels", name=name)
        return spec


if _CARRIED:
    sys.meta_path.insert(0, _CarriedOnly)
'''


def make_context(args: argparse.Namespace) -> Context:
    scratch = Path(tempfile.mkdtemp(prefix="lightning-dml-gpu-check-"))
    ctx = Context(python=args.python, out=Path(args.out).resolve(), dry_run=args.dry_run,
                  wheels=Path(args.wheels).resolve(), install=args.install or not args.dry_run,
                  site=scratch / "site", scratch=scratch)
    ctx.site.mkdir()
    path = [str(ctx.site)]
    if args.dry_run:
        ctx.hide_dir = scratch / "hide"
        ctx.hide_dir.mkdir()
        (ctx.hide_dir / "sitecustomize.py").write_text(HIDE_TEMPLATE.format(hidden=NOT_ON_DEVICE, site=str(ctx.site)))
        path.append(str(ctx.hide_dir))
    path.append(str(ROOT))
    if os.environ.get("PYTHONPATH"):
        path.append(os.environ["PYTHONPATH"])
    ctx.env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), WANDB_MODE="offline", WANDB_SILENT="true",
                   LIGHTNING_DML_OFFLINE="1", HF_HUB_OFFLINE="1", MPLBACKEND="Agg", PYTHONUNBUFFERED="1",
                   LIGHTNING_DML_CACHE=str(scratch / "cache"), TMPDIR=str(scratch))
    return ctx


def run_check(args: argparse.Namespace, steps: Sequence[Step] = STEPS) -> int:
    """Run ``steps`` within the budget, the summary rewritten around each; exit status 0 when all passed."""
    ctx = make_context(args)
    ctx.logs.mkdir(parents=True, exist_ok=True)
    selected = set(args.steps or [s.name for s in steps])
    started = time.monotonic()
    meta = {"started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "dry_run": ctx.dry_run, "budget_s": args.budget_seconds, "elapsed_s": 0.0, "state": "running",
            "python": ctx.python, "argv": sys.argv[1:]}
    results = [Result(s.name, s.title) for s in steps]
    for r in results:
        if r.name not in selected:
            r.status, r.note = "skipped", "not selected (--steps)"

    def save(state: str = "running") -> None:
        meta.update(elapsed_s=round(time.monotonic() - started, 1), state=state)
        write_summary(ctx, meta, results)

    old = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    state = "finished"
    try:
        save()
        for i, step in enumerate(steps):
            if step.name not in selected:
                continue
            left = args.budget_seconds - (time.monotonic() - started)
            cap = min(step.dry_cap_s if ctx.dry_run else step.gpu_cap_s, left)
            if cap < args.min_step_seconds:
                results[i].status, results[i].note = "skipped", f"no time left in the budget ({left:.0f} s)"
                continue
            results[i].status, results[i].cap_s = "running", round(cap, 1)
            save()
            print(f"[gpu-check] {step.name}: {step.title} (cap {cap:.0f} s)", flush=True)
            try:
                results[i] = run_step(step, ctx, cap, i)
            except Interrupted as exc:
                results[i].status, results[i].note = "interrupted", f"stopped by {exc}"
                state = "interrupted"
                break
            r = results[i]
            print(f"[gpu-check] {step.name}: {r.status} in {r.wall_s} s  {r.figures.get('headline', '')} "
                  f"{r.note}".rstrip(), flush=True)
            save()
    except Interrupted as exc:
        state = f"interrupted ({exc})"
    finally:
        for s, handler in old.items():
            signal.signal(s, handler)
        save(state)
        _rmtree(ctx.scratch)
    print(f"[gpu-check] summary: {ctx.out / 'gpu-check.md'}", flush=True)
    chosen = [r for r in results if r.name in selected and not (r.name == "install" and r.status == "skipped")]
    return 0 if state == "finished" and all(r.status == "passed" for r in chosen) else 1


# ------------------------------------------------------------------------------------------------ the wheels
def download_wheels(dest: Path, python: str = sys.executable) -> int:
    """Download :data:`WHEELS` for the GPU machine's Python into ``dest`` (replacing what was there)."""
    dest = dest.resolve()
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    argv = [python, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", DEVICE_PYTHON,
            *[a for p in WHEEL_PLATFORMS for a in ("--platform", p)], "--disable-pip-version-check", "--quiet",
            "-d", str(tmp), *WHEELS]
    print("$", shlex.join(argv), flush=True)
    if subprocess.run(argv).returncode != 0:
        print(f"pip download failed; {dest} left as it was", file=sys.stderr)
        _rmtree(tmp)
        return 1
    wheels = sorted(tmp.glob("*.whl"))
    total = sum(w.stat().st_size for w in wheels) / 2**20
    for w in wheels:
        print(f"{w.stat().st_size / 2**20:8.2f} MiB  {w.name}")
    print(f"{total:8.2f} MiB  in all, {len(wheels)} wheels -> {dest}")
    if total > MAX_WHEELS_MIB:
        print(f"more than {MAX_WHEELS_MIB} MiB: too much to carry; {dest} left as it was", file=sys.stderr)
        _rmtree(tmp)
        return 1
    old = dest.with_name(f".{dest.name}.old")
    if dest.exists():
        _rmtree(old)
        os.replace(dest, old)
    os.replace(tmp, dest)
    _rmtree(old)
    return 0


def _rmtree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ throughput worker
def throughput_worker(args: argparse.Namespace) -> None:
    """images/s of a DMLModule training step under Lightning and of a plain PyTorch loop (same model, loss and
    optimizer), per precision, on one synthetic P x K batch already on the device; one ``ROW {json}`` line each."""
    import copy
    import logging
    import warnings
    from functools import partial

    import pytorch_lightning as pl
    import torch

    from lightning_dml.losses import MultiSimilarityLoss
    from lightning_dml.models import SmallConvNet, TimmBackbone
    from lightning_dml.module import DMLModule

    warnings.filterwarnings("ignore")
    for name in ("pytorch_lightning", "lightning_fabric", "lightning.pytorch"):
        logging.getLogger(name).setLevel(logging.ERROR)
    device = torch.device(args.device)
    torch.manual_seed(0)
    if args.model == "small":
        backbone = SmallConvNet(in_channels=3, width=8)
    else:
        backbone = TimmBackbone(args.model, pretrained=False, img_size=args.image_size)
    batch = args.classes * args.per_class
    images = torch.randn(batch, 3, args.image_size, args.image_size, device=device)
    labels = torch.arange(args.classes, device=device).repeat_interleave(args.per_class)
    total = args.warmup + args.timed_steps

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def fresh() -> DMLModule:
        return DMLModule(copy.deepcopy(backbone), loss=MultiSimilarityLoss(), embedding_dim=128,
                         optimizer=partial(torch.optim.AdamW, lr=1e-5), clustering=False)

    class Timer(pl.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ARG002
            if batch_idx == args.warmup:
                sync()
                self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):  # noqa: ARG002
            if batch_idx == total - 1:
                sync()
                self.seconds = time.perf_counter() - self.start

    def lightning(precision: str) -> float:
        timer = Timer()
        trainer = pl.Trainer(accelerator="gpu" if device.type == "cuda" else "cpu", devices=1, precision=precision,
                             max_steps=total, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                             enable_model_summary=False, limit_val_batches=0, num_sanity_val_steps=0,
                             callbacks=[timer])
        data = [(images, labels)] * total  # one batch, already on the device: no data pipeline at all
        trainer.fit(fresh(), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
        return args.timed_steps * batch / timer.seconds

    def plain(precision: str) -> float:
        module = fresh().to(device).train()
        optimizer = torch.optim.AdamW(module.parameters(), lr=1e-5)
        loss_fn = module.loss
        autocast = precision == "bf16-mixed"

        def step() -> None:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                loss = loss_fn(module(images).float(), labels)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        for _ in range(args.warmup):
            step()
        sync()
        start = time.perf_counter()
        for _ in range(args.timed_steps):
            step()
        sync()
        return args.timed_steps * batch / (time.perf_counter() - start)

    for precision in args.precisions:
        for impl, fn in (("DMLModule", lightning), ("plain loop", plain)):
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            rate = fn(precision)
            peak = torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None
            print("ROW " + json.dumps({"impl": impl, "precision": precision, "model": args.model,
                                       "image_size": args.image_size, "batch": batch, "steps": args.timed_steps,
                                       "images_per_s": round(rate, 1),
                                       "peak_gpu_mib": None if peak is None else round(peak)}), flush=True)


# ------------------------------------------------------------------------------------------------ command line
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None,
                   help="summary folder (default: $OUT where set, else logs/gpu-check, logs/gpu-check-dry)")
    p.add_argument("--dry-run", action="store_true", help="the same steps on the CPU at tiny sizes")
    p.add_argument("--budget-seconds", type=float, default=None,
                   help="the whole check's time (default 450; dry run 1500)")
    p.add_argument("--min-step-seconds", type=float, default=None,
                   help="a step with less time left is skipped (default 20; dry run 2)")
    p.add_argument("--wheels", default=str(ROOT / "gpu-wheels"), help="the carried wheels (default gpu-wheels/)")
    p.add_argument("--install", action="store_true", help="dry run: install the wheels too")
    p.add_argument("--steps", nargs="+", choices=[s.name for s in STEPS], help="run only these steps")
    p.add_argument("--python", default=sys.executable, help="the interpreter of the steps (default: this one)")
    p.add_argument("--download-wheels", metavar="DIR", help="download the wheels into DIR (make gpu-wheels) and stop")
    worker = p.add_argument_group("throughput worker (internal)")
    worker.add_argument("--worker", choices=["environment", "throughput"], help=argparse.SUPPRESS)
    worker.add_argument("--site", default="", help=argparse.SUPPRESS)
    worker.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    worker.add_argument("--model", default="vit_small_patch16_224", help=argparse.SUPPRESS)
    worker.add_argument("--image-size", type=int, default=224, help=argparse.SUPPRESS)
    worker.add_argument("--classes", type=int, default=32, help=argparse.SUPPRESS)
    worker.add_argument("--per-class", type=int, default=4, help=argparse.SUPPRESS)
    worker.add_argument("--timed-steps", type=int, default=20, help=argparse.SUPPRESS)
    worker.add_argument("--warmup", type=int, default=5, help=argparse.SUPPRESS)
    worker.add_argument("--precisions", nargs="+", default=["bf16-mixed", "32-true"], help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.out is None:
        args.out = os.environ.get("OUT") or str(ROOT / "logs" / ("gpu-check-dry" if args.dry_run else "gpu-check"))
    if args.budget_seconds is None:
        args.budget_seconds = 1500.0 if args.dry_run else 450.0
    if args.min_step_seconds is None:
        args.min_step_seconds = 2.0 if args.dry_run else 20.0
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        {"environment": environment_worker, "throughput": throughput_worker}[args.worker](args)
        return 0
    if args.download_wheels:
        return download_wheels(Path(args.download_wheels))
    return run_check(args)


if __name__ == "__main__":
    sys.exit(main())
