"""``lightning-dml search --runtime onnx``: the search command with ONNX Runtime and no PyTorch.

The queries are read (:func:`~lightning_dml.index.gallery.read_sources`), embedded by the index folder's
``embedding_model.onnx`` (:class:`~lightning_dml.onnx.runtime.OnnxEmbedder`; cut to the index's ``--width``) and
searched in its faiss files (:class:`~lightning_dml.onnx.folder_search.FolderSearch`: float32 or compressed vectors,
re-scored as the index says); ``--threshold`` cuts the lists and a calibrated index flags each result ``match``
(``--matches_only`` keeps the matches), as the torch runtime does (:mod:`lightning_dml.onnx.cuts`). The output is
``search``'s (JSON Lines or CSV, a ``match`` column for a calibrated index). The options that need torch
(``--rerank``: the re-rankers and the pairwise model run on tensors; ``--adaptive``: the adaptive cut is written
with torch, :mod:`lightning_dml.index.cut`) and a store other than the faiss folder are refused in one line.
Nothing on this path imports torch (``tests/test_onnx.py`` checks ``sys.modules``).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys

from lightning_dml.errors import UserInputError

__all__ = ["TORCH_ONLY", "search_command"]

#: options of ``search`` that need the torch runtime: (attribute, option, why)
TORCH_ONLY = (("rerank", "--rerank", "the re-rankers run on torch tensors"),
              ("adaptive", "--adaptive", "the adaptive cut runs on torch tensors"))


class OnnxOptionError(UserInputError, ValueError):
    """An option of ``search`` that the ONNX runtime does not serve."""


def check_onnx_options(args: argparse.Namespace) -> None:
    """One line naming the first option given that needs the torch runtime."""
    for name, option, why in TORCH_ONLY:
        if getattr(args, name, None):
            raise OnnxOptionError(f"{option} needs the torch runtime ({why}): leave out --runtime onnx, or leave out "
                                  f"{option}")
    store = getattr(args, "store", None)
    if store not in (None, "faiss"):
        raise OnnxOptionError(f"--store {store}: --runtime onnx searches index folders (faiss) only")


def search_command(args: argparse.Namespace, max_k: int) -> None:
    """Run ``search`` (parsed ``args``) with the ONNX runtime; results on stdout as ``search`` writes them."""
    from lightning_dml.index.gallery import read_sources
    from lightning_dml.onnx.cuts import OnnxCutError, apply_keep, calibrated_threshold, match_flags, \
        parse_threshold, threshold_keep
    from lightning_dml.onnx.folder_search import FolderSearch

    check_onnx_options(args)
    if not 1 <= args.k <= max_k:
        raise OnnxOptionError(f"--k {args.k} outside 1..{max_k}")
    if args.batch_size < 1:
        raise OnnxOptionError(f"--batch_size {args.batch_size} must be >= 1")
    threshold = parse_threshold(args.threshold)
    index = FolderSearch.load(args.index)
    calibrated = calibrated_threshold(index.manifest, args.index)
    if calibrated is None and args.matches_only:  # before any work
        raise OnnxCutError(f"--matches_only: the index {args.index} has no calibrated threshold (lightning-dml "
                           "index calibrate)")
    embedder = index.embedder(device=args.device, batch_size=args.batch_size)
    items = read_sources(args.queries, args.split)
    results: list[list[dict]] = []
    for start in range(0, len(items.paths), args.batch_size):
        queries = embedder(items.paths[start : start + args.batch_size])
        scores, ids = index.search(queries, args.k)
        if threshold is not None:
            scores, ids = apply_keep(scores, ids, threshold_keep(scores, ids, threshold))
        flags = None
        if calibrated is not None:  # "match": the exact score of the query and the stored vector > the threshold
            flags = match_flags(index.prepare(queries), ids, index.vectors, index.rows_of, index.metric, calibrated)
            if args.matches_only:
                scores, ids = apply_keep(scores, ids, flags)
        results.extend(index.results(scores, ids, flags))
    out = sys.stdout
    if args.format == "json":
        for name, found in zip(items.names, results):
            out.write(json.dumps({"query": name, "results": found}, ensure_ascii=False) + "\n")
    else:
        writer = csv.writer(out, lineterminator="\n")
        marked = calibrated is not None  # a calibrated index: a match column
        writer.writerow(["query", "rank", "id", "path", "label", "score"] + ["match"] * marked)
        for name, found in zip(items.names, results):
            for rank, row in enumerate(found, start=1):
                writer.writerow([name, rank, row["id"], row["path"], row["label"], repr(row["score"])]
                                + ([str(row["match"]).lower()] if marked else []))
    out.flush()
