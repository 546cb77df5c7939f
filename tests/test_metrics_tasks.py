"""Own retrieval tasks (issue 20): sequences, label sets, categories, query/gallery overlap and the new metrics
(Precision@K, MRR, NDCG@K, MAP, FNMR@FMR), against a float64 brute force written from the definitions
(``tests/metrics_reference.py``), scikit-learn's ``ndcg_score`` and pytorch-metric-learning where they coincide."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.metrics import _ranks
from lightning_dml.metrics import functional as F
from tests.metrics_reference import brute_task_metrics, brute_task_rankings

RECALL = (1, 2, 4, 8, 32)
PRECISION_AT = (3, 10)
NDCG_AT = (5, 20)
FMRS = (0.01, 0.1, 0.5)
EXTRA = [*(f"precision@{k}" for k in PRECISION_AT), "mrr", *(f"ndcg@{k}" for k in NDCG_AT), "map",
         *(f"fnmr@fmr={f:g}" for f in FMRS)]


def _task_data(
    n: int = 240, d: int = 16, classes: int = 30, seed: int = 0, sets: bool = False, seq: bool = False,
    cat: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Clustered embeddings with exact duplicates, near-ties far below the bf16 rounding, a singleton class;
    optionally label sets (half the items with a second label, one item relevant to nothing), sequences (one whole
    class inside one sequence, some items without sequence) and categories."""
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, classes, (n,), generator=g)
    x = torch.randn(classes, d, generator=g)[y] + 0.8 * torch.randn(n, d, generator=g)
    x[10:15] = x[0]  # exact duplicates, mixed labels: ties by index
    x[15:20] = x[1] + 1e-6 * torch.randn(5, d, generator=g)
    y[30] = 1000  # a singleton class
    labels = y
    if sets:
        second = torch.randint(0, classes, (n,), generator=g)
        keep = torch.rand(n, generator=g) < 0.5
        labels = torch.stack([y, torch.where(keep, second, torch.full_like(y, -1))], 1)
        labels[31] = -1  # an item relevant to nothing
    sequence = None
    if seq:
        sequence = torch.randint(-1, 40, (n,), generator=g)
        sequence[y == 3] = 7  # every item of class 3 in one sequence: R = 0 for them
    category = torch.randint(0, 3, (n,), generator=g) if cat else None
    return x, labels, sequence, category


def _compare(got: dict[str, float], ref: dict[str, float]) -> None:
    for key, value in ref.items():
        if key.startswith("_"):
            continue
        assert key in got, key
        if math.isinf(value):
            assert got[key] == value, key
        else:
            assert got[key] == pytest.approx(value, abs=1e-12), key


