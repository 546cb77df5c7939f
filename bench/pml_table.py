"""The one protocol of ``bench/losses_part3{a,b,c}.py``: ours and pytorch-metric-learning's loss timed interleaved
on the same embeddings and labels (``bench/losses.py``'s ``run_once`` and ``CLOCKS``), the values compared first,
and the markdown table (or JSON lines) those scripts print. Each script only builds its cases."""

from __future__ import annotations

import argparse
import json
import statistics
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from losses import CLOCKS, run_once

Pair = Tuple[Callable, Callable]


def time_pair(ours: Callable, theirs: Callable, data: torch.Tensor, labels: torch.Tensor, repeats: int, clock: str,
              with_pml: bool, value_pair: Optional[Callable[[], Pair]]) -> Dict[str, float]:
    """Median forward + backward seconds of ``ours`` and ``theirs`` (pml's, only ``with_pml``), interleaved after
    one warm-up each, and the relative difference of the values of ``value_pair()`` (``None``: not comparable;
    a callable so that stateful losses can be compared as fresh copies)."""
    tick = CLOCKS[clock]
    run_once(ours, data, labels, "cpu", tick)  # warm-up
    diff = float("nan")
    if with_pml:
        run_once(theirs, data, labels, "cpu", tick)
        if value_pair is not None:
            a, b = value_pair()
            with torch.no_grad():
                mine, other = float(a(data, labels)), float(b(data, labels))
            diff = abs(mine - other) / max(abs(other), 1e-12)
    t_ours: List[float] = []
    t_pml: List[float] = []
    for _ in range(repeats):
        t_ours.append(run_once(ours, data, labels, "cpu", tick))
        if with_pml:
            t_pml.append(run_once(theirs, data, labels, "cpu", tick))
    mo = statistics.median(t_ours)
    mp = statistics.median(t_pml) if t_pml else float("nan")
    return {"ours_ms": 1e3 * mo, "pml_ms": 1e3 * mp, "ratio": mo / mp, "value_rel_diff": diff}


def main(description: str, cases: Sequence[str],
         time_case: Callable[[str, int, int, int, int, str], Dict[str, float]]) -> None:
    """The command line of a part-3 script: ``time_case(case, batch, dim, repeats, num_classes, clock)`` per row."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--cases", nargs="+", default=list(cases), choices=list(cases))
    parser.add_argument("--batch", nargs="+", type=int, default=[512, 2048])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--num-classes", type=int, default=11318)
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--json", action="store_true", help="one JSON line per case instead of the table")
    args = parser.parse_args()
    torch.manual_seed(0)
    if not args.json:
        print(f"torch threads {torch.get_num_threads()}, clock {args.clock}, dim {args.dim}, repeats {args.repeats}")
        print("| loss | B | ours ms | pml ms | ours/pml | value rel. diff |")
        print("|---|---|---|---|---|---|")
    for case in args.cases:
        for batch in args.batch:
            row = time_case(case, batch, args.dim, args.repeats, args.num_classes, args.clock)
            if args.json:
                print(json.dumps({"case": case, "batch": batch, **row}), flush=True)
            else:
                print(f"| {case} | {batch} | {row['ours_ms']:.1f} | {row['pml_ms']:.1f} | {row['ratio']:.3f} | "
                      f"{row['value_rel_diff']:.1e} |", flush=True)
