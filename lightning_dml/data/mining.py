"""Class embeddings for the N-pair paper's hard negative class mining (Sohn 2016, Sec. 3.2.1).

:class:`ClassEmbeddingRefresh` embeds a few training images of every class with the current model at the start
of every ``every_n_epochs``-th epoch and hands the per-class means to the data module's
:class:`~lightning_dml.data.samplers.NPairSampler`, which then builds each batch greedily from classes whose
embeddings are close (the paper: "pick a large number of classes C, embed one or two examples of each").
Under DDP each process embeds a shard of the images and the shards are all-gathered, so every process gives
its sampler the same embeddings and all processes derive the same global batch sequence.
"""

from __future__ import annotations

import numpy as np
import pytorch_lightning as pl
import torch
from torch.utils.data import DataLoader

from lightning_dml.data.image_list import collate_skipping
from lightning_dml.data.samplers import EvalShardSampler, NPairSampler


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

    @torch.no_grad()
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
        was_training = pl_module.training
        pl_module.eval()
        try:
            rows, positions = [], []
            for batch in loader:
                rows.append(pl_module(batch[0].to(pl_module.device)).float())
                positions.append(batch[2].to(pl_module.device))
        finally:
            pl_module.train(was_training)
        embeddings = torch.cat(rows) if rows else torch.zeros(0, 1, device=pl_module.device)
        position = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long, device=pl_module.device)
        if trainer.world_size > 1:
            embeddings, position = _gather_uneven(trainer, embeddings, position)
        order = torch.argsort(position)
        labels = view.labels[position[order].cpu()]
        sampler.set_class_embeddings(embeddings[order].cpu(), labels)


def _gather_uneven(trainer: pl.Trainer, embeddings: torch.Tensor, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather per-process rows of different lengths (pad to the longest, drop the padding)."""
    count = torch.tensor([embeddings.shape[0]], device=embeddings.device)
    counts = trainer.strategy.all_gather(count).flatten().tolist()
    longest = max(counts)
    pad = longest - embeddings.shape[0]
    embeddings = torch.cat([embeddings, embeddings.new_zeros(pad, embeddings.shape[1])])
    position = torch.cat([position, position.new_full((pad,), -1)])
    all_embeddings = trainer.strategy.all_gather(embeddings)
    all_positions = trainer.strategy.all_gather(position)
    keep = [slice(0, n) for n in counts]
    return (
        torch.cat([all_embeddings[r][keep[r]] for r in range(len(counts))]),
        torch.cat([all_positions[r][keep[r]] for r in range(len(counts))]),
    )


__all__ = ["ClassEmbeddingRefresh"]
