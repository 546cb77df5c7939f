"""The Glyphs experiment of the learned pairwise re-ranker (issue 30 s.1): base model vs base + re-ranker on the
test classes (zero-shot: the re-ranker is trained on the training classes only), over several re-ranker seeds.

1. the base model: ``lightning-dml fit --config configs/glyphs.yaml`` with checkpoints on (skipped when
   ``--base_root`` already holds ``checkpoints/last.ckpt`` and ``config.yaml``);
2. per seed and per re-ranker config (``configs/rerank/glyphs.yaml``: STIR's ConcatSiamese;
   ``configs/rerank/glyphs_feature.yaml``: FeatureDistanceSiamese), ``lightning-dml fit`` of the re-ranker on the
   base model's exact top-10 lists of the training split;
3. on the test classes, all-vs-all (each image a query against the others, as ``lightning-dml test``): the exact
   engine's ranked lists (:func:`lightning_dml.metrics.functional.knn`), the first ``--top_n`` re-scored and
   re-ordered by the re-ranker with the functions of ``lightning-dml test --rerank`` / ``index evaluate --rerank``
   (:func:`lightning_dml.index.pairwise.rerank_ranked`, :func:`~lightning_dml.index.pairwise.permuted_metrics`:
   items beyond ``top_n`` keep the base order), Recall@1 and MAP@R with the library's definitions, and the
   re-ranker's cost per query (wall time of the re-scoring divided by the queries; the exact search's for the base).

Prints one markdown table (per seed, then mean and sample standard deviation over the seeds) and writes it with the
raw figures to ``--out``/results.json.

    python bench/rerank_glyphs.py --out runs/rerank_bench --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
RERANK = ROOT / "configs" / "rerank"
#: row name -> (re-ranker config, extra fit arguments, folder tag)
CONFIGS = {
    "ConcatSiamese (STIR)": (RERANK / "glyphs.yaml", [], "concat"),
    "FeatureDistanceSiamese": (RERANK / "glyphs_feature.yaml", [], "feature"),
    "ConcatSiamese residual, 20% classes held out": (RERANK / "glyphs_residual.yaml", [], "concat_residual_val"),
    "ConcatSiamese residual, no validation": (RERANK / "glyphs_residual.yaml", ["--data.val_classes", "0"],
                                              "concat_residual"),
    "FeatureDistanceSiamese residual, 20% classes held out": (RERANK / "glyphs_feature_residual.yaml", [],
                                                              "feature_residual_val"),
    "FeatureDistanceSiamese residual, no validation": (RERANK / "glyphs_feature_residual.yaml",
                                                       ["--data.val_classes", "0"], "feature_residual"),
    # the mined top-10 lists of the 94 training classes: 12,568 positive and 4,332 negative pairs (4332 / 12568)
    "FeatureDistanceSiamese, balanced (pos_weight 0.345)": (RERANK / "glyphs_feature.yaml",
                                                            ["--model.pos_weight", "0.345"], "feature_balanced"),
}


def _run(args: list[str]) -> None:
    command = [sys.executable, "-m", "lightning_dml", *args]
    print("$ lightning-dml " + " ".join(args), flush=True)
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"failed ({done.returncode}):\n{done.stderr[-4000:]}")


def base_model(root: Path) -> tuple[Path, Path]:
    config, ckpt = root / "config.yaml", root / "checkpoints" / "last.ckpt"
    if not ckpt.is_file():
        _run(["fit", "--config", "configs/glyphs.yaml", "--trainer.enable_checkpointing", "true",
              "--trainer.default_root_dir", str(root), "--trainer.logger", "false",
              "--trainer.enable_progress_bar", "false"])
    return config, ckpt


def fit_reranker(config: Path, base_config: Path, base_ckpt: Path, seed: int, out: Path, epochs: int | None,
                 extra: list[str]) -> Path:
    folder = out / "reranker"
    if not (folder / "reranker.json").is_file():
        extra = [*extra, *([] if epochs is None else ["--trainer.max_epochs", str(epochs)])]
        _run(["fit", "--config", str(config), "--data.base_config", str(base_config), "--data.base_checkpoint",
              str(base_ckpt), "--seed_everything", str(seed), "--trainer.default_root_dir", str(out),
              "--model.output", str(folder), "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
              *extra])
    return folder


def test_split(base_config: Path, base_ckpt: Path, device: str):
    """Embeddings, images and labels of the base model's test split (its evaluation view), and its metric."""
    from lightning_dml.index.embed import embedding_metric, load_checkpoint_model
    from lightning_dml.rerank.data import embed_dataset

    module, datamodule, _ = load_checkpoint_model(base_config, base_ckpt)
    datamodule.setup("test")
    test = datamodule.test_dataset
    view = datamodule.make_eval_view(test, np.arange(len(test)))
    embeddings = embed_dataset(module, view, 512, 0, device)
    images = torch.stack([view[i][0] for i in range(len(view))])
    return embeddings, images, torch.as_tensor(test.labels), embedding_metric(module)


