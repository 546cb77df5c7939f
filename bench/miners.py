"""Time of the miners (``lightning_dml.miners``) against pytorch-metric-learning's (pml 2.9).

Usage::

    OMP_NUM_THREADS=1 python bench/miners.py                          # B = 512 and 2048, dim 512, CPU
    OMP_NUM_THREADS=1 python bench/miners.py --batch 512 --cases batch_hard hdc --repeats 9 --clock thread
    python bench/miners.py --device cuda

For every (miner, batch) ours and pml's run interleaved (ours, pml, ours, pml, ...) on the same embeddings and
P x 4 labels, ``--repeats`` times each after one warm-up; the medians are reported with their ratio (ours / pml; < 1
means faster). A miner has no backward: one call is the time. Before timing, the tuples of the deterministic miners
are checked to be the same number (``tuples``: ours = pml's), the random ones' counts are printed. pml enumerates
every triplet through a ``B x B x B`` mask for ``triplet_margin`` and ``angular`` (``get_all_triplets_indices``): not
run above ``PML_MAX_BATCH`` (8.6e9 bytes at B = 2048); ours gathers each anchor's positives (``[B, K, N]``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Callable, Dict, List, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from losses import CLOCKS, _sync  # noqa: E402  (bench/losses.py: the shared clocks)

CASES = ["batch_hard", "batch_easy_hard", "triplet_margin", "triplet_margin_semihard", "pair_margin",
         "multi_similarity", "angular", "hdc", "uniform_histogram", "distance_weighted"]
RANDOM = {"uniform_histogram", "distance_weighted"}
#: pml enumerates all triplets through a B x B x B mask for these: not run above this batch
PML_MAX_BATCH = {"triplet_margin": 512, "triplet_margin_semihard": 512, "angular": 512}


def make_pair(case: str) -> Tuple[Callable, Callable]:
    """(ours, pml) miners with the same settings."""
    import pytorch_metric_learning.miners as pml

    from lightning_dml import miners as ours

    pairs = {
        "batch_hard": (ours.BatchHardMiner(), pml.BatchHardMiner()),
        "batch_easy_hard": (ours.BatchEasyHardMiner(), pml.BatchEasyHardMiner()),
        "triplet_margin": (ours.TripletMarginMiner(0.2, "all"), pml.TripletMarginMiner(0.2)),
        "triplet_margin_semihard": (ours.TripletMarginMiner(0.2, "semihard"),
                                    pml.TripletMarginMiner(0.2, type_of_triplets="semihard")),
        "pair_margin": (ours.PairMarginMiner(), pml.PairMarginMiner()),
        "multi_similarity": (ours.MultiSimilarityMiner(), pml.MultiSimilarityMiner()),
        "angular": (ours.AngularMiner(20), pml.AngularMiner(20)),
        "hdc": (ours.HDCMiner(), pml.HDCMiner()),
        "uniform_histogram": (ours.UniformHistogramMiner(), pml.UniformHistogramMiner()),
        "distance_weighted": (ours.DistanceWeightedMiner(), pml.DistanceWeightedMiner()),
    }
    if case not in pairs:
        raise ValueError(f"unknown case {case!r}; cases: {', '.join(CASES)}")
    return pairs[case]


def make_data(batch: int, dim: int, device: str, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    """Unit-norm embeddings (pml's AngularMiner reads raw ones) and P x 4 labels."""
    g = torch.Generator().manual_seed(seed)
    labels = (torch.arange(batch) // 4)[torch.randperm(batch, generator=g)]
    x = torch.nn.functional.normalize(torch.randn(batch, dim, generator=g), dim=1)
    return x.to(device), labels.to(device)


def run_once(fn: Callable, data: torch.Tensor, labels: torch.Tensor, device: str, clock: Callable[[], float]):
    _sync(device)
    start = clock()
    out = fn(data, labels)
    _sync(device)
    return clock() - start, out


def time_case(case: str, batch: int, dim: int, repeats: int, device: str, clock: str) -> Dict[str, float]:
    ours, theirs = make_pair(case)
    data, labels = make_data(batch, dim, device)
    with_pml = batch <= PML_MAX_BATCH.get(case, batch)
    tick = CLOCKS[clock]
    _, mine = run_once(ours, data, labels, device, tick)  # warm-up
    n_ours, n_pml = sum(len(t) for t in mine), float("nan")
    if with_pml:
        _, other = run_once(theirs, data, labels, device, tick)
        n_pml = sum(len(t) for t in other)
        if case not in RANDOM and n_ours != n_pml:
            raise AssertionError(f"{case} B={batch}: {n_ours} indices ours, {n_pml} pml's")
    t_ours: List[float] = []
    t_pml: List[float] = []
    for _ in range(repeats):
        t_ours.append(run_once(ours, data, labels, device, tick)[0])
        if with_pml:
            t_pml.append(run_once(theirs, data, labels, device, tick)[0])
    mo = statistics.median(t_ours)
    mp = statistics.median(t_pml) if t_pml else float("nan")
    return {"ours_ms": 1e3 * mo, "pml_ms": 1e3 * mp, "ratio": mo / mp, "indices_ours": n_ours, "indices_pml": n_pml}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cases", nargs="+", default=CASES, choices=CASES)
    parser.add_argument("--batch", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--json", action="store_true", help="one JSON line per case instead of the table")
    args = parser.parse_args()
    torch.manual_seed(0)
    if not args.json:
        print(f"torch threads {torch.get_num_threads()}, device {args.device}, clock {args.clock}, dim {args.dim}, "
              f"repeats {args.repeats}")
        print("| miner | B | ours ms | pml ms | ours/pml | indices (ours / pml) |")
        print("|---|---|---|---|---|---|")
    for case in args.cases:
        for batch in args.batch:
            row = time_case(case, batch, args.dim, args.repeats, args.device, args.clock)
            if args.json:
                print(json.dumps({"case": case, "batch": batch, **row}), flush=True)
            else:
                n_pml = "-" if row["indices_pml"] != row["indices_pml"] else int(row["indices_pml"])
                print(f"| {case} | {batch} | {row['ours_ms']:.1f} | {row['pml_ms']:.1f} | {row['ratio']:.3f} | "
                      f"{int(row['indices_ours'])} / {n_pml} |", flush=True)


if __name__ == "__main__":
    main()
