"""``lightning-dml cv``: class-disjoint cross-validation of one config, repeated, evaluated on the test classes.

The protocol of Musgrave, Belongie and Lim, "A Metric Learning Reality Check" (ECCV 2020, section 4.2): the
training classes are split into ``k`` folds of whole classes (:func:`~lightning_dml.protocol.class_folds`); fold
``i`` trains on the other folds and validates on its own classes. Each fold's model (the best validation checkpoint
when checkpointing is on, else the model at the end of ``fit``) embeds the test split, and the test classes are
scored two ways, as the paper reports both:

* **separate**: each fold's model on its own; a repeat's value is the mean over its folds;
* **concatenated**: the fold models' embeddings, each L2-normalised, concatenated into one ``k * d`` embedding
  (with the cosine metric this weighs every fold model equally).

The whole cross-validation is repeated ``--repeats R`` times with ``seed_everything = seed + r`` (model
initialisation, augmentation); the folds (``data.init_args.fold_seed``) and the data module's ``seed`` stay as
configured, so every repeat sees the same folds and the same test split. The table gives, for every metric, the
mean over repeats and its 95% confidence interval, the Student t interval ``mean +- t.ppf(0.975, R - 1) * s /
sqrt(R)`` (``scipy.stats.t``; ``s`` the sample standard deviation, ``ddof=1``; no interval for ``R = 1``).

Every fit is an ordinary ``lightning-dml fit`` of the config (``build_cli``), with ``--data.init_args.num_folds``,
``--data.init_args.fold``, ``--seed_everything`` and ``--trainer.default_root_dir <run_dir>/repeat_<r>/fold_<i>``
added; any other argument is passed to ``fit`` unchanged. ``--budget`` (the file ``sweep`` takes too, see
:mod:`lightning_dml.protocol.budget`) gives the folds, the repeats and ``--trainer.max_steps``. A fit on several
devices (``--trainer.devices N``) runs in processes of its own (:mod:`lightning_dml.protocol.launch`); everything
else happens once, in this process. Layout of ``<run_dir>``::

    cv.json                           the command (fit arguments, folds, repeats, seed)
    repeat_<r>/fold_<i>/config.yaml          that fit's resolved config (lightning_dml.run_config)
    repeat_<r>/fold_<i>/classes.json         that fit's training, validation and test class ids
    repeat_<r>/fold_<i>/test_embeddings.pt   its test embeddings, labels, last validation metrics, W&B run
    repeat_<r>/fold_<i>/checkpoints/         its checkpoints (when checkpointing is on)
    results.md, results.csv, repeats.json    the table (written by the run, or by --aggregate)

With a W&B logger every fit is a run of its own: group ``cv <run_dir>``, job type ``repeat <r>``, name
``repeat <r> fold <i>``; the table is logged to one more run of the group (``cv results``, job type ``results``).
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from scipy import stats

from lightning_dml.callbacks.embedding import embed_loader
from lightning_dml.cli_parsing import CommandParser
from lightning_dml.checkpoints import read_checkpoint, read_torch_file
from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.metrics.retrieval import eval_batch_targets
from lightning_dml.models.adapters import restore_frozen_weights
from lightning_dml.protocol.budget import ProtocolError, load_budget
from lightning_dml.protocol.launch import (
    class_lists,
    finish_runs,
    fit_command,
    is_global_zero,
    run_name,
    started_externally,
    wandb_group,
)

MANIFEST = "cv.json"
EMBEDDINGS = "test_embeddings.pt"
CLASSES = "classes.json"
#: the metrics of the table besides Recall@K
TABLE_METRICS = ("map@r", "r_precision")


# ------------------------------------------------------------------------------------------- statistics
def confidence_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, float, float]:
    """``(mean, low, high)``: the Student t interval ``mean +- t.ppf((1 + confidence) / 2, n - 1) * s / sqrt(n)``
    with ``s`` the sample standard deviation (``ddof=1``). ``low``/``high`` are NaN for a single value."""
    x = np.asarray(values, dtype=np.float64)
    if x.ndim != 1 or x.size == 0:
        raise ValueError(f"confidence_interval needs a non-empty list of values, got shape {x.shape}")
    mean = float(x.mean())
    if x.size == 1:
        return mean, math.nan, math.nan
    half = float(stats.t.ppf((1.0 + confidence) / 2.0, x.size - 1) * x.std(ddof=1) / math.sqrt(x.size))
    return mean, mean - half, mean + half


# ------------------------------------------------------------------------------------------- evaluation
def retrieval_scores(embedding: dict[str, Any], recall_at: Sequence[int]) -> dict[str, float]:
    """Recall@K, MAP@R and R-Precision of one saved test embedding (``RetrievalMetrics``, cosine)."""
    metric = RetrievalMetrics(recall_at=recall_at, clustering=False, map_at_r=True)
    metric.update(
        embedding["embeddings"], embedding["labels"], embedding.get("indices"),
        embedding.get("query_mask"), embedding.get("gallery_mask"),
    )
    return {k: float(v) for k, v in metric.compute().items()}


def concatenate_folds(embeddings: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The fold models' test embeddings, each L2-normalised, concatenated along the feature dimension."""
    first = embeddings[0]
    for other in embeddings[1:]:
        for key in ("labels", "indices"):
            a, b = first.get(key), other.get(key)
            if (a is None) != (b is None) or (a is not None and not torch.equal(a, b)):
                raise ProtocolError(f"the folds' test embeddings disagree on the test {key}: not the same test split")
    features = torch.cat([torch.nn.functional.normalize(e["embeddings"].float(), dim=1) for e in embeddings], dim=1)
    return {**first, "embeddings": features}


