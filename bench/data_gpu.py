"""The GPU check of issue 21 (``../shared/gpu-checks.md``, item 7): images/s of a ViT-S/16 bf16 training step fed
from the decoded-image cache, against the same step on synthetic tensors already on the GPU (the ceiling).

Usage (one line, on a machine with a CUDA device)::

    OMP_NUM_THREADS=1 python bench/data_gpu.py --workers 8 16 --images-per-class 16 --root /tmp/bench_data21_16

The fixture is ``bench/data.py``'s CUB-200-2011 tree of 500 x 375 JPEGs (written to ``--root`` unless it is
there), read by :class:`~lightning_dml.data.CUB200DataModule` with ``cache="decoded"`` (the cache is built before
the timing, in ``$LIGHTNING_DML_CACHE``, a temporary folder unless set). The step: ``timm``'s ``--model``
(default ``vit_small_patch16_224``, random weights) + a linear embedding head (128), the Multi-Similarity loss,
AdamW, forward and loss under ``torch.autocast(dtype=torch.bfloat16)``, on P x K batches.

Rows, each timed over ``--steps`` steps after ``--warmup`` untimed ones (``torch.cuda.synchronize`` around the
timing): ``synthetic`` (one random float batch already on the device, reused: no data pipeline at all), then per
worker count ``--workers`` the cached loader with the flip and conversion in the workers
(``augment_on_device=False``) and on the device (``augment_on_device=True``: the data module's
``on_after_batch_transfer`` after the transfer). Each fed row prints its images/s and its ratio to the synthetic
row; the issue's target is a ratio of at least 0.9. ``--json``: one JSON line per row (``feed``, ``workers``,
``augment``, ``images_per_s``, ``ratio``).

``--device cpu --model vit_tiny_patch16_224 --crop 64`` runs the same code on the CPU (a smoke test of the script,
not a measurement).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

if "LIGHTNING_DML_CACHE" not in os.environ:  # keep the benchmark's cache out of the user's cache folder
    os.environ["LIGHTNING_DML_CACHE"] = tempfile.mkdtemp(prefix="bench_data_gpu_cache_")

import torch  # noqa: E402
from pytorch_lightning.utilities import move_data_to_device  # noqa: E402

from lightning_dml.data import CUB200DataModule  # noqa: E402
from lightning_dml.losses import MultiSimilarityLoss  # noqa: E402


def _bench_data():
    """``bench/data.py`` as a module (its fixture writer), loaded by path."""
    spec = importlib.util.spec_from_file_location("bench_data", HERE / "data.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class Step:
    """One training step: backbone + linear head, Multi-Similarity loss, AdamW; forward and loss in bf16 autocast."""

    def __init__(self, model_name: str, crop: int, device: torch.device) -> None:
        import timm

        extra = {} if crop == 224 else {"img_size": crop}
        self.backbone = timm.create_model(model_name, pretrained=False, num_classes=0, **extra).to(device)
        self.head = torch.nn.Linear(self.backbone.num_features, 128).to(device)
        self.loss = MultiSimilarityLoss()
        params = [*self.backbone.parameters(), *self.head.parameters()]
        self.optimizer = torch.optim.AdamW(params, lr=1e-5)
        self.device = device

    def __call__(self, images: torch.Tensor, labels: torch.Tensor) -> None:
        with torch.autocast(self.device.type, dtype=torch.bfloat16):
            embeddings = self.head(self.backbone(images))
            loss = self.loss(embeddings.float(), labels)
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_synthetic(step: Step, batch: int, crop: int, labels: torch.Tensor, steps: int, warmup: int) -> float:
    images = torch.randn(batch, 3, crop, crop, device=step.device)
    for _ in range(warmup):
        step(images, labels)
    _synchronize(step.device)
    start = time.perf_counter()
    for _ in range(steps):
        step(images, labels)
    _synchronize(step.device)
    return steps * batch / (time.perf_counter() - start)


def time_fed(step: Step, dm: CUB200DataModule, steps: int, warmup: int) -> float:
    """images/s of ``steps`` steps fed by the data module's training loader (moved to the device, then its
    ``on_after_batch_transfer``), after ``warmup`` untimed steps; epochs follow one another as in training."""
    loader = dm.train_dataloader()

    def batches():
        epoch = 0
        while True:
            loader.batch_sampler.set_epoch(epoch)
            yield from loader
            epoch += 1

    stream = batches()

    def one() -> int:
        batch = move_data_to_device(next(stream), step.device)
        batch = dm.on_after_batch_transfer(batch, 0)
        step(batch[0], batch[1])
        return batch[0].shape[0]

    for _ in range(warmup):
        one()
    _synchronize(step.device)
    start = time.perf_counter()
    count = sum(one() for _ in range(steps))
    _synchronize(step.device)
    rate = count / (time.perf_counter() - start)
    del stream, loader
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--model", default="vit_small_patch16_224")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--cache-size", type=int, default=256)
    parser.add_argument("--classes-per-batch", type=int, default=32)
    parser.add_argument("--samples-per-class", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--images-per-class", type=int, default=16)
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--height", type=int, default=375)
    parser.add_argument("--root", type=Path, default=None, help="where to write (and reuse) the fixture")
    parser.add_argument("--json", action="store_true", help="one JSON line per row instead of the table")
    args = parser.parse_args()
    say = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device: this check needs a GPU (--device cpu runs it as a smoke test only)")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    root = args.root or Path(tempfile.mkdtemp(prefix="bench_data_gpu_"))
    if not (root / "CUB_200_2011" / "images.txt").exists():
        _bench_data().write_cub_tree(root, args.images_per_class, args.width, args.height)
    listed = len((root / "CUB_200_2011" / "images.txt").read_text().split()) // 2
    if listed != 200 * args.images_per_class:
        parser.error(f"--root {root} holds a fixture of {listed} images, not 200 x {args.images_per_class}")
    batch = args.classes_per_batch * args.samples_per_class
    labels = torch.arange(args.classes_per_batch, device=device).repeat_interleave(args.samples_per_class)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    say(f"{args.model} bf16 step, batch {batch} ({args.classes_per_batch} x {args.samples_per_class}) at {args.crop} px "
        f"on {name}; fixture {root}; cpu count {os.cpu_count()}; load average {os.getloadavg()[0]:.2f}")

    def data_module(workers: int, on_device: bool) -> CUB200DataModule:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dm = CUB200DataModule(
                root, classes_per_batch=args.classes_per_batch, samples_per_class=args.samples_per_class,
                num_workers=workers, image_size=args.crop, check_counts=False, cache="decoded",
                cache_size=args.cache_size, augment_on_device=on_device,
            )
            dm.prepare_data()  # builds the cache (not timed)
            dm.setup()
        return dm

    data_module(0, False)
    for logger in ("lightning_fabric.utilities.rank_zero", "pytorch_lightning.utilities.rank_zero"):
        logging.getLogger(logger).setLevel(logging.WARNING)  # not the cache's "found" line for every row
    step = Step(args.model, args.crop, device)
    ceiling = time_synthetic(step, batch, args.crop, labels, args.steps, args.warmup)
    rows = [{"feed": "synthetic", "workers": None, "augment": None, "images_per_s": round(ceiling, 1), "ratio": 1.0}]
    for workers in args.workers:
        for on_device in (False, True):
            rate = time_fed(step, data_module(workers, on_device), args.steps, args.warmup)
            rows.append({"feed": "cache", "workers": workers, "augment": "device" if on_device else "workers",
                         "images_per_s": round(rate, 1), "ratio": round(rate / ceiling, 3)})
    if args.json:
        for row in rows:
            print(json.dumps(row), flush=True)
        return
    print(f"{'feed':>10} {'workers':>8} {'augment':>8} {'images/s':>10} {'ratio':>6}")
    for row in rows:
        workers = "-" if row["workers"] is None else row["workers"]
        print(f"{row['feed']:>10} {workers:>8} {row['augment'] or '-':>8} {row['images_per_s']:>10.1f} "
              f"{row['ratio']:>6.3f}")


if __name__ == "__main__":
    main()
