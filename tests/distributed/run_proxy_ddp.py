"""2-process DDP (gloo, CPU) fit of ``DMLModule`` with a loss that holds parameters (Proxy-Anchor, 100x proxy
learning rate, ``gather_distributed=True``): after a few optimizer steps the proxies and every model parameter are
identical on both processes, the proxies did train, and the logged ``train/loss`` is the same on both processes.
(BatchNorm running statistics are buffers, local to each process between DDP's buffer broadcasts: not compared.)

Run as a script (``python run_proxy_ddp.py``); Lightning's ``ddp`` strategy re-launches it for rank 1. Prints
``PROXY-DDP-OK`` on success.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # the repository root


def _fit(loss: str, gather: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor, int, int]:
    import pytorch_lightning as pl

    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule
    from tests.random_images import RandomImages

    torch.manual_seed(0)  # the same initial weights on both processes (DDP also broadcasts rank 0's)
    dm = RandomImages(classes_per_batch=3, samples_per_class=2, eval_batch_size=8, train_classes=6, test_classes=4)
    model = DMLModule(
        SmallConvNet(in_channels=1, width=4), loss=loss, embedding_dim=8, clustering=False,
        gather_distributed=gather, loss_lr_multiplier=100.0,
    )
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_steps=3, limit_val_batches=0, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    initial: dict[str, torch.Tensor] = {}

    class Snapshot(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            initial.update({k: v.detach().clone() for k, v in pl_module.loss.state_dict().items()})

    trainer.callbacks.append(Snapshot())
    trainer.fit(model, datamodule=dm)
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    state["logged train/loss"] = trainer.callback_metrics["train/loss"].detach().clone()  # sync_dist: global
    moved = max(float((state[f"loss.{k}"] - v).abs().max()) for k, v in initial.items())
    return state, torch.tensor(moved), trainer.global_rank, trainer.world_size


def main() -> None:
    loss = "proxy_anchor"
    state, moved, rank, world = _fit(loss, gather=True)
    states: list[dict] = [{} for _ in range(world)]
    torch.distributed.all_gather_object(states, state)
    if rank == 0:
        assert world == 2, world
        assert states[0].keys() == states[1].keys()
        different = [k for k in states[0] if not torch.equal(states[0][k], states[1][k])]
        assert not different, f"{loss}: parameters differ between the processes: {different}"
        assert "loss.proxies" in states[0], sorted(states[0])
        assert float(moved) > 0, f"{loss}: the proxies did not train (the test has no power)"
        print(f"{loss} (gather_distributed=True): {len(states[0])} tensors identical on both processes; "
              f"proxies moved by up to {float(moved):.3e}")
        print("PROXY-DDP-OK")


if __name__ == "__main__":
    main()
