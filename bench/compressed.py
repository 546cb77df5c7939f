"""What compressed vectors cost (issue 31 s.3): bytes per vector, search time per query, neighbour recall@10
against exact full-width search and Recall@1 / MAP@R of ``flat`` float32, ``int8``, ``binary``, ``binary`` /
``int8`` + ``--rescore N``, ``ivf_pq``, ``hnsw`` and cut (Matryoshka) widths, each measured by
:func:`lightning_dml.index.evaluate.evaluate_index` (the exact engine is the judge).

Usage::

    lightning-dml fit --config configs/glyphs.yaml                      # the Glyphs base model (6 epochs)
    lightning-dml predict --config configs/glyphs.yaml --ckpt_path CKPT --trainer.default_root_dir /tmp/p
    python bench/compressed.py --predictions /tmp/p/.../predictions.pt --size 0
    python bench/compressed.py --predictions MRL.pt --size 0 --kinds width --widths 16 32 64 128   # Matryoshka
    python bench/compressed.py --size 1000000 --dim 512 --queries 100 --kinds width --widths 64 128 256
    OMP_NUM_THREADS=1 python bench/compressed.py --size 1000000 --queries 100 --kinds ivf --ivf_pq nlist=1024 m=32 \
        --neighbours_only                                 # no Recall@1 / MAP@R: see below

1. **Glyphs** (``--predictions``: a ``lightning-dml predict`` file of the test classes): every item a query
   against the others (all-vs-all, leave-one-out).
2. **Synthetic** (``--size`` x ``--dim``, skipped with ``--size 0``): clustered Gaussian vectors (``--clusters``
   centres of norm about ``--spread`` times the noise's, labels = the cluster), ``--queries`` further draws of the same
   clusters as labelled queries. The gallery is generated in chunks into a ``.npy`` file in the work folder and
   memory-mapped only while an index is built from it.

Each index is built with :meth:`EmbeddingIndex.build` (cosine), saved and loaded again (so that a re-scoring index
reads its float32 vectors from the memory-mapped ``embeddings.npy`` as ``search`` does), then evaluated with
``k = 10``; at most one index is in memory at a time. ``--widths W ...`` adds rows of the leading ``W`` dimensions
(``lightning_dml.widths.cut``, re-normalised by the build: what ``index build --width W`` indexes; flat, float32),
whose neighbour recall@10 is against the exact search of the full-width vectors (the other rows' index holds the
full width: there it is :func:`evaluate_index`'s own).

Synthetic queries are evaluated in blocks of ``--query_block`` (the exact engine's relevance lists grow with queries
x gallery): each block asks for lists as long as the whole set's (``recall_at`` includes that length), so every
query gets the search it gets in one block, and the per-query means are recombined weighted by block size (every
synthetic query has relevant gallery items; otherwise one block). Even so a full-width row needs about 15 GiB at
1M x 512 (the exact engine's copies of the gallery inside ``evaluate_index``); ``--neighbours_only`` measures a
synthetic row without it: bytes, search time (k = 10) and neighbour recall@10 against the exact full-width
neighbours (the library's engine on gallery chunks), Recall@1 and MAP@R not measured (``nan``). Prints one
markdown table per gallery, the command line, ``uptime`` before and after, and the peak resident memory of the
process (``getrusage``).
"""

from __future__ import annotations

import argparse
import gc
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def peak_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def clustered_chunks(n: int, d: int, clusters: int, spread: float, seed: int,
                     chunk: int = 100_000) -> tuple[torch.Tensor, Iterator[tuple[int, torch.Tensor]]]:
    """Labels of ``n`` vectors and an iterator of ``(start, rows)``: a random centre (norm ``spread * sqrt(d)``) of
    ``clusters`` plus unit Gaussian noise, ``chunk`` rows at a time (bounded temporary memory)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, d, generator=torch.Generator().manual_seed(0)) * spread
    labels = torch.randint(clusters, (n,), generator=g)

    def rows() -> Iterator[tuple[int, torch.Tensor]]:
        for start in range(0, n, chunk):
            stop = min(n, start + chunk)
            yield start, centres[labels[start:stop]] + torch.randn(stop - start, d, generator=g)

    return labels, rows()


def clustered(n: int, d: int, clusters: int, spread: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The vectors of :func:`clustered_chunks` in memory (the queries)."""
    labels, rows = clustered_chunks(n, d, clusters, spread, seed)
    out = torch.empty(n, d)
    for start, block in rows:
        out[start:start + block.shape[0]] = block
    return out, labels


def clustered_file(path: Path, n: int, d: int, clusters: int, spread: float, seed: int) -> torch.Tensor:
    """The vectors of :func:`clustered_chunks` written to the float32 ``.npy`` file ``path``; returns the labels."""
    labels, rows = clustered_chunks(n, d, clusters, spread, seed)
    out = np.lib.format.open_memmap(path, mode="w+", dtype=np.float32, shape=(n, d))
    for start, block in rows:
        out[start:start + block.shape[0]] = block.numpy()
    out.flush()
    del out
    return labels


