"""``lightning-dml report``: the retrieval report of a model, a predictions file or a saved results file.

Three sources, one of them::

    lightning-dml report --out DIR --config CONFIG.yaml --ckpt_path MODEL.ckpt [--data.* overrides]
    lightning-dml report --out DIR --predictions predictions.pt [--config CONFIG.yaml]
    lightning-dml report --out DIR --results DIR/results.npz [--config CONFIG.yaml]

``DIR`` must be new, empty or an earlier report (``--overwrite`` otherwise; :mod:`~lightning_dml.report.folder`).

With ``--ckpt_path`` the test split is embedded by ``lightning-dml predict`` itself (the same CLI, config and
overrides, Lightning's predict loop and its :class:`~lightning_dml.callbacks.PredictionWriter`), writing
``DIR/predictions.pt``. With ``--predictions`` (a ``lightning-dml predict`` output) the images are the files it names;
a dataset without image files (Glyphs) needs ``--config`` too, whose data module then provides the images. The
search is the exact engine's (:class:`~lightning_dml.retrieval.RetrievalResults`), and the folder is written by
:func:`~lightning_dml.report.write_report` (``docs/report.md``).
"""

from __future__ import annotations

import argparse
import pickle
import re
import time
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_dml.cli_parsing import CommandParser
from lightning_dml.errors import UserInputError
from lightning_dml.metrics_format import format_metrics_line
from lightning_dml.report.evaluation import evaluate_predictions, evaluation_settings
from lightning_dml.report.folder import check_report_folder, claim_report_folder
from lightning_dml.report.thumbnails import FORMATS, image_source
from lightning_dml.report.writer import Report, write_report
from lightning_dml.retrieval import RetrievalResults

__all__ = ["ReportError", "build_parser", "main"]


class ReportError(UserInputError, ValueError):
    """A ``lightning-dml report`` command that cannot run as given."""


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(
        prog="lightning-dml report",
        allow_abbrev=False,
        description=(
            "Write a retrieval report (DIR/index.html, opens offline from disk): metrics, Recall@K curve, per-class "
            "table, the worst queries with their top-k, the most confused class pairs, the scores of positive and "
            "negative pairs. From --config with --ckpt_path (embeds the test split as `lightning-dml predict` does; "
            "every other argument goes to predict), --predictions FILE or --results FILE.npz."
        ),
    )
    parser.add_argument("--out", type=Path, required=True, help="the report folder (created; thumbnails are reused)")
    parser.add_argument("--overwrite", action="store_true",
                        help="write into --out even when it is not empty and holds no earlier report (the report's "
                             "files are replaced, other files left alone)")
    source = parser.add_argument_group("source (one of --ckpt_path, --predictions, --results)")
    source.add_argument("--config", action="append", default=[], help="the run's config (as for predict; repeatable)")
    source.add_argument("--ckpt_path", help="the checkpoint to embed the test split with (needs --config)")
    source.add_argument("--predictions", type=Path, help="a `lightning-dml predict` output (predictions.pt)")
    source.add_argument("--results", type=Path, help="a results.npz of an earlier report (RetrievalResults.save)")
    page = parser.add_argument_group("page")
    page.add_argument("--queries", default="500", help="the worst queries shown, or 'all' (default 500)")
    page.add_argument("--by", choices=("ap", "first_relevant_rank"), default="ap",
                      help="order of the worst queries: lowest AP or latest first relevant item (default ap)")
    page.add_argument("--per_page", type=int, default=50, help="query rows per page (default 50)")
    page.add_argument("--top_k", type=int, default=10, help="neighbours shown per query (default 10)")
    page.add_argument("--recall_at", type=int, nargs="+", default=[1, 2, 4, 8], help="Recall@K of the metrics table")
    page.add_argument("--confused", type=int, default=20, help="most confused class pairs shown (default 20)")
    page.add_argument("--bins", type=int, default=50, help="bins of the pair-score histograms (0: none; default 50)")
    page.add_argument("--metric", choices=("cosine", "euclidean"), default="cosine", help="similarity (default cosine)")
    page.add_argument("--fmr", default=None, help="mark the operating point at this false match rate (0 < F < 1) on "
                      "the pair-score histograms and the DET curve: its exact threshold over these pairs "
                      "(lightning_dml.index.calibrate)")
    page.add_argument("--thumb_size", type=int, default=96, help="thumbnails' longer side in pixels (default 96)")
    page.add_argument("--thumb_format", choices=tuple(FORMATS), default="webp", help="thumbnail format (default webp)")
    page.add_argument("--title", default=None, help="the page's title")
    return parser


