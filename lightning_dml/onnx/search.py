"""``lightning-dml search --runtime onnx``: the search command with ONNX Runtime and no PyTorch.

The queries are read (:func:`~lightning_dml.index.gallery.read_sources`), embedded by the index folder's
``embedding_model.onnx`` (:class:`~lightning_dml.onnx.runtime.OnnxEmbedder`) and searched in its faiss files
(:class:`~lightning_dml.onnx.folder_search.FolderSearch`); the output is ``search``'s (JSON Lines or CSV). The
options that need the torch runtime (``--rerank``, ``--threshold``, ``--adaptive``, ``--matches_only``, a store
other than the faiss folder) are refused in one line. Nothing on this path imports torch
(``tests/test_onnx.py`` checks ``sys.modules``).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys

from lightning_dml.errors import UserInputError

__all__ = ["TORCH_ONLY", "search_command"]

#: options of ``search`` that need the torch runtime: (attribute, option)
TORCH_ONLY = (("rerank", "--rerank"), ("threshold", "--threshold"), ("adaptive", "--adaptive"),
              ("matches_only", "--matches_only"))


class OnnxOptionError(UserInputError, ValueError):
    """An option of ``search`` that the ONNX runtime does not serve."""


def check_onnx_options(args: argparse.Namespace) -> None:
    """One line naming the first option given that needs the torch runtime."""
    for name, option in TORCH_ONLY:
        if getattr(args, name, None):
            raise OnnxOptionError(f"{option} needs the torch runtime (re-ranking, cuts and calibrated matches run on "
                                  "torch tensors): leave out --runtime onnx, or leave out " + option)
    store = getattr(args, "store", None)
    if store not in (None, "faiss"):
        raise OnnxOptionError(f"--store {store}: --runtime onnx searches index folders (faiss) only")


def search_command(args: argparse.Namespace, max_k: int) -> None:
    """Run ``search`` (parsed ``args``) with the ONNX runtime; results on stdout as ``search`` writes them."""
    from lightning_dml.index.gallery import read_sources
    from lightning_dml.onnx.folder_search import FolderSearch

    check_onnx_options(args)
    if not 1 <= args.k <= max_k:
        raise OnnxOptionError(f"--k {args.k} outside 1..{max_k}")
    if args.batch_size < 1:
        raise OnnxOptionError(f"--batch_size {args.batch_size} must be >= 1")
    index = FolderSearch.load(args.index)
    embedder = index.embedder(device=args.device, batch_size=args.batch_size)
    items = read_sources(args.queries, args.split)
    results: list[list[dict]] = []
    for start in range(0, len(items.paths), args.batch_size):
        queries = embedder(items.paths[start : start + args.batch_size])
        results.extend(index.results(*index.search(queries, args.k)))
    out = sys.stdout
    if args.format == "json":
        for name, found in zip(items.names, results):
            out.write(json.dumps({"query": name, "results": found}, ensure_ascii=False) + "\n")
    else:
        writer = csv.writer(out, lineterminator="\n")
        writer.writerow(["query", "rank", "id", "path", "label", "score"])
        for name, found in zip(items.names, results):
            for rank, row in enumerate(found, start=1):
                writer.writerow([name, rank, row["id"], row["path"], row["label"], repr(row["score"])])
    out.flush()
