"""``lightning-dml index``: build an index from a checkpoint and a gallery, add to it, evaluate it, check it.

::

    lightning-dml index build --config CONFIG --ckpt_path CKPT --gallery PATH --kind flat --out DIR
        [--split SPLIT] [--shards N] [--nlist N] [--nprobe N] [--m N] [--nbits N] [--M N] [--ef_construction N]
        [--ef_search N] [--vectors float32|int8|binary] [--rescore N] [--width N] [--accelerator auto] [--devices 1]
        [--strategy auto] [--num_workers 0] [--batch_size 128] [--overwrite] [--lock_timeout 600]
    lightning-dml index add --index DIR --gallery PATH [--split SPLIT] [--lock_timeout 600]
    lightning-dml index evaluate --index DIR [--queries PATH] [--k 10] [--recall_at 1 2 4 8] [--rerank SPEC]
        [--format table|json]
    lightning-dml index status --index DIR
    lightning-dml index calibrate --index DIR --labelled PATH (--fmr F | --fnmr F) [--split SPLIT] [--device cpu]
        [--lock_timeout 600] [--store milvus --uri URI]

``PATH``: an image folder of class folders or a CSV/Parquet table (:mod:`lightning_dml.index.gallery`); ``--queries``
also takes a ``lightning-dml predict`` file (``predictions.pt``: its checkpoint must be the index's). ``build`` runs
Lightning's predict loop (``--devices 2 --strategy ddp``: every process embeds its share, rank 0 writes the folder).
``status`` lists the gallery files that changed since they were indexed (``add`` re-embeds them) and says whether the
checkpoint the index was built from changed since (its sha256 against the one recorded at build).

``build`` and ``add`` write the folder as a whole under its lock (``.DIR.lock`` beside it,
:mod:`lightning_dml.index.folder`): a command stopped at any point leaves the old index whole, and a second writer
of the same folder waits for the first (a line names the holder) for at most ``--lock_timeout`` seconds.

``--store milvus --uri URI`` (``build``, ``add``, ``evaluate``, ``status``, ``calibrate``; ``build`` also
``--model_dir``): the gallery in a Milvus collection named by ``--out`` / ``--index``
(:mod:`lightning_dml.index.stores`, :mod:`lightning_dml.index.milvus`; ``build``: ``--kind flat`` only).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from lightning_dml.cli_parsing import CommandParser
from lightning_dml.errors import UserInputError
from lightning_dml.index.folder import DEFAULT_LOCK_TIMEOUT
from lightning_dml.index.manifest import MANIFEST
from lightning_dml.index.stores import add_store_arguments, check_store, milvus_add_command, milvus_build_command, \
    open_index

__all__ = ["build_parser", "main"]


class IndexCommandError(UserInputError, ValueError):
    """A bad option of ``lightning-dml index``."""


def _devices(text: str) -> int | str:
    return int(text) if text.lstrip("-").isdigit() else text


def build_parser() -> argparse.ArgumentParser:
    parser = CommandParser(prog="lightning-dml index", description="Build, extend, evaluate and check an "
                                     "embedding index (faiss) of an image gallery. See docs/serving.md.")
    sub = parser.add_subparsers(dest="action", required=True, metavar="{build,add,evaluate,status,calibrate}")

    build = sub.add_parser("build", help="embed a gallery with a checkpoint and index it")
    build.add_argument("--config", required=True, help="the run's config (lightning-dml saves config.yaml)")
    build.add_argument("--ckpt_path", required=True, help="the checkpoint whose model embeds the gallery")
    build.add_argument("--gallery", required=True, help="an image folder of class folders, or a CSV/Parquet table")
    build.add_argument("--kind", default="flat", help="flat (exact), ivf_flat, ivf_pq or hnsw (default flat)")
    build.add_argument("--out", required=True, help="the index folder to write")
    build.add_argument("--split", default=None, help="a table's rows of this split only (its 'split' column)")
    build.add_argument("--shards", type=int, default=1, help="faiss files the items are dealt to (default 1)")
    for name in ("nlist", "nprobe", "m", "nbits", "M", "ef_construction", "ef_search"):
        build.add_argument(f"--{name}", type=int, default=None,
                           help=f"option {name} of the index kind (docs/serving.md; default from the data)")
    build.add_argument("--vectors", default=None, choices=("float32", "int8", "binary"),
                       help="the vectors a flat index holds: float32 (default), int8 (scalar codes, range "
                            "calibrated on the gallery) or binary (sign bits, Hamming distance; cosine only)")
    build.add_argument("--width", type=int, default=None, help="keep the leading N dimensions of the embedding (a "
                       "Matryoshka model, docs/losses/matryoshka.md), re-normalised; queries are cut the same way")
    build.add_argument("--rescore", type=int, default=None, help="with --vectors int8|binary: re-score the best N "
                       "candidates exactly with the float32 vectors kept on disk (embeddings.npy, memory-mapped)")
    build.add_argument("--accelerator", default="auto", help="Trainer accelerator of the embedding (default auto)")
    build.add_argument("--devices", type=_devices, default=1, help="Trainer devices (default 1)")
    build.add_argument("--strategy", default="auto", help="Trainer strategy (ddp for several devices)")
    build.add_argument("--num_workers", type=int, default=0, help="DataLoader workers (default 0)")
    build.add_argument("--batch_size", type=int, default=128, help="images per forward pass (default 128)")
    build.add_argument("--progress_bar", type=lambda t: t.lower() in ("1", "true", "yes"), default=True,
                       help="show the progress bar (default true)")
    build.add_argument("--overwrite", action="store_true",
                       help="replace an existing index folder (as a whole, once the new one is complete)")
    build.add_argument("--lock_timeout", type=float, default=DEFAULT_LOCK_TIMEOUT, help="seconds to wait while "
                       f"another command writes the folder (default {DEFAULT_LOCK_TIMEOUT:g})")
    build.add_argument("--runtime", choices=("torch", "onnx"), default="torch",
                       help="torch (default: Lightning's predict loop) or onnx: the model exported to ONNX, verified, "
                       "stored in the folder and run by ONNX Runtime on the gallery (--accelerator: cpu, cuda, auto)")
    add_store_arguments(build, build=True)

    add = sub.add_parser("add", help="add a gallery's new or changed images to an index")
    add.add_argument("--index", required=True, help="the index folder")
    add.add_argument("--gallery", required=True, help="an image folder of class folders, or a CSV/Parquet table")
    add.add_argument("--split", default=None, help="a table's rows of this split only")
    add.add_argument("--device", default="cpu", help="cpu, cuda or auto: where the exported model runs")
    add.add_argument("--lock_timeout", type=float, default=DEFAULT_LOCK_TIMEOUT,
                     help=f"seconds to wait while another command writes the folder (default {DEFAULT_LOCK_TIMEOUT:g})")
    add_store_arguments(add)

    evaluate = sub.add_parser("evaluate",
                              help="neighbour recall and Recall@K / MAP@R of the index against exact search")
    evaluate.add_argument("--index", required=True, help="the index folder")
    evaluate.add_argument("--queries", default=None,
                          help="labelled queries: an image folder of class folders, a table, or a predictions.pt "
                               "file; default: the gallery all-vs-all (leave-one-out)")
    evaluate.add_argument("--split", default=None, help="a query table's rows of this split only")
    evaluate.add_argument("--k", type=int, default=10, help="k of the neighbour recall (default 10)")
    evaluate.add_argument("--recall_at", type=int, nargs="+", default=[1, 2, 4, 8], help="the K of Recall@K")
    evaluate.add_argument("--rerank", default=None, help="also the exact ranking re-ranked (see lightning-dml "
                          "search --help)")
    evaluate.add_argument("--format", choices=("table", "json"), default="table", help="output (default table)")
    evaluate.add_argument("--device", default="cpu", help="where the exported model embeds the queries")
    add_store_arguments(evaluate)

    status = sub.add_parser("status", help="the index's manifest and the gallery files changed since indexing")
    status.add_argument("--index", required=True, help="the index folder")
    add_store_arguments(status)

    calibrate = sub.add_parser("calibrate", help="store the match threshold at a false match rate, measured over all "
                               "pairs of a labelled set (lightning_dml.index.calibrate)")
    calibrate.add_argument("--index", required=True, help="the index folder")
    calibrate.add_argument("--labelled", required=True, help="labelled items: an image folder of class folders, a "
                           "table with labels, or a predictions.pt file of the index's checkpoint")
    target = calibrate.add_mutually_exclusive_group(required=True)
    target.add_argument("--fmr", default=None, help="the target false match rate over the negative pairs, in (0, 1), "
                        "e.g. 0.001")
    target.add_argument("--fnmr", default=None, help="or the target false non-match rate over the positive pairs, "
                        "in (0, 1)")
    calibrate.add_argument("--split", default=None, help="a table's rows of this split only")
    calibrate.add_argument("--device", default="cpu", help="where the exported model embeds the labelled images")
    calibrate.add_argument("--lock_timeout", type=float, default=DEFAULT_LOCK_TIMEOUT, help="seconds to wait while "
                           f"another command writes the folder (default {DEFAULT_LOCK_TIMEOUT:g})")
    add_store_arguments(calibrate)
    return parser


def _kind_options(args: argparse.Namespace) -> dict[str, int | str]:
    names = ("nlist", "nprobe", "m", "nbits", "M", "ef_construction", "ef_search", "vectors", "rescore")
    return {n: getattr(args, n) for n in names if getattr(args, n) is not None}


def _check_lock_timeout(args: argparse.Namespace) -> None:
    if not args.lock_timeout >= 0:  # also NaN
        raise IndexCommandError(f"--lock_timeout must be a number of seconds >= 0, got {args.lock_timeout}")


def _build(args: argparse.Namespace) -> None:
    from lightning_dml.index.build import build_index
    from lightning_dml.index.kinds import check_kind

    check_kind(args.kind, _kind_options(args))  # before any work
    check_store(args)
    if args.store == "milvus" and args.width is not None:  # the Milvus store does not cut its queries
        raise IndexCommandError("--width is an option of the faiss folder index: leave it out with --store milvus")
    if args.store == "milvus":
        return milvus_build_command(args, _kind_options(args))
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise IndexCommandError(f"--out {out} is a file, not a folder")
    is_index = (out / MANIFEST).is_file()
    if out.is_dir() and any(out.iterdir()) and not is_index:
        raise IndexCommandError(f"--out {out} is a non-empty folder that is not an index; give a new or empty folder "
                                "(--overwrite replaces only an index folder, as a whole)")
    if is_index and not args.overwrite:
        raise IndexCommandError(f"--out {out} is an index; give a new folder, or --overwrite to replace it")
    if args.batch_size < 1 or args.num_workers < 0 or args.shards < 1:
        raise IndexCommandError("--batch_size and --shards must be >= 1, --num_workers >= 0")
    if args.width is not None and args.width < 1:
        raise IndexCommandError(f"--width must be >= 1 (the leading dimensions kept), got {args.width}")
    _check_lock_timeout(args)
    if args.runtime == "onnx":  # ONNX Runtime embeds the gallery (lightning_dml.onnx.build)
        return _build_onnx(args, out)
    index = build_index(
        args.config, args.ckpt_path, args.gallery, args.kind, out, split=args.split, shards=args.shards,
        accelerator=args.accelerator, devices=args.devices, strategy=args.strategy, num_workers=args.num_workers,
        batch_size=args.batch_size, progress=args.progress_bar, overwrite=args.overwrite,
        lock_timeout=args.lock_timeout, width=args.width, **_kind_options(args),
    )
    if index is not None:
        print(f"lightning-dml index: {len(index)} items indexed ({index.kind}, {index.metric}, size {index.dim}) "
              f"in {out}")


def _build_onnx(args: argparse.Namespace, out: Path) -> None:
    from lightning_dml.onnx.build import build_index_onnx

    given = (("--devices", args.devices != 1), ("--strategy", args.strategy != "auto"),
             ("--num_workers", args.num_workers != 0))
    torch_only = [option for option, set_ in given if set_]
    if torch_only:
        raise IndexCommandError(f"{torch_only[0]} is an option of the torch runtime (Lightning's predict loop): "
                                "leave it out with --runtime onnx")
    device = {"gpu": "cuda"}.get(args.accelerator, args.accelerator)
    index = build_index_onnx(args.config, args.ckpt_path, args.gallery, args.kind, out, split=args.split,
                             shards=args.shards, device=device, batch_size=args.batch_size, overwrite=args.overwrite,
                             lock_timeout=args.lock_timeout, width=args.width, **_kind_options(args))
    print(f"lightning-dml index: {len(index)} items indexed ({index.kind}, {index.metric}, size {index.dim}, "
          f"embedded by ONNX Runtime) in {out}")


def _add(args: argparse.Namespace) -> None:
    check_store(args)
    if args.store == "milvus":
        return milvus_add_command(args)
    from lightning_dml.index.build import add_gallery

    _check_lock_timeout(args)
    counts = add_gallery(args.index, args.gallery, split=args.split, device=args.device,
                         lock_timeout=args.lock_timeout)
    print(f"lightning-dml index: {counts['added']} added, {counts['updated']} re-embedded (changed files), "
          f"{counts['unchanged']} unchanged in {args.index}")


def load_queries(index, source: str, split: str | None = None):
    """``(embeddings [Q, D], labels, names)`` of ``--queries``: a predictions file (``.pt``, its checkpoint checked
    against the index's) or images embedded with the index's exported model."""
    import torch

    if source.endswith(".pt"):
        from lightning_dml.callbacks.predictions import load_predictions

        try:
            data = load_predictions(source)
        except ValueError as error:
            raise IndexCommandError(str(error)) from None
        index.check_model((data.get("checkpoint") or {}).get("sha256"), data["embeddings"].shape[1],
                          what=f"the queries of {source}")
        names = data.get("class_names")
        labels = data["labels"]
        if labels.ndim != 1:
            raise IndexCommandError(f"{source}: label sets are not supported by index evaluate")
        labels = [names[int(v)] if names else str(int(v)) for v in labels.tolist()]
        paths = data.get("paths") or [f"{source}[{i}]" for i in range(len(labels))]
        return data["embeddings"].float(), labels, paths
    from lightning_dml.index.gallery import read_items

    items = read_items(source, split)
    with torch.no_grad():
        embeddings = index.embed_images(items.paths)
    return embeddings, items.labels, items.names


def _evaluate(args: argparse.Namespace) -> None:
    import warnings

    from lightning_dml.index.evaluate import evaluate_index, format_table
    from lightning_dml.index.index import warn_changed

    if args.k < 1 or any(v < 1 for v in args.recall_at):
        raise IndexCommandError("--k and --recall_at values must be >= 1")
    if args.rerank:
        from lightning_dml.index.rerank import parse_rerank

        parse_rerank(args.rerank)  # a bad option is reported before any work
    check_store(args)
    index = open_index(args.index, args.store, args.uri, device=args.device)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warn_changed(index)
    queries = labels = None
    if args.queries is not None:
        queries, labels, _ = load_queries(index, args.queries, args.split)
    result = evaluate_index(index, queries, labels, k=args.k, recall_at=args.recall_at, rerank=args.rerank)
    if args.format == "json":
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))


def _status(args: argparse.Namespace) -> None:
    check_store(args)
    index = open_index(args.index, args.store, args.uri)
    m = index.manifest
    ckpt = m.checkpoint or {}
    print(f"{index!r}\ncheckpoint: {ckpt.get('path')} (sha256 {ckpt.get('sha256')})\noptions: {m.options}\n"
          f"written by lightning-dml {m.library}, faiss {m.faiss}, torch {m.torch}")
    change = m.checkpoint_change()  # the recorded sha256 against the file's content now
    if change:
        print(f"checkpoint changed: {change}")
    elif m.checkpoint_sha256:
        print("checkpoint unchanged since the index was built (same sha256)")
    if m.calibration:  # lightning-dml index calibrate
        cal = m.calibration
        print(f"calibrated threshold: {cal.get('threshold')!r} ({cal.get('rule')}; target {cal.get('target')}: FMR "
              f"{cal.get('fmr')}, FNMR {cal.get('fnmr')} on {(cal.get('labelled') or {}).get('path')})")
    changed = index.changed_files()
    print(f"changed gallery files: {len(changed)}")
    for i, path, what in changed:
        print(f"  {what}: {path} (id {i})")


def _calibrate(args: argparse.Namespace) -> None:
    from lightning_dml.index.calibrate import calibrate_index, parse_rate

    if args.fmr is not None:  # a bad rate is reported before any work
        parse_rate(args.fmr)
    else:
        parse_rate(args.fnmr, "--fnmr")
    _check_lock_timeout(args)
    check_store(args)
    cal = calibrate_index(args.index, args.labelled, args.fmr, fnmr=args.fnmr, split=args.split, device=args.device,
                          lock_timeout=args.lock_timeout, store=args.store, uri=args.uri)
    where = (f"the manifest of Milvus collection {args.index} at {args.uri}" if args.store == "milvus"
             else Path(args.index) / MANIFEST)
    (kind, rate), = cal["target"].items()
    print(f"lightning-dml index: threshold {cal['threshold']!r} (match: {cal['rule']}) at target {kind.upper()} "
          f"{rate}: FMR {cal['fmr']:.6g}, FNMR {cal['fnmr']:.6g} over {cal['negatives']} negative and "
          f"{cal['positives']} positive pairs of {cal['labelled']['items']} labelled items; stored in {where}")


def main(argv: Sequence[str] | None = None) -> None:
    """``lightning-dml index ACTION ...`` (see the module docstring)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.action == "build":  # every runtime and store: no "GPU available" lines (lightning_dml.index.build)
        from lightning_dml.index.build import quiet_lightning

        with quiet_lightning():
            return _build(args)
    {"build": _build, "add": _add, "evaluate": _evaluate, "status": _status,
     "calibrate": _calibrate}[args.action](args)
