"""Every metric alone and in combination equals the all-metrics run and the float64 brute force (issue 26 s.4).

The engine computes only what the requested metrics need (the exact first relevant rank only where a K of
Recall@K needs it, every positive's rank only for ``map``, ...). A figure that silently depended on what else was
asked for (``mrr`` was a lower bound unless ``map`` was requested too) is caught here: each metric is run alone,
with every other one, and with all of them, on tie-heavy and clustered data, for single labels, label sets
(with a label repeated inside a set), sequences, categories and query/gallery sets, cosine and Euclidean, single
tiles, row chunks and symmetric tiles, fp32 and bf16 (whose wide error bound leaves many ranks for the exact
pass to settle). Each figure must equal the all-metrics run to the last bit and the brute force of
``tests/metrics_reference.py`` to 1e-12 (the brute force sums in another order).
"""

from __future__ import annotations

import itertools
import math
import os
import subprocess
import sys

import pytest
import torch

from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.metrics import functional as F
from tests.metrics_reference import brute_task_metrics

@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread (as under pytest-xdist): a bf16 product of a tiny tile waits ~15 ms for a second thread
    on a loaded machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: every metric family a user can ask for, as one selectable item each: the K of Recall@K (``recall_at``), MAP@R
#: with R-Precision (``map_at_r``) and the opt-in names (``metrics``); Precision@1 is always reported
ITEMS = ("recall@1", "recall@5", "map@r", "precision@3", "ndcg@4", "mrr", "map", "fnmr@fmr=0.29")


def _options(items: tuple[str, ...]) -> dict:
    return {
        "recall_at": tuple(int(i.split("@")[1]) for i in items if i.startswith("recall@")),
        "map_at_r": "map@r" in items,
        "metrics": tuple(i for i in items if not i.startswith("recall@") and i != "map@r"),
    }


