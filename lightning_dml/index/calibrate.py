"""Calibrated match thresholds: ``lightning-dml index calibrate`` and the ``match`` flag of ``search`` and ``serve``.

**Definition** (the ``fnmr@fmr`` metric's, :mod:`lightning_dml.metrics.functional`, computed by its exact engine:
:func:`~lightning_dml.metrics.functional.retrieval_stats` with the metric ``fnmr@fmr=F``). Over ALL ordered pairs
``(a, b)``, ``a != b``, of a labelled set (the metrics' all-vs-all mode: an item is never paired with itself), a
pair is positive when the labels are equal, else negative. A pair is a **match** when its score is **strictly
greater** than the threshold ``theta`` (``score > theta``, the metric's convention). For a target false match rate
``F`` (read exactly as the decimal written: :func:`~lightning_dml.metrics.functional.exact_rate`), ``theta`` is the
``(floor(F x negatives) + 1)``-th largest negative score: the smallest threshold, among the negative scores, that
accepts at most ``floor(F x negatives)`` negative pairs, so the achieved FMR (negatives ``> theta`` over all
negatives) is at most ``F`` and is the largest FMR at most ``F`` that a threshold can give; the FNMR is the
positives ``<= theta`` over all positives. Everything is exact (float64 scores, equal to a brute force), and the
engine gives the same result under DDP by its own contract (``calibrate`` itself runs in one process).

**Scores** are those of the index (:class:`~lightning_dml.index.EmbeddingIndex`): the vectors in the form the index
stores them (L2-normalised in float32 for ``cosine``, raw for ``euclidean``), scored in float64 by the exact engine
(:meth:`Scorer.exact` of :func:`~lightning_dml.metrics.functional.build_search`): the cosine similarity or the
negated squared Euclidean distance. The labelled items are embedded with the index's exported model, as ``search``
embeds its queries (or read from a ``lightning-dml predict`` file of the index's checkpoint).

**Stored** in the index manifest (``calibration``, :mod:`~lightning_dml.index.manifest`) under the folder's lock
(:mod:`lightning_dml.index.folder`: the folder is written whole and swapped in): the threshold and its rule, the
target, the achieved FMR and FNMR, the pair counts, the labelled data's identity (path, item count, the sha256 of
a file source, and of the listing ``path, size, mtime_ns`` of its images) and the sha256 of the checkpoint it was
computed with. A gallery in a Milvus collection (``--store milvus --uri URI``, :mod:`lightning_dml.index.milvus`)
keeps the same calibration in its manifest, a collection property (read again and written back by
:meth:`~lightning_dml.index.milvus.MilvusIndex.update_manifest`; Milvus has no lock). ``search`` and ``serve`` then
add ``"match": true|false`` to each result, from the exact float64 score of the query and the stored vector
(:func:`match_flags`; not the float32 score faiss returns, nor a re-ranked score), and return only matches on
request (``--matches_only``). A calibration whose checkpoint sha256 is not the index's is refused in one line
(:func:`check_calibration`); ``index build --overwrite`` writes a new manifest without one, and ``index add`` keeps
it (the same model).
"""

from __future__ import annotations

import hashlib
import math
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from lightning_dml.errors import UserInputError
from lightning_dml.index.folder import DEFAULT_LOCK_TIMEOUT, locked
from lightning_dml.index.manifest import IndexFolderError, IndexMismatchError, Manifest

if TYPE_CHECKING:  # torch is imported where it is used: check_calibration serves the torch-free ONNX search
    from torch import Tensor

__all__ = [
    "CalibrationError",
    "CalibrationMismatchError",
    "as_indexed",
    "calibrate_index",
    "check_calibration",
    "fnmr_threshold",
    "labelled_identity",
    "load_labelled",
    "mark_results",
    "match_flags",
    "pair_scores",
    "pair_threshold",
    "parse_rate",
]

#: How a score is compared with the threshold (the ``fnmr@fmr`` metric's convention)
RULE = "score > threshold"


class CalibrationError(UserInputError, ValueError):
    """A calibration that cannot be made as asked: a bad ``--fmr``, a labelled set without positive or negative
    pairs or without labels, or ``--matches_only`` on an index that was not calibrated."""


class CalibrationMismatchError(IndexMismatchError):
    """A stored threshold computed with another checkpoint than the index's."""


