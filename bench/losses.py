"""Forward + backward time and peak memory of our losses against pytorch-metric-learning (pml).

Usage::

    OMP_NUM_THREADS=1 python bench/losses.py                      # seed-loss cases, batch 80/512/2048, dim 512
    OMP_NUM_THREADS=1 python bench/losses.py --cases issue13 --batch 512 2048   # the losses of issue 13
    python bench/losses.py --batch 512 --cases multi_similarity contrastive --repeats 9
    python bench/losses.py --device cuda                           # when a GPU is present (default: auto)
    git worktree add /tmp/before HEAD~1                            # a checkout of the code before a change ...
    OMP_NUM_THREADS=1 python bench/losses.py --cases nca --batch 512 --compare-with /tmp/before   # ... against it

Timing: for every (case, batch) the two implementations run interleaved (ours, pml, ours, pml, ...) on the same
embeddings and labels, ``--repeats`` times each after one warm-up, and the medians are reported with their ratio
(ours / pml; < 1 means faster). One run = build the loss input (the same leaf tensor), forward, backward.
``--compare-with DIR``: before / after timing of a change. Two worker processes, one importing ``lightning_dml``
from this checkout and one from ``DIR`` (another checkout, e.g. a ``git worktree`` of the previous commit), run
the same cases of this script on the same inputs; the parent alternates their runs (ours, before, pml in each
worker, then the reverse order, ...), so that both see the same load and do the same work, and reports the medians
with ours / before and both ratios to pml (each to the pml of its own worker), and ours / before of the fastest
runs (the least disturbed on a loaded machine). ``--clock thread`` times the calling thread's CPU time instead
of the wall clock (the CPU with ``OMP_NUM_THREADS=1`` only: torch then works in that thread, and the time other
processes hold the cores is not counted; the better measure on a shared machine, though it still sees their cache
traffic). The two values are checked equal as for pml. No memory measurement.
Peak memory: each (case, batch, implementation) runs once more in a fresh subprocess, and the process's peak
resident set size is reported together with its value just before the loss ran (imports and data included; the
high-water mark is reset there through ``/proc/self/clear_refs``), so the difference is the loss's own peak.
The peak is ``VmHWM`` from ``/proc/self/status`` (see ``_rss_mb`` for why not ``ru_maxrss`` in a child process;
``ru_maxrss`` is the fallback). On CUDA the peak is
``torch.cuda.max_memory_allocated`` instead.

Labels form a P x K batch (K = 4; K = 2 for N-pair, whose batch is N pairs). The proxy and classification losses
(``PROXY_CASES``) hold ``--num-classes`` proxies (default 11,318, SOP's training classes): ours is completed to
that size and its proxies are copied into pml's loss (pml's layout, transposed where pml stores ``[dim, classes]``),
the P x K classes are drawn among all of them, and the backward also produces the proxies' gradients (reset to
``None`` before every run on both sides). pml's ArcFace / sub-centre ArcFace / angular margins are in degrees,
ours in radians: the pml side gets ``math.degrees`` of ours. Where the two definitions differ by a documented
term, the case uses the option that makes them coincide (named in ``make_pair``).
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


def _package_root() -> str:
    """The checkout whose ``lightning_dml`` is timed: this script's own, or the one given by ``--package-root``
    (the workers of ``--compare-with``)."""
    if "--package-root" in sys.argv[:-1]:
        return os.path.abspath(sys.argv[sys.argv.index("--package-root") + 1])
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


sys.path.insert(0, _package_root())

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
#: the losses of issue 13: proxy / classification losses (target <= 1.0x pml: one class-matrix product dominates
#: both) and pair / set losses (target <= 0.5x pml)
PROXY_CASES = [
    "proxy_anchor", "proxy_nca", "normalized_softmax", "cosface", "arcface", "subcenter_arcface", "soft_triple",
]
PAIRSET_CASES = ["circle", "supcon", "ntxent", "nca", "angular", "fastap", "smooth_ap", "margin", "npair_multi_positive"]
GROUPS = {"seed": CASES, "issue13": PROXY_CASES + PAIRSET_CASES}
ALL_CASES = CASES + PROXY_CASES + PAIRSET_CASES
TARGETED = {"multi_similarity", "contrastive", "triplet", "npair"}
#: target ratio ours / pml of the issue-13 losses
TARGET_RATIO = {**{c: 1.0 for c in PROXY_CASES}, **{c: 0.5 for c in PAIRSET_CASES}}
#: pml builds a (positive pairs) x (negative pairs) matrix for these (0.4e9 floats at B = 512, 26e9 at B = 2048):
#: more than 8 minutes for one B = 512 case on the shared CPU, so pml is run at B = 80 only
#: pml's NT-Xent loops over the positive pairs in Python (~30 s per B = 512 run on the shared CPU): B <= 512
PML_MAX_BATCH = {"lifted_structure": 80, "tuplet_margin": 80, "ntxent": 512}
#: peak-memory comparisons allow this much (MiB) for RSS page-granularity noise
MEMORY_SLACK_MB = 2.0
#: cases not run at all above this batch (either library): Smooth-AP's B x B x B sigmoid tensor (34 GB at 2048)
MAX_BATCH = {"smooth_ap": 512}
#: pml's layout of the proxies: (attribute, transposed) -- ours are [num_classes * proxies_per_class, dim]
PML_PROXIES = {
    "proxy_anchor": ("proxies", False), "proxy_nca": ("proxies", False), "normalized_softmax": ("W", True),
    "cosface": ("W", True), "arcface": ("W", True), "subcenter_arcface": ("W", True), "soft_triple": ("fc", True),
}


def make_pair(case: str, num_classes: int = 11318, dim: int = 512) -> Tuple[Callable, Callable]:
    """(ours, pml) callables ``f(embeddings, labels) -> loss`` with the same definition (the proxy cases: with the
    same proxies, ``num_classes`` x ``dim``)."""
    from pytorch_metric_learning import distances as pd
    from pytorch_metric_learning import losses as pl
    from pytorch_metric_learning import miners as pm

    from lightning_dml import losses as ours

    if case in PROXY_CASES:
        return _proxy_pair(case, num_classes, dim)
    if case == "circle":
        return ours.CircleLoss(), pl.CircleLoss(m=0.25, gamma=256)
    if case == "supcon":
        return ours.SupConLoss(), pl.SupConLoss(temperature=0.1)
    if case == "ntxent":
        return ours.NTXentLoss(), pl.NTXentLoss(temperature=0.1)
    if case == "nca":
        return ours.NCALoss(), pl.NCALoss()
    if case == "angular":  # 45 degrees; pml takes degrees (its x_n unnormalised: the data are unit rows here)
        return ours.AngularLoss(math.radians(45)), pl.AngularLoss(alpha=45)
    if case == "fastap":
        return ours.FastAPLoss(), pl.FastAPLoss(num_bins=10)
    if case == "smooth_ap":  # pml keeps the query in its own gallery (documented difference; same work)
        return ours.SmoothAPLoss(), pl.SmoothAPLoss(temperature=0.01)
    if case == "margin":  # all triplets, learnable per-class beta (pml: triplets_per_anchor="all")
        return (ours.MarginLoss(num_classes=num_classes, sampling="all"),
                pl.MarginLoss(margin=0.2, nu=0.0, beta=1.2, learn_beta=True, num_classes=num_classes,
                              triplets_per_anchor="all"))
    if case == "npair_multi_positive":  # N-pair Eq. 9 = pml's NCA on raw inner products
        return (ours.NPairLoss(l2_reg=0.0, variant="multi_positive"),
                pl.NCALoss(distance=pd.DotProductSimilarity(normalize_embeddings=False)))
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
    raise ValueError(f"unknown case {case!r}; valid: {ALL_CASES}")


def _proxy_pair(case: str, num_classes: int, dim: int) -> Tuple[torch.nn.Module, torch.nn.Module]:
    """Our proxy loss completed to ``num_classes`` x ``dim`` and pml's with the same proxies."""
    from pytorch_metric_learning import losses as pl

    from lightning_dml import losses as ours

    c, d = num_classes, dim
    if case == "proxy_anchor":
        mine = ours.ProxyAnchorLoss()
        theirs = pl.ProxyAnchorLoss(c, d, margin=mine.delta, alpha=mine.alpha)
    elif case == "proxy_nca":  # ProxyNCA++ form (positive kept in the denominator, as pml), temperature 1/9
        mine = ours.ProxyNCALoss(temperature=1 / 9, exclude_positive=False)
        theirs = pl.ProxyNCALoss(c, d, softmax_scale=9.0)
    elif case == "normalized_softmax":
        mine = ours.NormalizedSoftmaxLoss()
        theirs = pl.NormalizedSoftmaxLoss(c, d, temperature=mine.temperature)
    elif case == "cosface":
        mine = ours.CosFaceLoss()
        theirs = pl.CosFaceLoss(c, d, margin=mine.margin, scale=mine.scale)
    elif case == "arcface":
        mine = ours.ArcFaceLoss()
        theirs = pl.ArcFaceLoss(c, d, margin=math.degrees(mine.margin), scale=mine.scale)
    elif case == "subcenter_arcface":
        mine = ours.SubCenterArcFaceLoss()
        theirs = pl.SubCenterArcFaceLoss(num_classes=c, embedding_size=d, margin=math.degrees(mine.margin),
                                         scale=mine.scale, sub_centers=mine.proxies_per_class)
    elif case == "soft_triple":  # tau = 0: pml has no centre regulariser (ours with tau > 0 adds it)
        mine = ours.SoftTripleLoss(tau=0.0)
        theirs = pl.SoftTripleLoss(c, d, centers_per_class=mine.proxies_per_class, la=mine.la, gamma=mine.gamma,
                                   margin=mine.margin)
    else:
        raise ValueError(f"unknown proxy case {case!r}; valid: {PROXY_CASES}")
    mine.complete(c, d)
    attr, transposed = PML_PROXIES[case]
    with torch.no_grad():
        value = mine.proxies.detach().clone()
        getattr(theirs, attr).data = (value.T if transposed else value).contiguous()
    return mine, theirs


