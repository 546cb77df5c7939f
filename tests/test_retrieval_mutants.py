"""RetrievalResults' views and the pair-score histogram (lightning_dml/retrieval/): the cases the mutation check
(issue 26, docs/testing.md) found untested, against loop references: every row of ``per_class``, ``worst`` and
``confused_pairs`` (order and examples included), the histogram's row chunks, range and edges, tiny and
degenerate sets, defaults and the file format."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from lightning_dml.retrieval import RetrievalResults, pair_score_histogram
from lightning_dml.retrieval import histogram as H


def _data(n: int = 48, classes: int = 7, seed: int = 0, sets: bool = False):
    """Clustered embeddings; classes of one and two items (R = 0 and R = 1); label sets without a repeated label,
    some with padding (-1), one item relevant to nothing."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    y[0], y[1], y[2] = 50, 60, 60  # a class of one item, a class of two
    centres = torch.randn(61, 6, generator=g)
    x = centres[y] + 0.9 * torch.randn(n, 6, generator=g)
    if not sets:
        return x, y
    second = (y + 1 + torch.randint(0, classes - 1, (n,), generator=g)) % 61
    keep = torch.rand(n, generator=g) < 0.5
    labels = torch.stack([y, torch.where(keep, second, torch.full_like(y, -1))], 1)
    labels[3] = -1
    labels[4] = torch.tensor([-1, int(y[4])])  # padding first
    return x, labels


def _sets(labels: np.ndarray, row: int) -> list[int]:
    lab = labels[row]
    return [int(lab)] if np.ndim(lab) == 0 else [int(v) for v in lab if v >= 0]


# --------------------------------------------------------------------------------------------- views
@pytest.mark.parametrize("sets", [False, True], ids=["labels", "label-sets"])
def test_per_class_equals_a_loop_reference(sets) -> None:
    x, labels = _data(sets=sets)
    res = RetrievalResults.compute(x, labels, top_k=4)
    lab = res.labels
    q_rows = {}
    for row, q in enumerate(res.query.tolist()):
        for c in _sets(lab, int(np.searchsorted(res.index, q))):
            q_rows.setdefault(c, []).append(row)
    want = []
    for c in sorted(q_rows):
        rows = q_rows[c]
        with_r = [r for r in rows if res.num_relevant[r] > 0]
        want.append({
            "class": c, "name": str(c), "queries": len(rows),
            "items": sum(c in _sets(lab, i) for i in range(lab.shape[0])),
            "recall@1": float(np.mean([res.first_relevant_rank[r] == 0 for r in rows])),
            "map@r": float(np.mean([res.average_precision_at_r[r] for r in with_r])) if with_r else None,
        })
    got = res.per_class()
    assert [row["class"] for row in got] == [row["class"] for row in want]
    for g, w in zip(got, want):
        assert g == pytest.approx(w, abs=1e-15), w["class"]
    assert any(w["queries"] == 2 for w in want) and any(w["map@r"] is None for w in want)


def test_class_names_cover_every_id_and_only_those() -> None:
    res = RetrievalResults.compute(*_data(n=12, classes=3), top_k=2, class_names=["a", "b"])
    assert [res.class_name(c) for c in (-1, 0, 1, 2, 3)] == ["-1", "a", "b", "2", "3"]


@pytest.mark.parametrize("by", ["ap", "first_relevant_rank"])
def test_worst_equals_a_loop_reference_and_defaults_to_20(by) -> None:
    x, labels = _data(n=40)
    res = RetrievalResults.compute(x, labels, top_k=3)
    rows = range(res.query.size)
    if by == "ap":
        keyed = [(float(res.average_precision[r]), int(res.query[r]), r) for r in rows if res.num_relevant[r] > 0]
    else:
        keyed = [(-(math.inf if res.first_relevant_rank[r] < 0 else float(res.first_relevant_rank[r])),
                  int(res.query[r]), r) for r in rows]
    want = [r for *_, r in sorted(keyed)]
    assert res.worst(len(want) + 5, by=by).tolist() == want
    assert res.worst(by=by).tolist() == want[:20]
    assert res.worst(0, by=by).tolist() == [] and res.worst(-3, by=by).tolist() == []


