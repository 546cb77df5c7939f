"""Training-time callbacks (pair-similarity histograms, Recall@K curve, periodic checkpoints, the end-of-fit
validation table, the retrieval comparison on resumed runs), the shared eval-mode embedding pass and the CLI's
checkpoint defaults."""

from __future__ import annotations

import csv
import itertools

import pytest
import pytorch_lightning as pl
import torch
from pytorch_lightning.callbacks import ModelCheckpoint

from lightning_dml.callbacks import (
    PairSimilarityHistogram,
    PeriodicCheckpoint,
    RecallCurve,
    RetrievalComparison,
    ValidationSummary,
    embed_loader,
    evaluate_embeddings,
)
from lightning_dml.cli import build_cli
from lightning_dml.data.base import DMLDataModule, TensorImageDataset
from lightning_dml.models import SmallConvNet
from lightning_dml.module import DMLModule


class RandomImages(DMLDataModule):
    """12 train and 6 test classes of random 8 x 8 images, 6 per class."""

    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        images = torch.randint(0, 256, (108, 1, 8, 8), dtype=torch.uint8, generator=g)
        labels = torch.arange(108) // 6
        train = labels < 12
        return TensorImageDataset(images[train], labels[train]), TensorImageDataset(images[~train], labels[~train])


def test_pair_similarities_match_a_loop():
    torch.manual_seed(0)
    embeddings, labels = torch.randn(10, 5), torch.tensor([0, 1, 0, 2, 1, 0, 2, 2, 1, 3])
    positive, negative = PairSimilarityHistogram.pair_similarities(embeddings, labels)
    exp_pos, exp_neg = [], []
    for i, j in itertools.combinations(range(10), 2):
        cos = float(embeddings[i] @ embeddings[j] / (embeddings[i].norm() * embeddings[j].norm()))
        (exp_pos if labels[i] == labels[j] else exp_neg).append(cos)
    assert sorted(positive.tolist()) == pytest.approx(sorted(exp_pos), abs=1e-6)
    assert sorted(negative.tolist()) == pytest.approx(sorted(exp_neg), abs=1e-6)


def test_callbacks_during_a_fit(tmp_path):
    histograms = PairSimilarityHistogram(every_n_steps=2, bins=10)
    curve = RecallCurve(dirpath=str(tmp_path / "curve"))
    periodic = PeriodicCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=100)
    data = RandomImages(classes_per_batch=4, samples_per_class=3, eval_batch_size=64)
    model = DMLModule(SmallConvNet(width=4), embedding_dim=8, clustering=False, recall_at=(1, 2))
    trainer = pl.Trainer(
        max_epochs=2, logger=False, callbacks=[histograms, curve, periodic], enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=data)
    steps_per_epoch = 72 // 12
    assert trainer.global_step == 2 * steps_per_epoch

    # one histogram every 2 steps, each counting all pairs of the 4 x 3 batch
    assert [h["step"] for h in histograms.history] == list(range(0, 2 * steps_per_epoch, 2))
    for h in histograms.history:
        assert h["positive"].sum() == 4 * 3 * 2 / 2  # P * K(K-1)/2 positive pairs
        assert h["negative"].sum() == 12 * 11 / 2 - 12  # all other pairs
        assert len(h["edges"]) == 11
    assert {"train/sim_pos_mean", "train/sim_neg_mean", "train/sim_overlap"} <= set(trainer.callback_metrics)

    # one row per validation, read back from the CSV
    assert [row["epoch"] for row in curve.history] == [0, 1]
    rows = list(csv.DictReader((tmp_path / "curve" / "recall_curve.csv").open()))
    assert [r["epoch"] for r in rows] == ["0", "1"]
    assert float(rows[-1]["recall@1"]) == pytest.approx(float(trainer.callback_metrics["val/recall@1"]), abs=1e-6)
    assert (tmp_path / "curve" / "recall_curve.png").stat().st_size > 0

    # no mid-epoch save (100 > steps) but one at every epoch end: last.ckpt is the final state
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["last.ckpt"]
    ckpt = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert ckpt["global_step"] == 2 * steps_per_epoch
    # the Recall@K curve survives in the checkpoint
    state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("RecallCurve"))
    assert len(state["history"]) == 2


