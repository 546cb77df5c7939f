"""What a run leaves for the user: the predictions file (``PredictionWriter``, ``lightning-dml predict``), the
retrieval grid image and the callback that logs it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
from PIL import Image
from pytorch_lightning.loggers import CSVLogger

from lightning_dml.callbacks import PredictionWriter, RetrievalGridLogger, load_predictions
from lightning_dml.cli import build_cli
from lightning_dml.data import CUB200DataModule
from lightning_dml.data.base import DMLDataModule, TensorImageDataset
from lightning_dml.models import SmallConvNet
from lightning_dml.module import DMLModule
from lightning_dml.visualize import CORRECT, QUERY, WRONG, retrieval_grid
from tests import glyph_cache
from tests.fixtures_data import make_cub200
from tests.test_cli import FAST, GLYPHS


class RandomImages(DMLDataModule):
    """8 train and 7 test classes of random 8 x 8 grey images, 5 per class (35 test items: not a multiple of the
    eval batch size)."""

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        images = torch.randint(0, 256, (75, 1, 8, 8), dtype=torch.uint8, generator=g)
        labels = torch.arange(75) // 5
        train = labels < 8
        return TensorImageDataset(images[train], labels[train]), TensorImageDataset(images[~train], labels[~train])


def _trainer(tmp_path: Path, callbacks: list, logger=False) -> pl.Trainer:
    return pl.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        devices=1,
        logger=logger,
        callbacks=callbacks,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


def _module(in_channels: int = 1) -> DMLModule:
    return DMLModule(SmallConvNet(in_channels=in_channels, width=4), embedding_dim=6, clustering=False)


# ---------------------------------------------------------------------------------------------- predictions file
def test_prediction_file_matches_the_model_on_every_item(tmp_path):
    dm = RandomImages(classes_per_batch=2, samples_per_class=2, eval_batch_size=8, num_workers=0)
    module = _module()
    out = tmp_path / "sub" / "preds.pt"
    _trainer(tmp_path, [PredictionWriter(str(out))]).predict(module, datamodule=dm)
    data = load_predictions(out)
    n = len(dm.test_dataset)
    assert data["embeddings"].shape == (n, 6) and data["embeddings"].dtype == torch.float32
    assert data["labels"].shape == (n,) and data["indices"].shape == (n,)
    assert data["indices"].tolist() == list(range(n))
    assert data["labels"].tolist() == dm.test_dataset.labels.tolist()
    assert data["paths"] is None  # in-memory dataset
    images = torch.stack([dm.test_dataset[i][0] for i in range(n)])
    module.eval()
    with torch.no_grad():
        expected = module(images)
    torch.testing.assert_close(data["embeddings"], expected, rtol=1e-4, atol=1e-5)


def test_writer_sorts_and_drops_duplicate_indices(tmp_path):
    """What rank 0 gets under DDP when two shards overlap: items out of order, one index twice."""
    writer = PredictionWriter(str(tmp_path / "p.pt"))
    trainer = _trainer(tmp_path, [writer])
    e = torch.arange(12.0).reshape(4, 3)
    outputs = [
        {"embeddings": e[2:], "labels": torch.tensor([7, 8]), "indices": torch.tensor([2, 0])},
        {"embeddings": e[:2], "labels": torch.tensor([9, 7]), "indices": torch.tensor([1, 2])},
    ]
    writer.write_on_epoch_end(trainer, None, outputs, [])
    data = load_predictions(tmp_path / "p.pt")
    assert data["indices"].tolist() == [0, 1, 2]
    assert data["labels"].tolist() == [8, 9, 7]
    torch.testing.assert_close(data["embeddings"], torch.stack([e[3], e[0], e[2]]))
    with pytest.raises(ValueError, match="indices"):
        writer.write_on_epoch_end(trainer, None, [{"embeddings": e, "labels": torch.zeros(4)}], [])
    with pytest.raises(ValueError, match="no predictions file"):
        load_predictions(tmp_path / "missing.pt")


def test_prediction_file_has_the_image_paths_of_a_file_dataset(tmp_path):
    root = make_cub200(tmp_path / "cub", images_per_class=2)
    dm = CUB200DataModule(root, classes_per_batch=3, samples_per_class=2, num_workers=0, image_size=16, eval_batch_size=64)
    out = tmp_path / "preds.pt"
    _trainer(tmp_path, [PredictionWriter(str(out))]).predict(_module(in_channels=3), datamodule=dm)
    data = load_predictions(out)
    n = len(dm.test_dataset)
    assert n == 200 and data["indices"].tolist() == list(range(n))
    assert data["paths"] == [str(p) for p in dm.test_dataset.paths]
    # each path's class folder agrees with the stored label
    assert [int(Path(p).parent.name[:3]) for p in data["paths"]] == data["labels"].tolist()
    assert all(Path(p).is_file() for p in data["paths"])


def test_cli_predict_writes_the_predictions_file(tmp_path, tmp_path_factory, monkeypatch):
    glyph_cache.install(tmp_path_factory.getbasetemp() / glyph_cache.FILENAME)
    monkeypatch.chdir(tmp_path)
    cli = build_cli(["predict", "--config", str(GLYPHS), *FAST, "--trainer.callbacks=[]"])
    writers = [cb for cb in cli.trainer.callbacks if isinstance(cb, PredictionWriter)]
    assert len(writers) == 1 and writers[0].written_path is not None
    path = writers[0].written_path
    assert path.name == "predictions.pt" and path.is_file()
    data = load_predictions(path)
    n = len(cli.datamodule.test_dataset)
    assert data["embeddings"].shape == (n, 16)
    assert data["indices"].tolist() == list(range(n))
    assert data["labels"].tolist() == cli.datamodule.test_dataset.labels.tolist()
    assert data["paths"] is None


def test_cli_predict_keeps_the_users_writer_and_its_config(tmp_path, tmp_path_factory, monkeypatch):
    glyph_cache.install(tmp_path_factory.getbasetemp() / glyph_cache.FILENAME)
    monkeypatch.chdir(tmp_path)
    mine = str(tmp_path / "mine.pt")
    args = ["predict", "--config", str(GLYPHS), *FAST, "--trainer.limit_predict_batches=1", "--trainer.callbacks=[]",
            "--trainer.callbacks+=lightning_dml.callbacks.PredictionWriter", f"--trainer.callbacks.output_path={mine}"]
    cli = build_cli(args)
    writers = [cb for cb in cli.trainer.callbacks if isinstance(cb, PredictionWriter)]
    assert [w.output_path for w in writers] == [mine]  # no second, default writer
    assert load_predictions(mine)["embeddings"].shape[1] == 16
    # the callbacks the CLI adds (checkpoints, summary) stay out of the config the run saves: a rerun from the
    # saved config.yaml must not add them twice
    saved = cli.config["predict"].trainer.callbacks
    assert [c.class_path for c in saved] == ["lightning_dml.callbacks.PredictionWriter"]


# ---------------------------------------------------------------------------------------------- retrieval grid
def _tile_origin(r: int, c: int, tile_h: int, tile_w: int, gap: int) -> tuple[int, int]:
    return gap + r * (tile_h + gap), gap + c * (tile_w + gap) + (2 * gap if c > 0 else 0)


def test_retrieval_grid_frames_match_a_brute_force_search():
    rng = np.random.default_rng(3)
    n, h, w, border, gap, top_k = 30, 6, 5, 2, 3, 4
    labels = rng.integers(0, 4, size=n)
    embeddings = rng.normal(size=(n, 8)) * rng.uniform(0.5, 3.0, size=(n, 1))  # norms differ: cosine != dot
    images = torch.from_numpy(rng.normal(size=(n, 3, h, w))).float()
    queries = [0, 7, 13, 29]
    grid = retrieval_grid(images, labels, embeddings, top_k=top_k, query_indices=queries, border=border, gap=gap)
    tile_h, tile_w = h + 2 * border, w + 2 * border
    assert grid.dtype == np.uint8 and grid.shape == (gap + 4 * (tile_h + gap), gap + 5 * (tile_w + gap) + 2 * gap, 3)
    unit = embeddings / np.linalg.norm(embeddings, axis=1, keepdims=True)
    greens = 0
    for r, q in enumerate(queries):
        sims = [(float(unit[q] @ unit[j]), j) for j in range(n) if j != q]
        best = [j for _, j in sorted(sims, key=lambda t: -t[0])[:top_k]]
        for c in range(top_k + 1):
            top, left = _tile_origin(r, c, tile_h, tile_w, gap)
            expected = QUERY if c == 0 else (CORRECT if labels[best[c - 1]] == labels[q] else WRONG)
            greens += expected == CORRECT
            for y, x in ((top, left), (top + tile_h - 1, left + tile_w - 1), (top + border - 1, left + tile_w // 2)):
                assert tuple(grid[y, x]) == expected, (r, c)
            if c > 0:  # the tile shows the neighbour's own pixels, min-max scaled
                shown = grid[top + border : top + border + h, left + border : left + border + w].astype(float)
                img = images[best[c - 1]].permute(1, 2, 0).numpy()
                ref = (img - img.min()) / (img.max() - img.min()) * 255
                assert np.abs(shown - ref).max() <= 1.0
    assert 0 < greens < len(queries) * top_k  # both colours occur: the check can fail either way


def test_retrieval_grid_rejects_bad_arguments():
    images, labels, emb = torch.zeros(5, 1, 4, 4), torch.arange(5), torch.randn(5, 3)
    with pytest.raises(ValueError, match="top_k"):
        retrieval_grid(images, labels, emb, num_queries=2, top_k=5)
    with pytest.raises(ValueError, match="embeddings"):
        retrieval_grid(images, labels, emb[:4], num_queries=2, top_k=2)
    grid = retrieval_grid(images, labels, emb, num_queries=2, top_k=2)  # constant images: mid-grey tiles
    assert grid.shape[0] == 2 + 2 * (8 + 2)


class ImageRecorder(CSVLogger):
    """A logger with W&B's ``log_image`` signature that keeps what it is given."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.images: list[tuple[str, list, int]] = []

    def log_image(self, key: str, images: list, step: int | None = None, **kwargs) -> None:
        self.images.append((key, images, step))


