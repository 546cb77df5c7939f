"""2-process DDP (gloo, CPU): the gathers of ``ClassEmbeddingRefresh`` and ``PredictionWriter``.

Run as a script (``python run_callbacks_ddp.py WORKDIR``); Lightning's ``ddp`` strategy re-launches it for rank 1.
The training split has 11 classes (one image of each is embedded by the refresh: shards of 6 and 5 images), the
test split 7 classes x 3 images (predict shards of 11 and 10 items). The model does not change (learning rate 0),
so every rank can check what it received against its own single-process computation:

* after the refresh, both ranks' N-pair samplers hold the same class embeddings, equal to the normalised class
  means of the model's embeddings of all chosen images (not only the rank's shard);
* the single predictions file written by rank 0 holds every test item once, in index order, with the model's
  embedding and label of each.

Prints ``CALLBACKS-DDP-OK`` on success.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parents[2]))

TRAIN_CLASSES, TEST_CLASSES, PER_CLASS = 11, 7, 3


class _Flat(nn.Module):
    out_features = 48

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1)


def main() -> None:
    import pytorch_lightning as pl

    from lightning_dml.callbacks import ClassEmbeddingRefresh, PredictionWriter, load_predictions
    from lightning_dml.data import DMLDataModule, NPairSampler, TensorImageDataset
    from lightning_dml.distributed import all_gather_object
    from lightning_dml.module import DMLModule
    from tests.test_data_mining import expected_class_embeddings

    class Synthetic(DMLDataModule):
        def build_datasets(self):
            g = torch.Generator().manual_seed(0)
            n_train, n_test = TRAIN_CLASSES * PER_CLASS, TEST_CLASSES * PER_CLASS
            images = torch.randint(0, 256, (n_train + n_test, 3, 4, 4), dtype=torch.uint8, generator=g)
            train_labels = torch.arange(n_train) % TRAIN_CLASSES
            test_labels = TRAIN_CLASSES + torch.arange(n_test) % TEST_CLASSES
            return (
                TensorImageDataset(images[:n_train], train_labels),
                TensorImageDataset(images[n_train:], test_labels),
            )

    warnings.filterwarnings("ignore")
    workdir = Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix="callbacks_ddp_"))
    pl.seed_everything(0)
    dm = Synthetic(classes_per_batch=2, samples_per_class=2, sampler="npair", hard_class_mining=True, eval_batch_size=4)
    model = DMLModule(_Flat(), loss="contrastive", embedding_dim=5, optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    refresh = ClassEmbeddingRefresh(images_per_class=1, batch_size=2)
    writer = PredictionWriter(output_path=str(workdir / "predictions.pt"))
    trainer = pl.Trainer(
        strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, limit_train_batches=2, limit_val_batches=0,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        callbacks=[refresh, writer], default_root_dir=workdir,
    )
    trainer.fit(model, datamodule=dm)
    rank = trainer.global_rank

    # ClassEmbeddingRefresh: all chosen images, not only this rank's shard
    sampler = dm.train_sampler
    assert isinstance(sampler, NPairSampler) and sampler.class_embeddings is not None
    indices = refresh.last_indices
    assert len(indices) == TRAIN_CLASSES
    expected = expected_class_embeddings(model, dm.train_dataset, indices, sampler.classes)
    torch.testing.assert_close(sampler.class_embeddings.double(), expected, rtol=1e-5, atol=1e-6)
    both = all_gather_object(sampler.class_embeddings)
    assert torch.equal(both[0], both[1]), "the two ranks' samplers hold different class embeddings"

    # PredictionWriter: one file with every test item once
    trainer.predict(model, datamodule=dm, return_predictions=False)
    if rank == 0:
        out = load_predictions(workdir / "predictions.pt")
        test = dm.test_dataset
        n = len(test)
        assert torch.equal(out["indices"], torch.arange(n)), out["indices"]
        assert torch.equal(out["labels"], test.labels.long())
        with torch.no_grad():
            expected_emb = model(torch.stack([test[i][0] for i in range(n)]))
        torch.testing.assert_close(out["embeddings"], expected_emb, rtol=1e-5, atol=1e-6)
        assert out["paths"] is None
        print("CALLBACKS-DDP-OK", flush=True)
    trainer.strategy.barrier()


if __name__ == "__main__":
    main()
