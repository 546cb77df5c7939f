"""Memory of ArcFace with many classes: one process holding all class centres vs Partial FC's ``sharded=True`` under
W gloo processes, with and without ``sample_rate`` (issue 28 s.4).

Every row runs in fresh processes (``torch.multiprocessing`` spawn, one thread each). Per process it reports: the
peak RSS (``getrusage`` max RSS: everything the process held, torch and the interpreter included), the centres'
parameter size, what the loss step (forward + backward, the centres' gradient included) added to the RSS, the bytes
the autograd graph saved for the backward (``saved_tensors_hooks``: the logits-sized buffers and the centre copies),
and the wall time of the measured step. The global batch is the same in every row (``--batch``, split evenly).

    python bench/partial_fc.py --classes 1000000 --dim 512 --batch 64 --world 2 --sample-rate 0.1

prints one markdown table row per configuration (1 process unsharded; W processes sharded; W processes sampled).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _worker(rank: int, world: int, store: str, args: argparse.Namespace, sharded: bool, rate: float, out) -> None:
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from lightning_dml.losses import ArcFaceLoss

    g = torch.Generator().manual_seed(rank)
    local = args.batch // world
    x = torch.randn(local, args.dim, generator=g, requires_grad=True)
    y = torch.randint(0, args.classes, (local,), generator=g)
    ArcFaceLoss(8, args.dim, sharded=sharded)(x[:4], y[:4] % 8).backward()  # loads the code paths
    x.grad = None
    before_loss = _rss_mib()
    loss = ArcFaceLoss(args.classes, args.dim, sharded=sharded, sample_rate=rate)
    params_mib = loss.proxies.numel() * 4 / 2**20
    before_step = _rss_mib()
    saved = [0]

    seen: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:  # each storage once (a parameter saved twice is one buffer)
        key = t.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            saved[0] += t.untyped_storage().nbytes()
        return t

    start = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        value = loss(x, y)
    value.backward()
    step_s = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    row = {
        "rank": rank, "peak_rss_mib": peak, "params_mib": params_mib, "loss_setup_mib": before_step - before_loss,
        "step_added_mib": peak - before_step, "saved_mib": saved[0] / 2**20, "step_s": step_s,
        "value": value.item(),
    }
    out.put(row)
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()


def _run(world: int, args: argparse.Namespace, sharded: bool, rate: float) -> list[dict]:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "store"), args, sharded, rate, out))
            for r in range(world)
        ]
        for p in procs:
            p.start()
        rows = [out.get() for _ in procs]
        for p in procs:
            p.join()
    return sorted(rows, key=lambda r: r["rank"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--classes", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--batch", type=int, default=64, help="global batch (split over the processes)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--sample-rate", type=float, default=0.1)
    args = parser.parse_args()
    print(f"ArcFace, {args.classes} classes x {args.dim}, global batch {args.batch}, fp32, CPU, 1 thread/process")
    print("| configuration | process | peak RSS (MiB) | centres (MiB) | step adds (MiB) | graph saved (MiB) "
          "| step s | loss |")
    print("|---|---|---|---|---|---|---|---|")
    configs = [
        ("1 process, all centres", 1, False, 1.0),
        (f"{args.world} processes, sharded", args.world, True, 1.0),
        (f"{args.world} processes, sharded, sample_rate={args.sample_rate}", args.world, True, args.sample_rate),
    ]
    for label, world, sharded, rate in configs:
        for row in _run(world, args, sharded, rate):
            print(f"| {label} | {row['rank']} | {row['peak_rss_mib']:.0f} | {row['params_mib']:.0f} | "
                  f"{row['step_added_mib']:.0f} | {row['saved_mib']:.0f} | {row['step_s']:.2f} | "
                  f"{row['value']:.4f} |", flush=True)


if __name__ == "__main__":
    main()