CASES = {
    "plain": {},
    "label-sets": {"sets": True},
    "sequences": {"seq": True},
    "categories": {"cat": True},
    "all": {"sets": True, "seq": True, "cat": True},
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("tiles", [(None, None), (32, 50)], ids=["one-tile", "symmetric-tiles"])
def test_all_vs_all_equals_brute_force(case: str, tiles: tuple) -> None:
    x, labels, seq, cat = _task_data(**CASES[case])
    ref = brute_task_metrics(x, labels, RECALL, "cosine", None, None, seq, cat, PRECISION_AT, NDCG_AT, FMRS)
    got = F.retrieval_metrics(x, labels, recall_at=RECALL, sequence=seq, category=cat, metrics=EXTRA,
                              precision="fp32", query_block=tiles[0], gallery_chunk=tiles[1])
    _compare(got, ref)
    assert not {k for k in got if not k.startswith("threshold")} - set(ref)  # no key the definitions lack


@pytest.mark.parametrize("precision", ["tf32", "bf16"])
@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_every_precision_and_metric_is_exact(precision: str, metric: str) -> None:
    """bf16's wide bound leaves many bands and candidate runs to resolve exactly: every figure stays exact."""
    x, labels, seq, cat = _task_data(seed=1, sets=True, seq=True, cat=True)
    ref = brute_task_metrics(x, labels, RECALL, metric, None, None, seq, cat, PRECISION_AT, NDCG_AT, FMRS)
    got = F.retrieval_metrics(x, labels, recall_at=RECALL, sequence=seq, category=cat, metrics=EXTRA,
                              metric=metric, precision=precision, query_block=32, gallery_chunk=50)
    _compare(got, ref)


@pytest.mark.parametrize("overlap", [False, True], ids=["disjoint", "overlapping"])
def test_query_gallery_tables_equal_brute_force(overlap: bool) -> None:
    """Queries against a gallery; with overlap an item can be both, and never matches itself."""
    x, labels, seq, cat = _task_data(seed=2, sets=True, seq=True, cat=True)
    g = torch.Generator().manual_seed(5)
    qm = torch.rand(x.shape[0], generator=g) < 0.5
    gm = torch.rand(x.shape[0], generator=g) < 0.7 if overlap else ~qm
    if overlap:
        assert bool((qm & gm).any())
    ref = brute_task_metrics(x, labels, RECALL, "cosine", qm, gm, seq, cat, PRECISION_AT, NDCG_AT, FMRS)
    for tiles in ((None, None), (16, 40)):
        got = F.retrieval_metrics(x, labels, recall_at=RECALL, query_mask=qm, gallery_mask=gm, sequence=seq,
                                  category=cat, metrics=EXTRA, query_block=tiles[0], gallery_chunk=tiles[1])
        _compare(got, ref)


def test_sequence_members_are_ignored_not_irrelevant() -> None:
    """Hand-computed: the query's sequence mates vanish from its ranking (neither relevant nor irrelevant)."""
    x = torch.tensor([[1.0, 0.0], [0.99, 0.1], [0.9, 0.3], [0.0, 1.0]])
    y = torch.tensor([0, 1, 0, 0])
    seq = torch.tensor([5, 5, -1, -1])  # items 0 and 1 are one sequence; -1: none
    plain = F.retrieval_metrics(x, y, recall_at=(1,), map_at_r=False)
    masked = F.retrieval_metrics(x, y, recall_at=(1,), map_at_r=False, sequence=seq)
    # query 0: nearest is item 1 (irrelevant) without sequences, item 2 (relevant) once item 1 is ignored; query 1
    # has no positive, query 2's nearest is item 1 (not of its sequence), query 3's is item 2
    assert plain["recall@1"] == pytest.approx(1 / 4)
    assert masked["recall@1"] == pytest.approx(2 / 4)
    stats = F.retrieval_stats(x, y, sequence=seq, k=3)
    assert stats.num_relevant.tolist() == [2, 0, 2, 2]
    assert stats.neighbors[0].tolist() == [2, 3, -1]  # item 1 is absent for query 0: two gallery items left


def test_label_sets_relevance_is_intersection() -> None:
    x = torch.tensor([[1.0, 0.0], [0.9, 0.1], [0.0, 1.0], [0.1, 0.9]])
    sets = torch.tensor([[0, 1], [1, -1], [2, -1], [-1, -1]])  # 0 and 1 share label 1; 3 is relevant to nothing
    stats = F.retrieval_stats(x, sets, k=3)
    assert stats.num_relevant.tolist() == [1, 1, 0, 0]
    assert stats.relevance[0].tolist() == [True, False, False]
    assert stats.first_positive_rank.tolist() == [0, 0, -1, -1]


def test_categories_are_reported_by_name() -> None:
    x, labels, _, cat = _task_data(seed=3, cat=True)
    names = ["shoes", "bags", "hats"]
    got = F.retrieval_metrics(x, labels, category=cat, category_names=names, metrics=["mrr"])
    for name, c in zip(names, range(3)):
        mine = cat == c
        sub = F.retrieval_metrics(x, labels, category=cat, metrics=["mrr"])
        assert got[f"category/{name}/recall@1"] == sub[f"category/{c}/recall@1"]
        assert got[f"category/{name}/mrr"] == sub[f"category/{c}/mrr"]
        assert bool(mine.any())
    # a category's figure is the metric over its queries alone, ranked against the whole gallery
    ref = brute_task_metrics(x, labels, (1,), category=cat)
    assert got["category/bags/recall@1"] == pytest.approx(ref["category/1/recall@1"], abs=1e-12)


def test_empty_query_set_is_an_error() -> None:
    x, labels, _, _ = _task_data(n=40, classes=5)
    none = torch.zeros(40, dtype=torch.bool)
    with pytest.raises(ValueError, match="query_mask selects no query"):
        F.retrieval_metrics(x, labels, query_mask=none, gallery_mask=~none)


def test_fnmr_window_missed_by_the_sample_is_repaired_exactly(monkeypatch: pytest.MonkeyPatch) -> None:
    """The pair-score windows come from a sample; a window that misses its threshold is detected by exact counts and
    repaired by a histogram pass: the figures never depend on the sample."""
    x, labels, seq, _ = _task_data(seed=4, sets=True, seq=True)
    ref = brute_task_metrics(x, labels, (1,), sequence=seq, fmrs=FMRS)
    planned = _ranks.plan_windows
    repairs = []
    histogram = _ranks.histogram_pass

    def wrong(task, scorer, grid, fmrs, neg_total, bound, **kw):  # every window far above its threshold
        w = planned(task, scorer, grid, fmrs, neg_total, bound, **kw)
        return _ranks.make_windows([2.0] * len(fmrs), [3.0] * len(fmrs), bound, w.low.device)

    monkeypatch.setattr(_ranks, "plan_windows", wrong)
    monkeypatch.setattr(_ranks, "histogram_pass", lambda *a, **k: repairs.append(1) or histogram(*a, **k))
    for tiles in ((None, None), (32, 50)):
        got = F.retrieval_metrics(x, labels, recall_at=(1,), sequence=seq,
                                  metrics=[f"fnmr@fmr={f:g}" for f in FMRS], query_block=tiles[0], gallery_chunk=tiles[1])
        _compare(got, {k: v for k, v in ref.items() if "fmr" in k})
    assert len(repairs) == 2


def test_fnmr_threshold_definition_on_a_hand_made_set() -> None:
    """4 items on a line: every pair score known; FMR counts negatives strictly above the threshold."""
    x = torch.tensor([[0.0], [1.0], [2.0], [4.0]])
    y = torch.tensor([0, 0, 1, 1])
    # negative squared distances; negatives (0,2)=-4 (1,2)=-1 (0,3)=-16 (1,3)=-9 each twice (both directions)
    got = F.retrieval_metrics(x, y, recall_at=(1,), metric="euclidean", metrics=["fnmr@fmr=0.25", "fnmr@fmr=0.3"])
    # 8 negative pairs; fmr 0.25: at most 2 above theta -> theta = 3rd largest negative = -4; positives: (0,1) -1
    # twice, (2,3) -4 twice: -4 <= theta -> fnmr 2/4
    assert got["threshold@fmr=0.25"] == -4.0
    assert got["fnmr@fmr=0.25"] == 0.5
    assert got["threshold@fmr=0.3"] == -4.0  # floor(0.3 * 8) = 2 as well


def test_ndcg_against_scikit_learn() -> None:
    """Binary gains, no ties, every query with a relevant item: NDCG@K equals scikit-learn's ``ndcg_score``."""
    from sklearn.metrics import ndcg_score

    g = torch.Generator().manual_seed(6)
    y = torch.arange(40).repeat_interleave(4)
    x = torch.randn(40, 12, generator=g)[y] + 0.9 * torch.randn(160, 12, generator=g)
    s = torch.nn.functional.normalize(x.double(), dim=1) @ torch.nn.functional.normalize(x.double(), dim=1).T
    s.fill_diagonal_(-10.0)  # the query itself ranks last and is irrelevant
    rel = (y.unsqueeze(0) == y.unsqueeze(1)).double()
    rel.fill_diagonal_(0.0)
    got = F.retrieval_metrics(x, y, recall_at=(1,), metrics=["ndcg@5", "ndcg@20"])
    for k in (5, 20):
        assert got[f"ndcg@{k}"] == pytest.approx(ndcg_score(rel.numpy(), s.numpy(), k=k), abs=1e-12)


def test_map_and_mrr_against_pytorch_metric_learning() -> None:
    """pml's mean_average_precision (k = the whole gallery) and mean_reciprocal_rank, no lone queries (pml ranks by
    Euclidean distance: on L2-normalised embeddings that is our cosine ranking)."""
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    g = torch.Generator().manual_seed(7)
    y = torch.arange(30).repeat_interleave(5)
    x = torch.randn(30, 10, generator=g)[y] + 1.2 * torch.randn(150, 10, generator=g)
    calc = AccuracyCalculator(include=("mean_average_precision", "mean_reciprocal_rank"), k=149, device=torch.device("cpu"))
    xn = torch.nn.functional.normalize(x, dim=1)
    ref = calc.get_accuracy(xn, y, xn, y, ref_includes_query=True)
    got = F.retrieval_metrics(x, y, recall_at=(1,), metrics=["map", "mrr"])
    assert got["map"] == pytest.approx(ref["mean_average_precision"], abs=1e-6)
    assert got["mrr"] == pytest.approx(ref["mean_reciprocal_rank"], abs=1e-6)


def test_metric_class_takes_sequences_categories_and_label_sets() -> None:
    x, labels, seq, cat = _task_data(seed=8, sets=True, seq=True, cat=True)
    ref = brute_task_metrics(x, labels, (1, 2, 4, 8), "cosine", None, None, seq, cat, PRECISION_AT, NDCG_AT, FMRS)
    m = RetrievalMetrics(clustering=False, metrics=EXTRA, query_block=32, gallery_chunk=50)
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))
    for part in perm.split(50):  # shuffled batches with indices: the same figures
        m.update(x[part], labels[part], indices=part, sequence=seq[part], category=cat[part])
    _compare(m.compute(), ref)
    with pytest.warns(UserWarning, match="nmi and f1 need one class per item"):
        clustered = RetrievalMetrics()
        clustered.update(x, labels)
        assert "nmi" not in clustered.compute()
    with pytest.raises(ValueError, match="labels changed from shape"):
        m.update(x[:4], labels[:4, 0])


