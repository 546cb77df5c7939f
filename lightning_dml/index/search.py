"""``lightning-dml search``: the top-k gallery items of query images, from an index folder.

::

    lightning-dml search --index DIR --k K [--format json|csv] [--threshold T] [--adaptive N] [--rerank SPEC]
        [--batch_size 64] [--device cpu] IMAGE_OR_FOLDER_OR_CSV...

Queries: image files, folders (every image under them, sorted) and CSV/Parquet tables (their ``path`` column),
in the order given (:mod:`lightning_dml.index.gallery`); embedded with the index's exported model and preprocessing
(no training config), searched with :meth:`~lightning_dml.index.EmbeddingIndex.search`, optionally re-ranked
(``--rerank``, :func:`lightning_dml.index.rerank.parse_rerank`) and cut (``--threshold`` / ``--adaptive``,
:class:`lightning_dml.index.cut.SearchCut`: an empty ``results`` list means no match).

Output on stdout, one line per query:

* ``--format json`` (default): JSON Lines, ``{"query": QUERY, "results": [{"id", "path", "label", "score"}, ...]}``
  best first (``query``: the path as given on the command line or in the table);
* ``--format csv``: a header ``query,rank,id,path,label,score`` and one row per result (rank from 1).

``--store milvus --uri URI``: ``--index`` names a gallery in a Milvus collection (:mod:`lightning_dml.index.stores`,
:mod:`lightning_dml.index.milvus`), searched the same way.

With a calibrated index (``lightning-dml index calibrate``, :mod:`lightning_dml.index.calibrate`) each result also
has ``"match": true|false`` (a ``match`` column in CSV): its exact score ``>`` the stored threshold;
``--matches_only`` keeps the matches only (refused on an index without a threshold).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from collections.abc import Sequence

from lightning_dml.cli_parsing import CommandParser
from lightning_dml.errors import UserInputError
from lightning_dml.index.stores import add_store_arguments, check_store, open_index

__all__ = ["build_parser", "main", "search_embeddings", "search_images"]

#: most results a query may ask for
MAX_K = 10_000


class SearchOptionError(UserInputError, ValueError):
    """A bad option of ``lightning-dml search``."""


def build_parser() -> argparse.ArgumentParser:
    p = CommandParser(prog="lightning-dml search", description="Top-k gallery items of query images from "
                                "an index folder (lightning-dml index build). See docs/serving.md.")
    p.add_argument("--index", required=True, help="the index folder")
    p.add_argument("--k", type=int, default=10, help="results per query (default 10)")
    p.add_argument("--format", choices=("json", "csv"), default="json", help="JSON Lines (default) or CSV")
    p.add_argument("--threshold", default=None, help="keep results with a score >= T (a similarity)")
    p.add_argument("--adaptive", default=None,
                   help="cut each list at its first gap larger than N times its mean gap (open-metric-learning)")
    p.add_argument("--rerank", default=None, help="re-ranking: kreciprocal[:k1=20,k2=6,lambda=0.3,candidates=100], "
                   "aqe[:alpha=3,n=2] or dba[:alpha=3,n=2,candidates=100]; the learned pairwise:model=DIR,top_n=N, "
                   "alone or after one of them joined by + (docs/reranking.md)")
    p.add_argument("--batch_size", type=int, default=64, help="query images embedded together (default 64)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or auto (default cpu)")
    p.add_argument("--runtime", choices=("torch", "onnx"), default="torch",
                   help="torch (default) or onnx: the index's embedding_model.onnx on ONNX Runtime, without "
                   "PyTorch (index build --runtime onnx writes it; docs/serving.md)")
    p.add_argument("--split", default=None, help="a query table's rows of this split only")
    p.add_argument("--matches_only", action="store_true",
                   help="only the results that match under the index's calibrated threshold (index calibrate)")
    add_store_arguments(p)
    p.add_argument("queries", nargs="+", metavar="IMAGE_OR_FOLDER_OR_CSV", help="query images, folders or tables")
    return p


def search_images(index, images: Sequence, k: int, rerank: str | None = None, cut=None,
                  batch_size: int = 64, matches_only: bool = False) -> list[list[dict]]:
    """Result lists of images (paths or PIL images): embedded in batches of ``batch_size``, searched, re-ranked
    (``rerank``: a ``--rerank`` text), cut (``cut``: a :class:`~lightning_dml.index.cut.SearchCut`); one list of
    ``{"id", "path", "label", "score"}`` per image, best first. ``lightning-dml serve`` answers with it too."""
    import torch  # here, not at the top: the --runtime onnx path of main imports no torch

    out: list[list[dict]] = []
    for start in range(0, len(images), batch_size):
        with torch.no_grad():
            queries = index.embed_images(images[start : start + batch_size])
        from lightning_dml.index.pairwise import query_inputs  # the pixels of an images pairwise re-ranker

        inputs = query_inputs(index, rerank, images[start : start + batch_size])
        out.extend(search_embeddings(index, queries, k, rerank, cut, matches_only, query_inputs=inputs))
    return out


def search_embeddings(index, queries: torch.Tensor, k: int, rerank: str | None = None, cut=None,
                      matches_only: bool = False, query_inputs: torch.Tensor | None = None) -> list[list[dict]]:
    """Result lists of raw query embeddings ``[Q, D]`` of the index's model: searched, re-ranked (``rerank``: a
    ``--rerank`` text; its ``candidates`` and ``n`` clamped to the index's size), cut (``cut``); one list of
    ``{"id", "path", "label", "score"}`` per query, best first (what :func:`search_images` does after embedding).
    ``query_inputs``: the queries' model inputs ``[Q, C, H, W]``, for a pairwise re-ranker of images
    (:mod:`lightning_dml.index.pairwise`)."""
    from lightning_dml.index.rerank import parse_rerank, rerank_search

    from lightning_dml.index.pairwise import PairwiseRerank, search_index

    reranker = parse_rerank(rerank)
    if isinstance(reranker, PairwiseRerank):  # the learned re-ranker: the index's items (vectors or images)
        scores, ids = search_index(index, reranker, queries, k, query_inputs)
    else:
        scores, ids = rerank_search(index, queries, k, reranker)
    if cut:
        scores, ids = cut.apply(scores, ids)
    from lightning_dml.index.calibrate import mark_results

    return mark_results(index, queries, scores, ids, matches_only)  # + "match" with a calibrated threshold


def main(argv: Sequence[str] | None = None) -> None:
    """``lightning-dml search ...`` (module docstring)."""
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.runtime == "onnx":  # ONNX Runtime, no torch imported (lightning_dml.onnx.search)
        from lightning_dml.onnx.search import search_command

        return search_command(args, MAX_K)
    from lightning_dml.index.cut import SearchCut
    from lightning_dml.index.gallery import read_sources
    from lightning_dml.index.rerank import parse_rerank

    if not 1 <= args.k <= MAX_K:
        raise SearchOptionError(f"--k {args.k} outside 1..{MAX_K}")
    if args.batch_size < 1:
        raise SearchOptionError(f"--batch_size {args.batch_size} must be >= 1")
    cut = SearchCut.parse(args.threshold, args.adaptive)
    reranker = parse_rerank(args.rerank)
    check_store(args)
    index = open_index(args.index, args.store, args.uri, device=args.device)
    from lightning_dml.index.calibrate import CalibrationError, check_calibration

    if check_calibration(index.manifest, args.index) is None and args.matches_only:  # before any work
        raise CalibrationError(f"--matches_only: the index {args.index} has no calibrated threshold (lightning-dml "
                               "index calibrate)")
    if reranker is not None:
        reranker.check_metric(index.metric)
        if hasattr(reranker, "check_index"):  # pairwise: its folder, base checkpoint and inputs, before any work
            reranker.check_index(index)
    items = read_sources(args.queries, args.split)
    results = search_images(index, items.paths, args.k, args.rerank, cut, args.batch_size, args.matches_only)
    out = sys.stdout
    if args.format == "json":
        for name, found in zip(items.names, results):
            out.write(json.dumps({"query": name, "results": found}, ensure_ascii=False) + "\n")
    else:
        writer = csv.writer(out, lineterminator="\n")
        marked = index.manifest.calibration is not None  # a calibrated index: a match column
        writer.writerow(["query", "rank", "id", "path", "label", "score"] + ["match"] * marked)
        for name, found in zip(items.names, results):
            for rank, row in enumerate(found, start=1):
                writer.writerow([name, rank, row["id"], row["path"], row["label"], repr(row["score"])]
                                + ([str(row["match"]).lower()] if marked else []))
    out.flush()
