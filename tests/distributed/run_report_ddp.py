"""2-process DDP (gloo, CPU) ``test`` with :class:`~lightning_dml.callbacks.RetrievalReport`.

Run as a script (``python run_report_ddp.py OUT``); Lightning's ``ddp`` strategy re-launches it for rank 1. Each
rank embeds its shard of the test split; the callback gathers the metric's states, every rank takes part in the
split search (``distributed=True``) and gets the whole, identical result, and rank 0 alone writes the report
into ``OUT/test``. Rank 0 checks that the results cover every test item, equal the logged test metrics, are the
same on both ranks, and that rank 1 wrote nothing. Prints ``REPORT-DDP-OK`` on success.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))  # the repository root


def main(out: str) -> None:
    import pytorch_lightning as pl

    from lightning_dml.callbacks import RetrievalReport
    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule
    from tests.random_images import RandomImages

    torch.manual_seed(0)
    dm = RandomImages(classes_per_batch=3, samples_per_class=2, eval_batch_size=8, train_classes=6, test_classes=6)
    model = DMLModule(SmallConvNet(in_channels=1, width=4), embedding_dim=8, clustering=False, recall_at=(1, 2))
    report = RetrievalReport(folder=f"{out}/{{stage}}", top_k=4, bins=10, log_queries=0)
    quiet = {"logger": False, "enable_checkpointing": False, "enable_progress_bar": False,
             "enable_model_summary": False}
    trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, callbacks=[report], **quiet)
    trainer.test(model, datamodule=dm, verbose=False)
    res = report.results
    record = {
        "rank": trainer.global_rank,
        "wrote": report.report is not None,
        "index": res.index.tolist(),
        "neighbors": res.neighbors.tolist(),
        "histogram": res.pair_histogram,
        "recall@1": float(trainer.callback_metrics["test/recall@1"]),
        "map@r": float(trainer.callback_metrics["test/map@r"]),
    }
    records: list[dict] = [{} for _ in range(trainer.world_size)]
    torch.distributed.all_gather_object(records, record)
    if trainer.global_rank != 0:
        return
    assert trainer.world_size == 2
    assert [r["wrote"] for r in records] == [True, False], records
    assert records[0]["index"] == list(range(36)), records[0]["index"]  # both shards, gathered
    for key in ("index", "neighbors", "histogram"):
        assert records[0][key] == records[1][key], key
    f32 = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731 - the logged values are float32
    assert f32(res.recall_at(1)) == records[0]["recall@1"] and f32(res.map_at_r()) == records[0]["map@r"]
    assert sum(res.pair_histogram["positive"]) == 36 * 5
    assert (Path(out) / "test" / "index.html").is_file() and (Path(out) / "test" / "results.npz").is_file()
    print("REPORT-DDP-OK")


if __name__ == "__main__":
    main(sys.argv[1])
