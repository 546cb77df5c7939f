"""Downloads under several processes: the CUB archive comes from a loopback server (``LIGHTNING_DML_RESOURCES``).

``python run_download_ddp.py ddp <workdir>``: a 2-process DDP fit (gloo, CPU; Lightning's ``ddp`` strategy
re-launches the script for rank 1) of a CUB200DataModule with ``download=True``. Each rank records whether it
ran ``prepare_data`` and the image paths it loaded; rank 0 checks that only one process prepared the data and
that both loaded the same files, and prints ``DOWNLOAD-DDP-OK``. The test counts the server's requests.

``python run_download_ddp.py node <workdir> <name>``: one "node" of a job on a shared file system: calls
``prepare_data`` (as each node's local rank 0 does), then ``setup``, and writes the loaded paths to
``<workdir>/<name>.json``. The test starts two at once and checks one download and equal data.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # the repository root


def _data_module(root: Path):
    from lightning_dml.data import CUB200DataModule
    from lightning_dml.models import SmallConvNet

    class Recording(CUB200DataModule):
        prepared = False

        def prepare_data(self) -> None:
            self.prepared = True
            super().prepare_data()

    spec = SmallConvNet(in_channels=3, width=4).input_spec
    return Recording(
        str(root), download=True, classes_per_batch=2, samples_per_class=2, num_workers=0, image_size=16,
        resize_size=18, input_spec=spec, eval_batch_size=32, check_counts=False,
    )


def _fingerprint(dm) -> dict:
    paths = [str(p) for p in dm.train_dataset.paths] + [str(p) for p in dm.test_dataset.paths]
    return {"count": len(paths), "sha": hashlib.sha256("\n".join(paths).encode()).hexdigest()}


def run_ddp(workdir: Path) -> None:
    import pytorch_lightning as pl

    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule

    dm = _data_module(workdir / "data")
    model = DMLModule(SmallConvNet(in_channels=3, width=4), loss="contrastive", embedding_dim=8, clustering=False)
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_steps=2, limit_val_batches=0, num_sanity_val_steps=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        use_distributed_sampler=False,
    )
    trainer.fit(model, datamodule=dm)
    rank = trainer.global_rank
    record = {"prepared": dm.prepared, **_fingerprint(dm)}
    (workdir / f"rank{rank}.json").write_text(json.dumps(record))
    trainer.strategy.barrier()
    if rank != 0:
        return
    records = [json.loads((workdir / f"rank{r}.json").read_text()) for r in range(2)]
    assert [r["prepared"] for r in records] == [True, False], records  # prepare_data: local rank 0 only
    assert records[0]["count"] == records[1]["count"] == 400 and records[0]["sha"] == records[1]["sha"], records
    print("DOWNLOAD-DDP-OK", flush=True)


def run_node(workdir: Path, name: str) -> None:
    dm = _data_module(workdir / "data")
    dm.prepare_data()
    dm.setup("fit")
    (workdir / f"{name}.json").write_text(json.dumps(_fingerprint(dm)))


if __name__ == "__main__":
    warnings.filterwarnings("ignore")
    os.environ.setdefault("LIGHTNING_DML_OFFLINE", "0")
    mode, folder = sys.argv[1], Path(sys.argv[2])
    if mode == "ddp":
        run_ddp(folder)
    else:
        run_node(folder, sys.argv[3])
