"""Speed of the index (issue 23): ``EmbeddingIndex.search`` against bare faiss on the same index, and the embedding
throughput of ``index build`` against ``lightning-dml predict``.

Usage::

    python bench/index.py                      # the issue's sizes: 1,000,000 x 128 ivf_flat, 60,502 x 512 flat
    python bench/index.py --ivf-size 200000 --images 4000  # smaller, on a small machine

1. **Search** (``--ivf-size`` x ``--ivf-dim`` ``ivf_flat``, ``--flat-size`` x ``--flat-dim`` ``flat``): clustered random
   vectors (``--clusters`` Gaussian centres, unit noise), the index built by ``EmbeddingIndex.build`` (cosine), then
   ``--queries`` queries searched for ``k`` neighbours ``--repeats`` times, alternating ``EmbeddingIndex.search`` (raw
   query tensor in, tensors out: normalisation, conversion, tie ordering included) and ``index.faiss_index.search``
   (bare faiss, the same faiss object, queries already normalised as a float32 numpy array). The median wall time
   of each; the ratio is ours / faiss's (the issue's target: at most 1.10). The ids must agree.
2. **Embedding throughput** (``--images`` grey 32 x 32 PNGs in class folders; the tiny Glyphs model, SmallConvNet
   width 32, 128-d, random weights): the predict loop of ``lightning-dml predict`` (the config's
   ``ImageFolderDataModule`` test split, ``Trainer.predict``, its ``PredictionWriter``) against the embedding step of
   ``index build`` (:func:`lightning_dml.index.embed.predict_embeddings`), both timed by a callback from
   ``on_predict_start`` to ``on_predict_end``, the same batch size and workers, alternating ``--repeats`` times;
   images/s, median.

Prints the figures as markdown tables, with the command line and ``uptime`` before and after.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytorch_lightning as pl
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def clustered(n: int, d: int, clusters: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(clusters, d, generator=g) * 3
    out = torch.empty(n, d)
    for start in range(0, n, 100_000):  # bounded temporary memory
        stop = min(n, start + 100_000)
        labels = torch.randint(clusters, (stop - start,), generator=g)
        out[start:stop] = centres[labels] + torch.randn(stop - start, d, generator=g)
    return out


def bench_search(kind: str, n: int, d: int, args: argparse.Namespace) -> dict:
    from lightning_dml.index import EmbeddingIndex

    x = clustered(n, d, args.clusters, seed=0)
    began = time.perf_counter()
    options = {"nlist": args.nlist, "nprobe": args.nprobe} if kind == "ivf_flat" else {}
    index = EmbeddingIndex.build(x, kind=kind, **{k: v for k, v in options.items() if v is not None})
    build_s = time.perf_counter() - began
    del x
    q = clustered(args.queries, d, args.clusters, seed=1)
    q_np = np.ascontiguousarray(torch.nn.functional.normalize(q, dim=1).numpy())
    raw = index.faiss_index
    ours, bare = [], []
    index.search(q[:10], args.k), raw.search(q_np[:10], args.k)  # warm-up
    for _ in range(args.repeats):
        t = time.perf_counter()
        _, ids = index.search(q, args.k)
        ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        _, ref = raw.search(q_np, args.k)
        bare.append(time.perf_counter() - t)
    agree = float((np.sort(ids.numpy(), 1) == np.sort(ref, 1)).mean())
    return {"kind": kind, "n": n, "d": d, "options": index.options, "build_s": build_s,
            "ours_s": statistics.median(ours), "faiss_s": statistics.median(bare), "ids_agree": agree}


class Timer(pl.Callback):
    def __init__(self) -> None:
        self.seconds: list[float] = []

    def on_predict_start(self, trainer, pl_module) -> None:
        self._t = time.perf_counter()

    def on_predict_end(self, trainer, pl_module) -> None:
        self.seconds.append(time.perf_counter() - self._t)


def bench_embedding(args: argparse.Namespace) -> dict:
    from PIL import Image

    from lightning_dml.cli import build_cli
    from lightning_dml.index.embed import load_checkpoint_model, predict_embeddings, preprocessing
    from lightning_dml.index.gallery import read_items

    tmp = Path(tempfile.mkdtemp(prefix="bench-index-"))
    rng = np.random.default_rng(0)
    classes = 50
    for c in range(classes):
        base = rng.integers(0, 255, (32, 32))
        for i in range(args.images // classes):
            for split in ("test",) if i else ("train", "test"):
                path = tmp / "data" / split / f"c{c}" / f"{i}.png"
                path.parent.mkdir(parents=True, exist_ok=True)
                Image.fromarray(np.clip(base + rng.normal(0, 20, (32, 32)), 0, 255).astype(np.uint8), "L").save(path)
    cfg = yaml.safe_load((ROOT / "configs" / "glyphs.yaml").read_text())
    cfg["trainer"] = {"logger": False, "enable_checkpointing": False, "accelerator": "cpu", "devices": 1,
                      "enable_progress_bar": False, "enable_model_summary": False, "callbacks": []}
    cfg["data"] = {"class_path": "lightning_dml.data.ImageFolderDataModule",
                   "init_args": {"root": str(tmp / "data"), "num_workers": args.workers,
                                 "eval_batch_size": args.batch_size, "check_counts": False}}
    config = tmp / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    cli = build_cli(["--config", str(config)], run=False)
    ckpt = tmp / "model.ckpt"
    torch.save({"state_dict": cli.model.state_dict(), "pytorch-lightning_version": pl.__version__}, ckpt)

    # the trainer of `lightning-dml predict` with this config: the config's trainer and data module, the
    # PredictionWriter the command adds (build_cli with run=False takes no subcommand: added here as DMLCLI does)
    from lightning_dml.callbacks import PredictionWriter

    predict_cli = build_cli(["--config", str(config), f"--trainer.default_root_dir={tmp / 'predict'}"], run=False)
    predict_timer = Timer()
    predict_cli.trainer.callbacks.extend([PredictionWriter(str(tmp / "predictions.pt")), predict_timer])
    module, datamodule, _ = load_checkpoint_model(config, ckpt)
    spec, preprocess = preprocessing(module, datamodule)
    paths = read_items(tmp / "data" / "test").paths
    build_timer = Timer()
    for _ in range(args.repeats):
        predict_cli.trainer.predict(predict_cli.model, datamodule=predict_cli.datamodule, ckpt_path=str(ckpt))
        predict_embeddings(module, paths, spec, preprocess, accelerator="cpu", num_workers=args.workers,
                           batch_size=args.batch_size, progress=False, callbacks=[build_timer])
    n = len(paths)
    return {"images": n, "predict_ips": n / statistics.median(predict_timer.seconds),
            "build_ips": n / statistics.median(build_timer.seconds), "workers": args.workers,
            "batch_size": args.batch_size}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ivf-size", type=int, default=1_000_000)
    p.add_argument("--ivf-dim", type=int, default=128)
    p.add_argument("--nlist", type=int, default=None, help="ivf_flat cells (default: the library's, 4 sqrt(n))")
    p.add_argument("--nprobe", type=int, default=None)
    p.add_argument("--flat-size", type=int, default=60_502)
    p.add_argument("--flat-dim", type=int, default=512)
    p.add_argument("--clusters", type=int, default=1000)
    p.add_argument("--queries", type=int, default=1000)
    p.add_argument("--k", type=int, default=10)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--images", type=int, default=4000)
    p.add_argument("--workers", type=int, default=0)
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--skip", nargs="*", default=[], choices=("ivf", "flat", "embedding"))
    args = p.parse_args()
    print(f"command: {' '.join([Path(sys.executable).name, *sys.argv])}")
    print(f"uptime before: {uptime()}  (torch threads {torch.get_num_threads()})")
    rows = []
    if "ivf" not in args.skip:
        rows.append(bench_search("ivf_flat", args.ivf_size, args.ivf_dim, args))
    if "flat" not in args.skip:
        rows.append(bench_search("flat", args.flat_size, args.flat_dim, args))
    if rows:
        print(f"\n{args.queries} queries, k={args.k}, median of {args.repeats}\n")
        print("| index | vectors | options | build s | EmbeddingIndex.search s | bare faiss s | ratio | ids agree |")
        print("|---|---:|---|---:|---:|---:|---:|---:|")
        for r in rows:
            print(f"| {r['kind']} | {r['n']:,} x {r['d']} | {r['options'] or ''} | {r['build_s']:.1f} | "
                  f"{r['ours_s']:.4f} | {r['faiss_s']:.4f} | {r['ours_s'] / r['faiss_s']:.3f} | {r['ids_agree']:.4f} |")
    if "embedding" not in args.skip:
        e = bench_embedding(args)
        print(f"\n{e['images']} images (32 x 32 PNG), batch {e['batch_size']}, {e['workers']} workers, median of "
              f"{args.repeats}\n")
        print("| loop | images/s |\n|---|---:|")
        print(f"| lightning-dml predict | {e['predict_ips']:.1f} |\n| index build (embedding) | {e['build_ips']:.1f} |")
        print(f"\nratio index build / predict: {e['build_ips'] / e['predict_ips']:.3f}")
    print(f"\nuptime after: {uptime()}")


if __name__ == "__main__":
    main()