# --------------------------------------------------------------------------------------------- functional core
def parse_rate(text: str | float, option: str = "--fmr") -> str:
    """The rate ``text`` (a false match or non-match rate) as the canonical decimal the ``fnmr@fmr`` metric reads
    (``0 < F < 1``); a :class:`CalibrationError` naming ``option`` otherwise."""
    from lightning_dml.metrics.functional import parse_metric

    try:
        name = parse_metric(f"fnmr@fmr={str(text).strip()}")
    except ValueError:
        name = None
    if name is None or name.rate >= 1:
        raise CalibrationError(f"{option} {text!r} must be a number in (0, 1), e.g. {option} 0.001")
    return name.key.split("=", 1)[1]


def as_indexed(embeddings: Tensor, metric: str) -> Tensor:
    """Raw embeddings ``[N, D]`` in the form an index stores its vectors: float32, L2-normalised for ``cosine``
    (as :meth:`~lightning_dml.index.EmbeddingIndex.build` does), unchanged for ``euclidean``."""
    import torch

    x = embeddings.detach().float()
    return torch.nn.functional.normalize(x, dim=1) if metric == "cosine" else x


def pair_threshold(embeddings: Tensor, labels: Tensor, fmr: str | float, metric: str = "cosine",
                   **options: Any) -> dict[str, Any]:
    """The threshold at the false match rate ``fmr`` over all pairs of a labelled set (module docstring), by the
    exact engine (the ``fnmr@fmr`` metric: ``options`` are those of
    :func:`~lightning_dml.metrics.functional.retrieval_stats`, e.g. ``device``, ``distributed``).

    ``embeddings`` are scored as given (pass :func:`as_indexed` vectors for an index's scores); ``labels [N]``
    integer class ids. Returns ``{"threshold", "fmr", "fnmr", "positives", "negatives"}`` (``threshold`` in the
    scores' units); a :class:`CalibrationError` when the set has no positive or no negative pair, or when ``fmr``
    accepts every negative pair (no threshold)."""
    from lightning_dml.metrics.functional import parse_metric, retrieval_stats

    rate = parse_rate(fmr)
    stats = retrieval_stats(embeddings, labels, metric=metric, k=1, rank_ks=(),
                            metrics=[parse_metric(f"fnmr@fmr={rate}")], **options)
    pairs = stats.pairs
    if pairs.positives == 0:
        raise CalibrationError("the labelled set has no positive pair (every label occurs once): the false non-match "
                               "rate cannot be measured; give at least two items of some label")
    if pairs.negatives == 0:
        raise CalibrationError("the labelled set has no negative pair (one label only): the false match rate cannot "
                               "be measured; give items of at least two labels")
    theta = pairs.thresholds[0]
    if not math.isfinite(theta):
        raise CalibrationError(f"--fmr {rate} accepts every one of the {pairs.negatives} negative pairs of the "
                               "labelled set: there is no threshold; give a smaller --fmr")
    return {"threshold": theta / stats.score_scale, "fmr": pairs.fmr[0], "fnmr": pairs.fnmr[0],
            "positives": pairs.positives, "negatives": pairs.negatives}


