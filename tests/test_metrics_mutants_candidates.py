"""The metrics engine's candidate buffers, retrieval task and DDP split (``metrics/_candidates.py``, ``_task.py``,
``_ddp.py``): cases the mutation check (issue 26, docs/testing.md) found untested, each against a reference (the
float64 brute force of tests/metrics_reference.py, a sort, or one process).

The DDP split is run in this process: ``world`` threads stand for the processes, and ``all_gather_uneven`` is
replaced by an exchange between them that checks the documented contract of the real one (one row count per
process; the same number of dimensions, dtype and device everywhere; the same trailing shape on every process
that holds rows), so a mutant that would break a real collective fails here too.
"""

from __future__ import annotations

import math
import threading
from fractions import Fraction

import pytest
import torch

from lightning_dml.metrics import _ddp
from lightning_dml.metrics import functional as F
from lightning_dml.metrics._candidates import (
    PassState,
    SearchRequest,
    count_true,
    merge_states,
    packable,
    round_down,
    round_up,
    true_pairs,
)
from lightning_dml.metrics._ranks import run_search
from lightning_dml.metrics._task import RetrievalTask
from tests.metrics_reference import brute_task_metrics


# ------------------------------------------------------------------------------------------ word-wise primitives
def _bool_views() -> list[torch.Tensor]:
    """Bool matrices of every width 1..24, contiguous and as column / row slices of wider ones (other strides and
    storage offsets)."""
    g = torch.Generator().manual_seed(0)
    out = []
    for width in range(1, 25):
        base = torch.rand(5, 32, generator=g) < 0.3
        out.append(base[:, :width].contiguous())
        out.append(base[:, :width])  # row stride 32
        out.append(base[:, 8 : 8 + width])  # storage offset 8
        out.append(base[:, 3 : 3 + width])  # storage offset 3
        out.append(base[1:4, :width])  # storage offset 32
        out.append(base.reshape(-1)[: 5 * 24].view(5, 24)[:, :width])  # row stride 24
    return out


def _reads_as_words(m: torch.Tensor) -> bool:
    """Whether torch can read the bytes of ``m`` as int64 words (the reference for ``packable`` on the CPU)."""
    try:
        m.view(torch.int64)
    except RuntimeError:
        return False
    return m.storage_offset() % 8 == 0


def test_packable_is_whether_the_bytes_read_as_int64_words() -> None:
    """``packable`` says yes exactly when the bytes can be read as words (widths that are multiples of 8 included:
    otherwise every count would take the slow byte path), and the word-wise counts and pairs equal the plain ones on
    every width, stride and offset."""
    for m in _bool_views():
        assert packable(m) == _reads_as_words(m), (tuple(m.shape), m.stride(), m.storage_offset())
        for dim in (0, 1):
            assert torch.equal(count_true(m, dim), m.sum(dim=dim, dtype=torch.int32))
            r, c = true_pairs(m, dim)
            want = m.nonzero(as_tuple=True)
            assert torch.equal(r, want[0]) and torch.equal(c, want[1])
    assert packable(torch.zeros(3, 16, dtype=torch.bool)) and packable(torch.zeros(3, 8, dtype=torch.bool))


@pytest.mark.parametrize("shape", [(4, 0), (0, 16), (0, 0)])
def test_counts_and_pairs_of_an_empty_matrix(shape: tuple[int, int]) -> None:
    """No row or no column: zero counts and no pair (the word-wise sum once stacked an empty list of lanes)."""
    m = torch.zeros(shape, dtype=torch.bool)
    for dim in (0, 1):
        assert torch.equal(count_true(m, dim), torch.zeros(shape[1 - dim], dtype=torch.int32))
        r, c = true_pairs(m, dim)
        assert r.numel() == 0 and c.numel() == 0


def test_round_down_and_up_give_the_nearest_float32_on_each_side() -> None:
    """``round_down(t)`` is the largest float32 <= t, ``round_up(t)`` the smallest >= t (exact comparisons in
    float64, which holds every float32)."""
    g = torch.Generator().manual_seed(1)
    t = torch.cat([
        torch.randn(500, dtype=torch.float64, generator=g),
        torch.randn(100, dtype=torch.float64, generator=g) * 1e-30,
        torch.randn(100, dtype=torch.float64, generator=g) * 1e30,
        torch.randn(100, generator=g).double(),  # float32 values: kept as they are
        torch.tensor([0.0, 1.0, -1.0, 1 + 2.0**-40, -(1 + 2.0**-40), math.inf, -math.inf], dtype=torch.float64),
    ])
    down, up = round_down(t), round_up(t)
    assert down.dtype == torch.float32 and up.dtype == torch.float32
    assert bool((down.double() <= t).all()) and bool((up.double() >= t).all())
    finite = torch.isfinite(t)
    above = torch.nextafter(down, torch.full_like(down, math.inf)).double()
    below = torch.nextafter(up, torch.full_like(up, -math.inf)).double()
    assert bool((above[finite] > t[finite]).all()) and bool((below[finite] < t[finite]).all())
    exact = t.float().double() == t
    assert torch.equal(down[exact], t[exact].float()) and torch.equal(up[exact], t[exact].float())


