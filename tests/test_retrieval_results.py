"""RetrievalResults (issue 22): per-query results from the exact engine, against a float64 brute force, equal to
RetrievalMetrics (also under 2 gloo processes), saved and loaded, and the views a report uses."""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.retrieval import RetrievalResults
from tests.metrics_reference import brute_task_rankings
from tests.test_metrics_tasks import _task_data

SCRIPT = os.path.join(os.path.dirname(__file__), "distributed", "run_retrieval_results_ddp.py")

CASES = {"plain": {}, "label-sets": {"sets": True}, "sequences": {"seq": True}, "all": {"sets": True, "seq": True, "cat": True}}


def _masks(n: int, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    qm = torch.rand(n, generator=g) < 0.5
    return qm, torch.rand(n, generator=g) < 0.7  # overlapping


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("query_gallery", [False, True], ids=["all-vs-all", "query-gallery"])
def test_results_equal_brute_force_and_the_metrics(case: str, query_gallery: bool) -> None:
    x, labels, seq, cat = _task_data(seed=11, **CASES[case])
    qm, gm = _masks(x.shape[0]) if query_gallery else (None, None)
    res = RetrievalResults.compute(x, labels, top_k=7, query_mask=qm, gallery_mask=gm, sequence=seq, category=cat,
                                   query_block=32, gallery_chunk=50)
    ref = brute_task_rankings(x, labels, "cosine", qm, gm, seq)
    assert res.query.tolist() == [q for q, *_ in ref]
    for row, (q, ranking, rel, r, scores) in enumerate(ref):
        assert res.neighbors[row].tolist() == (ranking + [-1] * 7)[:7], q
        assert res.relevant[row].tolist() == (rel + [False] * 7)[:7]
        np.testing.assert_allclose(res.scores[row][: len(ranking[:7])], scores[:7], rtol=0, atol=1e-12)
        assert int(res.num_relevant[row]) == r
        assert int(res.first_relevant_rank[row]) == (rel.index(True) if any(rel) else -1)
        if r:
            hits = np.cumsum(rel)
            ap = sum(hits[i] / (i + 1) for i in range(len(rel)) if rel[i]) / r
            assert res.average_precision[row] == pytest.approx(ap, abs=1e-12)
        else:
            assert math.isnan(res.average_precision[row]) and math.isnan(res.average_precision_at_r[row])
    m = RetrievalMetrics(clustering=False, recall_at=(1, 2, 4, 8), metrics=["map"])
    m.update(x, labels, query_mask=qm, gallery_mask=gm, sequence=seq, category=cat)
    figures = m.compute()
    for k in (1, 2, 4, 8):
        assert res.recall_at(k) == figures[f"recall@{k}"]
    assert res.map_at_r() == figures["map@r"]
    assert res.mean_average_precision() == figures["map"]


def test_indices_name_the_items_and_paths_follow_them() -> None:
    x, y, _, _ = _task_data(n=60, classes=6, seed=3)
    perm = torch.randperm(60, generator=torch.Generator().manual_seed(1))
    indices = perm + 1000  # any unique indices, arriving in any order
    paths = [f"img_{int(i)}.jpg" for i in indices]
    res = RetrievalResults.compute(x, y, top_k=3, indices=indices, paths=paths)
    plain = RetrievalResults.compute(x[torch.argsort(indices)], y[torch.argsort(indices)], top_k=3)
    assert res.index.tolist() == list(range(1000, 1060))
    assert (res.neighbors - 1000).tolist() == plain.neighbors.tolist()
    assert res.paths == [f"img_{i}.jpg" for i in range(1000, 1060)]
    assert res.labels.tolist() == y[torch.argsort(indices)].tolist()


def test_worst_queries_per_class_and_confused_pairs_on_a_hand_made_set() -> None:
    """Two tight classes 0 and 1 and a class 2 spread between them: class 2's outer items retrieve class 0 and class
    1 first (confused pairs (2, 0) and (2, 1)), its middle item finds its own class."""
    x = torch.tensor([[1.0, 0.0], [0.99, 0.05], [0.0, 1.0], [0.05, 0.99], [0.95, 0.3], [0.3, 0.95], [0.7, 0.7]])
    y = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    res = RetrievalResults.compute(x, y, top_k=3, class_names=["a", "b", "c"])
    rank = res.first_relevant_rank.tolist()
    worst = res.worst(2, by="first_relevant_rank").tolist()
    assert all(rank[w] == max(rank) for w in worst[:1])
    ap_worst = res.worst(3, by="ap")
    assert res.average_precision[ap_worst].tolist() == sorted(res.average_precision[ap_worst].tolist())
    table = {row["name"]: row for row in res.per_class()}
    assert table["c"]["queries"] == 3 and table["c"]["items"] == 3
    for name, c in (("a", 0), ("b", 1), ("c", 2)):
        mine = y.numpy() == c
        assert table[name]["recall@1"] == pytest.approx(np.mean(np.array(rank)[mine] == 0))
    # the loop reference of confused pairs: irrelevant neighbours ahead of the first relevant one, within top k
    expect: dict[tuple[int, int], int] = {}
    for row in range(7):
        first = rank[row] if rank[row] >= 0 else 3
        for col in range(min(first, 3)):
            if not res.relevant[row, col]:
                key = (int(y[row]), int(y[res.neighbors[row, col]]))
                expect[key] = expect.get(key, 0) + 1
    got = {(p["query_class"], p["neighbor_class"]): p["count"] for p in res.confused_pairs(20)}
    assert got == expect and {(2, 0), (2, 1)} <= set(got)
    counts = [p["count"] for p in res.confused_pairs(20)]
    assert counts == sorted(counts, reverse=True)
    for p in res.confused_pairs(20):
        for row, col in p["examples"]:
            assert int(y[row]) == p["query_class"] and int(y[res.neighbors[row, col]]) == p["neighbor_class"]


def test_confused_pairs_with_label_sets_count_every_label_combination() -> None:
    x = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    sets = torch.tensor([[0, 5], [1, -1], [2, -1], [0, -1]])  # query 0's nearest (item 1) shares nothing with it
    res = RetrievalResults.compute(x, sets, top_k=2)
    got = {(p["query_class"], p["neighbor_class"]): p["count"] for p in res.confused_pairs()}
    assert got[(0, 1)] >= 1 and got[(5, 1)] >= 1
    assert {row["class"] for row in res.per_class()} == {0, 1, 2, 5}


def test_save_and_load_round_trip(tmp_path) -> None:
    x, labels, seq, cat = _task_data(seed=12, sets=True, seq=True, cat=True)
    qm, gm = _masks(x.shape[0])
    res = RetrievalResults.compute(x, labels, top_k=4, query_mask=qm, gallery_mask=gm, sequence=seq, category=cat,
                                   paths=[f"p/{i}.png" for i in range(x.shape[0])], category_names=["u", "v", "w"])
    res.extra["checkpoint"] = {"path": "/x.ckpt", "sha256": "ab"}
    path = res.save(tmp_path / "results")
    assert path.name == "results.npz" and path.is_file()
    back = RetrievalResults.load(path)
    for name, value in vars(res).items():
        other = getattr(back, name)
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(other, value)
        else:
            assert other == value, name
    with pytest.raises(ValueError, match="format"):
        data = dict(np.load(path))
        data["meta"] = np.array('{"format": 99}')
        np.savez(tmp_path / "old.npz", **data)
        RetrievalResults.load(tmp_path / "old.npz")


def test_from_a_predictions_file(tmp_path) -> None:
    x, y, _, _ = _task_data(n=80, classes=8, seed=13)
    indices = torch.arange(80).flip(0)
    torch.save({"embeddings": x, "labels": y, "indices": indices, "paths": [f"{i}.jpg" for i in range(80)],
                "checkpoint": None}, tmp_path / "predictions.pt")
    res = RetrievalResults.from_predictions(tmp_path / "predictions.pt", top_k=5)
    direct = RetrievalResults.compute(x, y, top_k=5, indices=indices, paths=[f"{i}.jpg" for i in range(80)])
    np.testing.assert_array_equal(res.neighbors, direct.neighbors)
    assert res.paths == direct.paths
    with pytest.raises(ValueError, match="top_k must be >= 1"):
        RetrievalResults.compute(x, y, top_k=0)


@pytest.mark.slow
def test_results_under_two_gloo_processes_equal_one_process() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "RESULTS-DDP-OK" in proc.stdout
