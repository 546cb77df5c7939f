"""What each training-free re-ranking gains: Recall@K and MAP@R of exact search, then each ``--rerank`` method, on
the embeddings of a ``lightning-dml predict`` run (the test classes), all-vs-all (each item a query against the
others), as ``lightning_dml.index.rerank.rerank_metrics`` computes them (the exact engine's neighbour lists and
metric definitions).

Usage (the Glyphs demo checkpoint; ``predict`` embeds the 93 unseen test classes)::

    lightning-dml predict --config configs/glyphs.yaml --ckpt_path CKPT --trainer.default_root_dir /tmp/p
    python bench/rerank.py --predictions /tmp/p/.../predictions.pt

Prints a markdown table, one row per method (``--methods``: ``--rerank`` specs, ``none`` for exact search).
"""

from __future__ import annotations

import argparse
import time

import torch

from lightning_dml.callbacks import load_predictions
from lightning_dml.index.rerank import parse_rerank, rerank_metrics

METHODS = (
    "none",
    "kreciprocal",
    "kreciprocal:k1=10,k2=3,lambda=0.3",
    "aqe:alpha=3,n=2",
    "aqe:alpha=3,n=5",
    "dba:alpha=3,n=2",
)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--predictions", required=True, help="predictions.pt of lightning-dml predict")
    p.add_argument("--methods", nargs="+", default=list(METHODS))
    a = p.parse_args(argv)
    data = load_predictions(a.predictions)
    emb, labels = data["embeddings"].float(), data["labels"].long()
    rows = []
    base = None
    print(f"{emb.shape[0]} items, {int(labels.unique().numel())} classes, {emb.shape[1]}-d")
    print("| --rerank | Recall@1 | Recall@2 | Recall@4 | Recall@8 | MAP@R | d Recall@1 | d MAP@R | s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for spec in a.methods:
        t0 = time.perf_counter()
        m = rerank_metrics(parse_rerank(spec), emb, labels, recall_at=(1, 2, 4, 8))
        dt = time.perf_counter() - t0
        base = base or m
        row = {"method": spec, **m, "seconds": dt}
        rows.append(row)
        print(f"| `{spec}` | " + " | ".join(f"{100 * m[k]:.1f}" for k in ("recall@1", "recall@2", "recall@4",
                                                                              "recall@8", "map@r"))
              + f" | {100 * (m['recall@1'] - base['recall@1']):+.1f} | {100 * (m['map@r'] - base['map@r']):+.1f}"
              + f" | {dt:.1f} |")
    return rows


if __name__ == "__main__":
    torch.set_num_threads(max(1, torch.get_num_threads()))
    main()
