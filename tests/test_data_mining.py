"""ClassEmbeddingRefresh: the N-pair sampler receives the model's per-class mean embeddings (Sohn 2016, 3.2.1)."""

from __future__ import annotations

import pytorch_lightning as pl
import torch
from torch import nn

from lightning_dml.callbacks import ClassEmbeddingRefresh
from lightning_dml.data import DMLDataModule, NPairSampler, TensorImageDataset
from lightning_dml.module import DMLModule


class _Synthetic(DMLDataModule):
    def build_datasets(self):
        g = torch.Generator().manual_seed(0)
        images = torch.randint(0, 256, (60, 3, 4, 4), dtype=torch.uint8, generator=g)
        labels = torch.arange(60) % 12
        return TensorImageDataset(images[:36], labels[:36]), TensorImageDataset(images[36:], labels[36:])


class _Flat(nn.Module):
    out_features = 48

    def forward(self, x):
        return x.flatten(1)


def expected_class_embeddings(model: nn.Module, train, indices, classes: torch.Tensor) -> torch.Tensor:
    """The normalised per-class means of the model's (eval-mode, float64) embeddings of ``train[indices]``."""
    model.eval()
    with torch.no_grad():
        emb = model(torch.stack([train[int(i)][0] for i in indices])).double()
    labels = train.labels[torch.as_tensor(indices)]
    means = torch.stack([emb[labels == c].mean(0) for c in classes.tolist()])
    return torch.nn.functional.normalize(means, dim=1)


def test_refresh_gives_the_sampler_the_models_class_means(tmp_path):
    dm = _Synthetic(classes_per_batch=4, samples_per_class=2, sampler="npair", hard_class_mining=True, eval_batch_size=7)
    model = DMLModule(_Flat(), loss="contrastive", embedding_dim=5, optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    refresh = ClassEmbeddingRefresh(images_per_class=2, batch_size=5)
    trainer = pl.Trainer(
        max_epochs=1, limit_train_batches=2, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[refresh], default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    sampler = dm.train_sampler
    assert isinstance(sampler, NPairSampler) and sampler.class_embeddings is not None
    indices = refresh.last_indices
    assert len(indices) == 2 * len(sampler.classes)
    expected = expected_class_embeddings(model, dm.train_dataset, indices, sampler.classes)
    torch.testing.assert_close(sampler.class_embeddings, expected, rtol=1e-5, atol=1e-6)


def test_refresh_ignores_samplers_without_mining(tmp_path):
    dm = _Synthetic(classes_per_batch=4, samples_per_class=2)
    model = DMLModule(_Flat(), loss="contrastive", embedding_dim=5)
    refresh = ClassEmbeddingRefresh()
    trainer = pl.Trainer(
        max_epochs=1, limit_train_batches=1, limit_val_batches=0, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[refresh], default_root_dir=tmp_path,
    )
    trainer.fit(model, datamodule=dm)
    assert refresh.last_indices is None