def _ref_confused(res: RetrievalResults) -> list[dict]:
    k = res.neighbors.shape[1]
    found: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for row, q in enumerate(res.query.tolist()):
        first = res.first_relevant_rank[row]
        stop = k if first < 0 else min(int(first), k)
        for col in range(stop):
            nb = int(res.neighbors[row, col])
            if nb < 0 or res.relevant[row, col]:
                continue
            for a in _sets(res.labels, int(np.searchsorted(res.index, q))):
                for b in _sets(res.labels, int(np.searchsorted(res.index, nb))):
                    found.setdefault((a, b), []).append((row, col))
    ranked = sorted(found.items(), key=lambda kv: (-len(kv[1]), kv[0]))
    return [{"query_class": a, "neighbor_class": b, "count": len(ex), "examples": ex[:5]} for (a, b), ex in ranked]


@pytest.mark.parametrize("sets", [False, True], ids=["labels", "label-sets"])
def test_confused_pairs_equal_a_loop_reference(sets) -> None:
    """Every pair, its count, the order (count, then query class, then neighbour class) and the examples."""
    x, labels = _data(n=60, classes=7, seed=2, sets=sets)
    res = RetrievalResults.compute(x, labels, top_k=6, indices=torch.arange(60) + 7)
    want = _ref_confused(res)
    assert len(want) > 21 and len({w["count"] for w in want}) < len(want)  # past the default 20; ties to order
    assert res.confused_pairs(1000) == want
    assert res.confused_pairs() == want[:20]
    assert res.confused_pairs(3) == want[:3]
    assert res.confused_pairs(0) == [] and res.confused_pairs(-3) == []


def test_views_of_a_one_item_set() -> None:
    """One item: no gallery item for its query (padding only); the views still answer."""
    res = RetrievalResults.compute(torch.randn(1, 3), torch.tensor([4]), top_k=2)
    assert res.neighbors.tolist() == [[-1, -1]]
    assert res.confused_pairs() == []
    assert res.per_class() == [{"class": 4, "name": "4", "queries": 1, "items": 1, "recall@1": 0.0, "map@r": None}]


def test_compute_defaults_to_top_10() -> None:
    x, y = _data(n=30)
    assert RetrievalResults.compute(x, y).neighbors.shape == (30, 10)


def test_from_predictions_defaults_and_small_files(tmp_path) -> None:
    x, y = _data(n=14)
    torch.save({"embeddings": x, "labels": y, "indices": torch.arange(14), "paths": None, "checkpoint": None},
               tmp_path / "p.pt")
    assert RetrievalResults.from_predictions(tmp_path / "p.pt").neighbors.shape == (14, 10)
    one = {"embeddings": x[:1], "labels": y[:1], "indices": torch.arange(1)}
    assert RetrievalResults.from_predictions(one, top_k=2).neighbors.tolist() == [[-1, -1]]
    with pytest.raises(ValueError, match="hold no item"):
        RetrievalResults.from_predictions({"embeddings": torch.zeros(0, 3), "labels": torch.zeros(0, dtype=torch.long),
                                           "indices": torch.zeros(0, dtype=torch.long)})


def test_compute_passes_only_the_search_options_to_the_histogram() -> None:
    """Options of retrieval_stats that the histogram does not take (``rank_ks``) stay with the search; the tile
    options reach both (the counts do not depend on them)."""
    x, y = _data(n=30)
    res = RetrievalResults.compute(x, y, top_k=3, pair_histogram_bins=5, rank_ks=(1, 2), query_block=7)
    assert res.pair_histogram == pair_score_histogram(x, y, bins=5)


def test_a_format_1_file_still_loads(tmp_path) -> None:
    """Files written by this format version (1) load; the version is part of the file format, not an internal."""
    res = RetrievalResults.compute(*_data(n=10), top_k=2)
    path = res.save(tmp_path / "r.npz")
    with np.load(path) as data:
        arrays = {k: data[k] for k in data.files}
    meta = json.loads(str(arrays["meta"]))
    assert meta["format"] == 1
    np.savez(tmp_path / "v1.npz", **arrays)
    np.testing.assert_array_equal(RetrievalResults.load(tmp_path / "v1.npz").neighbors, res.neighbors)


