"""2 gloo processes on the CPU: each retrieval metric asked for alone (``mrr`` alone included: its first relevant
rank must be exact for every query, not only around the K of Recall@K) under ``distributed=True`` equals the
single-process run and the float64 brute force, all-vs-all (symmetric tiles, merged band counts) and
query/gallery with label sets (query blocks split over the processes), in bf16 (wide bands: many ranks for the
exact pass). Prints "METRICS-ALONE-DDP-OK" from rank 0 (tests/test_metrics_combinations.py runs it)."""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from lightning_dml.metrics import functional as F  # noqa: E402
from tests.test_metrics_combinations import ITEMS, _brute, _case, _options  # noqa: E402

CASES = ("ties-euclidean-bf16-symmetric", "sets-sequences-categories-query-gallery")


def runs() -> dict[tuple[str, tuple[str, ...]], dict[str, float]]:
    return {(case, items): None for case in CASES for items in [(i,) for i in ITEMS] + [ITEMS]}


def worker(rank: int, port: int, expected: dict, world: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    bad = []
    for (case, items), want in expected.items():
        x, labels, opts = _case(case)
        got = F.retrieval_metrics(x, labels, **_options(items), **opts, distributed=True)
        if got != want:
            bad.append((case, items, {k: (v, want.get(k)) for k, v in got.items() if want.get(k) != v}))
    dist.barrier()
    dist.destroy_process_group()
    if bad:
        print(f"rank {rank} MISMATCH {bad[:3]}", flush=True)
        sys.exit(1)
    if rank == 0:
        print("METRICS-ALONE-DDP-OK", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    expected = {}
    for case, items in runs():
        x, labels, opts = _case(case)
        single = F.retrieval_metrics(x, labels, **_options(items), **opts)
        ref = _brute(x, labels, opts)
        wrong = {k: (v, ref.get(k)) for k, v in single.items() if k not in ref or abs(v - ref[k]) > 1e-12}
        if wrong:
            raise SystemExit(f"single process differs from the brute force: {case} {items} {wrong}")
        expected[(case, items)] = single
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, expected, 2), nprocs=2, join=True)
