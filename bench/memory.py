"""Peak memory and time of one training step with gradient caching and anchor-chunked losses (issue 28 s.4).

One step is what ``DMLModule.training_step`` runs: the batch embedded through
:func:`lightning_dml.gradient_cache.chunked_embeddings` (``embedding_chunk_size``), the Multi-Similarity loss of the
whole batch (``anchor_chunk_size``), one ``backward`` and one SGD step. Rows, each in a fresh process:

* models: ``vit_tiny`` (timm ``vit_tiny_patch16_224`` at 64 px, LayerNorm: the chunked step is exact) and
  ``small_cnn`` (lightning_dml's ``SmallConvNet``, width 32, BatchNorm frozen as the exact set-up needs), random
  initialisation, a 128-d linear head;
* batches of ``P x 4`` random 3 x 64 x 64 images;
* options: ``plain`` (neither), ``emb`` (``embedding_chunk_size=64``), ``anchor`` (``anchor_chunk_size=512``),
  ``both``.

Memory. CPU: the process's peak RSS (``VmHWM``, reset through ``/proc/self/clear_refs`` after a warm-up step at a
tiny batch) over the measured step, and its rise over the RSS just before the step, when the model, its optimizer
state and the batch's images already exist (so the rise is what the step itself adds: activations, the loss's
graph, gradients). CUDA (``--device cuda``): ``torch.cuda.max_memory_allocated`` over the step, absolute and over
the allocation before it. Time: wall-clock and process CPU time of each step (``--threads 1``, the default, makes
CPU time robust to other load on the machine), the median over the measured step and ``--steps`` more (fewer for
batches of at least ``--long-batch``: ``--long-steps``). Each row also prints the step's loss, which must be the
same for the four options of one model and batch (they compute the same step).

Rows of one batch size interleave the models and options, and ``--rounds`` repeats that order (the median per row
is kept), so a change in the machine's load hits every option alike. A row whose unchunked step would need more
than ``--max-gib`` (estimated from the same row at the previous batch size, scaled by the batch) is skipped and
marked so. Run::

    python bench/memory.py --steps 1               # the table of docs/benchmarks.md
    python bench/memory.py --dry-run               # tiny models and batches: a smoke test of the script

prints one markdown row per (batch, model, option) and the targets' verdicts.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MODELS = ("vit_tiny", "small_cnn")
OPTIONS = {"plain": (None, None), "emb": (64, None), "anchor": (None, 512), "both": (64, 512)}
PER_CLASS = 4
IMAGE_SIZE = {False: 64, True: 32}  # pixels of the images (the dry run's: 2 x 2 ViT patches)


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark ``VmHWM`` (Linux >= 4.0); False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def build_module(model: str, option: str, dry_run: bool):
    """The ``DMLModule`` of one row (random initialisation) and its SGD optimizer."""
    import torch
    from torch import nn

    from lightning_dml.losses import MultiSimilarityLoss
    from lightning_dml.models import SmallConvNet, TimmBackbone
    from lightning_dml.module import DMLModule

    emb_chunk, anchor_chunk = OPTIONS[option]
    if dry_run:  # tiny chunks so that both options act on the dry run's batches
        emb_chunk, anchor_chunk = (emb_chunk and 4), (anchor_chunk and 4)
    if model == "vit_tiny":
        extra = {"depth": 1, "embed_dim": 24, "num_heads": 2} if dry_run else {}
        backbone = TimmBackbone("vit_tiny_patch16_224", pretrained=False, img_size=IMAGE_SIZE[dry_run], **extra)
    elif model == "small_cnn":
        backbone = SmallConvNet(in_channels=3, width=4 if dry_run else 32)
    else:
        raise ValueError(f"model must be one of {MODELS}, got {model!r}")
    module = DMLModule(backbone, loss=MultiSimilarityLoss(anchor_chunk_size=anchor_chunk), embedding_dim=128,
                       freeze_bn=True, embedding_chunk_size=emb_chunk)
    module.train()
    for layer in module.modules():  # frozen BatchNorm: running statistics (what Lightning's fit start sets)
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            layer.eval()
    params = [p for p in module.parameters() if p.requires_grad]
    return module, torch.optim.SGD(params, lr=1e-3)


def train_step(module, optimizer, images, labels) -> float:
    """One training step as ``DMLModule.training_step`` computes it (embed, loss, backward) plus the SGD step."""
    from lightning_dml.gradient_cache import chunked_embeddings

    optimizer.zero_grad(set_to_none=True)
    embeddings = chunked_embeddings(module, images, module.embedding_chunk_size, module)
    loss = module.loss(embeddings, labels)
    loss.backward()
    optimizer.step()
    return float(loss.detach())


def measure_row(model: str, option: str, batch: int, steps: int, device: str, threads: int,
                dry_run: bool = False) -> dict:
    """Memory and time of one row (module docstring); meant to run in a fresh process."""
    import torch

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    module, optimizer = build_module(model, option, dry_run)
    module.to(device)
    size = IMAGE_SIZE[dry_run]
    g = torch.Generator().manual_seed(1)
    images = torch.randn(batch, 3, size, size, generator=g).to(device)
    labels = (torch.arange(batch) // PER_CLASS).to(device)
    # warm-up on 8 images with chunks of 4: loads every code path and allocates the gradients, and keeps the
    # memory the allocator may retain afterwards small
    emb_chunk, anchor_chunk = module.embedding_chunk_size, module.loss.anchor_chunk_size
    module.embedding_chunk_size, module.loss.anchor_chunk_size = emb_chunk and 4, anchor_chunk and 4
    train_step(module, optimizer, images[:8], labels[:8])
    module.embedding_chunk_size, module.loss.anchor_chunk_size = emb_chunk, anchor_chunk
    torch.manual_seed(0)
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated() / 2**20
    else:
        base = _status_mib("VmRSS")
        reset = _reset_peak_rss()
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    walls, cpus, losses = [], [], []
    for k in range(1 + steps):
        t, c = time.perf_counter(), time.process_time()
        losses.append(train_step(module, optimizer, images, labels))
        if device == "cuda":
            torch.cuda.synchronize()
        walls.append(time.perf_counter() - t)
        cpus.append(time.process_time() - c)
        if k == 0:  # memory over the first step
            if device == "cuda":
                peak = torch.cuda.max_memory_allocated() / 2**20
            elif reset:
                peak = _status_mib("VmHWM")
            else:  # no reset possible: the process's high-water mark, valid when the step raised it
                peak = max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, maxrss)
    return {"model": model, "option": option, "batch": batch, "peak_mib": peak, "rise_mib": peak - base,
            "wall_s": statistics.median(walls), "cpu_s": statistics.median(cpus), "steps": len(walls),
            "loss": losses[0]}


def _run_row(args, model: str, option: str, batch: int, steps: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "--row", f"{model},{option},{batch},{steps}",
           "--device", args.device, "--threads", str(args.threads)] + (["--dry-run"] if args.dry_run else [])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"row {model} {option} B={batch} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _verdicts(rows: dict, batches: list[int], models: list[str]) -> list[str]:
    """The issue's targets: with both options, peak memory at the largest batch within 1.5x of the smallest; time
    per sample of ``both`` within 1.4x of the unchunked step at the same batch, where that step ran."""
    lines = []
    small, large = min(batches), max(batches)
    for model in models:
        a, b = rows.get((model, "both", small)), rows.get((model, "both", large))
        if a and b:
            for key, what in (("peak_mib", "peak"), ("rise_mib", "rise")):
                ratio = b[key] / a[key]
                lines.append(f"{model}: both options, {what} memory B={large} / B={small} = {b[key]:.0f} / "
                             f"{a[key]:.0f} MiB = {ratio:.2f}x (target <= 1.5x: {'met' if ratio <= 1.5 else 'MISSED'})")
        for batch in batches:
            p, c = rows.get((model, "plain", batch)), rows.get((model, "both", batch))
            if p and c:
                ratio = c["cpu_s"] / p["cpu_s"]
                lines.append(f"{model}: B={batch}, CPU time per sample both / plain = {ratio:.2f}x "
                             f"(target <= 1.4x: {'met' if ratio <= 1.4 else 'MISSED'})")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    p.add_argument("--batch", nargs="+", type=int, default=[64, 512, 4096])
    p.add_argument("--steps", type=int, default=2, help="timed steps after the measured one")
    p.add_argument("--long-batch", type=int, default=4096)
    p.add_argument("--long-steps", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-gib", type=float, default=6.0)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", help="also write the rows to this file")
    p.add_argument("--dry-run", action="store_true", help="tiny models, batch 16, options plain and both")
    p.add_argument("--row", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.row:
        model, option, batch, steps = args.row.split(",")
        row = measure_row(model, option, int(batch), int(steps), args.device, args.threads, args.dry_run)
        print(json.dumps(row))
        return 0
    if args.dry_run:
        args.models, args.options, args.batch, args.steps, args.rounds = ["small_cnn"], ["plain", "both"], [16], 0, 1
    batches = sorted(args.batch)
    print(f"device {args.device}, threads {args.threads}; " + (os.popen("uptime").read().strip() or ""))
    print("| model | B | option | peak (MiB) | rise over the step (MiB) | wall s / step | CPU s / step "
          "| CPU ms / sample | CPU vs plain | steps | loss |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    rows: dict = {}
    for i, batch in enumerate(batches):
        steps = args.long_steps if batch >= args.long_batch else args.steps
        results: dict = {}
        for _ in range(args.rounds if batch < args.long_batch else 1):
            for model in args.models:
                for option in args.options:
                    prev = rows.get((model, option, batches[i - 1])) if i else None
                    if prev and prev["rise_mib"] * batch / batches[i - 1] > args.max_gib * 1024:
                        results[(model, option)] = None  # would not fit the limit
                        continue
                    results.setdefault((model, option), []).append(_run_row(args, model, option, batch, steps))
        for model in args.models:
            for option in args.options:
                runs = results.get((model, option))
                if not runs:
                    print(f"| {model} | {batch} | {option} | skipped: estimated above {args.max_gib} GiB "
                          "| | | | | | | |", flush=True)
                    continue
                row = dict(runs[0])
                for key in ("peak_mib", "rise_mib", "wall_s", "cpu_s"):
                    row[key] = statistics.median(r[key] for r in runs)
                rows[(model, option, batch)] = row
                plain = rows.get((model, "plain", batch))
                ratio = f"{row['cpu_s'] / plain['cpu_s']:.2f}" if plain else "-"
                print(f"| {model} | {batch} | {option} | {row['peak_mib']:.0f} | {row['rise_mib']:.0f} | "
                      f"{row['wall_s']:.2f} | {row['cpu_s']:.2f} | {1000 * row['cpu_s'] / batch:.2f} | {ratio} | "
                      f"{row['steps'] * len(runs)} | {row['loss']:.6f} |", flush=True)
    for line in _verdicts(rows, batches, args.models):
        print(line)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{**r} for r in rows.values()], f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
