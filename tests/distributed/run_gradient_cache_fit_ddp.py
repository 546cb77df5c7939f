"""2-process Lightning DDP fit (gloo, CPU) of ``DMLModule`` with ``gather_distributed`` and, when given, an
``embedding_chunk_size`` (4 optimizer steps, gradient accumulation 2): writes rank 0's final weights to OUT (a
``torch.save`` of the state dict).

Run as a script (``python run_gradient_cache_fit_ddp.py OUT [CHUNK]``); Lightning's ``ddp`` strategy re-launches it
for rank 1. ``tests/test_gradient_cache.py`` runs it with and without chunks and compares the weights: gradient
caching under Lightning's own DDP wrapper (the second pass of every chunk inside DDP's one backward) trains the same
model. Prints ``GRADIENT-CACHE-FIT-DDP-OK``.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # the repository root


def main() -> None:
    import pytorch_lightning as pl

    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule
    from tests.random_images import RandomImages

    out, chunk = sys.argv[1], (int(sys.argv[2]) if len(sys.argv) > 2 else None)
    torch.manual_seed(0)
    dm = RandomImages(classes_per_batch=3, samples_per_class=2, eval_batch_size=8, train_classes=6, test_classes=4)
    model = DMLModule(
        SmallConvNet(in_channels=1, width=4), loss="multi_similarity", embedding_dim=8, clustering=False,
        gather_distributed=True, freeze_bn=True, embedding_chunk_size=chunk,
        optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    )
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_steps=4, precision="64-true", accumulate_grad_batches=2,
        limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    if trainer.global_rank == 0:
        assert trainer.global_step == 4, trainer.global_step
        torch.save({k: v.detach().clone() for k, v in model.state_dict().items()}, out)
        print("GRADIENT-CACHE-FIT-DDP-OK", flush=True)


if __name__ == "__main__":
    main()