# --------------------------------------------------------------------------------------------- histogram
def _brute_hist(x, labels, bins, low, high, metric="cosine"):
    x64 = x.double()
    if metric == "cosine":
        x64 = torch.nn.functional.normalize(x64, dim=1)
        s = x64 @ x64.T
    else:
        s = -((x64[:, None, :] - x64[None, :, :]) ** 2).sum(-1)
    lab = labels if labels.ndim == 2 else labels[:, None]
    pos, neg = [0] * bins, [0] * bins
    width = (high - low) / bins
    for q in range(x.shape[0]):
        for g in range(x.shape[0]):
            if g != q:
                b = min(bins - 1, max(0, math.floor((float(s[q, g]) - low) / width)))
                a, c = set(lab[q].tolist()) - {-1}, set(lab[g].tolist()) - {-1}
                (pos if a & c else neg)[b] += 1
    return pos, neg


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_histogram_row_chunks(monkeypatch, precision) -> None:
    """Tiles of more query rows than the bin computation's chunk (``_ROWS``, 256 in use; 5 here): every chunk's
    pairs, bounds, exact re-scores and positives are its own; on-edge scores (multiples of 1/4) force re-scores."""
    g = torch.Generator().manual_seed(3)
    x = 0.5 * (torch.randint(0, 2, (37, 4), generator=g).double() * 2 - 1)
    x[20:] = torch.randn(17, 4, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (37,), generator=g)
    want = _brute_hist(x.float(), y, 8, -1.0, 1.0)
    monkeypatch.setattr(H, "_ROWS", 5)
    h = pair_score_histogram(x.float(), y, bins=8, precision=precision)
    assert (h["positive"], h["negative"]) == want
    # tiles of more rows (30 queries) than columns (7 gallery items)
    qm = torch.arange(37) < 30
    h = pair_score_histogram(x.float(), y, query_mask=qm, gallery_mask=~qm, bins=8, precision=precision)
    monkeypatch.setattr(H, "_ROWS", 256)
    assert h == pair_score_histogram(x.float(), y, query_mask=qm, gallery_mask=~qm, bins=8, precision="fp32")
    assert sum(h["positive"]) + sum(h["negative"]) == 30 * 7


def test_histogram_one_bin_and_scores_past_minus_one() -> None:
    """``bins=1`` is allowed (every pair in it); antipodal vectors whose float64 cosine is -1 - 2^-52 (|x|^2 = 3:
    sqrt(3)^2 < 3) fall in the first bin."""
    x = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0], [0.0, 1.0, 0.0]])
    y = torch.tensor([0, 1, 0])
    one = pair_score_histogram(x, y, bins=1)
    assert one == {"edges": [-1.0, 1.0], "positive": [2], "negative": [4]}
    h = pair_score_histogram(x, y, bins=4)
    assert (h["positive"], h["negative"]) == _brute_hist(x, y, 4, -1.0, 1.0) == ([0, 0, 0, 2], [4, 0, 0, 0])


def test_euclidean_range_and_edges() -> None:
    """The documented range [-(2 max |x|)^2, 0] (to rounding), equal-width edges, the last one 0."""
    x, labels = _data(n=20, sets=True)
    x = 3.0 * x
    h = pair_score_histogram(x, labels, metric="euclidean", bins=6)
    low = -(2.0 * float(x.double().norm(dim=1).max())) ** 2
    edges = h["edges"]
    assert edges[0] == pytest.approx(low, rel=1e-9)
    width = -edges[0] / 6
    assert edges[:-1] == pytest.approx([edges[0] + j * width for j in range(6)], rel=1e-12)
    assert edges[-1] == 0.0
    assert (h["positive"], h["negative"]) == _brute_hist(x, labels, 6, edges[0], 0.0, "euclidean")


def test_euclidean_all_zero_embeddings() -> None:
    """All scores 0 (no spread): the range falls back to [-1, 0], every pair in the last bin."""
    h = pair_score_histogram(torch.zeros(4, 3), torch.tensor([0, 0, 1, 1]), metric="euclidean", bins=3)
    assert h["edges"] == pytest.approx([-1.0, -2 / 3, -1 / 3, 0.0], abs=1e-15)
    assert h["positive"] == [0, 0, 4] and h["negative"] == [0, 0, 8]


