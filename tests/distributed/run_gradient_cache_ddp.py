"""2 gloo processes: gradient caching (``embedding_chunk_size``) under DDP with ``gather_distributed`` equals one
process holding the global batch, unchunked, and adds no gradient all-reduce per chunk.

Run directly (``python tests/distributed/run_gradient_cache_ddp.py``); exits 0 and prints ``GRADIENT-CACHE-DDP-OK``.

Every process holds the global batch (12 images, 6 classes x 2) and computes the single-process reference itself:
the unchunked step of a ``DMLModule`` (timm ViT, fp64) on the whole batch. It then runs the step on its own 6
images in chunks of 4 (4 + 2) inside ``torch.nn.parallel.DistributedDataParallel``, wrapped the way Lightning's DDP
strategy wraps a ``LightningModule``: DDP's forward runs the whole training step (chunked embeddings, then
:func:`~lightning_dml.losses.gathered_loss` on them), so the second pass of every chunk runs inside DDP's one
backward. Checked, for MS, SupCon, NT-Xent, contrastive, triplet, Proxy-Anchor (``gather_distributed``) and ArcFace
(per-sample: plain DDP, no gathering):

* the mean of the processes' losses equals the reference loss (fp64, 1e-12 relative);
* every parameter's gradient after DDP's average equals the reference gradient (1e-10 relative to its largest
  entry: the all-gather's backward and DDP's average add a few roundings);
* DDP's communication hook runs as many times as for the unchunked DDP step (one all-reduce per bucket per step;
  the buckets are made small, so a step has several).
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

P, K, CHUNK, WORLD = 6, 2, 4, 2
LOSSES = {"multi_similarity": True, "supcon": True, "ntxent": True, "contrastive": True, "triplet": True,
          "proxy_anchor": True, "arcface": False}  # name -> gather_distributed


def _module(loss: str, chunk: int | None):
    from lightning_dml.losses import build_loss
    from lightning_dml.models import TimmBackbone
    from lightning_dml.module import DMLModule

    torch.manual_seed(0)
    backbone = TimmBackbone("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=2, embed_dim=24,
                            num_heads=2)
    loss_module = build_loss(loss, num_classes=P, embedding_dim=8) if loss in ("proxy_anchor", "arcface") else (
        build_loss(loss)
    )
    return DMLModule(backbone, loss=loss_module, embedding_dim=8, clustering=False, embedding_chunk_size=chunk,
                     gather_distributed=LOSSES[loss]).double().train()


class Step(nn.Module):
    """What Lightning's DDP wrapper does: DDP's forward runs the training step and returns the loss."""

    def __init__(self, module) -> None:
        super().__init__()
        self.module = module

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        from lightning_dml.losses import gathered_loss

        embeddings = self.module._training_embeddings(self.module, images)
        if self.module.gather_distributed:
            return gathered_loss(self.module.loss, embeddings, labels)
        return self.module.loss(embeddings, labels)


def _ddp_step(loss: str, chunk: int | None, images, labels) -> tuple[torch.Tensor, dict, int]:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    # small buckets (several per step): an all-reduce per chunk would multiply the hook's calls
    ddp = nn.parallel.DistributedDataParallel(Step(_module(loss, chunk)), bucket_cap_mb=0.02)
    calls = [0]

    def counting_hook(state, bucket):
        calls[0] += 1
        return allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    for _ in range(2):  # DDP puts all gradients in one bucket in the first step and builds its buckets after it
        calls[0] = 0
        ddp.zero_grad(set_to_none=True)
        value = ddp(images, labels)
        value.backward()
    mean = value.detach().clone()
    dist.all_reduce(mean)
    grads = {n.removeprefix("module."): p.grad.clone() for n, p in ddp.module.named_parameters() if p.grad is not None}
    return mean / WORLD, grads, calls[0]


def _worker(rank: int, init_file: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(1)
    images = torch.randn(P * K, 3, 32, 32, generator=g, dtype=torch.float64)
    labels = torch.arange(P).repeat_interleave(K)[torch.randperm(P * K, generator=g)]  # classes split over ranks
    mine = slice(rank * P * K // WORLD, (rank + 1) * P * K // WORLD)
    for loss in LOSSES:
        reference_module = _module(loss, None)
        reference_loss = reference_module.loss(reference_module(images), labels)
        reference_loss.backward()
        reference = {n: p.grad for n, p in reference_module.named_parameters() if p.grad is not None}
        value, grads, hooks = _ddp_step(loss, CHUNK, images[mine], labels[mine])
        _, _, plain_hooks = _ddp_step(loss, None, images[mine], labels[mine])
        assert torch.allclose(value, reference_loss.detach(), rtol=1e-12, atol=0), (loss, value, reference_loss)
        assert grads.keys() == reference.keys(), (loss, sorted(set(grads) ^ set(reference)))
        for name, grad in grads.items():
            err = float((grad - reference[name]).abs().max() / reference[name].abs().max().clamp_min(1e-30))
            assert err <= 1e-10, f"{loss}: {name} differs by {err:.3g} relative"
        assert hooks == plain_hooks > 1, (loss, hooks, plain_hooks)
        if rank == 0:
            print(f"{loss}: loss and {len(grads)} gradients equal the global unchunked step; "
                  f"{hooks} all-reduce(s) per step, as unchunked", flush=True)
    dist.barrier()
    if rank == 0:
        print("GRADIENT-CACHE-DDP-OK", flush=True)
    dist.destroy_process_group()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_worker, args=(os.path.join(tmp, "init"),), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
