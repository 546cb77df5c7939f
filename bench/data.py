"""Training-pipeline throughput (images/second) of the file data modules on full-size JPEGs, with and without the
decoded-image cache.

Usage::

    python bench/data.py                      # CUB-like fixture, 0 and 2 workers, uncached and decoded-cache rows
    python bench/data.py --workers 0 2 --device-augment --compare-decoders --root /tmp/bench_data --json

A CUB-200-2011 tree in the official layout is written to a temporary folder (``--root`` to keep it): 200
classes, ``--images-per-class`` JPEGs each, ``--width`` x ``--height`` pixels (CUB's typical 500 x 375) of
smooth random texture plus noise at JPEG quality 90, so decoding costs what it costs on the real photographs
(about 40-70 KB per file). The timed loop iterates the training DataLoader of :class:`CUB200DataModule` (decode,
optional box crop, random resized crop to ``--crop``, flip, InputSpec conversion, collation of P x K batches)
and does nothing with the batches: the figure is the data pipeline's ceiling, not a training speed. The first
``--warmup`` batches (worker start-up) are not timed. The evaluation loader (resize 256 + centre crop) is
timed the same way.

Each setting runs once per ``--cache`` mode: ``none`` (every image decoded from its JPEG when read) and
``decoded`` (``cache="decoded"``: the decoded-image cache, built before the timing, in the user cache folder
``$LIGHTNING_DML_CACHE``, a temporary folder unless set; its size and build time are printed).
``--device-augment`` adds a training row per worker count with ``augment_on_device=True`` (flip, conversion and
normalisation batched after the loader, on the CPU here: ``on_after_batch_transfer`` is called inside the timed
loop); ``--compare-decoders`` adds an uncached training row decoded by PIL (``LIGHTNING_DML_JPEG_DECODER=pil``)
beside the default decoder's (simplejpeg where installed). At the end, each setting's figures are printed beside
the uncached row's, with the ratios.

Two speeds per row: ``images/s`` (wall clock) and ``/cpu-s``, images per CPU second: the timed images divided by
the user + system CPU time this process and its DataLoader workers used meanwhile (psutil), i.e. the images/s of
one fully used core. On a machine shared with other jobs the wall-clock figures follow the load, the CPU-second
figures much less, so compare settings by the second. A device-augmentation row also gives ``loader``: images per
CPU second without the CPU time of the flip and conversion (``on_after_batch_transfer``), i.e. what the CPU pays
when that step runs on a GPU. The ``worker MB`` column is the largest private memory of a worker process after the timed
batches (``Private_Dirty`` of ``/proc/<pid>/smaps_rollup``, Linux: what the worker wrote itself; the
memory-mapped cache is clean file memory, shared through the page cache, and not in it).

``--json`` prints one JSON object per row instead of the table (the rest goes to stderr): ``loader``
(``train``/``eval``), ``cache`` (``none``/``decoded``), ``workers``, ``images_per_s``, plus ``augment``
(``workers``/``device``), ``images_per_cpu_s``, ``loader_images_per_cpu_s`` (device rows), ``decoder`` (the JPEG decoder of an uncached row), ``batch``,
``images`` and ``worker_mb``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

if "LIGHTNING_DML_CACHE" not in os.environ:  # keep the benchmark's cache out of the user's cache folder
    os.environ["LIGHTNING_DML_CACHE"] = tempfile.mkdtemp(prefix="bench_data_cache_")

from lightning_dml.data import CUB200DataModule  # noqa: E402
from lightning_dml.data.image_list import JPEG_DECODER_ENV, jpeg_decoder  # noqa: E402
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


def _children() -> set[int]:
    """Process ids of this process's children (DataLoader workers), empty without psutil."""
    try:
        import psutil
    except ImportError:
        return set()
    return {child.pid for child in psutil.Process().children()}