def configs(rescore: list[int], ivf_pq: dict, hnsw: dict, widths: list[int], width_name: str
            ) -> list[tuple[str, str, dict, int | None]]:
    """(row name, kind, options, width) of every index measured."""
    rows = [("float32 flat", "flat", {}, None), ("int8", "flat", {"vectors": "int8"}, None)]
    rows += [(f"int8 + rescore {n}", "flat", {"vectors": "int8", "rescore": n}, None) for n in rescore[:1]]
    rows += [("binary", "flat", {"vectors": "binary"}, None)]
    rows += [(f"binary + rescore {n}", "flat", {"vectors": "binary", "rescore": n}, None) for n in rescore]
    rows += [(f"width {w} ({width_name})", "flat", {}, w) for w in widths]
    rows += [("ivf_pq (" + (", ".join(f"{k} {v}" for k, v in ivf_pq.items()) or "defaults") + ")", "ivf_pq", ivf_pq,
              None)]
    rows += [("hnsw (" + (", ".join(f"{k} {v}" for k, v in hnsw.items()) or "defaults") + ")", "hnsw", hnsw, None)]
    return rows


def list_length(gallery_labels: torch.Tensor, query_labels: torch.Tensor, k: int) -> tuple[int, bool]:
    """``evaluate_index``'s list length for all queries at once (the largest R, at least ``k``) and whether every
    query has a relevant gallery item."""
    counts = torch.bincount(gallery_labels, minlength=int(max(gallery_labels.max(), query_labels.max())) + 1)
    r = counts[query_labels]
    return max(int(r.max()), k, 1), bool((r > 0).all())


def evaluate_blocks(index, queries: torch.Tensor | None, query_labels: list[str] | None, length: int, block: int,
                    k: int = 10) -> dict:
    """:func:`evaluate_index` over query blocks (all at once for leave-one-out), recombined: Recall@1, MAP@R and
    neighbour recall are means over the queries (every query has R > 0: the caller checks), the search seconds a
    sum. ``recall_at`` holds ``length`` so that each block's lists are as long as the whole set's."""
    from lightning_dml.index.evaluate import evaluate_index

    if queries is None:
        return evaluate_index(index, None, None, k=k, recall_at=(1,))
    parts = []
    for start in range(0, queries.shape[0], block):
        q, ql = queries[start:start + block], query_labels[start:start + block]
        parts.append((q.shape[0], evaluate_index(index, q, ql, k=k, recall_at=(1, length))))
        gc.collect()
    n = sum(m for m, _ in parts)

    def mean(get: Callable[[dict], float]) -> float:
        return sum(m * get(r) for m, r in parts) / n

    first = parts[0][1]
    rows = {name: {metric: mean(lambda r, a=name, b=metric: r["rows"][a][b]) for metric in ("recall@1", "map@r")}
            for name in first["rows"]}
    seconds = sum(r["search_seconds"] for _, r in parts)
    return {**first, "rows": rows, "neighbour_recall@k": mean(lambda r: r["neighbour_recall@k"]),
            "search_seconds": seconds, "search_ms_per_query": 1000 * seconds / n, "queries": n}


def full_width_recall(index, queries: torch.Tensor | None, exact_ids: torch.Tensor, k: int = 10) -> float:
    """Neighbour recall@k of a cut-width ``index`` against ``exact_ids`` [Q, k] (gallery positions of the exact
    full-width neighbours; ``queries=None``: leave-one-out over the gallery, the item itself dropped)."""
    loo = queries is None
    q = index.embeddings if loo else queries
    _, ids = index.search(q, k + (1 if loo else 0))
    pos = torch.from_numpy(index.table.rows_of(ids.numpy())).view_as(ids)
    if loo:  # the query's own item out, the next k kept
        own = pos == torch.arange(pos.shape[0]).unsqueeze(1)
        keep = torch.sort(own.long(), dim=1, stable=True).indices[:, :k]
        pos = torch.where(own.gather(1, keep), -1, pos.gather(1, keep))
    pos = pos[:, :k]
    same = (pos.unsqueeze(2) == exact_ids.unsqueeze(1)) & (pos.unsqueeze(2) >= 0)
    valid = (exact_ids >= 0).sum(1).clamp_min(1)
    return float((same.any(1).sum(1) / valid).mean())


