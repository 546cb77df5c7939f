"""Class embeddings for the N-pair paper's hard negative class mining (Sohn 2016, Sec. 3.2.1).

:class:`ClassEmbeddingRefresh` embeds a few training images of every class with the current model at the start
of every ``every_n_epochs``-th epoch and hands the per-class means to the data module's
:class:`~lightning_dml.data.samplers.NPairSampler`, which then builds each batch greedily from classes whose
embeddings are close (the paper: "pick a large number of classes C, embed one or two examples of each").
Under DDP each process embeds a shard of the images and the shards are all-gathered
(:func:`lightning_dml.distributed.all_gather_uneven`), so every process gives its sampler the same embeddings
and all processes derive the same global batch sequence.
"""

from __future__ import annotations

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from lightning_dml.callbacks.embedding import embed_loader
from lightning_dml.data.image_list import collate_skipping
from lightning_dml.data.samplers import EvalShardSampler, NPairSampler
from lightning_dml.distributed import all_gather_uneven

__all__ = ["ClassEmbeddingRefresh"]


class ClassEmbeddingRefresh(pl.Callback):
    """Refresh the class embeddings of a hard-class-mining :class:`NPairSampler` from the model.

    Needs a :class:`~lightning_dml.data.base.DMLDataModule` with ``sampler="npair"`` and
    ``hard_class_mining=True``; does nothing otherwise. Images are embedded with the evaluation transforms, in
    eval mode, without gradient.

    Args:
        every_n_epochs: refresh at the start of epochs 0, n, 2n, ...
        images_per_class: training images embedded per class (1 or 2 in the paper), drawn at random per refresh.
        batch_size: batch size of the embedding pass.
        seed: seed of the image choice (combined with the epoch).
    """

    def __init__(self, every_n_epochs: int = 1, images_per_class: int = 1, batch_size: int = 256, seed: int = 0) -> None:
        super().__init__()
        if every_n_epochs < 1 or images_per_class < 1 or batch_size < 1:
            raise ValueError(
                f"every_n_epochs, images_per_class and batch_size must be >= 1, got {every_n_epochs}, "
                f"{images_per_class}, {batch_size}"
            )
        self.every_n_epochs = every_n_epochs
        self.images_per_class = images_per_class
        self.batch_size = batch_size
        self.seed = seed
        self.last_indices: np.ndarray | None = None

    def choose_images(self, sampler: NPairSampler, epoch: int) -> np.ndarray:
        """Training-set indices: ``images_per_class`` of each class (all of a smaller class), sorted."""
        rng = np.random.default_rng([self.seed, epoch, 11])
        chosen = [
            rng.choice(members, size=min(self.images_per_class, len(members)), replace=False) for members in sampler.members
        ]
        return np.sort(np.concatenate(chosen))

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        datamodule = trainer.datamodule
        sampler = getattr(datamodule, "train_sampler", None)
        if not isinstance(sampler, NPairSampler) or not sampler.hard_class_mining:
            return
        if trainer.current_epoch % self.every_n_epochs:
            return
        indices = self.choose_images(sampler, trainer.current_epoch)
        self.last_indices = indices
        view = datamodule.make_eval_view(datamodule.train_dataset, indices)
        shard = EvalShardSampler(view, trainer.world_size, trainer.global_rank)
        loader = DataLoader(view, batch_size=self.batch_size, sampler=shard, collate_fn=collate_skipping)
        embeddings, rest = embed_loader(pl_module, loader, pl_module.device)
        position = rest[1].to(embeddings.device) if rest else torch.zeros(0, dtype=torch.long, device=embeddings.device)
        emb_parts, pos_parts = all_gather_uneven(embeddings, position)
        embeddings, position = torch.cat(emb_parts), torch.cat(pos_parts)
        order = torch.argsort(position)
        labels = view.labels[position[order].cpu()]
        sampler.set_class_embeddings(embeddings[order].cpu(), labels)
