"""Peak memory and time of one loss step (forward + backward) with and without ``anchor_chunk_size``.

Each row runs in a fresh subprocess (CPU: the peak RSS of that process, minus its RSS just before the step, so the
figure is what the loss step adds; CUDA: ``torch.cuda.max_memory_allocated`` over the step), after a tiny warm-up
call that loads the code paths. Time: the median of ``--repeats`` steps after the measured one, as wall-clock and as
the process's CPU time (with ``--threads 1``, the default, CPU time is robust to other load on the machine).

    python bench/anchor_chunks.py --batch 1024 4096 --chunk 0 512 --losses multi_similarity supcon

prints one markdown table row per (loss, batch, chunk); ``--chunk 0`` is the unchunked loss.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _row(loss_name: str, batch: int, chunk: int, dim: int, repeats: int, device: str, threads: int) -> dict:
    import torch

    from lightning_dml.losses import LOSSES

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    classes = max(batch // 4, 2)
    labels = (torch.arange(batch) % classes).to(device)
    x = torch.randn(batch, dim, device=device, requires_grad=True)
    loss = LOSSES[loss_name](anchor_chunk_size=chunk or None)
    small = torch.randn(16, dim, device=device, requires_grad=True)
    LOSSES[loss_name](anchor_chunk_size=8)(small, labels[:16] % 4).backward()  # loads both code paths
    loss(small, labels[:16] % 4).backward()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_mib()
    loss(x, labels).backward()
    if device == "cuda":
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0 - base
    times, cpu = [], []
    for _ in range(repeats):
        x.grad = None
        t, c = time.perf_counter(), time.process_time()
        loss(x, labels).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        cpu.append(time.process_time() - c)
    return {"loss": loss_name, "batch": batch, "chunk": chunk, "peak_mib": peak, "step_s": statistics.median(times),
            "cpu_s": statistics.median(cpu)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--losses", nargs="+", default=["multi_similarity", "supcon"])
    p.add_argument("--batch", nargs="+", type=int, default=[1024, 4096])
    p.add_argument("--chunk", nargs="+", type=int, default=[0, 512])
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--row", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.row:
        name, batch, chunk = args.row.split(",")
        print(json.dumps(_row(name, int(batch), int(chunk), args.dim, args.repeats, args.device, args.threads)))
        return 0
    print("| loss | B | anchor_chunk_size | peak memory of the step (MiB) | wall s / step | CPU s / step "
          "| CPU / unchunked |")
    print("|---|---|---|---|---|---|---|")
    for name in args.losses:
        for batch in args.batch:
            plain = None
            for chunk in args.chunk:
                cmd = [sys.executable, __file__, "--row", f"{name},{batch},{chunk}", "--dim", str(args.dim),
                       "--repeats", str(args.repeats), "--device", args.device, "--threads", str(args.threads)]
                out = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
                plain = out["cpu_s"] if chunk == 0 else plain
                ratio = f"{out['cpu_s'] / plain:.2f}" if plain else "-"
                print(f"| {name} | {batch} | {chunk or 'none'} | {out['peak_mib']:.0f} | {out['step_s']:.3f} | "
                      f"{out['cpu_s']:.3f} | {ratio} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