def fnmr_threshold(embeddings: Tensor, labels: Tensor, fnmr: str | float, metric: str = "cosine",
                   **options: Any) -> dict[str, Any]:
    """The threshold at the target false non-match rate ``fnmr`` over all pairs of a labelled set: the largest
    threshold whose FNMR (positives ``<= theta`` over all positives) is at most ``fnmr`` (so the lowest FMR such a
    threshold gives): with the positive scores ascending ``p_0 <= p_1 <= ...`` and ``m = floor(fnmr x positives)``
    (exact rational arithmetic, as ``fnmr@fmr`` reads its rate), ``theta`` is the float64 number right below
    ``p_m`` (``nextafter(p_m, -inf)``: no score lies between them, so exactly the positives below ``p_m`` are
    rejected). The FMR there counts every negative pair's exact score ``> theta`` without an ``N x N`` matrix: the
    exact engine's approximate tiles (:func:`~lightning_dml.metrics.functional.score_tile`) with their error bound,
    the pairs within the bound of ``theta`` re-scored exactly. ``options``: those of
    :func:`~lightning_dml.metrics.functional.prepare` / ``build_search`` (``indices``, ``query_mask``,
    ``gallery_mask``, ``sequence``, ``device``; ``query_block``, ``gallery_chunk``, ``tile_memory``). Returns what
    :func:`pair_threshold` returns."""
    import torch

    from fractions import Fraction

    from lightning_dml.metrics.functional import build_search, prepare, score_tile

    rate = parse_rate(fnmr, "--fnmr")
    prep = {k: options.pop(k) for k in ("indices", "query_mask", "gallery_mask") if k in options}
    tiles = {k: options.pop(k) for k in ("query_block", "gallery_chunk", "tile_memory") if k in options}
    ps = prepare(embeddings, labels, prep.get("indices"), prep.get("query_mask"), prep.get("gallery_mask"), **options)
    task, scorer, grid = build_search(ps, metric=metric, precision="fp32", **tiles)
    all_rows = torch.arange(task.q_items.numel(), device=task.device)
    owner, gpos = task.positives(all_rows)
    pos = torch.sort(scorer.exact(task.q_items[owner], task.g_items[gpos])).values
    if pos.numel() == 0:
        raise CalibrationError("the labelled set has no positive pair (every label occurs once): the false non-match "
                               "rate cannot be measured; give at least two items of some label")
    m = math.floor(Fraction(rate) * pos.numel())
    theta = math.nextafter(float(pos[m]), -math.inf)
    pairs = above = 0
    ng = task.g_items.numel()
    for b in range(grid.num_blocks(task)):
        rows = grid.block_rows(task, b)
        w = scorer.error_bound(task.q_items[rows], task.g_items).unsqueeze(1)
        for c0 in range(0, ng, grid.gallery_chunk):
            c1 = min(ng, c0 + grid.gallery_chunk)
            a = score_tile(scorer, task, rows, c0, c1).double()
            valid = torch.isfinite(a)
            pairs += int(valid.sum())
            above += int((a > theta + w).sum())
            r, c = (valid & (a >= theta - w) & (a <= theta + w)).nonzero(as_tuple=True)
            if r.numel():
                above += int((scorer.exact(task.q_items[rows[r]], task.g_items[c + c0]) > theta).sum())
    negatives = pairs - pos.numel()
    if negatives == 0:
        raise CalibrationError("the labelled set has no negative pair (one label only): the false match rate cannot "
                               "be measured; give items of at least two labels")
    neg_above = above - int((pos > theta).sum())
    return {"threshold": theta / scorer.score_scale, "fmr": neg_above / negatives,
            "fnmr": int((pos <= theta).sum()) / pos.numel(), "positives": int(pos.numel()), "negatives": negatives}


def pair_scores(queries: Tensor, gallery: Tensor, metric: str = "cosine") -> Tensor:
    """Exact float64 scores ``[P]`` of the pairs ``(queries[i], gallery[i])`` (``[P, D]`` each), by the exact
    engine's scorer (:meth:`Scorer.exact` of :func:`~lightning_dml.metrics.functional.build_search`): bit for bit
    the scores :func:`pair_threshold` ranks (a pair's score does not depend on the other pairs)."""
    import torch

    from lightning_dml.metrics.functional import build_search, prepare

    n = queries.shape[0]
    if n == 0:
        return torch.empty(0, dtype=torch.float64, device=queries.device)
    x = torch.cat([queries.detach().float(), gallery.detach().float().to(queries.device)])
    is_query = torch.zeros(2 * n, dtype=torch.bool, device=x.device)
    is_query[:n] = True
    # every row a label of its own: no relevant pairs listed (one label for all listed all n^2 pairs)
    ps = prepare(x, torch.arange(2 * n, device=x.device), None, is_query, ~is_query)
    _, scorer, _ = build_search(ps, metric=metric, precision="fp32")
    rows = torch.arange(n, device=x.device)
    return scorer.exact(rows, rows + n) / scorer.score_scale


# --------------------------------------------------------------------------------------------- the manifest
def check_calibration(manifest: Manifest, where: str = "") -> dict[str, Any] | None:
    """The manifest's calibration (``None`` when the index was not calibrated); a
    :class:`CalibrationMismatchError` when it was computed with another checkpoint than the index's, an
    :class:`~lightning_dml.index.manifest.IndexFolderError` when it is malformed."""
    cal = manifest.calibration
    if cal is None:
        return None
    folder = where or "the index"
    if not isinstance(cal, dict) or not isinstance(cal.get("threshold"), (int, float)) or isinstance(
            cal.get("threshold"), bool) or not math.isfinite(float(cal["threshold"])):
        raise IndexFolderError(f"{folder}: manifest.json's calibration is malformed (no finite threshold); calibrate "
                               "again (lightning-dml index calibrate)")
    if cal.get("rule", RULE) != RULE or cal.get("metric", manifest.metric) != manifest.metric:
        raise IndexFolderError(f"{folder}: manifest.json's calibration has rule {cal.get('rule')!r} and metric "
                               f"{cal.get('metric')!r}, expected {RULE!r} and {manifest.metric!r}; calibrate again")
    mine = manifest.checkpoint_sha256
    if cal.get("checkpoint_sha256") != mine:
        raise CalibrationMismatchError(
            f"{folder}: its match threshold was calibrated with checkpoint sha256 {cal.get('checkpoint_sha256')}, the "
            f"index holds embeddings of checkpoint sha256 {mine}: a threshold of another model is refused; calibrate "
            "again (lightning-dml index calibrate)"
        )
    return cal