def make_data(case: str, batch: int, dim: int, device: str, seed: int = 0,
              num_classes: int = 11318) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = 2 if case == "npair" else 4
    labels = (torch.arange(batch) // k)[torch.randperm(batch, generator=g)]
    if case in PROXY_CASES or case == "margin":  # the P classes drawn among all num_classes
        labels = torch.randperm(num_classes, generator=g)[labels]
    if case == "smooth_ap":  # pml's Smooth-AP needs label-sorted equal-size class blocks
        labels = torch.sort(labels).values
    data = torch.randn(batch, dim, generator=g)
    if case == "angular":
        data = torch.nn.functional.normalize(data, dim=1)
    if case == "npair_multi_positive":  # raw inner products: keep them O(1)
        data = data / math.sqrt(dim)
    return data.to(device), labels.to(device)


def _to_device(fn: Callable, device: str) -> Callable:
    return fn.to(device) if isinstance(fn, torch.nn.Module) else fn


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run_once(fn: Callable, data: torch.Tensor, labels: torch.Tensor, device: str,
             clock: Callable[[], float] = time.perf_counter) -> float:
    if isinstance(fn, torch.nn.Module):
        for param in fn.parameters():
            param.grad = None
    emb = data.clone().requires_grad_(True)
    _sync(device)
    start = clock()
    fn(emb, labels).backward()
    _sync(device)
    return clock() - start


#: ``--clock``: wall-clock time, or the calling thread's CPU time (one intra-op thread on the CPU: all of torch's
#: work runs in that thread, and the time other processes hold the cores is not counted)
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def pml_runs(case: str, batch: int) -> bool:
    return batch <= PML_MAX_BATCH.get(case, batch)


def time_case(case: str, batch: int, dim: int, repeats: int, device: str, plain: bool = False,
              num_classes: int = 11318) -> Dict[str, float]:
    ours, theirs = (_to_device(f, device) for f in make_pair(case, num_classes, dim))
    if plain and hasattr(ours, "closed_form"):
        ours.closed_form = False  # plain masked composition differentiated by autograd
    data, labels = make_data(case, batch, dim, device, num_classes=num_classes)
    with_pml = pml_runs(case, batch)
    run_once(ours, data, labels, device)  # warm-up
    value_diff = float("nan")
    if with_pml:
        run_once(theirs, data, labels, device)
        with torch.no_grad():  # the two compute the same loss (smooth_ap: documented difference, see make_pair)
            mine, other = float(ours(data, labels)), float(theirs(data, labels))
        value_diff = abs(mine - other) / max(abs(other), 1e-12)
    t_ours: List[float] = []
    t_pml: List[float] = []
    for _ in range(repeats):
        t_ours.append(run_once(ours, data, labels, device))
        if with_pml:
            t_pml.append(run_once(theirs, data, labels, device))
    mo = statistics.median(t_ours)
    mp = statistics.median(t_pml) if t_pml else float("nan")
    return {"ours_ms": 1e3 * mo, "pml_ms": 1e3 * mp, "ratio": mo / mp, "value_rel_diff": value_diff}


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


def memory_child(case: str, impl: str, batch: int, dim: int, device: str, num_classes: int = 11318) -> None:
    """Runs in a fresh process: prints JSON {before, peak} in MiB (both include the loss's proxies, if any)."""
    ours, theirs = make_pair(case, num_classes, dim)
    data, labels = make_data(case, batch, dim, device, num_classes=num_classes)
    fn = _to_device(ours if impl == "ours" else theirs, device)
    del ours, theirs
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


def measure_memory(case: str, impl: str, batch: int, dim: int, device: str, num_classes: int = 11318) -> Dict[str, float]:
    cmd = [sys.executable, os.path.abspath(__file__), "--memory-child", case, impl, str(batch), "--dim", str(dim),
           "--device", device, "--num-classes", str(num_classes)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        return {"before": float("nan"), "peak": float("nan"), "error": out.stderr.strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def timing_worker(dim: int, device: str, num_classes: int, clock: str = "wall") -> None:
    """Serves ``--compare-with``: reads ``CASE BATCH IMPL KIND`` lines on stdin and answers each with one line, the
    time in ms of one :func:`run_once` (``KIND = time``) or the loss value (``KIND = value``); the pair and the
    inputs are built once per (case, batch), one at a time. The first line it prints is the folder of the
    ``lightning_dml`` it imported."""
    import lightning_dml

    print(os.path.dirname(os.path.dirname(os.path.abspath(lightning_dml.__file__))), flush=True)
    built: dict = {}
    for line in sys.stdin:
        case, batch, impl, kind = line.split()
        if (case, batch) not in built:
            built.clear()
            pair = [_to_device(f, device) for f in make_pair(case, num_classes, dim)]
            built[case, batch] = pair, make_data(case, int(batch), dim, device, num_classes=num_classes)
        (ours, theirs), (data, labels) = built[case, batch]
        fn = ours if impl == "ours" else theirs
        if kind == "value":
            with torch.no_grad():
                answer = float(fn(data, labels))
        else:
            answer = 1e3 * run_once(fn, data, labels, device, CLOCKS[clock])
        print(repr(answer), flush=True)


def compare_trees(cases: List[str], batches: List[int], other: str, repeats: int, dim: int, device: str,
                  num_classes: int, clock: str = "wall") -> List[dict]:
    """Ours (this checkout) against ours from ``other`` and pml, interleaved in two worker processes; prints a
    markdown table and returns its rows."""
    script = os.path.abspath(__file__)
    roots = {"ours": _package_root(), "before": os.path.abspath(other)}
    workers = {
        name: subprocess.Popen(
            [sys.executable, script, "--timing-worker", "--dim", str(dim), "--device", device,
             "--num-classes", str(num_classes), "--clock", clock, "--package-root", root],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for name, root in roots.items()
    }
    for name, worker in workers.items():  # each imported the checkout it was given (not, e.g., an installed copy)
        imported = worker.stdout.readline().strip()
        if os.path.realpath(imported) != os.path.realpath(roots[name]):
            raise RuntimeError(f"the {name!r} worker imported lightning_dml from {imported!r}, not {roots[name]!r}")

    def ask(name: str, case: str, batch: int, kind: str) -> float:
        worker = workers["before" if name in ("before", "pml_before") else "ours"]
        worker.stdin.write(f"{case} {batch} {'pml' if name.startswith('pml') else 'ours'} {kind}\n")
        worker.stdin.flush()
        reply = worker.stdout.readline()
        if not reply:
            raise RuntimeError(f"the timing worker for {name!r} stopped (case {case}, batch {batch})")
        return float(reply)

    print(f"# ours = {roots['ours']}, before = {roots['before']}, device {device}, dim {dim}, "
          f"repeats {repeats} each, interleaved, {clock} clock")
    print("| loss | B | ours ms | before ms | pml ms (each worker) | ours/before | ours/pml | before/pml "
          "| ours/before (fastest) |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    try:
        for case in cases:
            for batch in batches:
                if batch > MAX_BATCH.get(case, batch):
                    continue
                # pml runs in both workers, so that both processes do the same work (allocator state, caches)
                names = ["ours", "before"] + (["pml", "pml_before"] if pml_runs(case, batch) else [])
                values = {n: ask(n, case, batch, "value") for n in names}
                for n in names:  # warm-up
                    ask(n, case, batch, "time")
                times: Dict[str, List[float]] = {n: [] for n in names}
                for i in range(repeats):
                    for n in names if i % 2 == 0 else names[::-1]:
                        times[n].append(ask(n, case, batch, "time"))
                med = {n: statistics.median(t) for n, t in times.items()}
                pml, pml_before = med.get("pml", float("nan")), med.get("pml_before", float("nan"))
                row = {"case": case, "batch": batch, **{f"{n}_ms": m for n, m in med.items()},
                       "ours_before": med["ours"] / med["before"], "ours_pml": med["ours"] / pml,
                       "before_pml": med["before"] / pml_before,
                       "ours_before_fastest": min(times["ours"]) / min(times["before"]),
                       "value_rel_diff": abs(values["ours"] - values["before"]) / max(abs(values["before"]), 1e-12)}
                rows.append(row)
                note = f" (values differ: rel. {row['value_rel_diff']:.1e})" if row["value_rel_diff"] > 1e-4 else ""
                print(f"| {case}{note} | {batch} | {med['ours']:.2f} | {med['before']:.2f} | "
                      f"{pml:.2f} / {pml_before:.2f} | "
                      f"{row['ours_before']:.3f} | {row['ours_pml']:.3f} | {row['before_pml']:.3f} | "
                      f"{row['ours_before_fastest']:.3f} |", flush=True)
    finally:
        for worker in workers.values():
            worker.stdin.close()
            worker.wait()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", default=["seed"], choices=ALL_CASES + list(GROUPS),
                        help="case names, or the groups 'seed' (the seed losses) and 'issue13' (the losses of issue 13)")
    parser.add_argument("--num-classes", type=int, default=11318,
                        help="proxies of the proxy / classification losses (default: SOP's 11,318 training classes)")
    parser.add_argument("--batch", nargs="+", type=int, default=[80, 512, 2048])
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-memory", action="store_true", help="skip the per-case memory subprocesses")
    parser.add_argument("--plain", action="store_true",
                        help="time our plain masked autograd path instead of the closed-form backward")
    parser.add_argument("--json", default=None, help="also write the raw results to this file")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="with --compare-with: 'thread' times the thread's CPU time (CPU, OMP_NUM_THREADS=1 only)")
    parser.add_argument("--compare-with", metavar="DIR", default=None,
                        help="time ours against the lightning_dml of another checkout DIR, interleaved (see above)")
    parser.add_argument("--memory-child", nargs=3, metavar=("CASE", "IMPL", "BATCH"), help=argparse.SUPPRESS)
    parser.add_argument("--timing-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--package-root", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.memory_child:
        case, impl, batch = args.memory_child
        memory_child(case, impl, int(batch), args.dim, args.device, args.num_classes)
        return
    if args.clock == "thread" and (args.device != "cpu" or torch.get_num_threads() != 1):
        parser.error("--clock thread needs --device cpu and one intra-op thread (OMP_NUM_THREADS=1)")
    if args.timing_worker:
        timing_worker(args.dim, args.device, args.num_classes, args.clock)
        return
    cases = [c for name in args.cases for c in GROUPS.get(name, [name])]
    if args.compare_with:
        rows = compare_trees(cases, args.batch, args.compare_with, args.repeats, args.dim, args.device,
                             args.num_classes, args.clock)
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(rows, fh, indent=1)
        return

    import pytorch_metric_learning

    print(f"# torch {torch.__version__}, pytorch-metric-learning {pytorch_metric_learning.__version__}, "
          f"device {args.device}, threads {torch.get_num_threads()}, dim {args.dim}, repeats {args.repeats}, "
          f"proxy classes {args.num_classes}{', ours = plain autograd path' if args.plain else ''}")
    mem_unit = "MiB CUDA peak" if args.device.startswith("cuda") else "MiB peak RSS (before loss)"
    print(f"| loss | B | ours ms | pml ms | ours/pml | ours {mem_unit} | pml {mem_unit} | target |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    rows = []
    for case in cases:
        for batch in args.batch:
            if batch > MAX_BATCH.get(case, batch):
                continue
            res = time_case(case, batch, args.dim, args.repeats if batch < 2048 else max(3, args.repeats // 2),
                            args.device, plain=args.plain, num_classes=args.num_classes)
            mem = {}
            if not args.no_memory:
                for impl in ("ours", "pml") if pml_runs(case, batch) else ("ours",):
                    mem[impl] = measure_memory(case, impl, batch, args.dim, args.device, args.num_classes)

            def fmt(m):
                if not m:
                    return "-"
                return f"{m['peak']:.0f} ({m['before']:.0f})"

            flag = " *" if case in TARGETED and batch >= 512 else ""
            print(f"| {case}{flag} | {batch} | {res['ours_ms']:.2f} | {res['pml_ms']:.2f} | {res['ratio']:.2f} | "
                  f"{fmt(mem.get('ours'))} | {fmt(mem.get('pml'))} | {_verdict(case, res, mem)} |", flush=True)
            rows.append({"case": case, "batch": batch, **res, "memory": mem})
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rows, fh, indent=1)


def _verdict(case: str, res: Dict[str, float], mem: Dict[str, dict]) -> str:
    """``time <= target: met/missed; memory: met/missed`` for the issue-13 cases ('-' for the others)."""
    if case not in TARGET_RATIO:
        return "-"
    if math.isnan(res["ratio"]):
        return "pml not run"
    time_ok = "met" if res["ratio"] <= TARGET_RATIO[case] else "missed"
    text = f"<= {TARGET_RATIO[case]:.1f}x: {time_ok}"
    if "ours" in mem and "pml" in mem and not math.isnan(mem["pml"]["peak"]):
        own = {k: mem[k]["peak"] - mem[k]["before"] for k in ("ours", "pml")}
        text += f"; memory {'met' if own['ours'] <= own['pml'] + MEMORY_SLACK_MB else 'missed'}"
    if res.get("value_rel_diff", 0.0) > 1e-4:
        text += f"; values differ (rel. {res['value_rel_diff']:.1e})"
    return text


if __name__ == "__main__":
    main()
