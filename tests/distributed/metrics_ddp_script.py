"""2-process (gloo, CPU) check that RetrievalMetrics under DDP equals the single-process result exactly.

Run as a script, ``metrics_ddp_script.py [WORLD [MODE]]`` (default 2; tests/test_metrics_ddp.py runs 2 and 3
processes in a subprocess). 1,001 samples are sharded like
DistributedSampler(shuffle=True, drop_last=False): the shards are padded by repeating items, arrive in a
shuffled order and in uneven batches. Every figure must equal the single-process one to the last digit, for
all-vs-all mode (with clustering, 2 k-means seeds split across the processes) and In-Shop mode.
Prints "DDP-METRICS-OK" from rank 0 on success; exits non-zero on any mismatch.

MODE (default ``plain``) sets how each process chooses the search precision:

* ``mixed``: rank 0 asks for ``precision="bf16"``, the others for ``"fp32"`` (settings that disagree): every rank
  must raise the same clear ``ValueError`` (printed as "DDP-PRECISION-REJECTED") instead of mixing precisions;
* ``tasks``: own retrieval tasks (issue 20): label sets, sequences, categories, query and gallery sets that
  overlap, and every opt-in metric (Precision@K, MRR, NDCG@K, MAP, FNMR@FMR);
* ``tasks-repair``: ``tasks`` with pair-score windows that miss every threshold (patched): the exact repair (a
  histogram pass over every process's tiles) must give the same figures;
* ``auto-probe``: every rank asks for ``"auto"`` but ``"auto"`` resolves to bf16 on rank 0 only (monkeypatched, as
  on a job whose processes sit on different devices): the ranks must agree on fp32 (checked) and give the
  single-process figures.
"""

from __future__ import annotations

import os
import socket
import sys
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from lightning_dml.metrics import RetrievalMetrics, functional  # noqa: E402

N, D = 1001, 48
WORLD = int(sys.argv[1]) if len(sys.argv) > 1 else 2
MODE = sys.argv[2] if len(sys.argv) > 2 else "plain"
KW = dict(recall_at=(1, 2, 4, 8, 16, 32), kmeans_seeds=2, kmeans_backend="torch", query_block=128, gallery_chunk=300)


EXTRA = ["precision@5", "mrr", "ndcg@10", "map", "fnmr@fmr=0.001", "fnmr@fmr=0.1"]


def make_data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    y = torch.randint(0, 120, (N,), generator=g)
    x = torch.randn(120, D, generator=g)[y] + 1.5 * torch.randn(N, D, generator=g)
    x[100:110] = x[7]  # exact duplicates: ties resolved by index
    qm = torch.rand(N, generator=g) < 0.4
    return x, y, qm


def task_inputs() -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    """MODE tasks: label sets (a second label for a third of the items), sequence and category ids, and a gallery
    mask that overlaps the query mask."""
    x, y, qm = make_data()
    g = torch.Generator().manual_seed(1)
    second = torch.where(torch.rand(N, generator=g) < 0.33, torch.randint(0, 120, (N,), generator=g), -1)
    extra = {
        "sequence": torch.randint(-1, 150, (N,), generator=g),
        "category": torch.randint(0, 4, (N,), generator=g),
    }
    gm = ~qm | (torch.rand(N, generator=g) < 0.2)
    return torch.stack([y, second], 1), extra, gm


def metrics_objects() -> tuple[RetrievalMetrics, RetrievalMetrics]:
    """The all-vs-all and the query/gallery metric of this MODE."""
    opts = {"metrics": EXTRA, "category_names": ["a", "b", "c", "d"]} if MODE.startswith("tasks") else {}
    shop_kw = {k: v for k, v in KW.items() if k != "kmeans_seeds"}
    # the all-vs-all metric also at a nested width (issue 31): retrieval and k-means of the cut, == one process
    return RetrievalMetrics(**KW, **opts, widths=[16]), RetrievalMetrics(clustering=False, **shop_kw, **opts)


def feed(m: RetrievalMetrics, shop: RetrievalMetrics, b: torch.Tensor | None, indices: bool) -> None:
    """Update both metrics with the rows ``b`` (all rows when None), with the MODE's inputs."""
    x, y, qm = make_data()
    labels, extra, gm = task_inputs() if MODE.startswith("tasks") else (y, {}, ~qm)
    b = torch.arange(N) if b is None else b
    kw = {name: t[b] for name, t in extra.items()}
    if indices:
        kw["indices"] = b
    m.update(x[b], labels[b], **kw)
    shop.update(x[b], labels[b], query_mask=qm[b], gallery_mask=gm[b], **kw)


