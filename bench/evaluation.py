"""Benchmark of the evaluation layer at Stanford Online Products scale (issue 6).

60,502 random 512-d embeddings with SOP-like class sizes (11,316 classes of 2 to 12 items). Each method runs
in its own process so its peak memory (``getrusage`` max RSS) is its own:

* ``ours``     -- ``lightning_dml.metrics.functional.retrieval_metrics``: exact Recall@{1,10,100,1000},
                  Precision@1, R-Precision and MAP@R (clustering off).
* ``pml``      -- ``pytorch_metric_learning``'s ``AccuracyCalculator`` (faiss k-NN, k = 1000) computing the
                  same figures (Recall@K added as custom metrics on its k-NN labels).
* ``faiss``    -- a bare ``faiss.IndexFlatIP`` search of k = 1000 (no metric computed at all).
* ``torch``    -- a plain torch brute force on ``--device``: ``topk`` (k = 1000) over fp32 tiles of 4,096 queries
                  (the GPU peer of issue 11; no metric computed).
* ``nmi``      -- NMI + F1 of one k-means run with k = 11,316 (``kmeans_backend`` as given, default auto).
* ``ours-seq-cat``, ``ours-sets``, ``ours-fnmr`` -- ``ours`` on the issue-20 tasks (:func:`task_inputs`): sequence
                  exclusion plus per-category metrics, label sets of two labels per item, ``fnmr@fmr=0.001``.

Usage::

    OMP_NUM_THREADS=2 python bench/evaluation.py                 # all methods, markdown table
    OMP_NUM_THREADS=2 python bench/evaluation.py --methods ours faiss --n 20000
    OMP_NUM_THREADS=2 python bench/evaluation.py --methods ours --profile   # + time split of ours
    OMP_NUM_THREADS=2 python bench/evaluation.py --methods ours ours-seq-cat ours-sets ours-fnmr --rounds 2
    python bench/evaluation.py --worker ours                     # one method, JSON line (used internally)

``--profile`` splits the time of ``ours`` into: products (``Scorer.approx``), counting (the band counts of the
tile pass), candidates (the rest of the tile pass: threshold comparisons, candidate extraction and buffers),
set-up (error bounds, exact best positives) and finish (exact re-scoring of ambiguous ranks and candidate runs).
``--device cuda`` runs ``ours`` on the GPU (peak GPU memory reported).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)

RECALL_AT = (1, 10, 100, 1000)


def make_data(n: int, d: int, seed: int = 0):
    """Random embeddings and SOP-like labels: class sizes 2..12, as many classes as SOP has per item."""
    import torch

    g = torch.Generator().manual_seed(seed)
    classes = max(1, round(n * 11316 / 60502))
    sizes = torch.full((classes,), 2, dtype=torch.long)
    extra = n - 2 * classes
    while extra > 0:  # hand out the remaining items at random, at most 12 per class
        pick = torch.randint(0, classes, (extra,), generator=g)
        add = torch.minimum(torch.bincount(pick, minlength=classes), 12 - sizes)
        keep = torch.cumsum(add, 0) <= extra
        add = torch.where(keep, add, torch.zeros_like(add))
        sizes += add
        extra -= int(add.sum())
    labels = torch.repeat_interleave(torch.arange(classes), sizes)
    labels = labels[torch.randperm(n, generator=g)]
    x = torch.randn(n, d, generator=g)
    return x, labels


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _profiled() -> dict[str, float]:
    """Wrap the stages of the search with wall-clock timers (CPU: every op is synchronous); returns the totals.

    Stages: ``set-up`` (bounds, exact best positives), ``tile pass`` / ``chunk pass`` (the approximate pass) and
    ``finish`` (exact re-scoring); inside each, ``products`` (``Scorer.approx``) and ``counting`` are timed apart.
    """
    import torch

    from lightning_dml.metrics import _ranks, _scan, _scores

    times: dict[str, float] = {}
    stage = ["other"]

    def timed(owner, name: str, key: str, is_stage: bool) -> None:
        fn = getattr(owner, name)

        def wrapper(*a, **kw):
            label = key if is_stage else f"{key} in {stage[-1]}"
            if is_stage:
                stage.append(key)
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                times[label] = times.get(label, 0.0) + time.perf_counter() - t0
                if is_stage:
                    stage.pop()

        setattr(owner, name, wrapper)

    timed(_scores.Scorer, "__init__", "scorer (normalise, round)", True)
    timed(_scores.Scorer, "approx", "products", False)
    timed(_scan, "_count_side", "counting", False)
    timed(_scan, "_count_windows", "pair windows", False)
    timed(_scan, "true_pairs", "candidate extraction", False)
    timed(_scan, "insert_pairs", "candidate buffers", False)
    timed(_ranks, "scan_symmetric", "tile pass", True)
    timed(_ranks, "scan_rows", "chunk pass", True)
    timed(_ranks, "initial_state", "set-up", True)
    timed(_ranks, "finish", "finish", True)
    timed(_ranks, "plan_windows", "pair-window sample", True)
    timed(_ranks, "resolve_windows", "pair thresholds", True)
    return times


def task_inputs(y, variant: str, seed: int = 1) -> dict:
    """The inputs of the issue-20 variants of ``ours`` on the SOP-like set:

    * ``seq-cat``: sequence ids (groups of about 4 random items, as frames of one video) and 12 categories (SOP's
      super-categories), one per class;
    * ``sets``: label sets of two labels per item (its class and another random class): R grows accordingly (about
      4x on this set: a second label joins the items of another class);
    * ``sets-same-r``: two labels per item that always come together (the relevance, and R, of single labels): what
      the label-set machinery itself costs;
    * ``fnmr``: ``fnmr@fmr=0.001`` over all pairs.
    """
    import torch

    g = torch.Generator().manual_seed(seed)
    n = y.numel()
    if variant == "seq-cat":
        categories = torch.randint(0, 12, (int(y.max()) + 1,), generator=g)
        return {"sequence": torch.randint(0, max(1, n // 4), (n,), generator=g), "category": categories[y]}
    if variant == "sets":
        return {"labels": torch.stack([y, torch.randint(0, int(y.max()) + 1, (n,), generator=g)], 1)}
    if variant == "sets-same-r":  # two labels per item that always come together: the relevance of single labels
        return {"labels": torch.stack([y, y + int(y.max()) + 1], 1)}
    if variant == "fnmr":
        return {"metrics": ["fnmr@fmr=0.001"]}
    return {}


def run_ours(x, y, args) -> dict:
    import torch

    from lightning_dml.metrics import functional as F

    times = _profiled() if args.profile else None
    if args.device != "cpu":
        x, y = x.to(args.device), y.to(args.device)
        torch.cuda.reset_peak_memory_stats()
    extra = task_inputs(y, args.worker.partition("-")[2]) if args.worker != "ours" else {}
    labels = extra.pop("labels", y)
    if args.device != "cpu":
        extra = {k: v.to(args.device) if hasattr(v, "to") else v for k, v in extra.items()}
        labels = labels.to(args.device)
    out = F.retrieval_metrics(x, labels, recall_at=RECALL_AT, map_at_r=True, precision=args.precision, **extra)
    out = {k: v for k, v in out.items() if not k.startswith("category/")}
    if args.device != "cpu":
        out["peak_gpu_mb_above_embeddings"] = (torch.cuda.max_memory_allocated() - x.nbytes - y.nbytes) / 2**20
    if times is not None:
        for p in ("tile pass", "chunk pass"):
            if p in times:  # the rest of the pass: threshold comparisons, candidate extraction and buffers
                rest = times[p] - times.get(f"products in {p}", 0.0) - times.get(f"counting in {p}", 0.0)
                times[f"candidates in {p}"] = rest  # including the extraction and buffer times listed apart
        out["profile_s"] = {k: round(v, 2) for k, v in sorted(times.items())}
    return out


def run_pml(x, y, args) -> dict:
    import torch
    from pytorch_metric_learning.utils.accuracy_calculator import AccuracyCalculator

    class WithRecall(AccuracyCalculator):
        """AccuracyCalculator plus Recall@K computed from its own k-NN labels."""

        def requires_knn(self):
            return super().requires_knn() + [f"recall_at_{k}" for k in RECALL_AT]

    for k in RECALL_AT:

        def calc(self, knn_labels, query_labels, _k=k, **kwargs):
            hit = (knn_labels[:, :_k] == query_labels.unsqueeze(1)).any(dim=1)
            return float(hit.double().mean())

        setattr(WithRecall, f"calculate_recall_at_{k}", calc)
    calc = WithRecall(
        include=("precision_at_1", "r_precision", "mean_average_precision_at_r") + tuple(f"recall_at_{k}" for k in RECALL_AT),
        k=max(RECALL_AT),
        device=torch.device("cpu"),
    )
    xn = torch.nn.functional.normalize(x, dim=1)
    res = calc.get_accuracy(xn, y, xn, y, ref_includes_query=True)
    out = {f"recall@{k}": res[f"recall_at_{k}"] for k in RECALL_AT}
    out.update(precision_at_1=res["precision_at_1"], r_precision=res["r_precision"], map_at_r=res["mean_average_precision_at_r"])
    return out


def run_faiss(x, y, args) -> dict:
    import faiss
    import torch

    xn = torch.nn.functional.normalize(x, dim=1).numpy()
    index = faiss.IndexFlatIP(xn.shape[1])
    index.add(xn)
    _, idx = index.search(xn, max(RECALL_AT))
    return {"k": int(idx.shape[1])}


def run_torch(x, y, args) -> dict:
    import torch

    xn = torch.nn.functional.normalize(x.to(args.device), dim=1)
    k = min(max(RECALL_AT), xn.shape[0])
    idx = torch.cat([(xn[s : s + 4096] @ xn.T).topk(k, dim=1).indices.cpu() for s in range(0, xn.shape[0], 4096)])
    return {"k": int(idx.shape[1])}


def run_nmi(x, y, args) -> dict:
    from lightning_dml.metrics import functional as F

    return F.clustering_metrics(x, y, seeds=1, iters=args.kmeans_iters, backend=args.kmeans_backend)


METHODS = {
    "ours": run_ours, "ours-seq-cat": run_ours, "ours-sets": run_ours, "ours-sets-same-r": run_ours,
    "ours-fnmr": run_ours, "pml": run_pml,
    "faiss": run_faiss, "torch": run_torch, "nmi": run_nmi,
}


def worker(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
        try:
            import faiss

            faiss.omp_set_num_threads(args.threads)
        except ImportError:
            pass
    x, y = make_data(args.n, args.d)
    # imports are not timed (lightning_dml.metrics pulls in torchmetrics; faiss its own library)
    if args.worker.startswith("ours") or args.worker == "nmi":
        import lightning_dml.metrics.functional  # noqa: F401
    elif args.worker == "faiss":
        import faiss  # noqa: F401
    elif args.worker == "pml":
        import pytorch_metric_learning.utils.accuracy_calculator  # noqa: F401
    base = _rss_mb()  # interpreter + libraries + the embeddings
    t0 = time.perf_counter()
    res = METHODS[args.worker](x, y, args)
    dt = time.perf_counter() - t0
    peak = _rss_mb()
    print(json.dumps({"method": args.worker, "seconds": dt, "base_rss_mb": base, "peak_rss_mb": peak, "result": res}))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=60502)
    p.add_argument("--d", type=int, default=512)
    p.add_argument("--threads", type=int, default=int(os.environ.get("OMP_NUM_THREADS", "0") or 0))
    p.add_argument("--precision", default="auto", choices=["auto", "fp32", "tf32", "bf16"])
    p.add_argument("--device", default="cpu", help="device of ours (cpu or cuda)")
    p.add_argument("--profile", action="store_true", help="time split of ours (products, counting, ...)")
    p.add_argument("--kmeans-iters", type=int, default=20)
    p.add_argument("--kmeans-backend", default="auto", choices=["auto", "torch", "faiss"])
    p.add_argument("--methods", nargs="+", default=["ours", "pml", "faiss", "nmi"], choices=list(METHODS))
    p.add_argument("--rounds", type=int, default=1, help="run the methods in turn this many times (one row each)")
    p.add_argument("--worker", choices=list(METHODS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for m in [m for _ in range(args.rounds) for m in args.methods]:
        cmd = [sys.executable, __file__, "--worker", m, "--n", str(args.n), "--d", str(args.d),
               "--threads", str(args.threads), "--precision", args.precision, "--device", args.device,
               *(["--profile"] if args.profile else []),
               "--kmeans-iters", str(args.kmeans_iters), "--kmeans-backend", args.kmeans_backend]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        if out.returncode != 0:
            print(f"{m} failed:\n{out.stderr[-2000:]}", file=sys.stderr)
            continue
        rec = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(rec)
        print(json.dumps(rec), flush=True)
    print(f"\nN={args.n} D={args.d} threads={args.threads or 'default'} load={os.getloadavg()[0]:.1f} "
          f"uptime: {subprocess.run(['uptime'], capture_output=True, text=True).stdout.strip()}\n")
    print("| method | time (s) | x bare faiss k=1000 | x ours (same round) | peak RSS (MB) | above start (MB) |")
    print("|---|---|---|---|---|---|")
    per_round = len(args.methods)
    for i, r in enumerate(rows):
        this_round = rows[i - i % per_round : i - i % per_round + per_round]
        faiss_t = next((o["seconds"] for o in this_round if o["method"] == "faiss"), None)
        ours_t = next((o["seconds"] for o in this_round if o["method"] == "ours"), None)
        ratio = f"{r['seconds'] / faiss_t:.2f}" if faiss_t else "-"
        to_ours = f"{r['seconds'] / ours_t:.2f}" if ours_t else "-"
        print(f"| {r['method']} | {r['seconds']:.1f} | {ratio} | {to_ours} | {r['peak_rss_mb']:.0f} | "
              f"{r['peak_rss_mb'] - r['base_rss_mb']:.0f} |")


if __name__ == "__main__":
    main()