# ------------------------------------------------------------------------------------------ merging the buffers
def _state(buf_v: torch.Tensor, buf_i: torch.Tensor, lo: torch.Tensor, kc: int) -> PassState:
    rows = buf_v.shape[0]
    return PassState(
        rows=torch.arange(rows), w=torch.zeros(rows, dtype=torch.float64), has=torch.ones(rows, dtype=torch.bool),
        s_best=None, p_best=None, thr_lo=None, thr_hi=None, lo=lo, hi=lo + 1, kc=kc, buf_v=buf_v, buf_i=buf_i,
    )


@pytest.mark.parametrize("rows, kc, widths", [(3, 6, (6, 6, 6)), (2, 5, (4, 3)), (7, 4, (4, 4))])
def test_merge_states_keeps_the_kc_largest_of_every_process(rows: int, kc: int, widths: tuple[int, ...]) -> None:
    """The merged buffer of each row is the kc largest of every process's candidates (a sort of their union), also
    with fewer rows than kc; the counters are summed."""
    g = torch.Generator().manual_seed(2)
    states, values, positions = [], [], []
    for p, width in enumerate(widths):
        v = torch.rand(rows, width, generator=g).sort(dim=1, descending=True).values
        i = torch.randperm(50, generator=g)[: rows * width].view(rows, width) + 100 * p
        states.append(_state(v, i, torch.randint(0, 9, (rows,), generator=g), kc))
        values.append(v)
        positions.append(i)
    merged = merge_states(states)
    v, i = torch.cat(values, 1), torch.cat(positions, 1)
    keep = min(kc, v.shape[1])
    for r in range(rows):
        order = sorted(range(v.shape[1]), key=lambda j: -float(v[r, j]))[:keep]
        assert merged.buf_v[r].tolist() == [float(v[r, j]) for j in order]
        assert merged.buf_i[r].tolist() == [int(i[r, j]) for j in order]
    assert torch.equal(merged.lo, sum(s.lo for s in states))
    assert torch.equal(merged.hi, sum(s.hi for s in states))


# ------------------------------------------------------------------------------------------ the retrieval task
def test_neighbour_padding_past_the_gallery_is_never_relevant() -> None:
    """k past the gallery: the padding (-1) is irrelevant even when the first gallery item shares the query's
    label, and Precision@K counts only real neighbours (the float64 brute force)."""
    g = torch.Generator().manual_seed(3)
    y = torch.tensor([0, 1, 0, 0, 1, 1])
    x = torch.randn(6, 5, generator=g)
    qm = torch.tensor([True, True, False, False, False, False])
    gm = ~qm  # gallery rows 2..5, the first of class 0
    stats = F.retrieval_stats(x, y, query_mask=qm, gallery_mask=gm, k=6)
    assert (stats.neighbors[:, 4:] == -1).all() and not bool(stats.relevance[:, 4:].any())
    got = F.retrieval_metrics(x, y, query_mask=qm, gallery_mask=gm, recall_at=(1,), metrics=["precision@6"])
    want = brute_task_metrics(x, y, query_mask=qm, gallery_mask=gm, precision_at=(6,))
    assert got["precision@6"] == pytest.approx(want["precision@6"], abs=1e-15)
    task = RetrievalTask(y, torch.tensor([0, 1]), torch.tensor([2, 3, 4, 5]))
    assert task.relevant(torch.tensor([0, 0, 1]), torch.tensor([-1, 0, -1])).tolist() == [False, True, False]


