"""The report folder: ``index.html`` and what it loads, written from a
:class:`~lightning_dml.retrieval.RetrievalResults`.

Layout of the folder (``docs/report.md``)::

    index.html, report.css, report.js   the page (no CDN, no server: opens from disk in any browser)
    data/summary.js                     metrics, Recall@K curve, per-class table, confused pairs, histograms,
                                        DET curve and operating point
    data/queries-00000.js, ...          the query rows, one file per page, loaded when the page is shown
    thumbs/<2 hex>/<hash>.webp          thumbnails (content-addressed: a rerun reuses them)
    results.npz                         the RetrievalResults (``lightning-dml report --results`` rebuilds from it)
    report.json                         the marker: this folder is a report (:mod:`~lightning_dml.report.folder`)

The folder must be new, empty, an earlier report, or given with ``overwrite``
(:func:`~lightning_dml.report.folder.claim_report_folder`). Every file is written atomically (a temporary file
renamed onto it, :func:`~lightning_dml.data.cache_dir.atomic_path`): a run killed midway leaves each file whole, the
old one or the new one (the pages may then be a mix of both runs' until the next run).

The data are JavaScript files that call a function of ``report.js`` (``DMLReport.summary(...)``,
``DMLReport.page(n, ...)``), loaded by ``<script>`` tags: unlike ``fetch()`` of a JSON file, that works from
``file://`` in every browser. Only the shown page's file is loaded, so a report of 60,000 queries opens as fast as
one of 60.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from filelock import FileLock

from lightning_dml.data.cache_dir import atomic_path, write_text_atomic
from lightning_dml.report.folder import LOCK, check_report_folder, claim_report_folder
from lightning_dml.report.thumbnails import ImageSource, ThumbnailWriter
from lightning_dml.retrieval import RetrievalResults

__all__ = ["Report", "det_curve", "ignored_neighbors", "label_text", "page_metrics", "report_data", "report_metrics",
           "write_report"]

ASSETS = Path(__file__).parent / "assets"
#: flags of a shown neighbour (``data-flag`` on the page): irrelevant, relevant, ignored (e.g. same sequence)
IRRELEVANT, RELEVANT, IGNORED = 0, 1, 2


@dataclass
class Report:
    """What :func:`write_report` wrote: the folder, its page, and counts."""

    folder: Path
    index: Path
    queries: int
    pages: int
    thumbnails_written: int = 0
    thumbnails_reused: int = 0
    unreadable: list[tuple[int, str]] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)


def _finite(value: float | None) -> float | None:
    return None if value is None or not math.isfinite(float(value)) else float(value)


def _js(call: str, *args: Any) -> str:
    """``call(args...);`` with the arguments as JSON (NaN/inf as null; ``</`` escaped for inline use)."""
    text = ", ".join(json.dumps(a, allow_nan=False, separators=(",", ":")) for a in args)
    return f"{call}({text.replace('</', '<' + chr(92) + '/')});\n"


def det_curve(histogram: dict[str, list] | None) -> list[list[float]]:
    """The DET curve (Martin et al., *The DET Curve in Assessment of Detection Task Performance*, Eurospeech 1997:
    false non-match rate against false match rate) at the edges of the exact pair-score histograms: at edge ``i``
    the pairs in bins ``i`` and above are accepted, ``[FMR, FNMR] = [negatives in bins >= i / negatives, positives
    in bins < i / positives]``, from accepting every pair (``[1, 0]``) to none (``[0, 1]``). Its resolution is the
    histograms' bins (``--bins``); ``[]`` without histograms or without positive and negative pairs."""
    if not histogram:
        return []
    pos, neg = np.asarray(histogram["positive"], dtype=np.int64), np.asarray(histogram["negative"], dtype=np.int64)
    n_pos, n_neg = int(pos.sum()), int(neg.sum())
    if n_pos == 0 or n_neg == 0:
        return []
    below = np.concatenate([[0], np.cumsum(pos)])  # positives in bins < i
    at_or_above = n_neg - np.concatenate([[0], np.cumsum(neg)])  # negatives in bins >= i
    return [[float(a) / n_neg, float(b) / n_pos] for a, b in zip(at_or_above.tolist(), below.tolist())]


def recall_curve_ks(results: RetrievalResults) -> list[int]:
    """The K of the Recall@K curve: 1 to the neighbour lists' length, the powers of two below the gallery's size,
    and the gallery's size."""
    gallery = int(results.is_gallery.sum()) if results.is_gallery is not None else int(results.index.size) - 1
    ks = set(range(1, results.neighbors.shape[1] + 1))
    k = 1
    while k < gallery:
        ks.add(k)
        k *= 2
    ks.add(max(1, gallery))
    return sorted(ks)