def test_distributed_flag_in_a_single_process() -> None:
    """``distributed=True`` without an initialised process group (one process): the plain counts."""
    x, y = _data(n=20)
    assert pair_score_histogram(x, y, bins=5, distributed=True) == pair_score_histogram(x, y, bins=5)


def test_means_leave_out_queries_without_a_relevant_item_as_the_metrics_do() -> None:
    """A class of one item (R = 0: NaN per-query values) and top_k = 1, the smallest allowed."""
    from lightning_dml.metrics import RetrievalMetrics

    x, y = _data(n=30)
    res = RetrievalResults.compute(x, y, top_k=1, pair_histogram_bins=1)
    assert (res.num_relevant == 0).any() and res.neighbors.shape == (30, 1)
    m = RetrievalMetrics(clustering=False, recall_at=(1, 2), metrics=["map"])
    m.update(x, y)
    figures = m.compute()
    assert res.r_precision_mean() == figures["r_precision"]
    assert res.map_at_r() == figures["map@r"] and res.mean_average_precision() == figures["map"]
    assert res.recall_at(1) == figures["recall@1"] and res.recall_at(2) == figures["recall@2"]
    assert res.pair_histogram == {"edges": [-1.0, 1.0], "positive": [int(res.num_relevant.sum())],
                                  "negative": [30 * 29 - int(res.num_relevant.sum())]}


def test_load_refuses_a_file_with_pickled_objects(tmp_path) -> None:
    """A results file may come from anyone: an object array (unpickled code) is refused, never loaded."""
    res = RetrievalResults.compute(*_data(n=10), top_k=2)
    with np.load(res.save(tmp_path / "r.npz")) as data:
        arrays = {k: data[k] for k in data.files}
    arrays["paths"] = np.array([{"not": "data"}], dtype=object)
    np.savez(tmp_path / "evil.npz", **arrays)
    with pytest.raises(ValueError, match="pickle"):
        RetrievalResults.load(tmp_path / "evil.npz")


def test_histogram_checks_its_inputs_by_default() -> None:
    """Bad input is one clear ValueError naming it (validate=True is the default), never silent counts."""
    x, y = _data(n=6)
    with pytest.raises(ValueError, match="labels has 5 entries"):
        pair_score_histogram(x, y[:5], bins=2)
    with pytest.raises(ValueError, match="integer"):
        pair_score_histogram(x, y.float(), bins=2)


def test_pairs_on_an_edge_that_the_approximate_pass_may_put_on_either_side() -> None:
    """Unit vectors 60 and 120 degrees apart at random angles: cosines +-0.5 are edges of 8 bins, and the bf16 /
    tf32 approximate scores fall on either side of them. Every pair is in the bin of its exact float64 score (the
    engine's ``scorer.exact``, the reference the histogram promises), for every precision."""
    g = torch.Generator().manual_seed(0)
    theta = torch.rand(40, generator=g, dtype=torch.float64) * 2 * math.pi
    ang = torch.cat([theta, theta + math.pi / 3, theta + 2 * math.pi / 3])
    x = torch.stack([torch.cos(ang), torch.sin(ang)], 1).float()
    y = torch.arange(120) % 7
    from lightning_dml.metrics import functional as MF

    task, scorer, _ = MF.build_search(MF.prepare(x, y), metric="cosine", precision="fp32")
    qi, gi = torch.arange(120).repeat_interleave(120), torch.arange(120).repeat(120)
    keep = qi != gi
    s = scorer.exact(task.q_items[qi[keep]], task.g_items[gi[keep]])
    assert int(((s.abs() - 0.5).abs() < 1e-6).sum()) >= 200  # many pairs on an edge
    total = torch.bincount(torch.floor((s + 1.0) / 0.25).clamp(0, 7).long(), minlength=8).tolist()
    for precision in ("bf16", "tf32", "fp32"):
        h = pair_score_histogram(x, y, bins=8, precision=precision)
        assert [p + q for p, q in zip(h["positive"], h["negative"])] == total, precision
