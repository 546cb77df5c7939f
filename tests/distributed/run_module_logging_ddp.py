"""2-process DDP (gloo, CPU) fit of ``DMLModule`` with validation: its metric logging under DDP.

Run as a script (``python run_module_logging_ddp.py``); Lightning's ``ddp`` strategy re-launches it for
rank 1. Every rank records the warnings raised during ``fit`` and what it logged; rank 0 then checks that

* no rank got Lightning's "It is recommended to use ``self.log(..., sync_dist=True)``" warning for the
  evaluation metrics (they are global already: ``RetrievalMetrics`` evaluates the whole split across processes);
* ``val/recall@1`` and ``val/map@r`` are progress-bar metrics on every rank;
* every rank holds the same logged values (what ``ModelCheckpoint``'s monitor reads), equal to the values
  ``RetrievalMetrics`` computed.

Prints ``MODULE-LOGGING-DDP-OK`` on success.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # the repository root


def main() -> None:
    import pytorch_lightning as pl

    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule
    from tests.random_images import RandomImages

    class Recorder(DMLModule):
        def on_validation_epoch_end(self) -> None:
            self.computed = {k: float(v) for k, v in self._log_metrics(self.val_metrics, "val").items()}

    torch.manual_seed(0)
    dm = RandomImages(classes_per_batch=3, samples_per_class=2, eval_batch_size=8, train_classes=6, test_classes=6)
    model = Recorder(SmallConvNet(in_channels=1, width=4), loss="contrastive", embedding_dim=8, clustering=True)
    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False, "enable_model_summary": False}
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_steps=2, val_check_interval=2, num_sanity_val_steps=0, **quiet
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, datamodule=dm)
    rank, world = trainer.global_rank, trainer.world_size
    record = {
        "rank": rank,
        "world": world,
        "sync_dist_warnings": [str(w.message) for w in caught if "sync_dist" in str(w.message)],
        "progress_bar": sorted(k for k in trainer.progress_bar_metrics if k.startswith("val/")),
        "logged": {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")},
        "computed": model.computed,
    }
    records: list[dict] = [{} for _ in range(world)]
    torch.distributed.all_gather_object(records, record)
    # every rank ends the group before the interpreter exits: a process that exits with gloo's threads still up
    # can abort ("terminate called without an active exception", seen once in CI after the OK line)
    torch.distributed.destroy_process_group()
    if rank != 0:
        return
    assert world == 2, world
    for r in records:
        assert r["sync_dist_warnings"] == [], r["sync_dist_warnings"]
        assert {"val/recall@1", "val/map@r"} <= set(r["progress_bar"]), r["progress_bar"]
        assert set(r["logged"]) == {f"val/{k}" for k in r["computed"]}, (r["logged"], r["computed"])
        for k, v in r["computed"].items():
            assert r["logged"][f"val/{k}"] == torch.tensor(v, dtype=torch.float32).item(), (k, r["logged"], v)
    assert records[0]["logged"] == records[1]["logged"], records
    print("MODULE-LOGGING-DDP-OK", json.dumps(records[0]["logged"]))


if __name__ == "__main__":
    main()