def report_metrics(results: RetrievalResults, recall_at: Sequence[int] = (1, 2, 4, 8)) -> dict[str, float]:
    """The metrics table: Recall@K, MAP@R, R-Precision and MAP, as ``RetrievalMetrics`` computes them (equal to
    its values: Recall@K from the exact first relevant rank, the others from the per-query values)."""
    out = {f"recall@{int(k)}": results.recall_at(int(k)) for k in recall_at}
    out["map@r"] = results.map_at_r()
    if results.r_precision is not None:
        out["r_precision"] = results.r_precision_mean()
    out["map"] = results.mean_average_precision()
    return out


def page_metrics(
    results: RetrievalResults, recall_at: Sequence[int] = (1, 2, 4, 8), metrics: dict[str, float] | None = None
) -> tuple[dict[str, float], dict[str, Any] | None]:
    """``(overall, per category)`` of the page: ``metrics`` (what ``lightning-dml test`` computes for the model,
    :func:`~lightning_dml.report.evaluation.evaluate_predictions`; ``None``: those kept in ``results.extra``
    under ``"metrics"``), then those of :func:`report_metrics` it lacks; the ``category/<name>/<metric>`` keys as
    ``{"metrics": [names], "rows": [[category, value, ...], ...]}`` (``None`` without categories; a missing value
    ``None``)."""
    from lightning_dml.callbacks.summary import split_categories

    given = metrics if metrics is not None else results.extra.get("metrics") or {}
    overall, per_category = split_categories({k: float(v) for k, v in given.items()})
    for name, value in report_metrics(results, recall_at).items():
        overall.setdefault(name, value)
    if not per_category:
        return overall, None
    names = list(dict.fromkeys(m for row in per_category.values() for m in row))
    rows = [[category, *(_finite(row.get(m)) for m in names)] for category, row in per_category.items()]
    return overall, {"metrics": names, "rows": rows}


def ignored_neighbors(
    results: RetrievalResults, rows: Iterable[int], embeddings: torch.Tensor | None, indices: torch.Tensor | None = None
) -> dict[int, list[tuple[int, float, int]]]:
    """For the queries ``rows`` (positions in ``results.query``): the gallery items of the query's sequence (which
    the search ignores) that score at least as high as its last shown neighbour, as ``(item index, score, the
    number of shown neighbours ranked ahead of it)``. Needs the embeddings (``indices``: their item indices, in
    their order; default ``results.index``); without embeddings or sequences, none.

    Scores as the engine's exact ones: cosine of the L2-normalised float64 embeddings, or negative squared
    Euclidean distance in float64."""
    if embeddings is None or results.sequence is None:
        return {}
    idx = results.index if indices is None else np.asarray(torch.as_tensor(indices).cpu())
    order = np.argsort(idx, kind="stable")
    x = torch.as_tensor(embeddings).detach().double()
    if results.metric == "cosine":
        x = torch.nn.functional.normalize(x, dim=1)
    pos = {int(i): int(p) for i, p in zip(idx[order], order)}
    seq = results.sequence
    gallery = results.is_gallery if results.is_gallery is not None else np.ones(results.index.size, dtype=bool)
    out: dict[int, list[tuple[int, float, int]]] = {}
    for row in rows:
        q = int(results.query[row])
        qpos = int(np.searchsorted(results.index, q))
        s = int(seq[qpos])
        if s < 0:
            continue
        same = np.flatnonzero((seq == s) & gallery & (results.index != q))
        if same.size == 0:
            continue
        xq = x[pos[q]]
        items = results.index[same]
        xg = x[[pos[int(i)] for i in items]]
        if results.metric == "cosine":
            scores = (xg @ xq).tolist()
        else:
            scores = (-((xg - xq) ** 2).sum(1)).tolist()
        shown = results.scores[row]
        shown = shown[np.isfinite(shown)]
        last = float(shown[-1]) if shown.size else -math.inf
        keep = [(int(i), float(sc), int((shown > sc).sum())) for i, sc in zip(items, scores) if sc >= last]
        if keep:
            out[int(row)] = sorted(keep, key=lambda t: (t[2], -t[1], t[0]))
    return out


def label_text(results: RetrievalResults, position: int) -> str:
    """The class name of the item at ``position`` (its label set's names joined by `` + ``)."""
    label = results.labels[position]
    if np.ndim(label) == 0:
        return results.class_name(int(label))
    return " + ".join(results.class_name(int(c)) for c in label if c >= 0)


