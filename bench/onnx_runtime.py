"""The ONNX export of a checkpoint against PyTorch on a labelled gallery: embedding error, retrieval quality and
embedding speed of the float32 ONNX model and its int8 dynamic quantisation (issue 31 s.1; docs/serving.md).

::

    python bench/onnx_runtime.py --config runs/glyphs/config.yaml --ckpt_path runs/glyphs/checkpoints/last.ckpt \\
        --gallery glyphs_table/glyphs.csv --split test --out /tmp/glyphs_onnx

Every image of the gallery is preprocessed once (:class:`~lightning_dml.onnx.runtime.PixelTransform`, equal to
the torch runtime's pixels) and embedded by the PyTorch model, the ONNX model and the int8 ONNX model (CPU,
batches of ``--batch_size``). Reported per runtime: the worst relative embedding error against PyTorch
(:func:`~lightning_dml.onnx.export.embedding_error`) and the smallest cosine to the PyTorch embedding, Recall@1 and
MAP@R of the gallery all-vs-all (leave-one-out, the library's exact engine
:func:`~lightning_dml.metrics.functional.retrieval_metrics`), the fraction of queries whose top-10 neighbour ids
(float64 cosine, ties by the smaller index) equal PyTorch's, and images per second (the model alone, best of
``--repeats``). Prints one JSON line and a markdown table; the figures depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import tempfile
import time

import numpy as np
import torch


def top_ids(embeddings: np.ndarray, k: int) -> np.ndarray:
    """The ``k`` nearest other items of each item by float64 cosine, ties by the smaller index."""
    x = embeddings.astype(np.float64)
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    sims = x @ x.T
    np.fill_diagonal(sims, -np.inf)
    order = np.lexsort((np.broadcast_to(np.arange(len(x)), sims.shape), -sims), axis=1)
    return order[:, :k]


def timed(fn, batches: list, repeats: int) -> tuple[np.ndarray, float]:
    best, out = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        out = np.concatenate([fn(b) for b in batches])
        best = min(best, time.perf_counter() - start)
    return out, sum(len(b) for b in batches) / best


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", required=True)
    p.add_argument("--ckpt_path", required=True)
    p.add_argument("--gallery", required=True, help="an image folder of class folders or a table")
    p.add_argument("--split", default=None)
    p.add_argument("--out", default=None, help="where the ONNX files go (default: a temporary folder)")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args(argv)

    from lightning_dml.export import embedding_model, export_embedding_model
    from lightning_dml.index.embed import load_checkpoint_model, preprocessing
    from lightning_dml.index.gallery import read_items
    from lightning_dml.metrics.functional import retrieval_metrics
    from lightning_dml.onnx.export import embedding_error
    from lightning_dml.onnx.runtime import OnnxEmbedder, PixelTransform

    items = read_items(a.gallery, a.split)
    module, datamodule, _ = load_checkpoint_model(a.config, a.ckpt_path)
    spec, preprocess = preprocessing(module, datamodule)
    transform = PixelTransform(dataclasses.asdict(spec), preprocess)
    pixels = np.stack([transform.read(path) for path in items.paths])
    batches = [pixels[s : s + a.batch_size] for s in range(0, len(pixels), a.batch_size)]
    classes = {name: i for i, name in enumerate(sorted(set(items.labels)))}
    labels = torch.tensor([classes[name] for name in items.labels])
    model = embedding_model(module)
    out = a.out or tempfile.mkdtemp(prefix="onnx-bench-")
    written = export_embedding_model(model, out, torch.from_numpy(pixels[:2]), formats=("onnx",), quantize="int8")
    record = json.loads(written["onnx_record"].read_text())

    def torch_embed(batch: np.ndarray) -> np.ndarray:
        with torch.no_grad():
            return model(torch.from_numpy(batch)).numpy()

    runtimes = {"torch": torch_embed}
    for name, key in (("onnx", "onnx"), ("onnx int8", "onnx_int8")):
        runtimes[name] = OnnxEmbedder(written[key], dataclasses.asdict(spec), preprocess, "cpu",
                                      a.batch_size).embed_pixels
    rows, reference, reference_top = {}, None, None
    for name, fn in runtimes.items():
        embeddings, speed = timed(fn, batches, a.repeats)
        metrics = retrieval_metrics(torch.from_numpy(embeddings.astype(np.float32)), labels, recall_at=(1,))
        top = top_ids(embeddings, 10)
        if reference is None:
            reference, reference_top = embeddings, top
        unit, unit_ref = (x.astype(np.float64) / np.linalg.norm(x.astype(np.float64), axis=1, keepdims=True)
                          for x in (embeddings, reference))
        rows[name] = {
            "max_relative_error": embedding_error(embeddings, reference),
            "min_cosine_to_torch": float(np.sum(unit * unit_ref, axis=1).min()),
            "recall@1": metrics["recall@1"], "map@r": metrics["map@r"],
            "top10_ids_equal_torch": float(np.mean(np.all(top == reference_top, axis=1))),
            "images_per_s": round(speed, 1),
        }
    result = {"items": len(items), "classes": len(classes), "input_shape": record["input_shape"],
              "export_max_relative_error": record["max_relative_error"], "int8_export": record["int8"],
              "runtimes": rows, "torch_threads": torch.get_num_threads(),
              "uptime": subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()}
    print(json.dumps(result))
    print("| runtime | max relative error | min cosine to torch | Recall@1 | MAP@R | top-10 ids = torch | images/s |")
    print("|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['max_relative_error']:.2e} | {r['min_cosine_to_torch']:.6f} | {r['recall@1']:.4f} | "
              f"{r['map@r']:.4f} | {r['top10_ids_equal_torch']:.4f} | {r['images_per_s']} |")
    return result


if __name__ == "__main__":
    main()