def _private_mb(pid: int) -> float | None:
    """``Private_Dirty`` of process ``pid`` in MB (Linux ``smaps_rollup``): the memory the process wrote itself,
    excluding what it shares with its parent since the fork and the clean pages of mapped files (the cache)."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                if line.startswith("Private_Dirty:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _cpu_seconds(pids: list[int]) -> float | None:
    """User + system CPU seconds used so far by the processes ``pids`` (this one included when listed); ``None``
    without psutil (the worker rows then have no per-core figure)."""
    total = 0.0
    others = [pid for pid in pids if pid != os.getpid()]
    if len(others) < len(pids):
        total += time.process_time()  # this process: precise (psutil counts clock ticks)
    if not others:
        return total
    try:
        import psutil
    except ImportError:
        return None
    for pid in others:
        try:
            times = psutil.Process(pid).cpu_times()
        except psutil.Error:
            return None
        total += times.user + times.system
    return total


def _time_loader(loader, batches: int, warmup: int, finish=None) -> tuple[float, float | None, float | None, int, float | None]:
    """images/s (wall clock), images per CPU second (this process and its DataLoader workers together) and the
    same without the CPU time of ``finish`` (the step a GPU runs with ``augment_on_device``; ``None`` without
    ``finish``) over ``batches`` batches after ``warmup`` untimed ones, and the largest worker ``Private_Dirty`` (MB)."""
    before = _children()
    iterator = iter(loader)
    for _ in range(warmup):
        batch = next(iterator)
        if finish is not None:
            finish(batch, 0)
    pids = [os.getpid(), *sorted(_children() - before)]
    count = 0
    finishing = 0.0  # CPU seconds of this process in ``finish``
    cpu = _cpu_seconds(pids)
    start = time.perf_counter()
    for _ in range(batches):
        try:
            batch = next(iterator)
        except StopIteration:
            break
        if finish is not None:
            began = time.process_time()
            batch = finish(batch, 0)
            finishing += time.process_time() - began
        count += batch[0].shape[0]
    rate = count / (time.perf_counter() - start)
    cpu_after = _cpu_seconds(pids)
    per_cpu = loader_only = None
    if cpu is not None and cpu_after is not None and cpu_after > cpu:
        per_cpu = count / (cpu_after - cpu)
        if finish is not None and cpu_after - cpu > finishing:
            loader_only = count / (cpu_after - cpu - finishing)
    memory = [m for m in (_private_mb(pid) for pid in pids[1:]) if m is not None]
    del iterator
    return rate, per_cpu, loader_only, count, max(memory) if memory else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--cache", choices=["none", "decoded"], nargs="+", default=["none", "decoded"])
    parser.add_argument("--device-augment", action="store_true", help="add augment_on_device=True training rows")
    parser.add_argument("--compare-decoders", action="store_true",
                        help="add an uncached training row decoded by PIL (when simplejpeg is the decoder)")
    parser.add_argument("--batches", type=int, default=20, help="timed batches per setting")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--classes-per-batch", type=int, default=16)
    parser.add_argument("--samples-per-class", type=int, default=4)
    parser.add_argument("--crop", type=int, default=224)
    parser.add_argument("--cache-size", type=int, default=256)
    parser.add_argument("--spec", choices=["torchvision", "bninception"], default="torchvision")
    parser.add_argument("--crop-to-box", action="store_true")
    parser.add_argument("--images-per-class", type=int, default=8)
    parser.add_argument("--width", type=int, default=500)
    parser.add_argument("--height", type=int, default=375)
    parser.add_argument("--root", type=Path, default=None, help="where to write (and reuse) the fixture")
    parser.add_argument("--json", action="store_true", help="one JSON line per row instead of the table")
    args = parser.parse_args()
    say = (lambda *a, **k: print(*a, file=sys.stderr, **k)) if args.json else print

    root = args.root or Path(tempfile.mkdtemp(prefix="bench_data_"))
    if not (root / "CUB_200_2011" / "images.txt").exists():
        start = time.perf_counter()
        write_cub_tree(root, args.images_per_class, args.width, args.height)
        say(f"wrote {200 * args.images_per_class} JPEGs of {args.width}x{args.height} in {time.perf_counter() - start:.1f} s")
    listed = len((root / "CUB_200_2011" / "images.txt").read_text().split()) // 2
    if listed != 200 * args.images_per_class:
        parser.error(
            f"--root {root} holds a fixture of {listed} images, not 200 x {args.images_per_class}: give another --root "
            f"or --images-per-class {listed // 200}"
        )
    files = list((root / "CUB_200_2011" / "images").rglob("*.jpg"))
    say(f"fixture: {root} ({len(files)} files, mean {np.mean([f.stat().st_size for f in files]) / 1024:.0f} KB)")
    spec = BNINCEPTION if args.spec == "bninception" else TORCHVISION_IMAGENET
    say(
        f"torch threads {os.environ.get('OMP_NUM_THREADS', 'default')}, cpu count {os.cpu_count()}, spec {args.spec}, "
        f"JPEG decoder {jpeg_decoder()}, "
        f"load average {' '.join(f'{v:.2f}' for v in os.getloadavg())}"
    )

    def data_module(workers: int, cache: str, on_device: bool = False) -> CUB200DataModule:
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
                cache=cache,
                cache_size=args.cache_size,
                augment_on_device=on_device,
            )
            dm.prepare_data()  # builds the cache (timed here, not in the loop)
            dm.setup()
        return dm

    if "decoded" in args.cache:
        start = time.perf_counter()
        dm = data_module(0, "decoded")
        sizes = {name: ds.decoded.nbytes for name, ds in dm.split_datasets.items()}
        say(
            f"decoded-image cache at {args.cache_size} px: "
            + ", ".join(f"{name} {len(dm.split_datasets[name]):,} images {n / 1e6:.1f} MB" for name, n in sizes.items())
            + f" (set-up with the cache built or found: {time.perf_counter() - start:.1f} s)"
        )
    for name in ("lightning_fabric.utilities.rank_zero", "pytorch_lightning.utilities.rank_zero"):
        logging.getLogger(name).setLevel(logging.WARNING)  # not the cache's "found" line for every row

    header = (f"{'workers':>8} {'loader':>6} {'cache':>8} {'augment':>8} {'decoder':>10} {'batch':>6} {'images/s':>10} "
              f"{'/cpu-s':>8} {'loader':>8} {'images':>8} {'worker MB':>9}")
    say(header)
    decoder = jpeg_decoder()
    # (workers, loader, setting) -> (images/s, images per CPU second)
    rates: dict[tuple[int, str, str], tuple[float | None, float | None]] = {}
    for workers in args.workers:
        # (cache, augment on the device, JPEG decoder forced to PIL)
        settings = [(cache, False, False) for cache in args.cache]
        if args.compare_decoders and "none" in args.cache and decoder != "pil":
            settings.insert(args.cache.index("none") + 1, ("none", False, True))
        if args.device_augment and "decoded" in args.cache:
            settings.append(("decoded", True, False))
        for cache, on_device, force_pil in settings:
            if force_pil:
                os.environ[JPEG_DECODER_ENV] = "pil"  # read at every decode, inherited by the workers
            dm = data_module(workers, cache, on_device)
            loaders = [("train", dm.train_dataloader())]
            if not on_device and not force_pil:
                loaders.append(("eval", dm.test_dataloader()))
            for name, loader in loaders:
                finish = dm.on_after_batch_transfer if on_device else None
                rate, per_cpu, loader_only, count, memory = _time_loader(loader, args.batches, args.warmup, finish)
                augment = "device" if on_device else "workers"
                used = jpeg_decoder() if cache == "none" else "-"
                setting = cache + ("+device" if on_device else "") + ("+pil" if force_pil else "")
                rates[(workers, name, setting)] = (rate, per_cpu)
                if loader_only is not None:
                    rates[(workers, name, setting + ",loader")] = (None, loader_only)
                row = {
                    "loader": name, "cache": cache, "workers": workers, "images_per_s": round(rate, 1),
                    "images_per_cpu_s": None if per_cpu is None else round(per_cpu, 1),
                    "loader_images_per_cpu_s": None if loader_only is None else round(loader_only, 1),
                    "augment": augment, "decoder": used, "batch": dm.batch_size, "images": count,
                    "worker_mb": None if memory is None else round(memory, 1),
                }
                if args.json:
                    print(json.dumps(row), flush=True)
                else:
                    shown = "-" if memory is None else f"{memory:.0f}"
                    cpu_shown = "-" if per_cpu is None else f"{per_cpu:.1f}"
                    loader_shown = "-" if loader_only is None else f"{loader_only:.1f}"
                    print(f"{workers:>8} {name:>6} {cache:>8} {augment:>8} {used:>10} {dm.batch_size:>6} {rate:>10.1f} "
                          f"{cpu_shown:>8} {loader_shown:>8} {count:>8} {shown:>9}", flush=True)
                del loader
            del loaders
            if force_pil:
                os.environ.pop(JPEG_DECODER_ENV)

    # the cached and uncached figures side by side, with their ratios (wall clock, and per CPU second)
    def ratio(a: float | None, b: float | None) -> str:
        return "-" if not a or not b else f"{a / b:.2f}x"

    say("\nside by side (images/s wall clock | images per CPU second; ratio = setting / uncached; ',loader': without "
        "the device step's CPU time):")
    say(f"{'workers':>8} {'loader':>6} {'setting':>21} {'uncached':>17} {'setting':>17} {'ratio':>15}")
    for workers in args.workers:
        for name in ("train", "eval"):
            base = rates.get((workers, name, "none"))
            for mode in ("decoded", "decoded+device", "decoded+device,loader", "none+pil"):
                if base is None or (workers, name, mode) not in rates:
                    continue
                wall, cpu = rates[(workers, name, mode)]
                cell = lambda r: f"{'-' if r[0] is None else f'{r[0]:.1f}':>7} | {'-' if r[1] is None else f'{r[1]:.1f}':>7}"  # noqa: E731
                say(f"{workers:>8} {name:>6} {mode:>21} {cell(base):>17} {cell((wall, cpu)):>17} "
                    f"{ratio(wall, base[0]):>6} | {ratio(cpu, base[1]):>6}")


if __name__ == "__main__":
    main()