def report_data(
    results: RetrievalResults,
    *,
    queries: int | None = 500,
    by: str = "ap",
    per_page: int = 50,
    recall_at: Sequence[int] = (1, 2, 4, 8),
    confused: int = 20,
    embeddings: torch.Tensor | None = None,
    embedding_indices: torch.Tensor | None = None,
    title: str = "Retrieval report",
    source: dict[str, Any] | None = None,
    metrics: dict[str, float] | None = None,
    operating_point: dict[str, Any] | None = None,
) -> tuple[dict[str, Any], list[dict[str, Any]], set[int]]:
    """``(summary, pages, items)``: the page's data without thumbnails (``items``: every item index the page
    shows). ``queries``: the worst queries shown (None: every query), ordered by ``by``
    (:meth:`RetrievalResults.worst`). ``metrics``: the model's evaluation metrics (:func:`page_metrics`).
    ``operating_point``: ``{"target", "threshold", "fmr", "fnmr"}`` marked on the histograms and the DET curve
    (default: the one ``results.extra`` keeps, if any)."""
    if per_page < 1:
        raise ValueError(f"per_page must be >= 1, got {per_page}")
    n_queries = results.query.size
    shown = results.worst(n_queries if queries is None else int(queries), by=by)
    ignored = ignored_neighbors(results, shown, embeddings, embedding_indices)
    items: set[int] = set()
    rows = []
    for row in shown.tolist():
        q = int(results.query[row])
        items.add(q)
        hits = []
        for j, (nb, score, rel) in enumerate(zip(results.neighbors[row], results.scores[row], results.relevant[row])):
            for g, gscore, _ in (t for t in ignored.get(row, []) if t[2] == j):
                hits.append([g, gscore, IGNORED, None])
                items.add(g)
            if nb < 0:
                continue
            hits.append([int(nb), float(score), RELEVANT if rel else IRRELEVANT, j + 1])
            items.add(int(nb))
        for g, gscore, _ in (t for t in ignored.get(row, []) if t[2] >= results.neighbors.shape[1]):
            hits.append([g, gscore, IGNORED, None])
            items.add(g)
        rows.append({
            "q": q, "ap": _finite(results.average_precision[row]), "apr": _finite(results.average_precision_at_r[row]),
            "r": int(results.num_relevant[row]), "first": int(results.first_relevant_rank[row]), "hits": hits,
        })
    pages = [{"rows": rows[i : i + per_page]} for i in range(0, len(rows), per_page)] or [{"rows": []}]

    pairs = []
    for pair in results.confused_pairs(confused):
        examples = []
        for qrow, col in pair["examples"]:
            a, b = int(results.query[qrow]), int(results.neighbors[qrow, col])
            items.update((a, b))
            examples.append([a, b, float(results.scores[qrow, col])])
        pairs.append({
            "a": pair["query_class"], "an": results.class_name(pair["query_class"]), "b": pair["neighbor_class"],
            "bn": results.class_name(pair["neighbor_class"]), "count": pair["count"], "examples": examples,
        })
    per_class = [[c["class"], c["name"], c["queries"], c["items"], c["recall@1"], c["map@r"]]
                 for c in results.per_class()]
    overall, categories = page_metrics(results, recall_at, metrics)
    ks = recall_curve_ks(results)
    gallery = int(results.is_gallery.sum()) if results.is_gallery is not None else int(results.index.size)
    summary = {
        "title": title,
        "source": source or {},
        "metric": results.metric,
        "counts": {"items": int(results.index.size), "queries": int(n_queries), "gallery": gallery,
                   "shown": len(rows), "classes": len(per_class)},
        "by": by,
        "per_page": per_page,
        "pages": len(pages),
        "metrics": [[name, _finite(value)] for name, value in overall.items()],
        "categories": categories,
        "curve": [[k, results.recall_at(k)] for k in ks],
        "per_class": per_class,
        "confused": pairs,
        "histogram": results.pair_histogram,
        "det": det_curve(results.pair_histogram),
        "operating_point": operating_point if operating_point is not None else results.extra.get("operating_point"),
    }
    return summary, pages, items


