"""Forward + backward time and peak memory of our pair losses against pytorch-metric-learning (pml).

Usage::

    OMP_NUM_THREADS=1 python bench/losses.py                      # all cases, batch 80/512/2048, dim 512
    python bench/losses.py --batch 512 --cases multi_similarity contrastive --repeats 9
    python bench/losses.py --device cuda                           # when a GPU is present (default: auto)

Timing: for every (case, batch) the two implementations run interleaved (ours, pml, ours, pml, ...) on the same
embeddings and labels, ``--repeats`` times each after one warm-up, and the medians are reported with their ratio
(ours / pml; < 1 means faster). One run = build the loss input (the same leaf tensor), forward, backward.
Peak memory: each (case, batch, implementation) runs once more in a fresh subprocess, and the process's peak
resident set size is reported together with its value just before the loss ran (imports and data included; the
high-water mark is reset there through ``/proc/self/clear_refs``), so the difference is the loss's own peak.
The peak is ``VmHWM`` from ``/proc/self/status`` (see ``_rss_mb`` for why not ``ru_maxrss`` in a child process;
``ru_maxrss`` is the fallback). On CUDA the peak is
``torch.cuda.max_memory_allocated`` instead.

Labels form a P x K batch (K = 4; K = 2 for N-pair, whose batch is N pairs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Callable, Dict, List, Tuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

CASES = [
    "multi_similarity",
    "contrastive",
    "triplet",
    "npair",
    "triplet_batch_hard",
    "lifted_structure",
    "generalized_lifted",
    "tuplet_margin",
]
TARGETED = {"multi_similarity", "contrastive", "triplet", "npair"}
#: pml builds a (positive pairs) x (negative pairs) matrix for these (0.4e9 floats at B = 512, 26e9 at B = 2048):
#: more than 8 minutes for one B = 512 case on the shared CPU, so pml is run at B = 80 only
PML_MAX_BATCH = {"lifted_structure": 80, "tuplet_margin": 80}


def make_pair(case: str) -> Tuple[Callable, Callable]:
    """(ours, pml) callables ``f(embeddings, labels) -> loss`` with the same definition."""
    from pytorch_metric_learning import distances as pd
    from pytorch_metric_learning import losses as pl
    from pytorch_metric_learning import miners as pm

    from lightning_dml import losses as ours

    if case == "multi_similarity":
        loss, miner = pl.MultiSimilarityLoss(alpha=2.0, beta=50.0, base=0.5), pm.MultiSimilarityMiner(epsilon=0.1)
        return ours.MultiSimilarityLoss(), lambda e, y: loss(e, y, miner(e, y))
    if case == "contrastive":
        return ours.ContrastiveLoss(), pl.ContrastiveLoss(pos_margin=0.0, neg_margin=0.8)
    if case == "triplet":
        return ours.TripletLoss(margin=0.1), pl.TripletMarginLoss(margin=0.1)
    if case == "triplet_batch_hard":
        loss, miner = pl.TripletMarginLoss(margin=0.1), pm.BatchHardMiner()
        return ours.TripletLoss(margin=0.1, mining="batch_hard"), lambda e, y: loss(e, y, miner(e, y))
    if case == "npair":
        return ours.NPairLoss(l2_reg=0.0), pl.NPairsLoss(distance=pd.DotProductSimilarity(normalize_embeddings=False))
    if case == "lifted_structure":
        return ours.LiftedStructureLoss(margin=1.0), pl.LiftedStructureLoss(neg_margin=1.0, pos_margin=0.0)
    if case == "generalized_lifted":
        return (ours.LiftedStructureLoss(margin=1.0, variant="generalized"),
                pl.GeneralizedLiftedStructureLoss(neg_margin=1.0, pos_margin=0.0))
    if case == "tuplet_margin":
        tml, ipv = pl.TupletMarginLoss(margin=math.degrees(0.1), scale=64.0), pl.IntraPairVarianceLoss()
        return ours.TupletMarginLoss(negatives="all"), lambda e, y: tml(e, y) + 0.5 * ipv(e, y)
    raise ValueError(f"unknown case {case!r}; valid: {CASES}")


def make_data(case: str, batch: int, dim: int, device: str, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = 2 if case == "npair" else 4
    labels = (torch.arange(batch) // k)[torch.randperm(batch, generator=g)]
    return torch.randn(batch, dim, generator=g).to(device), labels.to(device)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_once(fn: Callable, data: torch.Tensor, labels: torch.Tensor, device: str) -> float:
    emb = data.clone().requires_grad_(True)
    _sync(device)
    start = time.perf_counter()
    fn(emb, labels).backward()
    _sync(device)
    return time.perf_counter() - start


def pml_runs(case: str, batch: int) -> bool:
    return batch <= PML_MAX_BATCH.get(case, batch)


def time_case(case: str, batch: int, dim: int, repeats: int, device: str, plain: bool = False) -> Dict[str, float]:
    ours, theirs = make_pair(case)
    if plain and hasattr(ours, "closed_form"):
        ours.closed_form = False  # plain masked composition differentiated by autograd
    data, labels = make_data(case, batch, dim, device)
    with_pml = pml_runs(case, batch)
    run_once(ours, data, labels, device)  # warm-up
    if with_pml:
        run_once(theirs, data, labels, device)
    t_ours: List[float] = []
    t_pml: List[float] = []
    for _ in range(repeats):
        t_ours.append(run_once(ours, data, labels, device))
        if with_pml:
            t_pml.append(run_once(theirs, data, labels, device))
    mo = statistics.median(t_ours)
    mp = statistics.median(t_pml) if t_pml else float("nan")
    return {"ours_ms": 1e3 * mo, "pml_ms": 1e3 * mp, "ratio": mo / mp}


def _rss_mb() -> float:
    """Peak RSS in MiB of this process's address space.

    ``getrusage(RUSAGE_SELF).ru_maxrss`` of a child started by this script inherits the *parent's* peak through
    fork/exec (Linux merges the pre-exec memory map's high-water mark), which would hide the loss's own peak; so
    the per-mm high-water mark ``VmHWM`` of ``/proc/self/status`` is read where available (the same quantity for a
    fresh address space, and resettable), with ``ru_maxrss`` as the fallback.
    """
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # KiB on Linux


def _reset_peak_rss() -> bool:
    """Reset the process's RSS high-water mark (Linux >= 4.0: ``echo 5 > /proc/self/clear_refs``), so that the
    peak after the run is the loss's own peak and not the one of the imports."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def memory_child(case: str, impl: str, batch: int, dim: int, device: str) -> None:
    """Runs in a fresh process: prints JSON {before, peak} in MiB."""
    ours, theirs = make_pair(case)
    data, labels = make_data(case, batch, dim, device)
    fn = ours if impl == "ours" else theirs
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.max_memory_allocated() / 2**20
        run_once(fn, data, labels, device)
        peak = torch.cuda.max_memory_allocated() / 2**20
    else:
        _reset_peak_rss()
        before = _rss_mb()
        run_once(fn, data, labels, device)
        peak = _rss_mb()
    print(json.dumps({"before": before, "peak": peak}))


def measure_memory(case: str, impl: str, batch: int, dim: int, device: str) -> Dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", case, impl, str(batch), "--dim", str(dim),
           "--device", device]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        return {"before": float("nan"), "peak": float("nan"), "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--batch", nargs="+", type=int, default=[80, 512, 2048])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-case memory subprocesses")
    parser.add_argument("--plain", action="store_true",
                        help="time our plain masked autograd path instead of the closed-form backward")
    parser.add_argument("--json", default=None, help="also write the raw results to this file")
    parser.add_argument("--memory-child", nargs=3, metavar=("CASE", "IMPL", "BATCH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        case, impl, batch = args.memory_child
        memory_child(case, impl, int(batch), args.dim, args.device)
        return

    import pytorch_metric_learning

    print(f"# torch {torch.__version__}, pytorch-metric-learning {pytorch_metric_learning.__version__}, "
          f"device {args.device}, threads {torch.get_num_threads()}, dim {args.dim}, repeats {args.repeats}"
          f"{', ours = plain autograd path' if args.plain else ''}")
    mem_unit = "MiB CUDA peak" if args.device.startswith("cuda") else "MiB peak RSS (before loss)"
    print(f"| loss | B | ours ms | pml ms | ours/pml | ours {mem_unit} | pml {mem_unit} |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    rows = []
    for case in args.cases:
        for batch in args.batch:
            res = time_case(case, batch, args.dim, args.repeats if batch < 2048 else max(3, args.repeats // 2),
                            args.device, plain=args.plain)
            mem = {}
            if not args.no_memory:
                for impl in ("ours", "pml") if pml_runs(case, batch) else ("ours",):
                    mem[impl] = measure_memory(case, impl, batch, args.dim, args.device)

            def fmt(m):
                if not m:
                    return "-"
                return f"{m['peak']:.0f} ({m['before']:.0f})"

            flag = " *" if case in TARGETED and batch >= 512 else ""
            print(f"| {case}{flag} | {batch} | {res['ours_ms']:.2f} | {res['pml_ms']:.2f} | {res['ratio']:.2f} | "
                  f"{fmt(mem.get('ours'))} | {fmt(mem.get('pml'))} |", flush=True)
            rows.append({"case": case, "batch": batch, **res, "memory": mem})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
