"""Adapter figures of a timm backbone (docs/models.md "Adapters"): trainable parameters per ``adapter``, the size of
a Lightning checkpoint after one training step, and the merged LoRA export against the unmerged model.

For each adapter (none = full fine-tuning, lora, bias, norm, vpt) it builds ``TimmBackbone(--model, adapter=...)``
with random weights (``pretrained=False``: the counts and sizes do not depend on the values), a ``DMLModule``
with a ``--width`` head, the multi-similarity loss and Adam, trains one step on 8 random images (4 classes x 2)
on the CPU, saves the checkpoint with ``trainer.save_checkpoint`` and prints one markdown row. Then it draws
LoRA's ``B`` from N(0, 0.02), exports the module (safetensors, LoRA merged) and prints the largest difference of
the exported model's embeddings from the module's::

    python bench/adapters.py --model vit_small_patch16_224.dino --width 384
"""

from __future__ import annotations

import argparse
import os
import tempfile
import warnings

import torch


def _module(model: str, adapter: str | None, width: int):
    from lightning_dml.models import TimmBackbone
    from lightning_dml.module import DMLModule

    backbone = TimmBackbone(model, pretrained=False, adapter=adapter)
    return DMLModule(backbone, loss="multi_similarity", embedding_dim=width, clustering=False)


def main() -> None:
    import pytorch_lightning as pl
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_dml.export import export_embedding_model, load_embedding_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit_small_patch16_224.dino")
    parser.add_argument("--width", type=int, default=384)
    args = parser.parse_args()
    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    side = 224
    images = torch.randn(8, 3, side, side)
    loader = DataLoader(TensorDataset(images, torch.arange(4).repeat_interleave(2)), batch_size=8)
    print("| `adapter` | trainable backbone parameters | of | checkpoint |\n|---|---:|---:|---:|")
    for adapter in (None, "lora", "bias", "norm", "vpt"):
        module = _module(args.model, adapter, args.width)
        total = sum(p.numel() for p in module.backbone.parameters())
        trainable = sum(p.numel() for p in module.backbone.parameters() if p.requires_grad)
        trainer = pl.Trainer(accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        trainer.fit(module, loader)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "step.ckpt")
            trainer.save_checkpoint(path)
            size = os.path.getsize(path)
        print(f"| {adapter or 'none (full fine-tuning)'} | {trainable:,} | {total:,} | {size / 1e6:.1f} MB |",
              flush=True)

    module = _module(args.model, "lora", args.width).eval()
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02)
    with tempfile.TemporaryDirectory() as out:
        export_embedding_model(module, out, images[:4], ["safetensors"])
        exported = load_embedding_model(out)
        with torch.no_grad():
            want, got = module(images[:4]), exported(images[:4])
    left = sum("lora" in key for key in exported.state_dict())
    print(f"max |merged - unmerged| = {(got - want).abs().max():.2e} (embeddings up to {want.abs().max():.2f}); "
          f"LoRA layers left in the export: {left}")


if __name__ == "__main__":
    main()
