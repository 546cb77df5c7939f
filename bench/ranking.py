"""Rank the registered losses on the Glyphs task: test Recall@1 and MAP@R, mean and spread over seeds.

Every loss of the registry (``lightning_dml.losses.LOSSES``, built by name: its paper's defaults) trains the same
number of steps from ``configs/glyphs.yaml`` (small CNN, 128-d, Adam lr 1e-3, P x K = 16 x 4 batches) through
:func:`lightning_dml.cli.build_cli`; only the loss changes, plus what a loss declares it needs: a loss with
``required_sampler`` (N-pair: ``"npair"``) gets that sampler with 2 images per class and as many classes as keep
the batch size (32 x 2 = 64). Losses with parameters (proxies, margins) get their sizes from the data module at
fit start and their parameters train at the optimizer's learning rate (``loss_lr_multiplier`` 1, the same for
all). Validation is skipped; after the last step the model is tested on the 93 unseen test classes.

Usage::

    OMP_NUM_THREADS=2 python bench/ranking.py --steps 600 --seeds 0 1 2 --out ranking.md
    python bench/ranking.py --losses multi_similarity proxy_anchor --seeds 0 --steps 5    # a quick check

The table (markdown, best mean Recall@1 first) gives mean and sample standard deviation over the seeds, the
number of runs, and the wall time per run; a loss whose run fails is listed with the error instead of figures.
Run it on a quiet machine: the figures themselves do not depend on the load, the wall times do.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "glyphs.yaml"
BATCH = (16, 4)  # P x K of configs/glyphs.yaml


def run_args(loss: str, seed: int, steps: int, root: str) -> list[str]:
    """CLI arguments of one run (no subcommand: the caller runs fit and test itself)."""
    from lightning_dml.losses import LOSSES

    args = [
        "--config", str(CONFIG),
        "--seed_everything", str(seed),
        "--model.loss", loss,
        "--trainer.max_epochs", "-1",
        "--trainer.max_steps", str(steps),
        "--trainer.limit_val_batches", "0",
        "--trainer.callbacks", "[]",
        "--trainer.logger", "false",
        "--trainer.enable_checkpointing", "false",
        "--trainer.enable_progress_bar", "false",
        "--trainer.enable_model_summary", "false",
        "--trainer.default_root_dir", root,
        "--data.init_args.seed", str(seed),
    ]
    sampler = getattr(LOSSES[loss], "required_sampler", None)
    if sampler == "npair":
        classes, per_class = BATCH
        args += ["--data.init_args.sampler", "npair", "--data.init_args.samples_per_class", "2",
                 "--data.init_args.classes_per_batch", str(classes * per_class // 2)]
    elif sampler is not None:
        raise ValueError(f"loss {loss!r} requires sampler {sampler!r}, which bench/ranking.py does not set up")
    if loss == "self_supervised":  # two views of every item, labelled by item (the data modules' views option)
        args += ["--data.init_args.views", "2"]
    return args


def run_one(loss: str, seed: int, steps: int, root: str) -> dict[str, Any]:
    """Train ``steps`` steps and test; returns ``{"recall@1", "map@r", "seconds"}`` or ``{"error"}``."""
    from lightning_dml.cli import build_cli
    from lightning_dml.losses import LOSSES

    start = time.perf_counter()
    try:
        cli = build_cli(run_args(loss, seed, steps, root), run=False)
        if type(cli.model.loss) is not LOSSES[loss]:
            raise RuntimeError(f"the CLI built {type(cli.model.loss).__name__}, not {LOSSES[loss].__name__}")
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        if cli.trainer.global_step != steps:
            raise RuntimeError(f"trained {cli.trainer.global_step} steps instead of {steps}")
        metrics = cli.trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)[0]
        result = {"recall@1": float(metrics["test/recall@1"]), "map@r": float(metrics["test/map@r"])}
    except Exception as err:  # noqa: BLE001 - one failing loss must not stop the ranking; it is reported
        return {"error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    if not all(math.isfinite(v) for v in result.values()):
        return {"error": f"non-finite test metrics {result}"}
    return {**result, "seconds": time.perf_counter() - start}


def _mean_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{100 * values[0]:.1f}"
    return f"{100 * statistics.mean(values):.1f} ± {100 * statistics.stdev(values):.1f}"


def ranking_table(results: dict[str, list[dict[str, Any]]]) -> str:
    """Markdown table, best mean Recall@1 first; losses with a failed run last, with the first error."""
    done, failed = [], []
    for loss, runs in results.items():
        errors = [r["error"] for r in runs if "error" in r]
        (failed if errors else done).append((loss, runs, errors))
    done.sort(key=lambda item: -statistics.mean(r["recall@1"] for r in item[1]))
    lines = ["| rank | loss | test Recall@1 (%) | test MAP@R (%) | runs | s / run |", "|---:|---|---:|---:|---:|---:|"]
    for rank, (loss, runs, _) in enumerate(done, 1):
        lines.append(
            f"| {rank} | `{loss}` | {_mean_spread([r['recall@1'] for r in runs])} | "
            f"{_mean_spread([r['map@r'] for r in runs])} | {len(runs)} | "
            f"{statistics.mean(r['seconds'] for r in runs):.0f} |"
        )
    for loss, runs, errors in failed:
        lines.append(f"| - | `{loss}` | failed: {errors[0]} | | {len(runs)} | |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> str:
    from lightning_dml.losses import LOSSES

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--losses", nargs="+", default=sorted(LOSSES), choices=sorted(LOSSES), metavar="LOSS",
                        help="registry names (default: every registered loss)")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=600, help="training steps of every run")
    parser.add_argument("--root", default="ranking_runs", help="trainer.default_root_dir of the runs")
    parser.add_argument("--out", default=None, help="also write the markdown table to this file")
    parser.add_argument("--json", default=None, help="also write the per-run results to this file")
    args = parser.parse_args(argv)
    if args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    os.environ.setdefault("WANDB_MODE", "offline")
    sys.argv = sys.argv[:1]  # the runs' arguments go to build_cli, not through sys.argv

    results: dict[str, list[dict[str, Any]]] = {}
    for loss in args.losses:
        results[loss] = []
        for seed in args.seeds:
            result = run_one(loss, seed, args.steps, args.root)
            results[loss].append({"seed": seed, **result})
            print(f"# {loss} seed {seed}: {result}", file=sys.stderr, flush=True)
    header = (f"Glyphs ranking: {args.steps} steps per run, seeds {' '.join(map(str, args.seeds))} "
              f"(mean ± sample std over seeds)\n\n")
    table = header + ranking_table(results)
    print(table)
    if args.out:
        Path(args.out).write_text(table + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return table


if __name__ == "__main__":
    main()
