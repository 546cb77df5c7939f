"""2-process DDP (gloo, CPU) training of a few steps on an In-Shop fixture: P x K batches and exact evaluation.

Run as a script (``python run_data_ddp.py [workdir]``); Lightning's ``ddp`` strategy re-launches it for rank 1.
Every rank records the batches it trains on and the items it evaluates; rank 0 then checks that

* Lightning's sampler replacement was switched off by the data module and each rank's batch sampler knows
  its rank and the world size;
* every training batch of every rank is P classes x K images, both ranks run the same number of steps, and at
  each step the two ranks train on different batches (together: the single-process global sequence);
* validation (query vs gallery, In-Shop) evaluated every test item exactly once across the two ranks, the
  query/gallery flags reached the metric, and both ranks logged the same Recall@1, equal to a single-process
  evaluation of the same embeddings.

Prints ``DATA-DDP-OK`` on success.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # the repository root, for `tests.fixtures_data`

P, K, STEPS = 3, 2, 4


def main() -> None:
    import pytorch_lightning as pl

    from lightning_dml.data import BalancedClassSampler, InShopDataModule
    from lightning_dml.metrics import RetrievalMetrics
    from lightning_dml.models import InputSpec, SmallConvNet
    from lightning_dml.module import DMLModule
    from tests.fixtures_data import make_inshop

    warnings.filterwarnings("ignore")
    workdir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="data_ddp_"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    top = workdir / "InShop"
    if local_rank == 0 and not (top / "list_eval_partition.txt").exists():
        make_inshop(workdir, train_items=16, test_items=9, images_per_item=3)
    if local_rank != 0:  # rank 1 is launched after rank 0 wrote the fixture (Lightning starts it from rank 0)
        assert (top / "list_eval_partition.txt").exists()

    class Recorder(DMLModule):
        def on_fit_start(self) -> None:
            self.train_batches: list[dict] = []
            self.val_items: list[int] = []
            self.val_flags: list[list[bool]] = []
            self.val_embeddings: list[torch.Tensor] = []
            self.val_labels: list[torch.Tensor] = []

        def training_step(self, batch, batch_idx):
            self.train_batches.append({"labels": batch[1].tolist(), "indices": batch[2].tolist()})
            return super().training_step(batch, batch_idx)

        def validation_step(self, batch, batch_idx):
            self.val_items += batch[2].tolist()
            self.val_flags += [[bool(q), bool(g)] for q, g in zip(batch[3].tolist(), batch[4].tolist())]
            self.val_embeddings.append(self(batch[0]).detach())
            self.val_labels.append(batch[1])
            super().validation_step(batch, batch_idx)

        def on_validation_epoch_end(self) -> None:
            values = self._log_metrics(self.val_metrics, "val")
            self.val_recall = float(values["recall@1"])

    backbone = SmallConvNet(in_channels=3, width=4)
    spec = InputSpec(color="RGB", mean=(0.1,) * 3, std=(0.25,) * 3, crop_size=32, resize_size=32)
    assert spec == backbone.input_spec  # a given input_spec must agree with the backbone's
    dm = InShopDataModule(
        top, classes_per_batch=P, samples_per_class=K, num_workers=0, image_size=16, resize_size=18, input_spec=spec,
        eval_batch_size=8,
    )
    model = Recorder(backbone, loss="contrastive", embedding_dim=8, clustering=False)
    trainer = pl.Trainer(
        strategy="ddp",
        accelerator="cpu",
        devices=2,
        max_steps=STEPS,
        val_check_interval=STEPS,
        limit_val_batches=None,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    rank, world = trainer.global_rank, trainer.world_size
    sampler = trainer.train_dataloader.batch_sampler
    assert isinstance(sampler, BalancedClassSampler), type(sampler)
    record = {
        "rank": rank,
        "world": world,
        "sampler_rank": sampler.rank,
        "sampler_replicas": sampler.num_replicas,
        "replacement": bool(trainer._accelerator_connector.use_distributed_sampler),
        "train_batches": model.train_batches,
        "val_items": model.val_items,
        "val_flags": model.val_flags,
        "val_recall": model.val_recall,
        "train_labels": dm.train_dataset.labels.tolist(),
    }
    torch.save(
        {"emb": torch.cat(model.val_embeddings), "labels": torch.cat(model.val_labels), "items": model.val_items},
        workdir / f"val_rank{rank}.pt",
    )
    (workdir / f"rank{rank}.json").write_text(json.dumps(record))
    trainer.strategy.barrier()
    if rank != 0:
        return

    records = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(world)]
    assert world == 2, world
    test = dm.test_dataset
    labels = dm.train_dataset.labels
    for r, rec in enumerate(records):
        assert rec["sampler_rank"] == r and rec["sampler_replicas"] == 2, rec
        assert rec["replacement"] is False, "Lightning's distributed sampler replacement was left on"
        assert len(rec["train_batches"]) == STEPS, len(rec["train_batches"])
        for batch in rec["train_batches"]:
            counts = Counter(batch["labels"])
            assert len(batch["labels"]) == P * K and len(counts) == P and set(counts.values()) == {K}, batch
            assert batch["labels"] == labels[batch["indices"]].tolist()
    single = list(BalancedClassSampler(labels, P, K, seed=0, num_replicas=1, rank=0))
    for step in range(STEPS):
        b0, b1 = (records[r]["train_batches"][step]["indices"] for r in range(2))
        assert b0 != b1
        assert b0 == single[2 * step] and b1 == single[2 * step + 1], (step, b0, b1)
    seen = Counter(i for rec in records for i in rec["val_items"])
    assert sorted(seen) == list(range(len(test))) and set(seen.values()) == {1}, seen
    for rec in records:
        for item, (q, g) in zip(rec["val_items"], rec["val_flags"]):
            assert q == bool(test.query_mask[item]) and g == bool(test.gallery_mask[item])
    assert records[0]["val_recall"] == records[1]["val_recall"]
    # the same embeddings scored in one process give the same Recall@1 (query vs gallery)
    parts = [torch.load(workdir / f"val_rank{r}.pt") for r in range(2)]
    items = torch.tensor(parts[0]["items"] + parts[1]["items"])
    metric = RetrievalMetrics(recall_at=(1,), clustering=False, distributed_split=False, sync_on_compute=False)
    metric.update(
        torch.cat([p["emb"] for p in parts]),
        torch.cat([p["labels"] for p in parts]),
        indices=items,
        query_mask=test.query_mask[items],
        gallery_mask=test.gallery_mask[items],
    )
    reference = float(metric.compute()["recall@1"])
    assert abs(reference - records[0]["val_recall"]) < 1e-6, (reference, records[0]["val_recall"])
    print(f"train steps per rank {STEPS}, eval items {len(test)} once each, recall@1 {reference:.4f}")
    print("DATA-DDP-OK", flush=True)


if __name__ == "__main__":
    main()