def exact_full_width(gallery: torch.Tensor, queries: torch.Tensor | None, chunk: int = 100_000,
                     k: int = 10) -> torch.Tensor:
    """Gallery positions of the exact ``k`` nearest (cosine) of each query at full width: the library's exact engine
    (:func:`lightning_dml.metrics.functional.knn`: float64 scores, ties by the smaller position) on ``chunk`` gallery
    rows at a time, the chunks' lists merged by the same rule (bounded memory; leave-one-out over the whole gallery
    when ``queries`` is None)."""
    from lightning_dml.metrics import functional as MF

    if queries is None:
        return MF.knn(gallery, None, k=k, metric="cosine")[1]
    scores, ids = [], []
    for start in range(0, gallery.shape[0], chunk):
        s, i = MF.knn(queries, gallery[start:start + chunk], k=k, metric="cosine")
        scores.append(s)
        ids.append(torch.where(i >= 0, i + start, i))
        gc.collect()
    scores, ids = torch.cat(scores, 1), torch.cat(ids, 1)
    by_id = torch.sort(torch.where(ids >= 0, ids, torch.iinfo(torch.int64).max), dim=1, stable=True).indices
    scores, ids = scores.gather(1, by_id), ids.gather(1, by_id)
    order = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :k]
    return ids.gather(1, order)


def measure(name: str, kind: str, options: dict, width: int | None, gallery: Callable[[], torch.Tensor],
            labels: list[str], queries: torch.Tensor | None, query_labels: list[str] | None, work: Path,
            length: int, block: int, exact_ids: Callable[[], torch.Tensor], neighbours_only: bool = False) -> dict:
    """Build, save, load and evaluate one index; ``gallery()`` gives the vectors (memory-mapped for synthetic)."""
    from lightning_dml.index import EmbeddingIndex
    from lightning_dml.widths import cut

    vectors = gallery()
    if width is not None:  # what index build --width W indexes: the leading W dims, normalised by build (cosine)
        vectors = cut(vectors, width, "bench/compressed.py --widths")
    began = time.perf_counter()
    index = EmbeddingIndex.build(vectors, {"labels": labels}, kind=kind, **options)
    built = time.perf_counter() - began
    del vectors
    folder = work / "index"
    index.save(folder)
    del index
    gc.collect()
    if width is not None and queries is not None:  # queries cut the same way (as the index's embedder does)
        queries = cut(queries, width, "bench/compressed.py --widths")
    if neighbours_only:  # no exact engine on the whole gallery: embeddings.npy stays on disk
        return neighbours_row(name, EmbeddingIndex.load(folder, mmap=True), queries, exact_ids, built, folder)
    index = EmbeddingIndex.load(folder)
    result = evaluate_blocks(index, queries, query_labels, length, block)
    row = next(v for r, v in result["rows"].items() if r.startswith("index"))
    nr = result["neighbour_recall@k"] if width is None else full_width_recall(index, queries, exact_ids())
    out = {"name": name, "bytes": result["bytes_per_vector"], "ms": result["search_ms_per_query"],
           "nr": nr, "r1": row["recall@1"], "map": row["map@r"],
           "exact_r1": result["rows"]["exact"]["recall@1"], "exact_map": result["rows"]["exact"]["map@r"],
           "build": built, "options": index.options}
    del index
    gc.collect()
    shutil.rmtree(folder)
    print(f"  {name}: {out}; peak so far {peak_gib():.2f} GiB, {uptime()}", file=sys.stderr, flush=True)
    return out


def neighbours_row(name: str, index, queries: torch.Tensor, exact_ids: Callable[[], torch.Tensor], built: float,
                   folder: Path) -> dict:
    """``--neighbours_only``: bytes per vector, search time of ``queries`` (k = 10) and neighbour recall@10 against the
    exact full-width neighbours, without :func:`evaluate_index` (whose exact engine holds several copies of the
    gallery); Recall@1 and MAP@R are not measured (NaN)."""
    from lightning_dml.index import vectors as V

    began = time.perf_counter()
    index.search(queries, 10)
    seconds = time.perf_counter() - began
    out = {"name": name, "bytes": V.index_bytes(index) / len(index), "ms": 1000 * seconds / queries.shape[0],
           "nr": full_width_recall(index, queries, exact_ids()), "r1": float("nan"), "map": float("nan"),
           "exact_r1": float("nan"), "exact_map": float("nan"), "build": built, "options": index.options}
    del index
    gc.collect()
    shutil.rmtree(folder)
    print(f"  {name}: {out}; peak so far {peak_gib():.2f} GiB, {uptime()}", file=sys.stderr, flush=True)
    return out


