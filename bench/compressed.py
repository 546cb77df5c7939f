"""What compressed vectors cost (issue 31 s.3): bytes per vector, search time per query, neighbour recall@10
against exact full-width search and Recall@1 / MAP@R of ``flat`` float32, ``int8``, ``binary``, ``binary`` /
``int8`` + ``--rescore N``, ``ivf_pq`` and ``hnsw`` indexes, each measured by
:func:`lightning_dml.index.evaluate.evaluate_index` (the exact engine is the judge).

Usage::

    lightning-dml fit --config configs/glyphs.yaml                      # the Glyphs base model (6 epochs)
    lightning-dml predict --config configs/glyphs.yaml --ckpt_path CKPT --trainer.default_root_dir /tmp/p
    python bench/compressed.py --predictions /tmp/p/.../predictions.pt --size 1000000 --dim 512 --queries 200

1. **Glyphs** (``--predictions``: a ``lightning-dml predict`` file of the test classes): every item a query
   against the others (all-vs-all, leave-one-out).
2. **Synthetic** (``--size`` x ``--dim``, skipped with ``--size 0``): clustered Gaussian vectors (``--clusters``
   centres of norm about ``--spread`` times the noise's, labels = the cluster), ``--queries`` further draws of the same
   clusters as labelled queries.

Each index is built with :meth:`EmbeddingIndex.build` (cosine), saved and loaded again (so that a re-scoring index
reads its float32 vectors from the memory-mapped ``embeddings.npy`` as ``search`` does), then evaluated with
``k = 10``. Prints one markdown table per gallery, the command line, ``uptime`` before and after, and the peak
resident memory of the process.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def clustered(n: int, d: int, clusters: int, spread: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` vectors: a random centre (norm ``spread * sqrt(d)``) of ``clusters`` plus unit Gaussian noise."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, d, generator=torch.Generator().manual_seed(0)) * spread
    out, labels = torch.empty(n, d), torch.randint(clusters, (n,), generator=g)
    for start in range(0, n, 100_000):  # bounded temporary memory
        stop = min(n, start + 100_000)
        out[start:stop] = centres[labels[start:stop]] + torch.randn(stop - start, d, generator=g)
    return out, labels


def configs(rescore: list[int]) -> list[tuple[str, str, dict]]:
    """(row name, kind, options) of every index measured."""
    rows = [("float32 flat", "flat", {}), ("int8", "flat", {"vectors": "int8"})]
    rows += [(f"int8 + rescore {n}", "flat", {"vectors": "int8", "rescore": n}) for n in rescore[:1]]
    rows += [("binary", "flat", {"vectors": "binary"})]
    rows += [(f"binary + rescore {n}", "flat", {"vectors": "binary", "rescore": n}) for n in rescore]
    rows += [("ivf_pq (defaults)", "ivf_pq", {}), ("hnsw (defaults)", "hnsw", {})]
    return rows


def measure(name: str, kind: str, options: dict, gallery: torch.Tensor, labels: list[str],
            queries: torch.Tensor | None, query_labels: list[str] | None, work: Path) -> dict:
    from lightning_dml.index import EmbeddingIndex
    from lightning_dml.index.evaluate import evaluate_index

    began = time.perf_counter()
    index = EmbeddingIndex.build(gallery, {"labels": labels}, kind=kind, **options)
    built = time.perf_counter() - began
    folder = work / "index"
    index.save(folder)
    del index
    index = EmbeddingIndex.load(folder)
    result = evaluate_index(index, queries, query_labels, k=10, recall_at=(1,))
    row = next(v for r, v in result["rows"].items() if r.startswith("index"))
    out = {"name": name, "bytes": result["bytes_per_vector"], "ms": result["search_ms_per_query"],
           "nr": result["neighbour_recall@k"], "r1": row["recall@1"], "map": row["map@r"],
           "exact_r1": result["rows"]["exact"]["recall@1"], "exact_map": result["rows"]["exact"]["map@r"],
           "build": built, "options": index.options}
    del index
    shutil.rmtree(folder)
    print(f"  {name}: {out}", file=sys.stderr, flush=True)
    return out


def table(title: str, rows: list[dict]) -> str:
    lines = [f"**{title}**", "", "| index | bytes / vector | ms / query | neighbour recall@10 | Recall@1 | MAP@R | "
             "build s | options |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['bytes']:.1f} | {r['ms']:.3f} | {100 * r['nr']:.2f} | {100 * r['r1']:.2f} "
                     f"| {100 * r['map']:.2f} | {r['build']:.1f} | {r['options']} |")
    exact = rows[0]
    lines.append(f"\n(exact search: Recall@1 {100 * exact['exact_r1']:.2f}, MAP@R {100 * exact['exact_map']:.2f})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--predictions", default=None, help="predictions.pt of lightning-dml predict (Glyphs test)")
    p.add_argument("--size", type=int, default=1_000_000, help="synthetic gallery size (0: none)")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--clusters", type=int, default=10_000)
    p.add_argument("--spread", type=float, default=0.5, help="centre norm / noise norm")
    p.add_argument("--queries", type=int, default=200, help="synthetic queries")
    p.add_argument("--rescore", type=int, nargs="+", default=[10, 20, 50, 100, 200], help="N of --rescore")
    p.add_argument("--kinds", nargs="+", default=None, help="only the rows whose name starts with one of these")
    a = p.parse_args(argv)
    print(f"command: python bench/compressed.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"before: {uptime()}; torch threads {torch.get_num_threads()}")
    rows = [c for c in configs(a.rescore) if not a.kinds or any(c[0].startswith(k) for k in a.kinds)]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if a.predictions:
            from lightning_dml.callbacks import load_predictions

            data = load_predictions(a.predictions)
            emb, labels = data["embeddings"].float(), [str(int(v)) for v in data["labels"]]
            began = time.perf_counter()
            out = [measure(n, k, o, emb, labels, None, None, work) for n, k, o in rows]
            print(table(f"Glyphs test gallery: {emb.shape[0]} x {emb.shape[1]}, all-vs-all "
                        f"({time.perf_counter() - began:.0f} s)", out))
        if a.size:
            began = time.perf_counter()
            gallery, gl = clustered(a.size, a.dim, a.clusters, a.spread, seed=1)
            queries, ql = clustered(a.queries, a.dim, a.clusters, a.spread, seed=2)
            glabels, qlabels = [str(v) for v in gl.tolist()], [str(v) for v in ql.tolist()]
            out = [measure(n, k, o, gallery, glabels, queries, qlabels, work) for n, k, o in rows]
            print(table(f"Synthetic: {a.size} x {a.dim}, {a.clusters} clusters, {a.queries} queries "
                        f"({time.perf_counter() - began:.0f} s)", out))
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"after: {uptime()}; peak resident memory {peak:.1f} GiB")


if __name__ == "__main__":
    main()