def match_flags(index: Any, queries: Tensor, ids: Tensor) -> Tensor | None:
    """``[Q, k]`` bool: whether each result ``ids[q, j]`` (``-1``: padding, never a match) matches the raw query
    embedding ``queries[q]`` under the index's calibrated threshold (exact score ``>`` threshold, module
    docstring); ``None`` when the index was not calibrated."""
    import torch

    cal = check_calibration(index.manifest, str(getattr(index, "folder", None) or ""))
    if cal is None:
        return None
    out = torch.zeros(ids.shape, dtype=torch.bool)
    ids = ids.detach().cpu()
    q, j = (ids >= 0).nonzero(as_tuple=True)
    if q.numel():
        vectors = index.vectors(ids[q, j])
        query = as_indexed(queries.detach().cpu(), index.metric)[q]
        out[q, j] = pair_scores(query, vectors, index.metric) > float(cal["threshold"])
    return out


def mark_results(index: Any, queries: Tensor, scores: Tensor, ids: Tensor,
                 matches_only: bool = False) -> list[list[dict[str, Any]]]:
    """``index.results(scores, ids)`` with ``"match": true|false`` added to each row of a calibrated index
    (:func:`match_flags`); ``matches_only`` keeps the matching rows only (a :class:`CalibrationError` on an index
    that was not calibrated)."""
    import torch

    flags = match_flags(index, queries, ids)
    if flags is None:
        if matches_only:
            where = getattr(index, "folder", None) or ""
            raise CalibrationError(f"matches_only: the index {where} has no calibrated threshold (lightning-dml index "
                                   "calibrate --index DIR --labelled ... --fmr F)")
        return index.results(scores, ids)
    keep = flags if matches_only else ids.detach().cpu() >= 0
    ids = torch.where(keep.to(ids.device), ids, torch.full_like(ids, -1))
    rows = index.results(scores, ids)
    for q, found in enumerate(rows):
        marks = flags[q][keep[q]].tolist()  # the rows index.results kept, in order
        for row, mark in zip(found, marks):
            row["match"] = bool(mark)
    return rows