def write_report(
    results: RetrievalResults,
    out: str | os.PathLike,
    *,
    images: ImageSource | None = None,
    queries: int | None = 500,
    by: str = "ap",
    per_page: int = 50,
    recall_at: Sequence[int] = (1, 2, 4, 8),
    confused: int = 20,
    embeddings: torch.Tensor | None = None,
    embedding_indices: torch.Tensor | None = None,
    thumb_size: int = 96,
    thumb_format: str = "webp",
    title: str = "Retrieval report",
    source: dict[str, Any] | None = None,
    save_results: bool = True,
    overwrite: bool = False,
    metrics: dict[str, float] | None = None,
    operating_point: dict[str, Any] | None = None,
) -> Report:
    """Write the report of ``results`` into the folder ``out`` (created; the page and data files are replaced,
    the thumbnails kept and reused). ``out`` must be new, empty or an earlier report unless ``overwrite``
    (:func:`~lightning_dml.report.folder.claim_report_folder`); every file is written atomically, and the folder is
    locked while it is written (``.report.lock``): a second run into the same folder waits for the first.

    Args:
        results: the retrieval results (with :attr:`~RetrievalResults.pair_histogram` for the histograms).
        out: the report folder.
        images: where the items' images come from (:func:`~lightning_dml.report.image_source`); None: the page
            shows each item's label in place of its image.
        queries: how many of the worst queries get a row (None: every query).
        by: the order of the rows, ``"ap"`` or ``"first_relevant_rank"`` (:meth:`RetrievalResults.worst`).
        per_page: rows per page.
        recall_at: the K of the metrics table's Recall@K.
        confused: the number of most confused class pairs shown.
        embeddings, embedding_indices: the embeddings (and their item indices) the results came from: with
            sequences, the ignored same-sequence items that would rank in a row are shown (grey).
        thumb_size, thumb_format: the thumbnails' longer side in pixels and their format.
        title: the page's title.
        source: what the report was made from (shown in the page's header), e.g. ``{"predictions": path}``.
        save_results: also write ``results.npz``.
        overwrite: write into a folder that is not empty and not a report (replacing files of the report's names).
        metrics: the model's evaluation metrics, as ``lightning-dml test`` computes them
            (:func:`~lightning_dml.report.evaluation.evaluate_predictions`; with ``category/<name>/<metric>`` keys):
            shown with those of :func:`report_metrics`, and kept in ``results.npz`` (``results.extra["metrics"]``)
            for a rebuild from it. ``None``: those ``results`` keep, if any.
        operating_point: a match threshold and its rates on these pairs, ``{"target", "threshold", "fmr",
            "fnmr"}`` (``lightning-dml report --fmr``: :func:`lightning_dml.index.calibrate.pair_threshold`), marked
            on the pair-score histograms and the DET curve, and kept in ``results.npz``
            (``results.extra["operating_point"]``). ``None``: the one ``results`` keep, if any.
    """
    check_report_folder(out, overwrite, option="overwrite=True")
    summary, pages, items = report_data(
        results, queries=queries, by=by, per_page=per_page, recall_at=recall_at, confused=confused,
        embeddings=embeddings, embedding_indices=embedding_indices, title=title, source=source, metrics=metrics,
        operating_point=operating_point,
    )
    if metrics is not None:
        results.extra["metrics"] = {k: float(v) for k, v in metrics.items()}
    if operating_point is not None:
        results.extra["operating_point"] = dict(operating_point)
    Path(out).mkdir(parents=True, exist_ok=True)
    with FileLock(str(Path(out) / LOCK)):  # two runs into one folder write one after the other
        folder = claim_report_folder(out, overwrite, option="overwrite=True")
        (folder / "data").mkdir(parents=True, exist_ok=True)
        thumbs: dict[int, Path | None] = {}
        writer = ThumbnailWriter(folder / "thumbs", size=thumb_size, fmt=thumb_format)
        if images is not None:
            thumbs = writer.write(images, sorted(items))

        def item(i: int) -> list[Any]:
            pos = int(np.searchsorted(results.index, i))
            name = images.name(i) if images is not None else (
                Path(results.paths[pos]).name if results.paths is not None else f"item {i}")
            thumb = thumbs.get(i)
            return [label_text(results, pos), name, None if thumb is None else thumb.relative_to(folder).as_posix()]

        if save_results:  # first: the source of truth, from which `lightning-dml report --results` rebuilds the rest
            with atomic_path(folder / "results.npz", fsync=True) as temporary:
                results.save(temporary)
        for n, page in enumerate(pages):
            needed = {r["q"] for r in page["rows"]} | {h[0] for r in page["rows"] for h in r["hits"]}
            page["items"] = {str(i): item(i) for i in sorted(needed)}
            write_text_atomic(folder / "data" / f"queries-{n:05d}.js", _js("DMLReport.page", n, page))
        examples = {e for p in summary["confused"] for ex in p["examples"] for e in ex[:2]}
        summary["items"] = {str(i): item(int(i)) for i in sorted(examples)}
        summary["images"] = images is not None
        write_text_atomic(folder / "data" / "summary.js", _js("DMLReport.summary", summary))
        for old in (folder / "data").glob("queries-*.js"):  # a previous report's pages beyond this one's
            number = re.fullmatch(r"queries-(\d+)\.js", old.name)
            if number is not None and int(number.group(1)) >= len(pages):
                old.unlink(missing_ok=True)
        for name in ("index.html", "report.css", "report.js"):
            with atomic_path(folder / name) as temporary:
                shutil.copyfile(ASSETS / name, temporary)
        return Report(
            folder=folder, index=folder / "index.html", queries=summary["counts"]["shown"], pages=len(pages),
            thumbnails_written=writer.written, thumbnails_reused=writer.reused, unreadable=list(writer.failed),
            metrics={name: math.nan if value is None else value for name, value in summary["metrics"]},
        )
