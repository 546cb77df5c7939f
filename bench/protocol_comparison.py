"""The worked comparison of losses on Glyphs with the fair-comparison protocol (issue 15, docs/protocol.md).

For every loss of ``--losses`` (default: Multi-Similarity, contrastive and Proxy-Anchor, three families), with one
budget file for all of them (``configs/protocol/budget.yaml``: trials, steps, folds, repeats) and the loss's
search space (``configs/protocol/space_<loss>.yaml``: the learning rate, as for every loss, plus the loss's own
hyper-parameters), this script runs the public commands as subprocesses, from the repository root:

1. ``lightning-dml sweep --space <space> --budget <budget> --run_dir <out>/<loss>/sweep --config
   configs/glyphs.yaml --config configs/protocol/glyphs.yaml --model.loss <class> --model.lr_scheduler.init_args.
   T_max <steps>``: hyper-parameters chosen by the mean validation MAP@R over the folds of the training classes;
2. ``lightning-dml cv --budget <budget> --run_dir <out>/<loss>/cv --config <out>/<loss>/sweep/best.yaml``: the
   best config cross-validated ``repeats`` times and evaluated on the test classes (separate and concatenated);

then reads every cv ``results.csv`` and writes one table of the losses (mean and 95% Student t interval over the
repeats, as cv computes them) to ``<out>/comparison.md`` and ``<out>/comparison.csv``, and prints it.

Rerunning the same command resumes: the sweep continues its study (a finished study runs no trial), and a cv
whose ``results.csv`` exists with the budget's folds, repeats and steps is not run again. Each step's output goes
to ``<out>/<loss>/{sweep,cv}.log``; a failed step stops the script with its exit status and the end of its log.
Stopping the script (Ctrl-C, SIGTERM) kills the running command; the sweep marks the trial it interrupted as
failed when it resumes (that trial does not count against the budget).

Usage (``make compare`` runs the first)::

    OMP_NUM_THREADS=2 python bench/protocol_comparison.py --out logs/compare
    python bench/protocol_comparison.py --losses multi_similarity supcon --budget my_budget.yaml --out logs/c2
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_LOSSES = ("multi_similarity", "contrastive", "proxy_anchor")
DEFAULT_CONFIGS = ("configs/glyphs.yaml", "configs/protocol/glyphs.yaml")
DEFAULT_BUDGET = "configs/protocol/budget.yaml"
DEFAULT_SPACE_DIR = "configs/protocol"
#: the metrics of the combined table (keys of cv's results.csv) and their headers
TABLE_METRICS = {"recall@1": "Recall@1", "map@r": "MAP@R", "r_precision": "R-Precision"}
EVALUATIONS = ("separate", "concatenated")


class StepFailed(RuntimeError):
    """A step of the comparison failed (a command's exit status, a missing or inconsistent output)."""


# ------------------------------------------------------------------------------------------- set-up
def loss_class_path(name: str) -> str:
    """The ``class_path`` of the loss registered as ``name`` (as exported by ``lightning_dml.losses``), so that the
    search space can set its ``model.loss.init_args.*``."""
    import lightning_dml.losses as losses
    from lightning_dml.losses.registry import LOSSES

    if name not in LOSSES:
        raise StepFailed(f"unknown loss {name!r}; registered losses: {', '.join(sorted(LOSSES))}")
    cls = LOSSES[name]
    if getattr(losses, cls.__name__, None) is cls:
        return f"lightning_dml.losses.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"


def space_file(space_dir: Path, loss: str) -> Path:
    return Path(space_dir) / f"space_{loss}.yaml"


def executable() -> Path:
    """The ``lightning-dml`` command of this Python's environment."""
    path = Path(sys.executable).with_name("lightning-dml")
    if not path.exists():
        raise StepFailed(f"{path} not found: install the package in this environment (make install)")
    return path


def fit_args(loss: str, configs: Sequence[str], steps: int) -> list[str]:
    """The fit arguments of ``loss``: the configs, the loss's class, and the cosine schedule over ``steps``."""
    args = [arg for config in configs for arg in ("--config", str(config))]
    return [*args, f"--model.loss={loss_class_path(loss)}", f"--model.lr_scheduler.init_args.T_max={steps}"]


def sweep_command(exe: Path, loss: str, options: argparse.Namespace, steps: int) -> list[str]:
    return [
        str(exe), "sweep", "--space", str(space_file(options.space_dir, loss)), "--budget", str(options.budget),
        "--run_dir", str(options.out / loss / "sweep"), *fit_args(loss, options.config, steps),
    ]


def cv_command(exe: Path, loss: str, options: argparse.Namespace) -> list[str]:
    return [
        str(exe), "cv", "--budget", str(options.budget), "--run_dir", str(options.out / loss / "cv"),
        "--config", str(options.out / loss / "sweep" / "best.yaml"),
    ]


def run_step(command: Sequence[str], log: Path, what: str) -> float:
    """Run ``command`` from the repository root with its output in ``log``; the wall time in seconds. A non-zero
    exit status raises :class:`StepFailed` with the end of the log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    print(f"[{time.strftime('%H:%M:%S')}] {what}: {' '.join(command)}", flush=True)
    start = time.perf_counter()
    with open(log, "w", encoding="utf-8") as handle:
        status = subprocess.call(list(command), cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - start
    if status != 0:
        tail = "".join(log.read_text(encoding="utf-8", errors="replace").splitlines(keepends=True)[-25:])
        raise StepFailed(f"{what} failed with exit status {status} after {seconds:.0f} s; end of {log}:\n{tail}")
    print(f"[{time.strftime('%H:%M:%S')}] {what}: done in {seconds:.0f} s (log: {log})", flush=True)
    return seconds


# ------------------------------------------------------------------------------------------- results
def read_cv_results(path: Path) -> list[dict[str, Any]]:
    """The rows of a cv ``results.csv`` (``mean``, ``ci_low``, ``ci_high`` as floats, ``repeats`` as int)."""
    with open(path, newline="", encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    needed = {"evaluation", "metric", "mean", "ci_low", "ci_high", "repeats"}
    if not rows or not needed <= set(rows[0]):
        raise StepFailed(f"{path}: not a cv results.csv (expected the columns {sorted(needed)})")
    for row in rows:
        for key in ("mean", "ci_low", "ci_high"):
            row[key] = float(row[key]) if row[key] not in ("", "nan") else math.nan
        row["repeats"] = int(row["repeats"])
    return rows


def matches_budget(rows: Sequence[dict[str, Any]], budget: dict[str, int]) -> bool:
    """Whether cv results were produced with ``budget``'s folds, repeats and steps (recorded in every row)."""
    recorded = rows[0]
    expected = {"num_folds": budget["folds"], "repeats": budget["repeats"], "max_steps": budget["steps"]}
    return all(str(recorded.get(key)) == str(value) for key, value in expected.items())


def combined_rows(results: dict[str, Sequence[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per loss x evaluation x metric of :data:`TABLE_METRICS` (long format, for the CSV)."""
    out = []
    for loss, rows in results.items():
        by_key = {(r["evaluation"], r["metric"]): r for r in rows}
        for evaluation in EVALUATIONS:
            for metric in TABLE_METRICS:
                if (evaluation, metric) not in by_key:
                    raise StepFailed(f"cv results of {loss} have no {evaluation} {metric}")
                row = by_key[(evaluation, metric)]
                out.append({"loss": loss, "evaluation": evaluation, "metric": metric,
                            **{k: row[k] for k in ("mean", "ci_low", "ci_high", "repeats")}})
    return out


def cell(row: dict[str, Any]) -> str:
    """``mean ± half-width`` of the 95% interval, in percent (the mean alone without an interval)."""
    if math.isnan(row["ci_low"]):
        return f"{100 * row['mean']:.2f}"
    return f"{100 * row['mean']:.2f} ± {100 * (row['ci_high'] - row['mean']):.2f}"


def overlaps(rows: Sequence[dict[str, Any]]) -> dict[tuple[str, str], tuple[str, list[str]]]:
    """For every evaluation x metric: the loss with the highest mean and the other losses whose 95% interval
    overlaps the best one's (all of them when there is no interval)."""
    out = {}
    for evaluation in EVALUATIONS:
        for metric in TABLE_METRICS:
            group = [r for r in rows if r["evaluation"] == evaluation and r["metric"] == metric]
            if not group:
                continue
            best = max(group, key=lambda r: r["mean"])
            out[(evaluation, metric)] = (best["loss"], [
                r["loss"] for r in group if r is not best
                and (math.isnan(r["ci_high"]) or math.isnan(best["ci_low"]) or r["ci_high"] >= best["ci_low"])
            ])
    return out


def markdown(rows: Sequence[dict[str, Any]], sweeps: dict[str, dict[str, Any]], budget: dict[str, int]) -> str:
    """The comparison table, the tuning table (best trial of every sweep) and which intervals overlap."""
    repeats = rows[0]["repeats"]
    lines = ["| loss | evaluation | " + " | ".join(TABLE_METRICS.values()) + " |",
             "|---|---|" + "---|" * len(TABLE_METRICS)]
    for loss in dict.fromkeys(r["loss"] for r in rows):
        for evaluation in EVALUATIONS:
            cells = {r["metric"]: cell(r) for r in rows if r["loss"] == loss and r["evaluation"] == evaluation}
            lines.append(f"| {loss} | {evaluation} | " + " | ".join(cells[m] for m in TABLE_METRICS) + " |")
    lines += [
        "", f"Test classes, percent: mean over {repeats} repeats ± half-width of the 95% Student t interval "
        "(scipy.stats.t). separate: mean over the fold models; concatenated: the fold models' L2-normalised "
        "embeddings concatenated.", "",
        "Budget (every loss): " + ", ".join(f"{k}={v}" for k, v in budget.items()), "",
        "| loss | trials | best trial | val MAP@R (mean over folds) | best parameters |", "|---|---|---|---|---|",
    ]
    for loss, sweep in sweeps.items():
        best = sweep["best"]
        params = ", ".join(f"`{k}`={v:.4g}" if isinstance(v, float) else f"`{k}`={v}" for k, v in best["params"].items())
        lines.append(f"| {loss} | {sweep['finished_trials']} | {best['number']} | {100 * best['value']:.2f} | {params} |")
    lines.append("")
    for (evaluation, metric), (best, overlapping) in overlaps(rows).items():
        lines.append(f"- {evaluation} {TABLE_METRICS[metric]}: highest mean {best}; 95% intervals overlapping it: "
                     + (", ".join(overlapping) if overlapping else "none"))
    return "\n".join(lines) + "\n"


def write_csv(rows: Sequence[dict[str, Any]], budget: dict[str, int], path: Path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*rows[0], *budget])
        writer.writeheader()
        writer.writerows({**row, **budget} for row in rows)


# ------------------------------------------------------------------------------------------- command
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--losses", nargs="+", default=list(DEFAULT_LOSSES), help="registry names of the losses")
    parser.add_argument("--budget", type=Path, default=ROOT / DEFAULT_BUDGET, help="budget YAML (sweep and cv)")
    parser.add_argument("--space_dir", type=Path, default=ROOT / DEFAULT_SPACE_DIR,
                        help="folder of the search spaces space_<loss>.yaml")
    parser.add_argument("--config", nargs="+", default=[str(ROOT / c) for c in DEFAULT_CONFIGS],
                        help="fit configs of every loss, in order (the loss is set on top of them)")
    parser.add_argument("--out", type=Path, default=ROOT / "logs/compare", help="output folder")
    return parser


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and check the arguments (losses registered and distinct, the budget, spaces and configs readable);
    paths are made absolute (the commands run from the repository root)."""
    from lightning_dml.protocol.budget import load_budget
    from lightning_dml.protocol.sweep import load_space

    parser = build_parser()
    options = parser.parse_args(argv)
    options.budget, options.space_dir, options.out = (p.resolve() for p in (options.budget, options.space_dir, options.out))
    options.config = [str(Path(c).resolve()) for c in options.config]
    try:
        if len(set(options.losses)) != len(options.losses):
            raise StepFailed(f"--losses lists a loss twice: {options.losses}")
        options.budget_values = load_budget(options.budget).as_dict()
        for loss in options.losses:
            loss_class_path(loss)
            load_space(space_file(options.space_dir, loss))
        missing = [c for c in options.config if not Path(c).is_file()]
        if missing:
            raise StepFailed(f"config file(s) not found: {missing}")
    except (StepFailed, ValueError) as error:  # ProtocolError is a ValueError
        parser.error(str(error))
    return options


def compare_loss(exe: Path, loss: str, options: argparse.Namespace) -> tuple[list[dict[str, Any]], dict[str, Any], dict]:
    """Sweep and cross-validate one loss (skipping a cv whose results exist); its cv rows, its sweep summary and
    the wall time of each step run now."""
    budget = options.budget_values
    timings = {"sweep": run_step(sweep_command(exe, loss, options, budget["steps"]), options.out / loss / "sweep.log",
                                 f"{loss}: sweep")}
    sweep_dir = options.out / loss / "sweep"
    sweep = json.loads((sweep_dir / "sweep.json").read_text(encoding="utf-8"))
    if sweep.get("best") is None or not (sweep_dir / "best.yaml").is_file():
        raise StepFailed(f"{loss}: the sweep has no complete trial (all diverged?): see {sweep_dir / 'sweep.json'}")
    results = options.out / loss / "cv" / "results.csv"
    if results.is_file() and matches_budget(read_cv_results(results), budget):
        print(f"{loss}: cv results exist, not run again ({results})", flush=True)
    else:
        if results.is_file():
            raise StepFailed(f"{results} was produced with another budget than {options.budget}: remove "
                             f"{results.parent} or use another --out")
        timings["cv"] = run_step(cv_command(exe, loss, options), options.out / loss / "cv.log", f"{loss}: cv")
    return read_cv_results(results), sweep, timings


def _terminate(signum: int, frame: Any) -> None:
    """SIGTERM ends the script like Ctrl-C: the running command is killed with it (``subprocess.call`` kills its
    child on an exception), and rerunning the script resumes."""
    raise SystemExit(128 + signum)


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    exe = executable()
    options.out.mkdir(parents=True, exist_ok=True)
    load_start, start = os.getloadavg(), time.perf_counter()
    results, sweeps, timings = {}, {}, {}
    try:
        for loss in options.losses:
            results[loss], sweeps[loss], timings[loss] = compare_loss(exe, loss, options)
    except StepFailed as error:
        print(f"protocol_comparison: {error}", file=sys.stderr)
        return 1
    total, load_end = time.perf_counter() - start, os.getloadavg()
    rows = combined_rows(results)
    steps_run = "; ".join(f"{loss} " + ", ".join(f"{k} {v:.0f} s" for k, v in t.items()) for loss, t in timings.items())
    skipped = [loss for loss, t in timings.items() if "cv" not in t]
    text = markdown(rows, sweeps, options.budget_values) + (
        f"\nWall time of this invocation: {total:.0f} s ({steps_run}"
        + (f"; cv not run for {', '.join(skipped)}: its results existed" if skipped else "") + "). "
        f"Load average (1, 5, 15 min) at start {', '.join(f'{x:.2f}' for x in load_start)}, at end "
        f"{', '.join(f'{x:.2f}' for x in load_end)}; {os.cpu_count()} CPUs, "
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}.\n"
    )
    (options.out / "comparison.md").write_text(text, encoding="utf-8")
    write_csv(rows, options.budget_values, options.out / "comparison.csv")
    print(text)
    print(f"written: {options.out / 'comparison.md'}, {options.out / 'comparison.csv'}")
    return 0


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _terminate)
    sys.exit(main())