def _predict(
    configs: list[str], ckpt_path: str, out: Path, extra: list[str]
) -> tuple[dict[str, Any], Any, Any, bool]:
    """Run ``lightning-dml predict`` (the CLI itself) writing ``out/predictions.pt``: (its data, the data module,
    the model, whether this process is rank 0). During the run the command line is predict's
    (:func:`~lightning_dml.protocol.launch.fit_command`): the other processes of a DDP predict run
    ``lightning-dml predict`` alone."""
    from lightning_dml.callbacks.predictions import PredictionWriter, load_predictions
    from lightning_dml.cli import build_cli
    from lightning_dml.protocol.launch import fit_command

    args = ["predict", *(f"--config={c}" for c in configs), f"--ckpt_path={ckpt_path}", "--trainer.logger=false",
            f"--trainer.default_root_dir={out}", *extra]
    with fit_command(args):
        cli = build_cli()
    if not cli.trainer.is_global_zero:
        return {}, cli.datamodule, cli.model, False
    writer = next(cb for cb in cli.trainer.callbacks if isinstance(cb, PredictionWriter))
    if writer.written_path is None:
        raise ReportError("lightning-dml predict wrote no predictions file (no item in the test split?)")
    return load_predictions(writer.written_path), cli.datamodule, cli.model, True


def _datamodule(configs: list[str], extra: list[str]) -> tuple[Any, Any]:
    """The configured data module and model (the config's classes are instantiated as ``lightning-dml predict``
    would)."""
    from lightning_dml.cli import build_cli
    from lightning_dml.protocol.launch import fit_command

    with fit_command([*(f"--config={c}" for c in configs), "--trainer.logger=false", *extra]):
        cli = build_cli(run=False)
    return cli.datamodule, cli.model


def _test_images(datamodule: Any, indices: torch.Tensor | Any) -> tuple[Any, list[str] | None]:
    """(image source, class names) of the data module's test split, checked against the evaluated indices."""
    datamodule.setup("test")
    dataset = datamodule.test_dataset
    largest = int(max(indices)) if len(indices) else -1
    if largest >= len(dataset):
        raise ReportError(
            f"the predictions name item {largest}, but the config's test split has {len(dataset)} items: give the "
            "config the predictions were made with"
        )
    names = getattr(datamodule, "class_names", None)
    return image_source(dataset=dataset), (list(names) if names else None)


def run_name(path: str | Path) -> str:
    """The run a checkpoint or predictions file belongs to: the folder holding it, or holding its ``checkpoints/``
    folder (``logs/glyphs/checkpoints/last.ckpt`` -> ``glyphs``), with the folder above a ``version_N``
    (``logs/glyphs/version_2/predictions.pt`` -> ``glyphs/version_2``)."""
    folder = Path(path).resolve().parent
    if folder.name == "checkpoints":
        folder = folder.parent
    if re.fullmatch(r"version_\d+", folder.name) and folder.parent.name:
        return f"{folder.parent.name}/{folder.name}"
    return folder.name


def report_title(source: dict[str, Any], results: RetrievalResults, out: Path) -> str:
    """The page's title: the run of the model (``--ckpt_path``, the checkpoint a predictions or results file was
    made with, else the predictions or results file's folder; the report folder's name without any):
    ``glyphs/version_0: retrieval report``."""
    checkpoint = results.extra.get("checkpoint")
    path = source.get("checkpoint") or (checkpoint.get("path") if isinstance(checkpoint, dict) else None)
    path = path or source.get("predictions") or source.get("results")
    run = run_name(path) if path else out.resolve().name
    return f"{run}: retrieval report"


def _first_line(error: BaseException) -> str:
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"


def _load_predictions(path: Path) -> dict[str, Any]:
    from lightning_dml.callbacks.predictions import load_predictions

    if not path.is_file():
        raise ReportError(f"--predictions {path}: no such file (lightning-dml predict writes <log_dir>/predictions.pt)")
    try:
        return load_predictions(path)
    except (ValueError, OSError, RuntimeError, EOFError, TypeError, pickle.UnpicklingError) as error:
        raise ReportError(
            f"--predictions {path}: not a predictions file of lightning-dml predict ({_first_line(error)})"
        ) from None


def _load_results(path: Path) -> RetrievalResults:
    if not path.is_file():
        raise ReportError(f"--results {path}: no such file (a report folder holds results.npz)")
    try:
        return RetrievalResults.load(path)
    except (ValueError, OSError, KeyError, TypeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile) as error:
        raise ReportError(
            f"--results {path}: not a results file of lightning-dml report ({_first_line(error)})"
        ) from None


def _operating_point(data: dict[str, Any], fmr: str, metric: str) -> dict[str, Any]:
    """The threshold at the false match rate ``fmr`` over the pairs the histograms count (the same queries, gallery
    and sequences), with the FMR and FNMR it gives: :func:`lightning_dml.index.calibrate.pair_threshold`."""
    from lightning_dml.index.calibrate import pair_threshold, parse_rate

    rate = parse_rate(fmr)
    found = pair_threshold(data["embeddings"], data["labels"], rate, metric, indices=data["indices"],
                           query_mask=data.get("query_mask"), gallery_mask=data.get("gallery_mask"),
                           sequence=data.get("sequence"))
    return {"target": rate, "threshold": found["threshold"], "fmr": found["fmr"], "fnmr": found["fnmr"],
            "positives": found["positives"], "negatives": found["negatives"]}


