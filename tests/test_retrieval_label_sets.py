"""RetrievalResults' per-class views with label sets that repeat a label (issue 26 s.4), and its atomic save.

A label written twice in one label set (``[0, 0]``) is one class of the item: ``per_class()`` counted such a query
twice under its class (class 0 of ``[[0, 0], [0, -1], [1, -1]]``: 3 queries instead of 2), its items twice, and
``confused_pairs()`` counted one confusion twice. Checked against a brute force written from the docstrings.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from lightning_dml.retrieval import RetrievalResults
from tests.test_metrics_tasks import _task_data


def _classes(row: np.ndarray) -> set[int]:
    return {int(v) for v in np.atleast_1d(row) if int(v) >= 0}


def _brute_per_class(res: RetrievalResults) -> list[dict]:
    q_labels = res.query_labels()
    out = []
    for c in sorted(set().union(*(_classes(r) for r in q_labels))):
        mine = [q for q in range(res.query.size) if c in _classes(q_labels[q])]
        with_r = [q for q in mine if res.num_relevant[q] > 0]
        out.append({
            "class": c, "name": res.class_name(c), "queries": len(mine),
            "items": sum(c in _classes(r) for r in res.labels),
            "recall@1": float(np.mean([res.first_relevant_rank[q] == 0 for q in mine])),
            "map@r": float(np.mean([res.average_precision_at_r[q] for q in with_r])) if with_r else None,
        })
    return out


def _brute_confused(res: RetrievalResults) -> dict[tuple[int, int], int]:
    q_labels = res.query_labels()
    k = res.neighbors.shape[1]
    counts: dict[tuple[int, int], int] = {}
    for q in range(res.query.size):
        first = res.first_relevant_rank[q] if res.first_relevant_rank[q] >= 0 else k
        for col in range(min(first, k)):
            nb = res.neighbors[q, col]
            if nb < 0 or res.relevant[q, col]:
                continue
            nb_labels = res.labels[int(np.searchsorted(res.index, nb))]
            for a in _classes(q_labels[q]):
                for b in _classes(nb_labels):
                    counts[(a, b)] = counts.get((a, b), 0) + 1
    return counts


def _check(res: RetrievalResults) -> None:
    got = res.per_class()
    want = _brute_per_class(res)
    assert [r["class"] for r in got] == [r["class"] for r in want]
    for g, w in zip(got, want):
        for key in ("class", "name", "queries", "items"):
            assert g[key] == w[key], (g, w)
        assert g["recall@1"] == pytest.approx(w["recall@1"], abs=1e-12)
        assert (g["map@r"] is None) == (w["map@r"] is None)
        if w["map@r"] is not None:
            assert g["map@r"] == pytest.approx(w["map@r"], abs=1e-12)
    pairs = res.confused_pairs(10_000)
    assert {(p["query_class"], p["neighbor_class"]): p["count"] for p in pairs} == _brute_confused(res)
    for p in pairs:
        for row, col in p["examples"]:
            assert p["query_class"] in _classes(res.query_labels()[row])
            assert p["neighbor_class"] in _classes(res.labels[int(np.searchsorted(res.index, res.neighbors[row, col]))])


def test_a_label_repeated_in_a_set_counts_once_on_the_issue_example() -> None:
    x = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.7, 0.7]])
    sets = torch.tensor([[0, 0], [0, -1], [1, -1]])
    res = RetrievalResults.compute(x, sets, top_k=2)
    table = {row["class"]: row for row in res.per_class()}
    assert table[0]["queries"] == 2 and table[0]["items"] == 2
    assert table[1]["queries"] == 1 and table[1]["items"] == 1
    _check(res)


@pytest.mark.parametrize("query_gallery", [False, True])
def test_per_class_and_confused_pairs_equal_the_brute_force_with_repeated_labels(query_gallery: bool) -> None:
    x, sets, _, _ = _task_data(n=90, classes=8, seed=4, sets=True)
    sets = sets.clone()
    sets[::4, 1] = sets[::4, 0]  # a quarter of the sets repeat their label
    qm = gm = None
    if query_gallery:
        g = torch.Generator().manual_seed(2)
        qm = torch.rand(90, generator=g) < 0.5
        gm = (torch.rand(90, generator=g) < 0.7) | ~qm
    _check(RetrievalResults.compute(x, sets, top_k=6, query_mask=qm, gallery_mask=gm))


def test_save_is_atomic_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    x, y, _, _ = _task_data(n=40, classes=5, seed=6)
    res = RetrievalResults.compute(x, y, top_k=3)
    path = res.save(tmp_path / "results.npz")
    before = path.read_bytes()

    def killed(file, *args, **kwargs):  # writes part of a file, then the process is interrupted
        with open(file, "wb") as handle:
            handle.write(b"PK\x03\x04 half a zip")
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez_compressed", killed)
    with pytest.raises(KeyboardInterrupt):
        res.save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.npz"]  # no temporary file left behind
    back = RetrievalResults.load(path)
    np.testing.assert_array_equal(back.neighbors, res.neighbors)
    # a successful save replaces it
    res.extra["note"] = "second"
    res.save(path)
    assert RetrievalResults.load(path).extra == {"note": "second"}