# --------------------------------------------------------------------------------------------- labelled data
def labelled_identity(source: str | os.PathLike, paths: list[Path] | None = None) -> dict[str, Any]:
    """What the labelled data was: ``{"path", "items", "sha256"}`` (the file's bytes, for a table or a predictions
    file) and ``"images_sha256"`` (of the lines ``path<TAB>size<TAB>mtime_ns`` of its images, when it names image
    files), so that a later look can tell whether the same data would give the same threshold."""
    from lightning_dml.data.decoded_cache import file_sha256

    path = Path(source).expanduser().absolute()
    out: dict[str, Any] = {"path": str(path)}
    if path.is_file():
        out["sha256"] = file_sha256(path)
    if paths is not None:
        digest = hashlib.sha256()
        for p in paths:
            try:
                st = os.stat(p)
                digest.update(f"{p}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
            except OSError:
                digest.update(f"{p}\t-\t-\n".encode())
        out["images_sha256"] = digest.hexdigest()
    return out


def load_labelled(index: Any, source: str, split: str | None = None) -> tuple[Tensor, Tensor, dict[str, Any]]:
    """``(raw embeddings [N, D], integer labels [N], identity)`` of the labelled set ``source``: a ``lightning-dml
    predict`` file (``.pt``; its checkpoint sha256 must be the index's) or images (a folder of class folders or a
    table with labels) embedded with the index's exported model."""
    import torch

    if str(source).endswith(".pt"):
        from lightning_dml.callbacks.predictions import load_predictions

        try:
            data = load_predictions(source)
        except ValueError as error:
            raise CalibrationError(str(error)) from None
        sha = (data.get("checkpoint") or {}).get("sha256")
        if index.manifest.checkpoint_sha256 is not None and sha is None:
            raise CalibrationMismatchError(f"--labelled {source} records no checkpoint sha256: it cannot be told to "
                                           "come from the index's model; embed the images instead")
        index.check_model(sha, data["embeddings"].shape[1], what=f"the labelled items of {source}")
        labels = data["labels"]
        if labels.ndim != 1:
            raise CalibrationError(f"--labelled {source}: label sets are not supported; give one label per item")
        return data["embeddings"].float(), labels.long(), labelled_identity(source) | {"items": int(labels.numel())}
    from lightning_dml.index.gallery import read_items

    items = read_items(source, split)
    if len(items) == 0:
        raise CalibrationError(f"--labelled {source} holds no image")
    unlabelled = sum(1 for v in items.labels if not v)
    if unlabelled:
        raise CalibrationError(f"--labelled {source}: {unlabelled} of {len(items)} images have no label (a folder of "
                               "class folders, or a table with a label column)")
    names = sorted(set(items.labels))
    labels = torch.tensor([names.index(v) for v in items.labels], dtype=torch.long)
    with torch.no_grad():
        embeddings = index.embed_images(items.paths)
    return embeddings, labels, labelled_identity(source, items.paths) | {"items": len(items)}


def calibrate_index(index_dir: str | os.PathLike, labelled: str, fmr: str | float | None = None, *,
                    fnmr: str | float | None = None, split: str | None = None, device: str = "cpu",
                    lock_timeout: float = DEFAULT_LOCK_TIMEOUT, store: str = "faiss",
                    uri: str | None = None) -> dict[str, Any]:
    """Calibrate the gallery ``index_dir`` at the false match rate ``fmr`` (:func:`pair_threshold`) or at the
    false non-match rate ``fnmr`` (:func:`fnmr_threshold`; one of the two) on the labelled set ``labelled``
    (:func:`load_labelled`) and store the result in its manifest (module docstring); returns the calibration.

    ``store``/``uri`` (:func:`~lightning_dml.index.stores.open_index`): ``faiss``, an index folder, or ``milvus``,
    the collection ``index_dir`` at ``uri``, whose manifest is a collection property
    (:meth:`~lightning_dml.index.milvus.MilvusIndex.update_manifest`; ``lock_timeout`` is the folder's only). The
    labelled items are embedded and the threshold computed without the lock; the manifest is then written under the
    folder's lock (the index loaded again there, and refused when it was rebuilt with another checkpoint meanwhile),
    the folder swapped in whole (:meth:`~lightning_dml.index.EmbeddingIndex.save`); a Milvus manifest is read
    again and refused the same way."""
    from lightning_dml import __version__
    from lightning_dml.index.index import EmbeddingIndex
    from lightning_dml.index.stores import close_index, open_index

    if (fmr is None) == (fnmr is None):
        raise CalibrationError("give one target: --fmr F (false match rate) or --fnmr F (false non-match rate)")
    kind, rate = ("fmr", parse_rate(fmr)) if fmr is not None else ("fnmr", parse_rate(fnmr, "--fnmr"))
    index = open_index(str(index_dir), store, uri, device=device)
    try:
        embeddings, labels, identity = load_labelled(index, labelled, split)
        find = pair_threshold if kind == "fmr" else fnmr_threshold
        found = find(as_indexed(embeddings, index.metric), labels, rate, index.metric)
        sha, metric = index.manifest.checkpoint_sha256, index.metric
        calibration = {
            "threshold": found["threshold"], "rule": RULE, "target": {kind: rate}, "fmr": found["fmr"],
            "fnmr": found["fnmr"], "positives": found["positives"], "negatives": found["negatives"],
            "metric": metric, "checkpoint_sha256": sha, "labelled": identity,
            "computed": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "library": __version__,
        }

        def store_in(manifest: Manifest) -> None:
            if manifest.checkpoint_sha256 != sha or manifest.metric != metric:
                raise CalibrationMismatchError(f"index {index_dir} was rebuilt with another model while it was "
                                               "calibrated (its checkpoint sha256 changed): calibrate again")
            manifest.calibration = calibration

        if store == "milvus":
            index.update_manifest(store_in)
            return calibration
    finally:
        close_index(index)
    with locked(index_dir, lock_timeout, "calibration of the index"):
        current = EmbeddingIndex.load(index_dir)
        store_in(current.manifest)
        current.save(index_dir, lock_timeout=lock_timeout)
    return calibration