def main(argv: Sequence[str]) -> Report | None:
    """``lightning-dml report ...``; returns what was written (None in the other processes of a DDP predict)."""
    parser = build_parser()
    options, extra = parser.parse_known_args(list(argv))
    given = [name for name in ("ckpt_path", "predictions", "results") if getattr(options, name) is not None]
    if len(given) != 1:
        raise ReportError(
            "give one source: --config CONFIG --ckpt_path MODEL.ckpt, --predictions FILE or --results FILE.npz"
            + (f" (got {', '.join('--' + g for g in given)})" if given else "")
        )
    if extra and not options.config:
        raise ReportError(f"unknown arguments {' '.join(extra)} (arguments for predict need --config)")
    if options.ckpt_path is not None and not options.config:
        raise ReportError("--ckpt_path needs the run's --config (the data module and model to embed the test split)")
    if options.queries == "all":
        queries = None
    else:
        try:
            queries = int(options.queries)
        except ValueError:
            raise ReportError(f"--queries must be a number or 'all', got {options.queries!r}") from None
        if queries < 0:
            raise ReportError(f"--queries must be >= 0, got {queries}")
    for name in ("per_page", "top_k", "thumb_size"):
        if getattr(options, name) < 1:
            raise ReportError(f"--{name} must be >= 1, got {getattr(options, name)}")
    if options.bins < 0 or options.confused < 0 or min(options.recall_at) < 1:
        raise ReportError("--bins and --confused must be >= 0 and every --recall_at K >= 1")
    if options.thumb_size < 8:
        raise ReportError(f"--thumb_size must be >= 8 pixels, got {options.thumb_size}")
    out = options.out
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out} is a file, not a folder")
    if options.fmr is not None:
        from lightning_dml.index.calibrate import parse_rate

        parse_rate(options.fmr)  # a bad rate is reported before any work
        if options.results is not None:
            raise ReportError("--fmr needs the embeddings: give --predictions or --ckpt_path (a results.npz keeps the "
                              "operating point it was written with)")
    check_report_folder(out, options.overwrite)  # before any work: a foreign folder is refused, untouched

    start = time.perf_counter()
    images = class_names = embeddings = indices = evaluated = operating_point = None
    source: dict[str, Any] = {}
    if options.results is not None:
        results = _load_results(options.results)
        source["results"] = str(options.results)
        if options.config:
            images, class_names = _test_images(_datamodule(options.config, extra)[0], results.index)
        elif results.paths is not None:
            images = image_source(paths=results.paths, indices=results.index)
    else:
        if options.ckpt_path is not None:
            claim_report_folder(out, options.overwrite)  # predict writes DIR/predictions.pt
            data, datamodule, model, rank_zero = _predict(options.config, options.ckpt_path, out, extra)
            if not rank_zero:
                return None
            source["checkpoint"] = str(options.ckpt_path)
        else:
            data = _load_predictions(options.predictions)
            datamodule, model = _datamodule(options.config, extra) if options.config else (None, None)
            source["predictions"] = str(options.predictions)
        if data["embeddings"].shape[0] == 0:
            raise ReportError("the predictions hold no item (an empty test split?)")
        if datamodule is not None:
            images, class_names = _test_images(datamodule, data["indices"])
            data = {**data, "class_names": data.get("class_names") or class_names}
        elif data.get("paths") is not None:
            images = image_source(paths=data["paths"], indices=data["indices"].tolist())
        embeddings, indices = data["embeddings"], data["indices"]
        results = RetrievalResults.from_predictions(
            data, top_k=options.top_k, metric=options.metric, pair_histogram_bins=options.bins
        )
        # what `lightning-dml test` computes for the model (its metrics, per category too), on these items
        # (without a config, no model: the report's own Recall@K and the per-category figures)
        settings = evaluation_settings(model, options.recall_at) if model is not None else {
            "recall_at": tuple(options.recall_at), "clustering": False, "metrics": ()}
        evaluated = evaluate_predictions(data, metric=options.metric, **settings)
        if options.fmr is not None:
            operating_point = _operating_point(data, options.fmr, options.metric)
    if class_names and results.class_names is None:
        results.class_names = [str(c) for c in class_names]
    if options.config:
        source["config"] = ", ".join(options.config)
    report = write_report(
        results, out, images=images, queries=queries, by=options.by, per_page=options.per_page,
        recall_at=options.recall_at, confused=options.confused, embeddings=embeddings, embedding_indices=indices,
        thumb_size=options.thumb_size, thumb_format=options.thumb_format,
        title=options.title or report_title(source, results, out), source=source, overwrite=options.overwrite,
        metrics=evaluated, operating_point=operating_point,
    )
    seconds = time.perf_counter() - start
    metrics = format_metrics_line(report.metrics)
    print(f"lightning-dml report: {report.index} ({report.queries} queries on {report.pages} pages, "
          f"{report.thumbnails_written} thumbnails written, {report.thumbnails_reused} reused; {seconds:.1f} s)\n"
          f"  {metrics}")
    return report
