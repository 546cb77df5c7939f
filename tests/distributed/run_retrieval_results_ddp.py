"""2 gloo processes on the CPU: RetrievalResults with ``distributed=True`` (every process passes the same set and
searches its share) equals the single-process results on every process, array for array (the pair-score histogram
included), and its Recall@K and
MAP@R equal RetrievalMetrics' under the same DDP run. Prints "RESULTS-DDP-OK" from rank 0."""

from __future__ import annotations

import os
import socket
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

from lightning_dml.metrics import RetrievalMetrics  # noqa: E402
from lightning_dml.retrieval import RetrievalResults  # noqa: E402
from tests.test_metrics_tasks import _task_data  # noqa: E402

KW = dict(top_k=6, query_block=64, gallery_chunk=90, pair_histogram_bins=16)


def worker(rank: int, port: int, expected: RetrievalResults, world: int) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x, labels, seq, cat = _task_data(n=500, seed=21, sets=True, seq=True, cat=True)
    got = RetrievalResults.compute(x, labels, sequence=seq, category=cat, distributed=True, **KW)
    bad = [name for name, value in vars(expected).items()
           if isinstance(value, np.ndarray) and not np.array_equal(value, getattr(got, name), equal_nan=value.dtype.kind == "f")]
    if got.pair_histogram != expected.pair_histogram:  # the exact pair counts, summed over the processes
        bad.append("pair_histogram")
    shard = torch.arange(rank, 500, world)
    m = RetrievalMetrics(clustering=False, recall_at=(1, 2, 4))
    m.update(x[shard], labels[shard], indices=shard, sequence=seq[shard], category=cat[shard])
    figures = m.compute()
    for k in (1, 2, 4):
        if got.recall_at(k) != figures[f"recall@{k}"]:
            bad.append(f"recall@{k}")
    if got.map_at_r() != figures["map@r"]:
        bad.append("map@r")
    dist.barrier()
    dist.destroy_process_group()
    if bad:
        print(f"rank {rank} MISMATCH {bad}", flush=True)
        sys.exit(1)
    if rank == 0:
        print("RESULTS-DDP-OK", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    x, labels, seq, cat = _task_data(n=500, seed=21, sets=True, seq=True, cat=True)
    single = RetrievalResults.compute(x, labels, sequence=seq, category=cat, **KW)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port, single, 2), nprocs=2, join=True)