def test_callback_arguments_are_checked():
    with pytest.raises(ValueError, match="every_n_train_steps must be >= 1, got 0"):
        PeriodicCheckpoint(every_n_train_steps=0)
    with pytest.raises(ValueError, match="every_n_steps >= 1 and bins >= 2"):
        PairSimilarityHistogram(every_n_steps=0)


_BASE = [
    "--trainer.logger=false",
    "--model.backbone=lightning_dml.models.SmallConvNet",
    "--data=lightning_dml.data.GlyphsDataModule",
]


def test_cli_checkpoint_defaults(tmp_path):
    cli = build_cli([*_BASE, f"--trainer.default_root_dir={tmp_path}", "--periodic_checkpoint.every_n_train_steps=7"],
                    run=False)
    callbacks = [cb for cb in cli.trainer.callbacks if isinstance(cb, ModelCheckpoint)]
    best = next(cb for cb in callbacks if not isinstance(cb, PeriodicCheckpoint))
    periodic = next(cb for cb in callbacks if isinstance(cb, PeriodicCheckpoint))
    assert cli.trainer.checkpoint_callback is best  # what ckpt_path="best" uses
    assert (best.monitor, best.mode, best.save_top_k, best.save_last) == ("val/recall@1", "max", 1, False)
    assert periodic.save_last is True and periodic._every_n_train_steps == 7
    assert best.dirpath == periodic.dirpath == str((tmp_path / "checkpoints").resolve())
    assert sum(isinstance(cb, ValidationSummary) for cb in cli.trainer.callbacks) == 1

    cli = build_cli([*_BASE, "--trainer.enable_checkpointing=false"], run=False)
    assert not any(isinstance(cb, ModelCheckpoint) for cb in cli.trainer.callbacks)

    cli = build_cli([*_BASE, f"--checkpoint.dirpath={tmp_path / 'mine'}"], run=False)
    dirs = {cb.dirpath for cb in cli.trainer.callbacks if isinstance(cb, ModelCheckpoint)}
    assert dirs == {str(tmp_path / "mine")}