@pytest.mark.parametrize("bad, match", [
    (["precision@0"], "K must be >= 1"), (["fnmr@fmr=2"], r"false match rate must be a number in \(0, 1\]"),
    (["ndcg"], "unknown metric 'ndcg'"), (["fnmr@fmr=abc"], "false match rate"),
])
def test_metric_names_are_checked(bad: list[str], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RetrievalMetrics(metrics=bad)


def test_bad_label_sets_and_ids_are_named() -> None:
    x = torch.randn(4, 3)
    with pytest.raises(ValueError, match="label sets hold labels >= 0 padded with -1, got -2"):
        F.retrieval_metrics(x, torch.tensor([[0, -2], [1, -1], [0, -1], [1, -1]]))
    with pytest.raises(ValueError, match="sequence must be a 1-D torch.Tensor"):
        F.retrieval_metrics(x, torch.tensor([0, 1, 0, 1]), sequence=np.zeros(4))
    with pytest.raises(ValueError, match="category has 3 entries but embeddings has 4 rows"):
        F.retrieval_metrics(x, torch.tensor([0, 1, 0, 1]), category=torch.zeros(3, dtype=torch.long))


def test_brute_force_reference_excludes_sequences() -> None:
    """The reference itself: a query's sequence mates are absent from its ranking."""
    x = torch.randn(6, 3)
    seq = torch.tensor([1, 1, 2, 2, -1, -1])
    rk = brute_task_rankings(x, torch.zeros(6, dtype=torch.long), sequence=seq)
    assert sorted(rk[0][1]) == [2, 3, 4, 5]
    assert sorted(rk[4][1]) == [0, 1, 2, 3, 5]


def test_pair_histogram_bins_are_monotone_and_floor_their_values() -> None:
    """The pair-score histograms bin float32 values by an order-preserving key: bins never decrease with the
    value, each bin's floor is at most its values, and -inf (the excluded pairs) has a bin of its own."""
    from lightning_dml.metrics._scan import NEG_INF_BIN, bin_floor, float_key

    g = torch.Generator().manual_seed(0)
    v = torch.cat([torch.randn(5000, generator=g) * torch.exp2(torch.randint(-40, 40, (5000,), generator=g).float()),
                   torch.tensor([0.0, -0.0, 1.0, -1.0, 3.4e38, -3.4e38, math.inf])]).sort().values
    keys = float_key(v)
    assert bool((keys[1:] >= keys[:-1]).all())
    assert bool((bin_floor(keys) <= v.double()).all())
    assert int(float_key(torch.tensor([-math.inf]))) == NEG_INF_BIN and int(keys.min()) > NEG_INF_BIN
