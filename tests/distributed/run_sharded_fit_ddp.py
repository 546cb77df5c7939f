"""2-process Lightning DDP fit (gloo, CPU, fp64) of ``DMLModule`` with a sharded ArcFace (Partial FC) against the
same fit with the unsharded ArcFace: 3 SGD steps with momentum end with the same weights, the sharded run's
checkpoint holds all classes' centres and their momentum (gathered from both processes) equal to the unsharded
run's. Writes the unsharded run's final state (weights, loss centres, their momentum) and the sharded run's
checkpoint to OUT_DIR for the resume check of ``tests/test_losses_sharded.py``.

Run as a script (``python run_sharded_fit_ddp.py OUT_DIR``); Lightning's ``ddp`` strategy re-launches it for rank 1.
Prints ``SHARDED-FIT-DDP-OK``.
"""

from __future__ import annotations

import sys
from functools import partial
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # the repository root


def fit_setup(sharded: bool):
    """The model, data module and trainer options of both runs (the resume check reuses them)."""
    from lightning_dml.losses import ArcFaceLoss
    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule
    from tests.random_images import RandomImages

    loss = ArcFaceLoss(6, 8, scale=16.0, sharded=sharded)
    # the same centres: each process of the sharded run takes its rows (the process group exists in the second run)
    loss.load_state_dict({"proxies": torch.randn(6, 8, generator=torch.Generator().manual_seed(1))})
    torch.manual_seed(0)  # the same weights in both runs and on both processes
    dm = RandomImages(classes_per_batch=3, samples_per_class=2, eval_batch_size=8, train_classes=6, test_classes=4)
    model = DMLModule(
        SmallConvNet(in_channels=1, width=4), loss=loss, embedding_dim=8,
        clustering=False, freeze_bn=True, loss_lr_multiplier=10.0,
        optimizer=partial(torch.optim.SGD, lr=0.05, momentum=0.9),
    )
    kwargs = dict(
        strategy="ddp", accelerator="cpu", devices=2, max_steps=3, precision="64-true", limit_val_batches=0,
        num_sanity_val_steps=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )
    return model, dm, kwargs


def fit(sharded: bool, out: Path):
    import pytorch_lightning as pl

    model, dm, kwargs = fit_setup(sharded)
    trainer = pl.Trainer(**kwargs)
    trainer.fit(model, datamodule=dm)
    if sharded:
        trainer.save_checkpoint(out / "sharded.ckpt")  # every process: the centres are gathered
    weights = {k: v.detach().clone() for k, v in model.state_dict().items() if not k.startswith("loss.")}
    optimizer = trainer.optimizers[0]
    momentum = optimizer.state[model.loss.proxies]["momentum_buffer"].clone()
    return trainer, model, weights, momentum


def main() -> None:
    out = Path(sys.argv[1])
    trainer, model, plain_weights, plain_momentum = fit(False, out)
    plain_centres = model.loss.proxies.detach().clone()
    trainer, model, weights, momentum = fit(True, out)
    rank = trainer.global_rank
    assert model.loss.proxies.shape[0] == 3, model.loss.proxies.shape  # 6 classes over 2 processes
    assert not any(k.startswith("loss.") for k, _ in model.named_parameters())  # outside DDP's wrapper
    lo = 3 * rank
    torch.testing.assert_close(model.loss.proxies.detach(), plain_centres[lo : lo + 3], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(momentum, plain_momentum[lo : lo + 3], rtol=1e-9, atol=1e-12)
    for name, value in plain_weights.items():
        torch.testing.assert_close(weights[name], value, rtol=1e-9, atol=1e-12, msg=name)
    if rank == 0:
        checkpoint = torch.load(out / "sharded.ckpt", weights_only=False)
        centres = checkpoint["state_dict"]["loss.proxies"]
        torch.testing.assert_close(centres, plain_centres, rtol=1e-9, atol=1e-12)
        (group,) = [g for g in checkpoint["optimizer_states"][0]["param_groups"] if g["name"] == "loss"]
        saved_momentum = checkpoint["optimizer_states"][0]["state"][group["params"][0]]["momentum_buffer"]
        torch.testing.assert_close(saved_momentum, plain_momentum, rtol=1e-9, atol=1e-12)
        moved = float((centres - torch.randn(6, 8, generator=torch.Generator().manual_seed(1))).abs().max())
        torch.save({"weights": plain_weights, "centres": plain_centres, "momentum": plain_momentum},
                   out / "plain.pt")
        print(f"sharded fit = unsharded fit (weights, centres, momentum); the centres moved by up to {moved:.2e}")
        print("SHARDED-FIT-DDP-OK", flush=True)


if __name__ == "__main__":
    main()