# ------------------------------------------------------------------------------------------ the DDP split
class _ThreadWorld:
    """``world`` processes played by threads: rank and world size per thread, and an all-gather between them that
    checks the documented contract of :func:`lightning_dml.distributed.all_gather_uneven`."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.local = threading.local()
        self.barrier = threading.Barrier(world, timeout=120)
        self.slots: list[tuple[torch.Tensor, ...] | None] = [None] * world

    def get_rank(self, group: object = None) -> int:
        return self.local.rank

    def get_world_size(self, group: object = None) -> int:
        return self.world

    def all_gather_uneven(self, *tensors: torch.Tensor, group: object = None) -> tuple[list[torch.Tensor], ...]:
        if len({t.shape[0] for t in tensors}) > 1:
            raise ValueError(f"all_gather_uneven: row counts differ within a process: {[t.shape for t in tensors]}")
        self.slots[self.local.rank] = tuple(t.clone() for t in tensors)
        self.barrier.wait()
        blocks = list(self.slots)
        self.barrier.wait()  # every process has read the slots before the next collective overwrites them
        out = []
        for n in range(len(tensors)):
            parts = [b[n] for b in blocks]
            if len({(p.ndim, p.dtype, p.device) for p in parts}) > 1:
                raise ValueError(f"all_gather_uneven: tensor {n} differs between processes: "
                                 f"{[(tuple(p.shape), p.dtype) for p in parts]}")
            full = [p for p in parts if p.shape[0] > 0]
            if len({p.shape[1:] for p in full}) > 1:
                raise ValueError(f"all_gather_uneven: trailing shapes of tensor {n} differ: {[p.shape for p in parts]}")
            trailing = full[0].shape[1:] if full else parts[0].shape[1:]
            out.append([p if p.shape[0] > 0 else p.reshape(0, *trailing) for p in parts])
        return tuple(out)

    def run(self, fn, *args):  # noqa: ANN001, ANN201
        """``fn(rank, *args)`` on every rank; the results in rank order (the first error, re-raised)."""
        results: list = [None] * self.world
        errors: list[BaseException] = []

        def one(rank: int) -> None:
            self.local.rank = rank
            try:
                results[rank] = fn(rank, *args)
            except BaseException as error:  # noqa: BLE001 - handed to the test
                errors.append(error)
                self.barrier.abort()  # the other ranks stop waiting in a collective

        threads = [threading.Thread(target=one, args=(r,)) for r in range(self.world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        first = next((e for e in errors if not isinstance(e, threading.BrokenBarrierError)), errors[0] if errors else None)
        if first is not None:
            raise first
        return results


@pytest.fixture
def thread_world(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    def make(world: int) -> _ThreadWorld:
        w = _ThreadWorld(world)
        for name in ("get_rank", "get_world_size", "all_gather_uneven"):
            monkeypatch.setattr(_ddp, name, getattr(w, name))
        return w

    return make


def _agree(world: _ThreadWorld, per_rank: list[dict]) -> list:
    """``agree_search_settings`` on every rank with that rank's settings: its result, or its ValueError's text."""

    def one(rank: int):  # noqa: ANN202
        kw = dict(requested="auto", resolved="fp32", metric="cosine", tiles=(64, 256), shape=(40, 6))
        kw.update(per_rank[rank])
        try:
            return _ddp.agree_search_settings(device=torch.device("cpu"), **kw)
        except ValueError as error:
            return str(error)

    return world.run(one)


def test_two_processes_that_disagree_are_refused_on_both(thread_world) -> None:  # noqa: ANN001
    """Two processes, two different requested precisions (or metrics, or sets): both raise, naming each rank's
    value; the resolved "auto" precisions and the tiles are merged (the most precise, the smallest)."""
    got = _agree(thread_world(2), [{"requested": "bf16"}, {"requested": "fp32"}])
    assert all("different precision" in g and "rank 0: 'bf16', rank 1: 'fp32'" in g for g in got), got
    got = _agree(thread_world(2), [{}, {"metric": "euclidean"}])
    assert all("different metric" in g and "rank 1: 'euclidean'" in g for g in got), got
    got = _agree(thread_world(3), [{}, {}, {"shape": (41, 6)}])
    assert all("same evaluated set" in g and "rank 2: 41 x 6" in g for g in got), got
    got = _agree(thread_world(3), [{"resolved": "bf16", "tiles": (32, 512)}, {"resolved": "tf32"}, {}])
    assert got == [("fp32", (32, 256))] * 3
    assert _agree(thread_world(2), [{"resolved": "bf16"}, {"resolved": "tf32"}]) == [("tf32", (64, 256))] * 2


def _search_inputs(query_mask: torch.Tensor | None, seed: int, labels: torch.Tensor, query_block: int):  # noqa: ANN202
    g = torch.Generator().manual_seed(seed)
    n = labels.shape[0]
    x = torch.randn(int(labels.max()) + 1, 6, generator=g)[labels] + 0.7 * torch.randn(n, 6, generator=g)
    ps = F.prepare(x, labels, query_mask=query_mask, gallery_mask=None if query_mask is None else ~query_mask)
    return F.build_search(ps, precision="fp32", query_block=query_block, gallery_chunk=16)


def _same_result(got, want) -> None:  # noqa: ANN001
    """Per-query results equal (every positive's rank compared as a set: the padding's side is free)."""
    assert torch.equal(got.neighbors, want.neighbors) and torch.equal(got.scores, want.scores)
    assert torch.equal(got.first_positive_rank, want.first_positive_rank)
    assert torch.equal(got.num_positives, want.num_positives)
    assert (got.positive_ranks is None) == (want.positive_ranks is None)
    if want.positive_ranks is not None:
        assert got.positive_ranks.shape == want.positive_ranks.shape
        for a, b in zip(got.positive_ranks.tolist(), want.positive_ranks.tolist()):
            assert sorted(v for v in a if v >= 0) == sorted(v for v in b if v >= 0)


def _distributed(world: _ThreadWorld, task, scorer, grid, request):  # noqa: ANN001, ANN202
    return world.run(lambda rank: _ddp.run_distributed(task, scorer, grid, request))


@pytest.mark.parametrize("k, positive_ranks", [(3, False), (0, False), (4, True)])
def test_an_idle_process_takes_part_with_empty_blocks(thread_world, k: int, positive_ranks: bool) -> None:  # noqa: ANN001
    """More processes than query blocks (3 processes, 2 blocks): the idle one sends well-shaped empty blocks, and
    every process gets the one-process result."""
    labels = torch.arange(24) % 5
    qm = torch.arange(24) < 10
    task, scorer, grid = _search_inputs(qm, 4, labels, query_block=6)
    assert grid.num_blocks(task) == 2
    request = SearchRequest(k=k, rank_ks=(1, 2), exact_scores=True, positive_ranks=positive_ranks)
    want, _ = run_search(task, scorer, grid, request)
    for got, pairs in _distributed(thread_world(3), task, scorer, grid, request):
        _same_result(got, want)
        assert pairs is None


def test_every_positive_rank_from_processes_of_unequal_widths(thread_world) -> None:  # noqa: ANN001
    """``map``'s ranks of every positive: the processes' blocks hold queries with 1 and with 5 positives (blocks of
    other widths), the gathered ranks have the one-process width and values."""
    one, zeros = torch.arange(1, 7), torch.zeros
    labels = torch.cat([one, zeros(6, dtype=torch.long), one, zeros(5, dtype=torch.long)])
    qm = torch.arange(23) < 12  # queries: 6 of 6 classes with one positive each, then 6 of class 0 (5 positives)
    task, scorer, grid = _search_inputs(qm, 5, labels, query_block=6)
    assert [int(task.num_relevant[grid.block_rows(task, b)].max()) for b in range(2)] == [1, 5]
    request = SearchRequest(k=2, rank_ks=(1,), exact_scores=True, positive_ranks=True)
    want, _ = run_search(task, scorer, grid, request)
    assert want.positive_ranks.shape[1] == int(task.num_relevant.max())
    for got, _ in _distributed(thread_world(2), task, scorer, grid, request):
        _same_result(got, want)


@pytest.mark.parametrize("query_mask", [None, torch.arange(40) % 3 == 0], ids=["all-vs-all", "in-shop"])
def test_pair_thresholds_repaired_across_processes(thread_world, monkeypatch, query_mask) -> None:  # noqa: ANN001
    """``fnmr@fmr`` when the planned windows miss every threshold: the exact repair (a histogram of every process's
    pairs, summed over the processes) gives the one-process figures; all-vs-all takes the symmetric tile split."""
    labels = torch.arange(40) % 6
    task, scorer, grid = _search_inputs(query_mask, 6, labels, query_block=8)
    assert grid.symmetric(task) == (query_mask is None)
    fmrs = (Fraction(1, 20), Fraction(1, 4))
    request = SearchRequest(k=3, rank_ks=(1, 4), exact_scores=True, fmrs=fmrs, positive_ranks=query_mask is None)
    want, want_pairs = run_search(task, scorer, grid, request)
    calls = []

    def missing(task, scorer, grid, fmrs, neg_total, bound, **kw):  # noqa: ANN001, ANN202
        calls.append(1)
        return _ddp.make_windows([2.0] * len(fmrs), [3.0] * len(fmrs), bound, task.device)  # far above every score

    monkeypatch.setattr(_ddp, "plan_windows", missing)
    for got, pairs in _distributed(thread_world(2), task, scorer, grid, request):
        _same_result(got, want)
        assert pairs == want_pairs
    assert len(calls) == 2