# ------------------------------------------------------------------------------------------ embed_loader
class _Scale(torch.nn.Module):
    """Embeds ``x`` as ``2x`` in eval mode and ``3x`` in training mode (so the mode used is visible)."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(()))

    def forward(self, x):
        return x.flatten(1) * self.weight * (3.0 if self.training else 2.0)


@pytest.mark.parametrize("mode", [True, False])
def test_embed_loader_uses_eval_mode_without_grad_and_restores_the_mode(mode):
    model = _Scale().train(mode)
    batches = [
        (torch.full((2, 1, 2), float(b)), torch.tensor([b, b]), torch.tensor([2 * b, 2 * b + 1])) for b in range(3)
    ]
    embeddings, (labels, indices) = embed_loader(model, batches)
    assert model.training is mode
    assert not embeddings.requires_grad and embeddings.dtype == torch.float32
    assert torch.equal(embeddings, torch.cat([2.0 * b[0].flatten(1) for b in batches]))
    assert labels.tolist() == [0, 0, 1, 1, 2, 2] and indices.tolist() == list(range(6))
    # plain tensors as batches, a callable instead of a module, and an empty loader
    emb, rest = embed_loader(lambda x: x.flatten(1), [torch.ones(3, 2, 2)], torch.device("cpu"))
    assert emb.shape == (3, 4) and rest == []
    emb, rest = embed_loader(model, [])
    assert emb.shape == (0, 0) and rest == []


def test_embed_loader_restores_the_mode_after_an_error():
    model = _Scale().train()

    def broken():
        yield torch.ones(1, 2)
        raise RuntimeError("corrupt batch")

    with pytest.raises(RuntimeError, match="corrupt batch"):
        embed_loader(model, broken())
    assert model.training


# ------------------------------------------------------------------------------ the end-of-fit tables
def _trainer(tmp_path, callbacks, max_epochs=1, **kwargs):
    return pl.Trainer(
        max_epochs=max_epochs, logger=False, callbacks=callbacks, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=tmp_path, **kwargs,
    )


def _data_and_model(seed=0):
    pl.seed_everything(seed)
    data = RandomImages(classes_per_batch=4, samples_per_class=3, eval_batch_size=64)
    model = DMLModule(SmallConvNet(width=4), embedding_dim=8, clustering=False, recall_at=(1, 2))
    return data, model


def test_validation_summary_prints_the_last_validation(tmp_path, capsys):
    summary = ValidationSummary()
    data, model = _data_and_model()
    trainer = _trainer(tmp_path, [summary], enable_checkpointing=False)
    trainer.fit(model, datamodule=data)
    out = capsys.readouterr().out
    assert out.count("Last validation") == 1 and summary.table in out
    lines = {line.split()[0]: float(line.split()[1]) for line in summary.table.splitlines()[1:]}
    logged = {k[len("val/"):]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    assert set(lines) == set(logged) and {"recall@1", "recall@2", "map@r"} <= set(lines)
    for name, value in logged.items():
        assert lines[name] == pytest.approx(100 * value, abs=0.05)


def test_validation_summary_is_silent_next_to_a_retrieval_comparison(tmp_path, capsys):
    summary = ValidationSummary()
    data, model = _data_and_model()
    trainer = _trainer(tmp_path, [RetrievalComparison(clustering=False), summary], enable_checkpointing=False)
    trainer.fit(model, datamodule=data)
    out = capsys.readouterr().out
    assert out.count("Retrieval on the test classes") == 1
    assert "Last validation" not in out and summary.table is None


def test_retrieval_comparison_keeps_the_untrained_figures_of_a_resumed_run(tmp_path, capsys):
    """Regression: ``--ckpt_path last`` showed the restored model in the "untrained network" row."""
    data, model = _data_and_model()
    first = RetrievalComparison(clustering=False)
    ckpt = PeriodicCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=100)
    _trainer(tmp_path, [first, ckpt]).fit(model, datamodule=data)
    untrained = first.rows["untrained network"]
    assert first.rows["trained network"] != untrained

    data, model = _data_and_model()
    resumed = RetrievalComparison(clustering=False)
    trainer = _trainer(tmp_path, [resumed, PeriodicCheckpoint(dirpath=str(tmp_path / "ckpt"), every_n_train_steps=100)],
                       max_epochs=2)
    trainer.fit(model, datamodule=data, ckpt_path=str(tmp_path / "ckpt" / "last.ckpt"))
    assert list(resumed.rows) == ["raw pixels", "untrained network", "trained network"]
    assert resumed.rows["untrained network"] == untrained  # the figures of the first fit's start
    assert resumed.rows["raw pixels"] == first.rows["raw pixels"]
    assert resumed.note is None

    # a checkpoint written without the callback: no "untrained network" row rather than the restored model's
    data, model = _data_and_model()
    _trainer(tmp_path / "plain", [PeriodicCheckpoint(dirpath=str(tmp_path / "plain"), every_n_train_steps=100)]).fit(
        model, datamodule=data
    )
    data, model = _data_and_model()
    late = RetrievalComparison(clustering=False)
    trainer = _trainer(tmp_path / "plain", [late], max_epochs=2, enable_checkpointing=False)
    capsys.readouterr()
    trainer.fit(model, datamodule=data, ckpt_path=str(tmp_path / "plain" / "last.ckpt"))
    assert list(late.rows) == ["raw pixels", "trained network"]
    assert "untrained network: not recorded in" in capsys.readouterr().out


def test_evaluate_embeddings_matches_the_metric_fed_by_hand():
    data, model = _data_and_model()
    data.setup("test")
    loader = data.test_dataloader()
    got = evaluate_embeddings(model, loader, torch.device("cpu"), clustering=False)
    from lightning_dml.metrics import RetrievalMetrics

    metric = RetrievalMetrics(recall_at=(1, 2, 4, 8), clustering=False)
    model.eval()
    with torch.no_grad():
        for images, labels, indices in loader:
            metric.update(model(images), labels, indices=indices)
    assert got == metric.compute()
