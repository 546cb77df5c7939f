"""Training-pipeline throughput (images/second) of the file data modules on full-size JPEGs.

Usage::

    python bench/data.py                                  # CUB-like fixture, 2 workers, P x K = 16 x 4, crop 224
    python bench/data.py --workers 0 2 4 --batches 30 --spec bninception --crop-to-box

A CUB-200-2011 tree in the official layout is written to a temporary folder (``--root`` to keep it): 200
classes, ``--images-per-class`` JPEGs each, ``--width`` x ``--height`` pixels (CUB's typical 500 x 375) of
smooth random texture plus noise at JPEG quality 90, so decoding costs what it costs on the real photographs
(about 40-70 KB per file). The timed loop iterates the training DataLoader of :class:`CUB200DataModule` (decode,
optional box crop, random resized crop to ``--crop``, flip, InputSpec conversion, collation of P x K batches)
and does nothing with the batches: the figure is the data pipeline's ceiling, not a training speed. The first
``--warmup`` batches (worker start-up) are not timed. The evaluation loader (resize 256 + centre crop) is
timed the same way.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from lightning_dml.data import CUB200DataModule  # noqa: E402
from lightning_dml.models import BNINCEPTION, TORCHVISION_IMAGENET  # noqa: E402


def _texture(rng: np.random.Generator, width: int, height: int) -> np.ndarray:
    """Smooth random colour field (bilinear-upsampled coarse noise) plus fine noise, uint8 [H, W, 3]."""
    coarse = rng.integers(0, 256, size=(height // 25 + 2, width // 25 + 2, 3)).astype(np.uint8)
    smooth = np.asarray(Image.fromarray(coarse).resize((width, height), Image.Resampling.BILINEAR), dtype=np.int16)
    noisy = smooth + rng.normal(0, 12, size=smooth.shape).astype(np.int16)
    return np.clip(noisy, 0, 255).astype(np.uint8)


def write_cub_tree(root: Path, images_per_class: int, width: int, height: int, seed: int = 0) -> Path:
    """A CUB_200_2011 tree of full-size textured JPEGs in the official list-file layout."""
    top = root / "CUB_200_2011"
    rng = np.random.default_rng(seed)
    images, labels, boxes = [], [], []
    image_id = 0
    for c in range(1, 201):
        folder = f"{c:03d}.Bench_{c}"
        (top / "images" / folder).mkdir(parents=True, exist_ok=True)
        for k in range(images_per_class):
            image_id += 1
            relative = f"{folder}/Bench_{c}_{k}.jpg"
            Image.fromarray(_texture(rng, width, height)).save(top / "images" / relative, quality=90)
            images.append(f"{image_id} {relative}")
            labels.append(f"{image_id} {c}")
            boxes.append(f"{image_id} {width * 0.1:.1f} {height * 0.1:.1f} {width * 0.7:.1f} {height * 0.75:.1f}")
    (top / "images.txt").write_text("\n".join(images) + "\n")
    (top / "image_class_labels.txt").write_text("\n".join(labels) + "\n")
    (top / "bounding_boxes.txt").write_text("\n".join(boxes) + "\n")
    (top / "classes.txt").write_text("\n".join(f"{c} {c:03d}.Bench_{c}" for c in range(1, 201)) + "\n")
    return top


def _time_loader(loader, batches: int, warmup: int) -> tuple[float, int]:
    iterator = iter(loader)
    for _ in range(warmup):
        next(iterator)
    count = 0
    start = time.perf_counter()
    for _ in range(batches):
        try:
            images = next(iterator)[0]
        except StopIteration:
            break
        count += images.shape[0]
    return count / (time.perf_counter() - start), count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[2])
    parser.add_argument("--batches", type=int, default=20, help="timed batches per setting")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--classes-per-batch", type=int, default=16)
    parser.add_argument("--samples-per-class", type=int, default=4)
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--spec", choices=["torchvision", "bninception"], default="torchvision")
    parser.add_argument("--crop-to-box", action="store_true")
    parser.add_argument("--images-per-class", type=int, default=8)
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--height", type=int, default=375)
    parser.add_argument("--root", type=Path, default=None, help="where to write (and reuse) the fixture")
    args = parser.parse_args()

    root = args.root or Path(tempfile.mkdtemp(prefix="bench_data_"))
    if not (root / "CUB_200_2011" / "images.txt").exists():
        start = time.perf_counter()
        write_cub_tree(root, args.images_per_class, args.width, args.height)
        print(f"wrote {200 * args.images_per_class} JPEGs of {args.width}x{args.height} in {time.perf_counter() - start:.1f} s")
    files = list((root / "CUB_200_2011" / "images").rglob("*.jpg"))
    print(f"fixture: {root} ({len(files)} files, mean {np.mean([f.stat().st_size for f in files]) / 1024:.0f} KB)")
    spec = BNINCEPTION if args.spec == "bninception" else TORCHVISION_IMAGENET
    print(f"torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}, cpu count {os.cpu_count()}, spec {args.spec}")
    print(f"{'workers':>8} {'loader':>6} {'batch':>6} {'images/s':>10} {'images':>8}")
    for workers in args.workers:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dm = CUB200DataModule(
                root,
                classes_per_batch=args.classes_per_batch,
                samples_per_class=args.samples_per_class,
                num_workers=workers,
                image_size=args.crop,
                input_spec=spec,
                crop_to_box=args.crop_to_box,
                eval_batch_size=args.classes_per_batch * args.samples_per_class,
                check_counts=False,
            )
            dm.setup()
        for name, loader in (("train", dm.train_dataloader()), ("eval", dm.test_dataloader())):
            rate, count = _time_loader(loader, args.batches, args.warmup)
            print(f"{workers:>8} {name:>6} {dm.batch_size:>6} {rate:>10.1f} {count:>8}", flush=True)
            del loader


if __name__ == "__main__":
    main()
