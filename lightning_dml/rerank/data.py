"""Training pairs for a pairwise re-ranker: each training query's top-n neighbours under a base model.

STIR (Shabanov et al. 2023) trains its siamese transformer on the pairs the base model confuses: a query and the
candidates the base model ranks near it, positives and hard negatives, labelled same class or not. Here:

* :func:`mine_pairs`: with the library's exact engine (:func:`lightning_dml.metrics.functional.knn`, float64
  scores, ties by index), each training item as a query against the rest of the training split, its ``top_n``
  nearest items (itself excluded; with sequence ids, the items of its own sequence excluded as the metrics exclude
  them), each pair labelled by the metrics' relevance rule (the same label, or intersecting label sets:
  ``build_search(...)[0].relevant``). A query's positives beyond its top-n are not added: the re-ranker only ever
  re-scores a top-n list, so it is trained on what such lists hold (OML mines its pairs the same way, from
  the base model's nearest neighbours, inside each training batch).
* :class:`PairwiseRerankDataModule`: given a base checkpoint and the config it was trained with, embeds the
  training split (its evaluation view: no random augmentation) with the base model, mines the pairs once, and
  yields ``(x1, x2, target)`` batches: images (the training split's evaluation view: the preprocessing the index
  gives its images, no random augmentation) for
  :class:`~lightning_dml.rerank.models.ConcatSiamese`, or the embeddings as an index stores them (L2-normalised
  for the cosine metric) for :class:`~lightning_dml.rerank.models.FeatureDistanceSiamese`, each with the pair's base
  score (the exact engine's, which a residual re-ranker adds to).
* a validation split (``val_classes``): a seeded fraction of the training classes is held out; the pairs are mined
  within each part (the training part's items never list a held-out item, nor the reverse), and the held-out
  classes' lists are what :class:`~lightning_dml.rerank.module.PairwiseRerankerModule` measures its re-ranking on
  after each epoch (classes the re-ranker never trains on, as the test classes; the base model may have trained on
  them: on Glyphs it did, so its lists of them are better than of the test classes).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import pytorch_lightning as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_dml.errors import UserInputError

__all__ = ["MinedPairs", "PairDataset", "PairwiseRerankDataModule", "mine_pairs"]


@dataclass(frozen=True)
class MinedPairs:
    """Pairs of rows of one split: ``query[p]``, ``candidate[p]`` (row positions), ``target[p]`` (1.0: relevant),
    ``rank[p]`` (0-based rank of the candidate in the query's list), ``score[p]`` (the exact engine's float64 score
    of the pair: cosine similarity, or minus the squared Euclidean distance)."""

    query: Tensor
    candidate: Tensor
    target: Tensor
    rank: Tensor
    score: Tensor

    def __len__(self) -> int:
        return int(self.query.numel())


def mine_pairs(embeddings: Tensor, labels: Tensor, top_n: int, *, metric: str = "cosine",
               sequence: Tensor | None = None) -> MinedPairs:
    """Each row's ``top_n`` nearest other rows by the exact engine, with their relevance (module docstring).

    Args:
        embeddings: ``[N, D]`` raw embeddings (the engine normalises them for ``cosine``).
        labels: ``[N]`` class ids or ``[N, L]`` label sets padded with ``-1``.
        top_n: neighbours per query (fewer where fewer rows remain after the exclusions).
        metric: ``"cosine"`` or ``"euclidean"``, the base model's.
        sequence: ``[N]`` sequence ids (negative: none): the items of a query's sequence are never its candidates.

    Returns:
        :class:`MinedPairs` ordered by query, then rank.
    """
    from lightning_dml.metrics.functional import build_search, knn, prepare

    if int(top_n) < 1:
        raise ValueError(f"top_n must be >= 1, got {top_n}")
    n = int(embeddings.shape[0])
    if n < 2:
        raise UserInputError(f"mining re-ranker pairs needs at least 2 training items, got {n}")
    task, _, _ = build_search(prepare(embeddings, labels, sequence=sequence), metric=metric)
    device = task.q_items.device
    seq = None if sequence is None else sequence.to(device).long()
    extra = 0  # the items of the query's own sequence (itself among them) that the list must reach past
    if seq is not None and bool((seq >= 0).any()):
        extra = int(torch.unique(seq[seq >= 0], return_counts=True)[1].max())
    k = min(n - 1, int(top_n) + extra)
    scores, neighbours = knn(embeddings, None, k=k, metric=metric)
    neighbours, scores = neighbours.to(device), scores.to(device)
    rows = torch.arange(n, device=device).unsqueeze(1).expand_as(neighbours)
    valid = neighbours >= 0
    if seq is not None:
        own = seq[rows] >= 0
        valid &= ~(own & (seq[neighbours.clamp(min=0)] == seq[rows]))
    rank = valid.long().cumsum(1) - 1
    keep = valid & (rank < int(top_n))
    q, c, r = rows[keep], neighbours[keep], rank[keep]
    target = task.relevant(q, c)  # positions: prepare keeps the rows' order without indices, no query mask
    return MinedPairs(q.cpu(), c.cpu(), target.float().cpu(), r.cpu(), scores[keep].double().cpu())


def subset_pairs(pairs: MinedPairs, rows: Tensor) -> MinedPairs:
    """``pairs`` mined on the rows ``rows`` of a split (positions into ``rows``) as positions into the whole split."""
    rows = rows.long().cpu()
    return MinedPairs(rows[pairs.query], rows[pairs.candidate], pairs.target, pairs.rank, pairs.score)


def held_out_classes(labels: Tensor, fraction: float, seed: int = 0) -> Tensor:
    """``[N]`` bool: the items of a seeded random ``fraction`` of the classes of ``labels [N]`` (at least one class,
    at least one class left out of it). Label sets ``[N, L]`` are refused (one line): their classes overlap."""
    if labels.ndim != 1:
        raise UserInputError("data.val_classes holds out whole classes: it needs one label per training item, not "
                             f"label sets (labels of shape {tuple(labels.shape)})")
    classes = torch.unique(labels)
    if classes.numel() < 2:
        raise UserInputError(f"data.val_classes needs at least 2 training classes, got {classes.numel()}")
    count = min(classes.numel() - 1, max(1, round(float(fraction) * classes.numel())))
    order = torch.randperm(classes.numel(), generator=torch.Generator().manual_seed(int(seed)))
    return torch.isin(labels, classes[order[:count]])


def recall_at_1(logits: Tensor, pairs: MinedPairs) -> float:
    """Recall@1 of the queries of ``pairs`` after sorting each query's pairs by ``logits [P]`` (larger first, ties:
    the base rank), with the targets as relevance: the fraction of queries whose first pair is relevant (a query
    without a relevant item in its list counts as a miss, as it would at any re-ranking)."""
    if len(pairs) == 0:
        return 0.0
    order = torch.argsort(pairs.rank, stable=True)
    order = order[torch.argsort(logits.detach().double().cpu()[order], descending=True, stable=True)]
    order = order[torch.argsort(pairs.query[order], stable=True)]
    q = pairs.query[order]
    first = torch.ones_like(q, dtype=torch.bool)
    first[1:] = q[1:] != q[:-1]
    return float(pairs.target[order][first].double().mean())


class PairDataset(Dataset):
    """``(x1, x2, target)`` of mined pairs: ``items[query]``, ``items[candidate]`` where ``items`` is a dataset
    (its items' first element: an image) or a tensor of embeddings."""

    def __init__(self, items: Dataset | Tensor, pairs: MinedPairs) -> None:
        self.items, self.pairs = items, pairs

    def __len__(self) -> int:
        return len(self.pairs)

    def _item(self, row: int) -> Tensor:
        if isinstance(self.items, Tensor):
            return self.items[row]
        return self.items[row][0]

    def __getitem__(self, p: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(x1, x2, target, base score)`` of pair ``p`` (the score as float32)."""
        return (self._item(int(self.pairs.query[p])), self._item(int(self.pairs.candidate[p])),
                self.pairs.target[p], self.pairs.score[p].float())


def _first_elements(items: list[Any]) -> Tensor:
    return torch.stack([item[0] for item in items])


@torch.no_grad()
def embed_dataset(module: torch.nn.Module, dataset: Dataset, batch_size: int = 256, num_workers: int = 0,
                  device: torch.device | str = "cpu") -> Tensor:
    """Raw float32 embeddings ``[N, D]`` (CPU) of every item of ``dataset`` in order, by ``module`` in eval mode."""
    module = module.to(device).eval()
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False, num_workers=num_workers,
                        collate_fn=_first_elements)
    return torch.cat([module(images.to(device)).float().cpu() for images in loader])


class PairwiseRerankDataModule(pl.LightningDataModule):
    """Mined pairs of a base model's training split (module docstring).

    Args:
        base_config: the config the base checkpoint was trained with (``config.yaml`` of its run, or the one given
            to ``fit``): its data module gives the training split and the preprocessing.
        base_checkpoint: the base model's checkpoint (its sha256 is recorded in the re-ranker's folder).
        top_n: neighbours per training query (STIR re-ranks the top 5 in its experiments; OML's default n is 5).
        inputs: ``"images"`` (ConcatSiamese) or ``"embeddings"`` (FeatureDistanceSiamese); must be the model's.
        batch_size: pairs per training batch.
        num_workers: DataLoader workers (embedding and training).
        embed_batch_size: images per batch when the base model embeds the training split.
        device: where the base model embeds (default: CUDA when available, else the CPU).
        val_classes: the fraction of the training classes held out as a validation split (module docstring; 0: none).
        val_seed: the seed of the held-out classes' choice.
    """

    def __init__(self, base_config: str, base_checkpoint: str, top_n: int = 5,
                 inputs: Literal["images", "embeddings"] = "images", batch_size: int = 32, num_workers: int = 0,
                 embed_batch_size: int = 256, device: str | None = None, val_classes: float = 0.0,
                 val_seed: int = 0) -> None:
        super().__init__()
        if inputs not in ("images", "embeddings"):
            raise ValueError(f"inputs must be 'images' or 'embeddings', got {inputs!r}")
        if int(top_n) < 1 or int(batch_size) < 1:
            raise ValueError(f"top_n and batch_size must be >= 1, got {top_n} and {batch_size}")
        self.base_config, self.base_checkpoint = os.fspath(base_config), os.fspath(base_checkpoint)
        self.top_n, self.inputs = int(top_n), inputs
        self.batch_size, self.num_workers, self.embed_batch_size = int(batch_size), int(num_workers), int(embed_batch_size)
        self.device = device
        if not 0.0 <= float(val_classes) < 1.0:
            raise UserInputError(f"data.val_classes must be a fraction in [0, 1), got {val_classes}")
        self.val_classes, self.val_seed = float(val_classes), int(val_seed)
        self.pairs: MinedPairs | None = None
        self.train_set: PairDataset | None = None
        #: set by :meth:`setup` when ``val_classes > 0``: the held-out classes' pairs and their dataset
        self.val_pairs: MinedPairs | None = None
        self.val_set: PairDataset | None = None
        #: set by :meth:`setup`: the base checkpoint's record, metric, embedding width, preprocessing
        self.base_record: dict[str, str] | None = None
        self.metric = "cosine"
        self.embedding_dim: int | None = None
        self.input_spec: Any = None

    def setup(self, stage: str | None = None) -> None:
        if self.train_set is not None:
            return
        from lightning_dml.index.embed import embedding_metric, load_checkpoint_model
        from lightning_dml.index.rerank import as_stored

        module, datamodule, record = load_checkpoint_model(self.base_config, self.base_checkpoint)
        self.base_record, self.metric = record, embedding_metric(module)
        datamodule.setup("fit")
        train = datamodule.train_dataset
        view = datamodule.make_eval_view(train, np.arange(len(train)))
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        embeddings = embed_dataset(module, view, self.embed_batch_size, self.num_workers, device)
        labels = torch.as_tensor(train.labels)
        sequence = getattr(train, "sequence", None)
        sequence = None if sequence is None else torch.as_tensor(sequence)
        held = (held_out_classes(labels, self.val_classes, self.val_seed) if self.val_classes > 0
                else torch.zeros(len(labels), dtype=torch.bool))
        parts = []
        for mask in (~held, held):
            rows = torch.nonzero(mask).flatten()
            if rows.numel() == 0:
                parts.append(None)
                continue
            part = mine_pairs(embeddings[rows], labels[rows], self.top_n, metric=self.metric,
                              sequence=None if sequence is None else sequence[rows])
            parts.append(subset_pairs(part, rows))
        self.pairs, self.val_pairs = parts
        self.embedding_dim = int(embeddings.shape[1])
        self.input_spec = datamodule.input_spec
        items = as_stored(embeddings, self.metric) if self.inputs == "embeddings" else view
        self.train_set = PairDataset(items, self.pairs)
        self.val_set = None if self.val_pairs is None else PairDataset(items, self.val_pairs)

    def train_dataloader(self) -> DataLoader:
        assert self.train_set is not None, "setup() first"
        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers,
                          drop_last=False, persistent_workers=self.num_workers > 0)