def evaluate_repeat(embeddings: Sequence[dict[str, Any]], recall_at: Sequence[int]) -> dict[str, dict[str, float]]:
    """``{"separate": mean over folds of each fold model's scores, "concatenated": scores of the concatenation,
    "fold <i>": fold i's scores}`` for one repeat."""
    per_fold = [retrieval_scores(e, recall_at) for e in embeddings]
    out = {f"fold {i}": scores for i, scores in enumerate(per_fold)}
    out["separate"] = {k: float(np.mean([s[k] for s in per_fold])) for k in per_fold[0]}
    out["concatenated"] = retrieval_scores(concatenate_folds(embeddings), recall_at)
    return out


def table_rows(repeats: Sequence[dict[str, dict[str, float]]], confidence: float = 0.95) -> list[dict[str, Any]]:
    """One row per (evaluation, metric): mean over repeats and the t interval."""
    rows = []
    for evaluation in ("separate", "concatenated"):
        for name in repeats[0][evaluation]:
            mean, low, high = confidence_interval([r[evaluation][name] for r in repeats], confidence)
            rows.append({"evaluation": evaluation, "metric": name, "mean": mean, "ci_low": low, "ci_high": high,
                         "repeats": len(repeats)})
    return rows


def _percent(row: dict[str, Any]) -> str:
    if math.isnan(row["ci_low"]):
        return f"{100 * row['mean']:.2f}"
    return f"{100 * row['mean']:.2f} ± {100 * (row['ci_high'] - row['mean']):.2f}"


def markdown_table(rows: Sequence[dict[str, Any]], budget: dict[str, Any]) -> str:
    """The table in markdown: one line per evaluation, metrics in percent as ``mean ± half-width`` (95% t interval)."""
    metrics = list(dict.fromkeys(r["metric"] for r in rows))
    lines = ["| evaluation | " + " | ".join(metrics) + " |", "|---" * (len(metrics) + 1) + "|"]
    for evaluation in dict.fromkeys(r["evaluation"] for r in rows):
        cells = {r["metric"]: _percent(r) for r in rows if r["evaluation"] == evaluation}
        lines.append(f"| {evaluation} | " + " | ".join(cells[m] for m in metrics) + " |")
    repeats = rows[0]["repeats"]
    interval = "95% Student t interval over repeats (scipy.stats.t)" if repeats > 1 else "one repeat: no interval"
    lines += ["", f"Test classes, percent, mean over {repeats} repeat(s) ± half-width of the {interval}. "
              "separate: mean over the fold models; concatenated: the fold models' L2-normalised embeddings "
              "concatenated.", "", "Budget: " + ", ".join(f"{k}={v}" for k, v in budget.items())]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------- run folder
