"""2-process DDP (gloo, CPU) fit of a few steps from the decoded-image cache with device-side augmentation.

Run as a script (``python run_cache_ddp.py <workdir>``); Lightning's ``ddp`` strategy re-launches it for rank 1.
Every build of a cache file is recorded (process, rank, file name) in ``<workdir>/builds.txt``; every rank records
what it trained on. Rank 0 then checks that

* the cache was built once: one build per split, both by rank 0 in ``prepare_data``, none by rank 1 (which found
  it in ``setup``), and both ranks read the same cache files;
* the training steps received float images in the backbone's convention (converted on the device by the data
  module's ``on_after_batch_transfer``), and both ranks trained on their own P x K batches.

Prints ``CACHE-DDP-OK`` on success.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # the repository root

P, K, STEPS = 3, 2, 3


def main() -> None:
    workdir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="cache_ddp_"))
    os.environ["LIGHTNING_DML_CACHE"] = str(workdir / "cache")  # inherited by rank 1
    import numpy as np
    import pytorch_lightning as pl
    import torch
    from PIL import Image

    import lightning_dml.data.decoded_cache as decoded_cache
    from lightning_dml.data import ImageFolderDataModule
    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule

    warnings.filterwarnings("ignore")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    top = workdir / "images"
    if local_rank == 0 and not (top / "test").exists():
        rng = np.random.default_rng(0)
        for split, classes in (("train", 8), ("test", 4)):
            for c in range(classes):
                folder = top / split / f"{split}_{c}"
                folder.mkdir(parents=True)
                base = rng.integers(0, 256, size=3)
                for k in range(4):
                    pixels = np.clip(base + rng.normal(0, 40, size=(30, 40, 3)), 0, 255).astype(np.uint8)
                    Image.fromarray(pixels).save(folder / f"{k}.png")
    assert (top / "test").exists()

    real_build = decoded_cache._build

    def recording_build(*args, **kwargs):
        with open(workdir / "builds.txt", "a", encoding="utf-8") as log:
            log.write(json.dumps({"pid": os.getpid(), "rank": local_rank, "stem": args[6]}) + "\n")
        return real_build(*args, **kwargs)

    decoded_cache._build = recording_build

    class Recorder(DMLModule):
        def on_fit_start(self) -> None:
            self.seen: list[dict] = []

        def training_step(self, batch, batch_idx):
            images = batch[0]
            self.seen.append({"dtype": str(images.dtype), "shape": list(images.shape), "indices": batch[2].tolist()})
            return super().training_step(batch, batch_idx)

    backbone = SmallConvNet(in_channels=3, width=4)
    dm = ImageFolderDataModule(
        top, classes_per_batch=P, samples_per_class=K, num_workers=0, image_size=16, resize_size=18,
        eval_batch_size=8, check_counts=False, cache="decoded", cache_size=18, augment_on_device=True,
    )
    model = Recorder(backbone, loss="contrastive", embedding_dim=8, clustering=False)
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_steps=STEPS, limit_val_batches=0, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
    )
    trainer.fit(model, datamodule=dm)
    rank = trainer.global_rank
    record = {
        "seen": model.seen,
        "train_file": str(dm.train_dataset.decoded.data_file),
        "test_file": str(dm.test_dataset.decoded.data_file),
    }
    (workdir / f"rank{rank}.json").write_text(json.dumps(record))
    trainer.strategy.barrier()
    if rank != 0:
        return

    records = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(2)]
    builds = [json.loads(line) for line in (workdir / "builds.txt").read_text().splitlines()]
    stems = sorted(b["stem"] for b in builds)
    assert len(builds) == 2 and stems[0].startswith("decoded-test-18-") and stems[1].startswith("decoded-train-18-"), builds
    assert {b["rank"] for b in builds} == {0} and len({b["pid"] for b in builds}) == 1, builds
    assert records[0]["train_file"] == records[1]["train_file"] and records[0]["test_file"] == records[1]["test_file"]
    for rec in records:
        assert len(rec["seen"]) == STEPS
        assert all(s["dtype"] == "torch.float32" and s["shape"] == [P * K, 3, 16, 16] for s in rec["seen"]), rec
    for step in range(STEPS):
        assert records[0]["seen"][step]["indices"] != records[1]["seen"][step]["indices"]
    print(f"cache built once ({', '.join(stems)}), {STEPS} steps per rank from it")
    print("CACHE-DDP-OK", flush=True)


if __name__ == "__main__":
    main()