def _tie_data(n: int = 48, d: int = 4, classes: int = 7, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Few classes in few dimensions, every kind of exact tie: exact duplicates with different labels, power-of-two
    scaled copies (a tie under the cosine metric), items on a coarse grid (many equal scores)."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randint(-2, 3, (n, d), generator=g).float()  # a coarse grid: many exactly equal scores
    x[(x == 0).all(dim=1)] = 1.0
    x[5:9] = x[0]  # exact duplicates of item 0, mixed labels
    x[9] = 2.0 * x[1]  # scaled copies: the same direction
    x[10] = 0.5 * x[1]
    x[11:14] = x[20] + 1e-7 * torch.randn(3, d, generator=g)  # near-ties below the bf16 and fp32 error bounds
    y[n - 5] = 99  # a singleton class: R = 0
    return x, y


def _clustered(n: int = 56, d: int = 8, classes: int = 9, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn(classes, d, generator=g)[y] + 0.6 * torch.randn(n, d, generator=g)
    x[30:33] = x[3]
    return x, y


def _label_sets(y: torch.Tensor, seed: int = 2) -> torch.Tensor:
    """A second label for about half the items, a label written twice in some sets, an item relevant to nothing."""
    g = torch.Generator().manual_seed(seed)
    second = torch.randint(0, int(y.max()) + 1, y.shape, generator=g)
    keep = torch.rand(y.shape, generator=g) < 0.5
    sets = torch.stack([y, torch.where(keep, second, torch.full_like(y, -1))], 1)
    sets[2] = torch.tensor([int(y[2]), int(y[2])])  # the same label twice in one set
    sets[3] = -1
    return sets


def _case(name: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(embeddings, labels, task and search options) of a named case."""
    if name == "ties-cosine-fp32":
        x, y = _tie_data()
        return x, y, {"metric": "cosine", "precision": "fp32"}
    if name == "ties-euclidean-bf16-symmetric":
        x, y = _tie_data(seed=3)
        return x, y, {"metric": "euclidean", "precision": "bf16", "query_block": 8, "gallery_chunk": 8}
    if name == "clustered-cosine-bf16-chunks":
        x, y = _clustered()
        return x, y, {"metric": "cosine", "precision": "bf16", "query_block": 16, "gallery_chunk": 24}
    g = torch.Generator().manual_seed(4)
    if name == "sets-sequences-categories-query-gallery":
        x, y = _tie_data(n=52, seed=5)
        qm = torch.rand(52, generator=g) < 0.5
        gm = (torch.rand(52, generator=g) < 0.7) | ~qm  # overlapping sets
        seq = torch.randint(-1, 12, (52,), generator=g)
        cat = torch.randint(-1, 3, (52,), generator=g)
        return x, _label_sets(y), {"metric": "cosine", "precision": "bf16", "query_mask": qm, "gallery_mask": gm,
                                   "sequence": seq, "category": cat, "query_block": 8, "gallery_chunk": 16}
    if name == "sets-clustered-euclidean-symmetric":
        x, y = _clustered(seed=6)
        cat = torch.randint(0, 2, (x.shape[0],), generator=g)
        return x, _label_sets(y, seed=7), {"metric": "euclidean", "precision": "fp32", "category": cat,
                                           "query_block": 8, "gallery_chunk": 8}
    raise KeyError(name)


def _brute(x: torch.Tensor, labels: torch.Tensor, opts: dict) -> dict[str, float]:
    return brute_task_metrics(
        x, labels, (1, 5), metric=opts["metric"], query_mask=opts.get("query_mask"),
        gallery_mask=opts.get("gallery_mask"), sequence=opts.get("sequence"), category=opts.get("category"),
        precision_at=(3,), ndcg_at=(4,), fmrs=("0.29",),
    )


def _check(got: dict[str, float], full: dict[str, float], ref: dict[str, float], what: str) -> None:
    for key, value in got.items():
        assert key in full, f"{what}: {key} not in the all-metrics run"
        assert value == full[key] or (math.isnan(value) and math.isnan(full[key])), (
            f"{what}: {key} = {value!r} alone, {full[key]!r} with every metric"
        )
        assert key in ref, f"{what}: no brute-force value for {key}"
        assert value == pytest.approx(ref[key], rel=0, abs=1e-12), f"{what}: {key} = {value!r}, brute force {ref[key]!r}"


def _subsets(pairs: bool) -> list[tuple[str, ...]]:
    out = [(i,) for i in ITEMS]
    if pairs:
        out += list(itertools.combinations(ITEMS, 2))
    return out + [ITEMS]


CASES = {  # name: run every pair too (else each metric alone and all of them)
    "ties-cosine-fp32": True,
    "ties-euclidean-bf16-symmetric": True,
    "clustered-cosine-bf16-chunks": False,
    "sets-sequences-categories-query-gallery": True,
    "sets-clustered-euclidean-symmetric": False,
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_metric_alone_and_in_pairs_equals_all_metrics_and_brute_force(case: str) -> None:
    x, labels, opts = _case(case)
    ref = _brute(x, labels, opts)
    full = F.retrieval_metrics(x, labels, **_options(ITEMS), **opts)
    _check(full, full, ref, f"{case}, all")
    assert "mrr" in full and "fnmr@fmr=0.29" in full and "map" in full
    for items in _subsets(CASES[case]):
        got = F.retrieval_metrics(x, labels, **_options(items), **opts)
        _check(got, full, ref, f"{case}, {items}")
        for item in items:  # each requested figure is there (recall_at=() still gives precision@1)
            assert item in got


def test_mrr_alone_on_the_issue_example() -> None:
    """Issue 26: query 1's first relevant item is at rank 2, behind a tie won by the smaller index; ``mrr`` alone
    reported 0.625 (rank 1 for query 1) instead of (1 + 1/3 + 1/2 + 1/2) / 4 = 0.58333."""
    x = torch.tensor([[-1.0, 0.0], [-1.0, 0.0], [0.0, 2.0], [0.0, -1.0]])
    y = torch.tensor([1, 2, 1, 2])
    # first relevant ranks: q0 -> 1 (item 2, after item 1), q1 -> 2 (item 3, after item 0 and item 2, which ties
    # with it at score 0 and has the smaller index), q2 -> 0 (item 0), q3 -> 1 (item 1, after item 0: a tie)
    expected = (1 / 2 + 1 / 3 + 1 + 1 / 2) / 4
    ref = brute_task_metrics(x, y, (1,))["mrr"]
    assert ref == pytest.approx(0.5833333333333334, abs=1e-15) and expected == pytest.approx(ref, abs=1e-15)
    m = RetrievalMetrics(metrics=("mrr",), clustering=False)
    m.update(x, y)
    assert m.compute()["mrr"] == pytest.approx(ref, abs=1e-15)
    assert F.retrieval_metrics(x, y, recall_at=(), map_at_r=False, metrics=["mrr"])["mrr"] == pytest.approx(ref, abs=1e-15)


def test_mrr_alone_without_ties_equals_mrr_with_map() -> None:
    """No exact ties, fp32 and bf16: the first relevant rank beyond every K of Recall@K used to be a lower bound."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(400, 16, generator=g)
    y = torch.randint(0, 80, (400,), generator=g)
    for precision in ("fp32", "bf16"):
        alone = F.retrieval_metrics(x, y, metrics=["mrr"], precision=precision, query_block=128, gallery_chunk=200)
        both = F.retrieval_metrics(x, y, metrics=["mrr", "map"], precision=precision, query_block=128, gallery_chunk=200)
        assert alone["mrr"] == both["mrr"], precision
    ref = brute_task_metrics(x, y, (1,))["mrr"]
    assert alone["mrr"] == pytest.approx(ref, abs=1e-12)


def test_retrieval_stats_decides_the_ranks_its_metrics_need() -> None:
    """``retrieval_stats`` with ``metrics`` but the default ``rank_ks``: Recall@K, Precision@1 and MRR reduced from
    its statistics are exact (the K a metric needs is added to ``rank_ks``)."""
    x, y = _tie_data(seed=8)
    ref = brute_task_metrics(x, y, (1, 3, 6), precision_at=())
    for name in ("recall@3", "recall@6", "precision@1", "mrr"):
        for precision in ("fp32", "bf16"):
            stats = F.retrieval_stats(x, y, metrics=[name], rank_ks=(), precision=precision)
            value, included = F.per_query(stats, F.parse_metric(name))
            assert F.exact_mean(value, included) == pytest.approx(ref[name], abs=1e-12), (name, precision)


@pytest.mark.parametrize("clustering", [False, True])
def test_retrieval_metrics_class_every_metric_alone_with_and_without_clustering(clustering: bool) -> None:
    """The way a user asks (``RetrievalMetrics(metrics=(...))``): each metric alone and all of them, clustering
    on or off, with categories: every retrieval figure equals the all-metrics functional run and the brute force;
    NMI and F1 do not depend on the retrieval metrics asked for."""
    x, y = _tie_data(n=40, seed=9)
    cat = torch.arange(40) % 3
    opts = {"metric": "cosine", "precision": "bf16", "category": cat}
    ref = _brute(x, y, opts)
    full = F.retrieval_metrics(x, y, **_options(ITEMS), **opts)
    clusters = F.clustering_metrics(x, y, seeds=1, iters=20, backend="torch")
    for items in [(i,) for i in ITEMS] + [ITEMS]:
        m = RetrievalMetrics(**_options(items), clustering=clustering, kmeans_backend="torch", precision="bf16")
        m.update(x[:25], y[:25], category=cat[:25])
        m.update(x[25:], y[25:], category=cat[25:])
        got = m.compute()
        if clustering:
            assert got.pop("nmi") == clusters["nmi"] and got.pop("f1") == clusters["f1"], items
        else:
            assert "nmi" not in got and "f1" not in got
        _check(got, full, ref, f"RetrievalMetrics {items}")


@pytest.mark.slow
def test_each_metric_alone_under_two_gloo_processes() -> None:
    """The distributed search (merged band counts and buffers of the symmetric pass, per-block finish) gives the
    single-process and brute-force figures for each metric alone (``mrr`` alone included)."""
    script = os.path.join(os.path.dirname(__file__), "distributed", "run_metrics_alone_ddp.py")
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=400, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "METRICS-ALONE-DDP-OK" in proc.stdout