def single_process() -> tuple[dict, dict]:
    m, shop = metrics_objects()
    feed(m, shop, None, indices=False)
    if MODE.startswith("tasks"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # nmi/f1 are skipped with label sets
            return m.compute(), shop.compute()
    return m.compute(), shop.compute()


def shard(rank: int) -> torch.Tensor:
    """DistributedSampler(shuffle=True, seed=0) indices of this rank: padded to a multiple of WORLD."""
    g = torch.Generator().manual_seed(0)
    order = torch.randperm(N, generator=g)
    total = -(-N // WORLD) * WORLD
    order = torch.cat([order, order[: total - N]])
    return order[rank:total:WORLD]


def precision_settings(rank: int) -> tuple[dict, list[str]]:
    """The ``precision`` argument of this rank in MODE, and a list that records the precisions the search used."""
    used: list[str] = []
    if MODE == "tasks-repair":
        from lightning_dml.metrics import _ddp

        def wrong(task, scorer, grid, fmrs, neg_total, bound, **kw):  # windows far above every threshold
            return _ddp.make_windows([2.0] * len(fmrs), [3.0] * len(fmrs), bound, task.device)

        _ddp.plan_windows = wrong
        histogram = _ddp.histogram_pass

        def counted(*args, **kw):
            print(f"rank {rank} REPAIR-PASS", flush=True)
            return histogram(*args, **kw)

        _ddp.histogram_pass = counted
    if MODE in ("plain", "tasks", "tasks-repair"):
        return {}, used
    original = functional.Scorer

    def recording_scorer(x: torch.Tensor, metric: str, precision: str) -> object:
        used.append(precision)
        return original(x, metric, precision)

    functional.Scorer = recording_scorer
    if MODE == "mixed":
        return {"precision": "bf16" if rank == 0 else "fp32"}, used
    if MODE == "auto-probe":
        resolve = functional.resolve_precision  # "auto" resolves differently on rank 0
        functional.resolve_precision = lambda p, device: "bf16" if rank == 0 and p == "auto" else resolve(p, device)
        return {"precision": "auto"}, used
    raise SystemExit(f"unknown mode {MODE!r}")


def worker(rank: int, port: int, expected: tuple[dict, dict]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    idx = shard(rank)
    precision, used = precision_settings(rank)
    m, shop = metrics_objects()
    for metric in (m, shop):
        metric.precision = precision.get("precision", metric.precision)
    sizes = [97, 3, 200, 501]  # uneven batches (each shard has at most 501 items)
    start = 0
    for s in sizes:
        b = idx[start : start + s]
        start += s
        if b.numel() == 0:
            continue
        feed(m, shop, b, indices=True)
    warnings.simplefilter("ignore")  # nmi/f1 skipped with label sets (MODE tasks)
    if MODE == "mixed":
        try:
            m.compute()
        except ValueError as error:
            ok = "different precision" in str(error) and "rank 0: 'bf16'" in str(error) and not used
            print(f"rank {rank} {'DDP-PRECISION-REJECTED' if ok else 'WRONG-ERROR'}: {error}", flush=True)
            dist.destroy_process_group()
            sys.exit(0 if ok else 1)
        print(f"rank {rank} MISMATCH: mixed precisions were not rejected", flush=True)
        sys.exit(1)
    out, out_shop = m.compute(), shop.compute()
    bad = []
    if MODE == "auto-probe" and set(used) != {"fp32"}:
        bad.append(f"auto-probe: the search used {used}, not the agreed fp32")
    for name, got, exp in (("all-vs-all", out, expected[0]), ("in-shop", out_shop, expected[1])):
        if set(got) != set(exp):
            bad.append(f"{name}: keys {sorted(got)} != {sorted(exp)}")
        for key in exp:
            if got.get(key) != exp[key]:
                bad.append(f"{name} {key}: ddp={got.get(key)!r} single={exp[key]!r}")
    dist.barrier()
    dist.destroy_process_group()
    if bad:
        print(f"rank {rank} MISMATCH:\n" + "\n".join(bad), flush=True)
        sys.exit(1)
    if rank == 0:
        print("DDP-METRICS-OK", out, out_shop, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    torch.set_num_threads(1)
    expected = single_process()
    mp.spawn(worker, args=(free_port(), expected), nprocs=WORLD, join=True)