def fold_dir(run_dir: Path, repeat: int, fold: int) -> Path:
    return Path(run_dir) / f"repeat_{repeat}" / f"fold_{fold}"


def fold_args(fit_args: Sequence[str], run_dir: Path, num_folds: int, fold: int, repeat: int, seed: int) -> list[str]:
    """The ``fit`` arguments of one fold x repeat (the user's, then the protocol's, which win)."""
    return [
        "fit", *fit_args, f"--data.init_args.num_folds={num_folds}", f"--data.init_args.fold={fold}",
        f"--seed_everything={seed + repeat}", f"--trainer.default_root_dir={fold_dir(run_dir, repeat, fold)}",
    ]


def wandb_run(run_dir: Path, repeat: int | None = None, fold: int | None = None) -> dict[str, str]:
    """The W&B group, job type and name of a fit (``repeat``, ``fold``) or of the table (``None``) of the cv run
    ``run_dir``: the group is the run folder's absolute path, the same for every task of one cross-validation."""
    group = wandb_group(f"cv {Path(run_dir).resolve()}")
    if fold is None:
        return {"group": group, "job_type": "results", "name": "cv results"}
    return {"group": group, "job_type": f"repeat {repeat}", "name": f"repeat {repeat} fold {fold}"}


def write_json(path: Path, data: Any) -> None:
    """``data`` as JSON in ``path``, replaced atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(path)


def _budget(cli: Any, num_folds: int, repeats: int) -> dict[str, Any]:
    trainer = cli.config.get("fit", cli.config).get("trainer", {})
    keys = ("max_steps", "max_epochs", "limit_train_batches")
    return {"num_folds": num_folds, "repeats": repeats, **{k: trainer.get(k) for k in keys}}


def embed_test_split(model: torch.nn.Module, datamodule: Any) -> dict[str, Any]:
    """The model's raw embeddings of the whole test split, in order, with labels, indices and query/gallery masks
    (on the CPU, the size of the test split, as saved to disk)."""
    embeddings, rest = embed_loader(model, datamodule.full_test_dataloader())
    targets = eval_batch_targets([embeddings, *rest])
    return {"embeddings": embeddings.cpu(), **{k: v.cpu() for k, v in targets.items() if v is not None}}


def run_fold(fit_args: Sequence[str], run_dir: Path, num_folds: int, fold: int, repeat: int, seed: int,
             repeats: int = 1) -> Path:
    """Fit fold ``fold`` of repeat ``repeat`` (of ``repeats``) through :func:`~lightning_dml.cli.build_cli` (the
    fit's processes its own, one W&B run: :func:`~lightning_dml.protocol.launch.fit_command`), then, on global rank
    0, save its class lists and its test embeddings (of the best validation checkpoint when there is one) with its
    last validation metrics."""
    from lightning_dml.cli import build_cli

    with fit_command(fold_args(fit_args, run_dir, num_folds, fold, repeat, seed), wandb_run(run_dir, repeat, fold)):
        cli = build_cli()
    trainer, model = cli.trainer, cli.model
    folder = fold_dir(run_dir, repeat, fold)
    path = folder / EMBEDDINGS
    try:
        if trainer.is_global_zero:
            write_json(folder / CLASSES, class_lists(cli.datamodule))
            callback = trainer.checkpoint_callback
            checkpoint = getattr(callback, "best_model_path", "") if callback else ""
            if checkpoint:
                state = read_checkpoint(checkpoint, what="the fold's best checkpoint")  # tensors only
                restore_frozen_weights(model.backbone, state, f"checkpoint {checkpoint}")  # an adapter's: on the frozen weights
                model.load_state_dict(state["state_dict"])
            saved = embed_test_split(model, cli.datamodule)
            saved["val"] = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
            saved["checkpoint"] = checkpoint
            saved["recall_at"] = list(model.hparams.get("recall_at", (1, 2, 4, 8)))
            saved["budget"] = _budget(cli, num_folds, repeats)
            saved["world_size"] = trainer.world_size
            saved["wandb"] = run_name(trainer)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            torch.save(saved, tmp)
            tmp.replace(path)
    finally:
        finish_runs(trainer)
    return path


def write_manifest(run_dir: Path, manifest: dict[str, Any], write: bool = True) -> None:
    """Record the command in ``<run_dir>/cv.json``; one that records another command is an error (``write=False``:
    only that check, for the processes other than global rank 0 under an external launcher)."""
    path = run_dir / MANIFEST
    if path.exists():
        old = json.loads(path.read_text())
        if old != manifest:
            raise ProtocolError(
                f"{path} records another cross-validation ({old}); use a new --run_dir for {manifest}"
            )
        return
    if write:
        write_json(path, manifest)


def read_manifest(run_dir: Path) -> dict[str, Any]:
    path = Path(run_dir) / MANIFEST
    if not path.exists():
        raise ProtocolError(f"{path} not found: --aggregate takes the --run_dir of a cv run")
    return json.loads(path.read_text())


def aggregate(run_dir: Path, log: bool = True) -> list[dict[str, Any]]:
    """Evaluate every fold x repeat of ``run_dir`` on the test classes, write ``results.md``/``results.csv`` and
    log the table to the config's logger; returns the table rows."""
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    num_folds, repeats = manifest["num_folds"], manifest["repeats"]
    paths = [[fold_dir(run_dir, r, i) / EMBEDDINGS for i in range(num_folds)] for r in range(repeats)]
    missing = [str(p) for row in paths for p in row if not p.exists()]
    if missing:
        raise ProtocolError(f"cv --aggregate {run_dir}: {len(missing)} fold x repeat runs have not finished: {missing}")
    evaluations = []
    for row in paths:
        saved = [read_torch_file(p, f"cv --aggregate {run_dir}: fold file", "fold embeddings file") for p in row]
        evaluations.append(evaluate_repeat(saved, saved[0]["recall_at"]))
    budget = {**saved[0]["budget"], "repeats": repeats}
    rows = table_rows(evaluations)
    (run_dir / "results.md").write_text(markdown_table(rows, budget))
    with open(run_dir / "results.csv", "w", newline="") as handle:
        # one column per name: the rows' `repeats` is the budget's
        writer = csv.DictWriter(handle, fieldnames=list(dict.fromkeys([*rows[0], *budget])))
        writer.writeheader()
        writer.writerows({**row, **budget} for row in rows)
    (run_dir / "repeats.json").write_text(json.dumps(evaluations, indent=2))
    if log:
        log_table(manifest["fit_args"], run_dir, rows, budget)
    return rows


def log_table(fit_args: Sequence[str], run_dir: Path, rows: Sequence[dict[str, Any]], budget: dict[str, Any]) -> None:
    """Log the table to the loggers the config configures (``cv/<evaluation>/<metric>/{mean,ci_low,ci_high}``,
    the budget as hyper-parameters, and a table where the logger has ``log_table``, as W&B's does); with W&B, a
    run of the cv's group named ``cv results``."""
    from lightning_dml.cli import build_cli

    with fit_command([*fit_args, f"--trainer.default_root_dir={run_dir}"], wandb_run(run_dir)):
        cli = build_cli(run=False)
    metrics = {
        f"cv/{r['evaluation']}/{r['metric']}/{key}": r[key]
        for r in rows for key in ("mean", "ci_low", "ci_high") if not math.isnan(r[key])
    }
    columns = ["evaluation", "metric", "mean", "ci_low", "ci_high", "repeats"]
    try:
        for logger in cli.trainer.loggers:
            logger.log_hyperparams({"cv_budget": budget})
            logger.log_metrics(metrics)
            if hasattr(logger, "log_table"):
                logger.log_table("cv/results", columns=columns, data=[[r[c] for c in columns] for r in rows])
            logger.finalize("success")
    finally:
        finish_runs(cli.trainer)


# ------------------------------------------------------------------------------------------- command
def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="lightning-dml cv",
        allow_abbrev=False,
        description=(
            "Class-disjoint cross-validation of one config (Musgrave et al., ECCV 2020): fits the k folds of the "
            "training classes, --repeats times with seed_everything = seed + repeat, and evaluates on the test "
            "classes each fold's model (separate) and the concatenation of the fold models' L2-normalised "
            "embeddings (concatenated). Writes results.md and results.csv (mean and 95%% Student t interval over "
            "repeats) into --run_dir and logs them to the configured logger. Every other argument (--config ..., "
            "--model.* overrides) goes to `lightning-dml fit`."
        ),
    )
    parser.add_argument(
        "--budget", type=Path, help="budget YAML shared with `sweep` (folds, repeats, steps: trainer.max_steps)"
    )
    parser.add_argument("--num_folds", type=int, help="folds of the training classes (default 4; or the budget's)")
    parser.add_argument("--repeats", type=int, help="repetitions with different seeds (default 1; or the budget's)")
    parser.add_argument("--seed", type=int, default=0, help="repeat r uses seed_everything = seed + r (default 0)")
    parser.add_argument("--run_dir", type=Path, default=Path("logs/cv"), help="folder of the runs and the table")
    parser.add_argument("--fold", type=int, help="run only this fold (with --repeat; e.g. one SLURM array task)")
    parser.add_argument("--repeat", type=int, help="run only this repeat (with --fold)")
    parser.add_argument(
        "--aggregate", type=Path, metavar="RUN_DIR", help="evaluate the finished folds of RUN_DIR and write the table"
    )
    return parser


