"""RetrievalReport (issue 22): the report at the end of test, the worst queries and the per-class table in an
offline W&B run (read back from the run's folder), the image grid in a TensorBoard event file, and the report of
each validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
from PIL import Image
from pytorch_lightning.loggers import TensorBoardLogger, WandbLogger

from lightning_dml.callbacks import RetrievalReport
from lightning_dml.models import SmallConvNet
from lightning_dml.module import DMLModule
from tests.random_images import RandomImages
from tests.test_report import read_js


def _fit_free(tmp_path: Path, logger, callbacks) -> tuple[pl.Trainer, DMLModule, RandomImages]:
    pl.seed_everything(0)
    data = RandomImages(classes_per_batch=4, samples_per_class=3, eval_batch_size=16)
    model = DMLModule(SmallConvNet(width=4), embedding_dim=8, clustering=False, recall_at=(1, 2))
    trainer = pl.Trainer(logger=logger, callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, max_epochs=1, num_sanity_val_steps=0, enable_checkpointing=False)
    return trainer, model, data


def _f32(value: float) -> float:
    return float(torch.tensor(value, dtype=torch.float32))


def test_test_report_and_wandb_tables(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))  # the artifact staging of this run
    import wandb

    logger = WandbLogger(save_dir=str(tmp_path), offline=True, project="report-test")
    report = RetrievalReport(log_queries=4, log_top_k=3, top_k=5, bins=10)
    trainer, model, data = _fit_free(tmp_path, logger, [report])
    trainer.test(model, datamodule=data, verbose=False)
    run_id = logger.version
    wandb.finish()

    folder = tmp_path / "report" / run_id / "test"
    assert report.report is not None and report.report.index == folder / "index.html" and report.report.index.is_file()
    res = report.results
    # the results are those of the test metric the module logged (eval batches of 16: gathered, not one batch)
    assert res.index.tolist() == list(range(36))
    assert _f32(res.recall_at(1)) == float(trainer.callback_metrics["test/recall@1"])  # logged as float32
    assert _f32(res.map_at_r()) == float(trainer.callback_metrics["test/map@r"])
    (summary,) = read_js(folder / "data" / "summary.js")
    assert summary["counts"]["items"] == 36 and sum(summary["histogram"]["positive"]) == 36 * 5
    page = read_js(folder / "data" / "queries-00000.js")[1]
    assert all(item[2] and (folder / item[2]).is_file() for item in page["items"].values())  # in-memory images

    (run,) = (tmp_path / "wandb").glob(f"offline-run-*-{run_id}")
    columns = ["query", "label", "top_k", "flags", "scores", "neighbor_labels", "ap", "r", "first_relevant_rank"]
    worst = json.loads(next(run.glob("files/media/table/test/worst_queries_*.table.json")).read_text())
    assert worst["columns"] == columns
    rows = res.worst(4)
    assert len(worst["data"]) == 4
    for logged, row in zip(worst["data"], rows):
        assert logged[3] == "".join("+" if f else "-" for f in res.relevant[row, :3])
        assert [float(s) for s in logged[4].split()] == pytest.approx(res.scores[row, :3].tolist(), abs=1e-4)
        assert logged[7] == int(res.num_relevant[row]) and logged[1] == str(int(res.labels[res.query[row]]))
        assert logged[6] == pytest.approx(res.average_precision[row], abs=1e-12)
    # offline, W&B stages a table's images with the run's table artifact under WANDB_DATA_DIR (this test's own
    # folder): 4 query images and 4 top-k strips of query + 3 neighbours, 2 + 4 x 54 + 4 wide
    staged = list((tmp_path / "wandb-data" / "artifacts" / "staging").iterdir())
    tables = [json.loads(p.read_text()) for p in staged if p.is_file() and p.read_bytes()[:1] == b"{"]
    full = next(t for t in tables if t.get("columns") == columns)
    assert [r[3] for r in full["data"]] == [r[3] for r in worst["data"]]
    for cell in (c for r in full["data"] for c in (r[0], r[2])):
        assert cell["_type"] == "image-file" and cell["path"].startswith("media/images/")
    sizes = sorted(Image.open(p).size for p in staged if p.is_file() and p.read_bytes()[:4] == b"\x89PNG")
    assert sizes.count((2 + 4 * 54 + 4, 2 + 54)) == 4 and sizes.count((96, 96)) == 4, sizes
    per_class = json.loads(next(run.glob("files/media/table/test/per_class_*.table.json")).read_text())
    assert [r[0] for r in per_class["data"]] == list(range(12, 18))


def test_tensorboard_grid_and_a_report_per_validation(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(save_dir=str(tmp_path), name="tb")
    report = RetrievalReport(folder=str(tmp_path / "reports" / "{stage}"), every_validation=True, log_queries=3,
                             log_top_k=2, bins=0)
    trainer, model, data = _fit_free(tmp_path, logger, [report])
    trainer.fit(model, datamodule=data)
    assert (tmp_path / "reports" / "val-epoch=0" / "index.html").is_file()
    assert _f32(report.results.recall_at(1)) == float(trainer.callback_metrics["val/recall@1"])
    trainer.test(model, datamodule=data, verbose=False)
    assert (tmp_path / "reports" / "test" / "index.html").is_file()
    (summary,) = read_js(tmp_path / "reports" / "test" / "data" / "summary.js")
    assert summary["histogram"] is None  # bins=0
    logger.experiment.flush()
    events = EventAccumulator(str(Path(logger.log_dir)), size_guidance={"images": 0})
    events.Reload()
    assert {"val-epoch=0/worst_queries", "test/worst_queries"} <= set(events.Tags()["images"])
    (image,) = events.Images("test/worst_queries")
    assert (image.height, image.width) == (2 + 3 * 54, 2 + 3 * 54 + 4)


@pytest.mark.slow
def test_report_under_ddp_is_built_once_from_the_whole_split(tmp_path: Path) -> None:
    """2 gloo processes: the callback's search is split over both, both get the whole result, rank 0 writes."""
    script = Path(__file__).parent / "distributed" / "run_report_ddp.py"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "REPORT-DDP-OK" in proc.stdout