def table(title: str, rows: list[dict]) -> str:
    lines = [f"**{title}**", "", "| index | bytes / vector | ms / query | neighbour recall@10 | Recall@1 | MAP@R | "
             "build s | options |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['bytes']:.1f} | {r['ms']:.3f} | {100 * r['nr']:.2f} | {100 * r['r1']:.2f} "
                     f"| {100 * r['map']:.2f} | {r['build']:.1f} | {r['options']} |")
    exact = next((r for r in rows if "width" not in r["name"]), None)  # a width row's exact search is its own
    if exact is not None and exact["exact_r1"] == exact["exact_r1"]:  # not NaN: measured (no --neighbours_only)
        lines.append(f"\n(exact search: Recall@1 {100 * exact['exact_r1']:.2f}, MAP@R {100 * exact['exact_map']:.2f})")
    return "\n".join(lines)


def key_values(items: list[str]) -> dict[str, int]:
    """``["nlist=1024", ...]`` -> ``{"nlist": 1024, ...}`` (index options of a row)."""
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        out[name] = int(value)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--predictions", default=None, help="predictions.pt of lightning-dml predict (Glyphs test)")
    p.add_argument("--size", type=int, default=1_000_000, help="synthetic gallery size (0: none)")
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--clusters", type=int, default=10_000)
    p.add_argument("--spread", type=float, default=0.5, help="centre norm / noise norm")
    p.add_argument("--queries", type=int, default=200, help="synthetic queries")
    p.add_argument("--query_block", type=int, default=20, help="synthetic queries per evaluate_index call")
    p.add_argument("--rescore", type=int, nargs="+", default=[10, 20, 50, 100, 200], help="N of --rescore")
    p.add_argument("--widths", type=int, nargs="*", default=[], help="rows of the leading W dimensions")
    p.add_argument("--ivf_pq", nargs="*", default=[], help="options of the ivf_pq row, name=value (default: the "
                   "library's defaults)")
    p.add_argument("--hnsw", nargs="*", default=[], help="options of the hnsw row, name=value")
    p.add_argument("--kinds", nargs="+", default=None, help="only the rows whose name starts with one of these")
    p.add_argument("--neighbours_only", action="store_true", help="synthetic: no evaluate_index (its exact engine "
                   "needs ~15 GiB at 1M x 512): bytes, ms / query, neighbour recall@10 only")
    p.add_argument("--work", default=None, help="folder for the data file and the index (default: a temporary one)")
    a = p.parse_args(argv)
    print(f"command: python bench/compressed.py {' '.join(sys.argv[1:] if argv is None else argv)}")
    print(f"before: {uptime()}; torch threads {torch.get_num_threads()}")
    with tempfile.TemporaryDirectory(dir=a.work) as tmp:
        work = Path(tmp)
        if a.predictions:
            from lightning_dml.callbacks import load_predictions

            data = load_predictions(a.predictions)
            emb, labels = data["embeddings"].float(), [str(int(v)) for v in data["labels"]]
            rows = [c for c in configs(a.rescore, key_values(a.ivf_pq), key_values(a.hnsw), a.widths, "Matryoshka")
                    if not a.kinds or any(c[0].startswith(k) for k in a.kinds)]
            exact = exact_full_width(emb, None) if a.widths else None
            began = time.perf_counter()
            out = [measure(n, k, o, w, lambda: emb, labels, None, None, work, 0, 0, lambda: exact)
                   for n, k, o, w in rows]
            print(table(f"Glyphs test gallery: {emb.shape[0]} x {emb.shape[1]}, all-vs-all "
                        f"({time.perf_counter() - began:.0f} s)", out))
        if a.size:
            began = time.perf_counter()
            path = work / "gallery.npy"
            gl = clustered_file(path, a.size, a.dim, a.clusters, a.spread, seed=1)
            queries, ql = clustered(a.queries, a.dim, a.clusters, a.spread, seed=2)
            length, every_query_has_r = list_length(gl, ql, k=10)
            block = a.query_block if every_query_has_r else a.queries
            glabels, qlabels = [str(v) for v in gl.tolist()], [str(v) for v in ql.tolist()]

            def gallery() -> torch.Tensor:  # copy-on-write map: writable for torch, pages read on demand
                return torch.from_numpy(np.load(path, mmap_mode="c"))

            exact: list[torch.Tensor] = []

            def exact_ids() -> torch.Tensor:
                if not exact:
                    exact.append(exact_full_width(gallery(), queries))
                    gc.collect()
                return exact[0]

            rows = [c for c in configs(a.rescore, key_values(a.ivf_pq), key_values(a.hnsw), a.widths, "cut")
                    if not a.kinds or any(c[0].startswith(k) for k in a.kinds)]
            out = [measure(n, k, o, w, gallery, glabels, queries, qlabels, work, length, block, exact_ids,
                           a.neighbours_only) for n, k, o, w in rows]
            print(table(f"Synthetic: {a.size} x {a.dim}, {a.clusters} clusters, {a.queries} queries "
                        f"({time.perf_counter() - began:.0f} s)", out))
    print(f"after: {uptime()}; peak resident memory {peak_gib():.1f} GiB")


if __name__ == "__main__":
    main()