def main(argv: Sequence[str]) -> list[dict[str, Any]] | None:
    """``lightning-dml cv ...``; returns the table rows (``None`` after a single ``--fold``/``--repeat``)."""
    parser = build_parser()
    options, fit_args = parser.parse_known_args(list(argv))
    if options.aggregate is not None:
        if fit_args:
            raise ProtocolError(f"cv --aggregate takes only the run folder, got extra arguments {fit_args}")
        rows = aggregate(options.aggregate)
        print((Path(options.aggregate) / "results.md").read_text())
        return rows
    if not fit_args:
        raise ProtocolError("cv needs the fit's config: lightning-dml cv --config CONFIG.yaml [overrides]")
    if options.budget is not None:
        if options.num_folds is not None or options.repeats is not None:
            raise ProtocolError("--budget gives the folds and repeats: leave out --num_folds and --repeats")
        budget = load_budget(options.budget)
        options.num_folds, options.repeats = budget.folds, budget.repeats
        fit_args = [*fit_args, f"--trainer.max_steps={budget.steps}"]
    options.num_folds = 4 if options.num_folds is None else options.num_folds
    options.repeats = 1 if options.repeats is None else options.repeats
    if options.num_folds < 2 or options.repeats < 1:
        raise ProtocolError(f"need --num_folds >= 2 and --repeats >= 1, got {options.num_folds}, {options.repeats}")
    if (options.fold is None) != (options.repeat is None):
        raise ProtocolError("--fold and --repeat are given together (one fold x repeat of the cross-validation)")
    in_range = options.fold is None or (0 <= options.fold < options.num_folds and 0 <= options.repeat < options.repeats)
    if not in_range:
        raise ProtocolError(
            f"--fold {options.fold} --repeat {options.repeat} is outside --num_folds {options.num_folds} "
            f"--repeats {options.repeats}"
        )
    manifest = {"fit_args": fit_args, "num_folds": options.num_folds, "repeats": options.repeats, "seed": options.seed}
    # under an external launcher every process runs the command; rank 0 writes
    write_manifest(options.run_dir, manifest, write=is_global_zero())
    if options.fold is not None:
        run_fold(fit_args, options.run_dir, options.num_folds, options.fold, options.repeat, options.seed,
                 options.repeats)
        return None
    for repeat in range(options.repeats):
        for fold in range(options.num_folds):
            run_fold(fit_args, options.run_dir, options.num_folds, fold, repeat, options.seed, options.repeats)
    if started_externally():
        # the fits ran in lockstep in every process; the table is rank 0's, computed without the process group
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        if not is_global_zero():
            return None
    rows = aggregate(options.run_dir)
    print((options.run_dir / "results.md").read_text())
    return rows


__all__ = [
    "ProtocolError",
    "aggregate",
    "concatenate_folds",
    "confidence_interval",
    "embed_test_split",
    "evaluate_repeat",
    "main",
    "run_fold",
    "table_rows",
]
