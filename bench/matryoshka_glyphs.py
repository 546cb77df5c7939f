"""Metric vs width on the Glyphs task: one Matryoshka model against separately trained fixed-width models.

Every run is bench/ranking.py's protocol (``configs/glyphs.yaml``: small CNN, Adam lr 1e-3 with the config's cosine
schedule, P x K = 16 x 4, Multi-Similarity loss with its paper's defaults; the same number of steps, no validation,
then tested on the 93 unseen test classes), with only the loss and the embedding width changed:

* ``matryoshka``: ``MatryoshkaLoss(multi_similarity, widths=WIDTHS)`` (Kusupati et al., NeurIPS 2022, weights 1)
  on a ``max(WIDTHS)``-wide embedding, tested at every width (``RetrievalMetrics(widths)``: the leading ``d``
  dimensions, re-normalised);
* ``fixed d``: ``multi_similarity`` on a ``d``-wide embedding, for each ``d`` of WIDTHS (same steps: same budget);
* ``cut of fixed max``: the fixed ``max(WIDTHS)`` model tested at every width too (what cutting a model that was
  not trained for it gives).

``--loss proxy_anchor`` (any registered loss) replaces Multi-Similarity in every run: with a loss with parameters the
Matryoshka model has one proxy matrix per width (Eq. 1's ``W^(m)``), or with ``--tied`` one ``D``-wide matrix whose
leading ``d`` columns serve width ``d`` (MRL-E, Sec. 3). The loss's learning rate is the protocol's, the same for
all (``loss_lr_multiplier`` 1, as bench/ranking.py's Proxy-Anchor row), unless ``--loss_lr_multiplier`` (100:
Proxy-Anchor's paper).

Usage::

    OMP_NUM_THREADS=2 python bench/matryoshka_glyphs.py --steps 200 --seeds 0 --out matryoshka.md
    python bench/matryoshka_glyphs.py --steps 3 --widths 8 16 --seeds 0     # a quick check
    # the runs split over processes (each logs its runs to stderr), then one table from the logs:
    python bench/matryoshka_glyphs.py --runs matryoshka 8 16 2> a.log &
    python bench/matryoshka_glyphs.py --runs 32 64 128 2> b.log
    python bench/matryoshka_glyphs.py --merge a.log b.log
    python bench/matryoshka_glyphs.py --loss proxy_anchor --runs matryoshka 8 16 128 2> pa.log   # proxies per width

Prints (and with ``--out`` writes) a markdown table of test Recall@1 and MAP@R (%) per width, and the wall time
of each run.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import statistics
import sys
import time
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.ranking import run_args  # noqa: E402  (the ranking's protocol: one place for the recipe)


def run(
    seed: int, steps: int, root: str, width: int, widths: list[int] | None, loss: str = "multi_similarity",
    tied: bool = False,
    loss_lr_multiplier: float = 1.0,
) -> dict[str, Any]:
    """Train and test one model of embedding width ``width`` with ``loss``; ``widths``: train it with MatryoshkaLoss
    over ``loss`` at those widths (``tied``: MRL-E). Returns ``{"metrics": {key: value}, "seconds": s}`` (the test
    metrics, per width ``w<d>/...``)."""
    from lightning_dml.cli import build_cli

    args = run_args(loss, seed, steps, root) + ["--model.embedding_dim", str(width), "--model.clustering", "false",
                                                "--model.loss_lr_multiplier", str(loss_lr_multiplier)]
    evaluated = [d for d in (widths or WIDTHS_OF_FIXED.get(width, [])) if d < width]
    if evaluated:
        args += ["--model.metric_widths", str(evaluated)]
    if widths:
        args += ["--model.loss", "lightning_dml.losses.MatryoshkaLoss",
                 "--model.loss.init_args.loss", loss, "--model.loss.init_args.widths", str(widths)]
        if tied:
            args += ["--model.loss.init_args.tied", "true"]
    start = time.perf_counter()
    cli = build_cli(args, run=False)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    if cli.trainer.global_step != steps:
        raise RuntimeError(f"trained {cli.trainer.global_step} steps instead of {steps}")
    metrics = cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)[0]
    out = {k[len("test/"):]: float(v) for k, v in metrics.items() if k.startswith("test/")}
    return {"metrics": out, "seconds": time.perf_counter() - start}


#: widths at which the widest fixed model is also tested (filled in by main)
WIDTHS_OF_FIXED: dict[int, list[int]] = {}


def _value(metrics: dict[str, float], width: int, full: int, name: str) -> float:
    return metrics[name] if width == full else metrics[f"w{width}/{name}"]


def _cell(values: list[float]) -> str:
    if not values:
        return "not run"
    if len(values) == 1:
        return f"{100 * values[0]:.1f}"
    return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f}"


def table(widths: list[int], results: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown: one row per width, Recall@1 / MAP@R (%) of the Matryoshka model, the fixed model of that width and
    the cut of the widest fixed model."""
    full = max(widths)
    lines = [f"| width | Matryoshka R@1 | fixed R@1 | cut of fixed-{full} R@1 | Matryoshka MAP@R | fixed MAP@R | "
             f"cut of fixed-{full} MAP@R |", "|---:|---:|---:|---:|---:|---:|---:|"]
    for d in widths:
        cells = []
        for name in ("recall@1", "map@r"):
            cells += [
                _cell([_value(r["metrics"], d, full, name) for r in results["matryoshka"]]),
                _cell([r["metrics"][name] for r in results[f"fixed {d}"]]),
                _cell([_value(r["metrics"], d, full, name) for r in results[f"fixed {full}"]]),
            ]
        lines.append(f"| {d} | " + " | ".join(cells) + " |")
    seconds = {name: statistics.mean(r["seconds"] for r in runs) for name, runs in results.items() if runs}
    lines.append("")
    lines.append("Seconds per run: " + ", ".join(f"{name} {s:.0f}" for name, s in seconds.items()))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--widths", nargs="+", type=int, default=[8, 16, 32, 64, 128])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--steps", type=int, default=200, help="training steps of every run")
    parser.add_argument("--root", default="matryoshka_runs", help="trainer.default_root_dir of the runs")
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    parser.add_argument("--runs", nargs="+", default=None, help="only these runs: matryoshka and/or fixed widths")
    parser.add_argument("--merge", nargs="+", default=None, help="no runs: the table from these runs' stderr logs")
    parser.add_argument("--loss", default="multi_similarity", help="the registered loss of every run")
    parser.add_argument("--tied", action="store_true", help="Matryoshka run: one tied proxy matrix (MRL-E)")
    parser.add_argument("--loss_lr_multiplier", type=float, default=1.0, help="the loss parameters' lr multiplier")
    args = parser.parse_args(argv)
    widths = sorted(set(args.widths))
    if args.steps < 1 or widths[0] < 1:
        parser.error("--steps and every width must be >= 1")
    os.environ.setdefault("WANDB_MODE", "offline")
    sys.argv = sys.argv[:1]  # the runs' arguments go to build_cli, not through sys.argv
    WIDTHS_OF_FIXED[max(widths)] = widths
    results: dict[str, list[dict[str, Any]]] = {"matryoshka": [], **{f"fixed {d}": [] for d in widths}}
    if args.merge:
        for path in args.merge:
            for line in open(path):
                m = re.match(r"^# (matryoshka|fixed \d+) seed (\d+): (\{.*\})$", line.strip())
                if m:
                    results[m.group(1)].append(ast.literal_eval(m.group(3)))
    chosen = ["matryoshka", *[str(d) for d in widths]] if args.runs is None else args.runs
    for seed in [] if args.merge else args.seeds:
        if "matryoshka" in chosen:
            results["matryoshka"].append(run(
                seed, args.steps, args.root, max(widths), widths, args.loss, args.tied, args.loss_lr_multiplier
            ))
            print(f"# matryoshka seed {seed}: {results['matryoshka'][-1]}", file=sys.stderr, flush=True)
        for d in widths:
            if str(d) in chosen:
                results[f"fixed {d}"].append(run(
                    seed, args.steps, args.root, d, None, args.loss, loss_lr_multiplier=args.loss_lr_multiplier
                ))
                print(f"# fixed {d} seed {seed}: {results[f'fixed {d}'][-1]}", file=sys.stderr, flush=True)
    if not args.merge and any(not runs for runs in results.values()):
        return ""  # a part of the runs (--runs): the table comes from --merge of the logs
    text = table(widths, results)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