def _fit_one_epoch(tmp_path: Path, callback: RetrievalGridLogger, logger) -> pl.Trainer:
    dm = RandomImages(classes_per_batch=2, samples_per_class=2, eval_batch_size=16, num_workers=0)
    trainer = pl.Trainer(
        default_root_dir=tmp_path,
        accelerator="cpu",
        max_epochs=1,
        limit_train_batches=2,
        num_sanity_val_steps=0,
        logger=logger,
        callbacks=[callback],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        use_distributed_sampler=False,
    )
    trainer.fit(_module(), datamodule=dm)
    return trainer


def test_grid_callback_logs_one_image_to_a_log_image_logger(tmp_path):
    logger = ImageRecorder(tmp_path)
    callback = RetrievalGridLogger(num_queries=3, top_k=4, sample_size=20)
    _fit_one_epoch(tmp_path, callback, logger)
    assert len(logger.images) == 1
    key, images, _ = logger.images[0]
    assert key == "val/retrievals" and len(images) == 1
    grid = images[0]
    assert grid is callback.last_grid and grid.dtype == np.uint8 and grid.ndim == 3 and grid.shape[2] == 3
    assert grid.shape[0] == 2 + 3 * (8 + 4 + 2)  # 3 rows of 8 x 8 tiles, border 2, gap 2
    assert not list(tmp_path.rglob("*.png"))


def test_grid_callback_saves_a_png_without_logger(tmp_path):
    callback = RetrievalGridLogger(num_queries=2, top_k=3, sample_size=12, seed=1)
    _fit_one_epoch(tmp_path, callback, logger=False)
    pngs = list((tmp_path / "retrievals").glob("*.png"))
    assert len(pngs) == 1
    assert np.array_equal(np.asarray(Image.open(pngs[0])), callback.last_grid)
    with pytest.raises(ValueError, match="sample_size"):
        RetrievalGridLogger(num_queries=8, top_k=5, sample_size=5)