def evaluate(embeddings, images, labels, metric: str, top_n: int, folder: Path | None, device: str) -> dict:
    from lightning_dml.index.pairwise import permuted_metrics, rerank_ranked
    from lightning_dml.index.rerank import as_stored
    from lightning_dml.metrics import functional as MF
    from lightning_dml.rerank import load_reranker

    r = (labels.unsqueeze(1) == labels.unsqueeze(0)).sum(1) - 1
    length = min(max(int(r.max()), top_n, 1), labels.numel() - 1)
    start = time.perf_counter()
    base, ranked = MF.knn(embeddings, None, k=length, metric=metric)
    search_s = time.perf_counter() - start
    relevance = (ranked >= 0) & (labels[ranked.clamp_min(0)] == labels.unsqueeze(1))
    hit = relevance.any(dim=1)
    first = torch.where(hit, relevance.double().argmax(dim=1), torch.full_like(hit, -1, dtype=torch.int64))
    n = min(top_n, length)
    if folder is None:
        perm = torch.arange(n).expand(labels.numel(), n)
        return {**permuted_metrics(perm, relevance, r, first, (1,)), "ms_per_query": 1e3 * search_s / labels.numel()}
    model = load_reranker(folder, device)
    items = (as_stored(embeddings, metric) if model.inputs == "embeddings" else images).to(device)
    start = time.perf_counter()
    perm = rerank_ranked(model, ranked.to(device), items, lambda pos: items[pos.clamp_min(0)], n,
                         base.to(device)).cpu()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    return {**permuted_metrics(perm, relevance, r, first, (1,)), "ms_per_query": 1e3 * seconds / labels.numel()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base_root", type=Path, default=ROOT / "runs" / "glyphs")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "rerank_bench")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--top_n", type=int, default=10, help="re-scored neighbours per test query")
    parser.add_argument("--epochs", type=int, default=None, help="re-ranker epochs (default: the config's)")
    parser.add_argument("--models", nargs="+", default=list(CONFIGS)[:2], choices=list(CONFIGS))
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    os.environ.setdefault("WANDB_MODE", "offline")
    base_config, base_ckpt = base_model(args.base_root.resolve())
    embeddings, images, labels, metric = test_split(base_config, base_ckpt, args.device)
    results = {"base": evaluate(embeddings, images, labels, metric, args.top_n, None, args.device)}
    for name in args.models:
        for seed in args.seeds:
            config, extra, tag = CONFIGS[name]
            folder = fit_reranker(config, base_config, base_ckpt, seed, args.out.resolve() / f"{tag}_{seed}",
                                  args.epochs, extra)
            results[f"{name} seed {seed}"] = evaluate(embeddings, images, labels, metric, args.top_n, folder,
                                                      args.device)
    rows = ["| model | Recall@1 | MAP@R | ms / query |", "| --- | ---: | ---: | ---: |"]
    base = results["base"]
    rows.append(f"| base (exact search) | {100 * base['recall@1']:.2f} | {100 * base['map@r']:.2f} | "
                f"{base['ms_per_query']:.3f} |")
    for name in args.models:
        per_seed = [results[f"{name} seed {s}"] for s in args.seeds]
        for seed, res in zip(args.seeds, per_seed):
            rows.append(f"| {name}, seed {seed} | {100 * res['recall@1']:.2f} | {100 * res['map@r']:.2f} | "
                        f"{res['ms_per_query']:.3f} |")
        if len(per_seed) > 1:
            cells = []
            for key in ("recall@1", "map@r"):
                values = [100 * res[key] for res in per_seed]
                cells.append(f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}")
            ms = statistics.mean(res["ms_per_query"] for res in per_seed)
            rows.append(f"| {name}, mean ± sd ({len(per_seed)} seeds) | {cells[0]} | {cells[1]} | {ms:.3f} |")
    table = "\n".join(rows)
    print(f"Glyphs test classes, {labels.numel()} queries all-vs-all, top_n={args.top_n} re-scored, device "
          f"{args.device}\n{table}")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"results": results, "table": table,
                                                       "top_n": args.top_n, "seeds": args.seeds}, indent=1))


if __name__ == "__main__":
    main()
