"""A loss restricted to a miner's tuples, ``loss(embeddings, labels, indices_tuple=miner(embeddings, labels))``, as
one callable that :func:`lightning_dml.losses.distributed.gathered_loss` and ``DMLModule`` call like a loss.

Under ``DMLModule(gather_distributed=True)`` the miner sees the global batch: with a ``"references"`` loss and a
per-anchor miner (:attr:`~lightning_dml.miners.base.Miner.per_anchor`) each process mines its own anchors against
the gathered batch (its rows, then the other processes'), the same tuples as one process holding the global batch
up to the order of exactly tied distances; a batch-wide miner (HDC, uniform histogram) or a random one (distance
weighted) turns the call into ``"global_batch"`` (every process mines and scores the whole gathered batch), where a
random miner draws the same tuples on every process, and as one process would, only with its ``seed`` set.
"""

from __future__ import annotations

from torch import Tensor, nn

from lightning_dml.miners.base import Miner

__all__ = ["MinedLoss"]


class MinedLoss:
    """``loss`` restricted to the tuples of ``miner``; ``gather_mode`` as the module docstring says."""

    def __init__(self, loss: nn.Module, miner: Miner) -> None:
        self.loss, self.miner = loss, miner
        mode = getattr(loss, "gather_mode", None)
        batch_wide = not miner.per_anchor or miner.random
        self.gather_mode = "global_batch" if mode == "references" and batch_wide else mode

    def __call__(
        self, embeddings: Tensor, labels: Tensor, ref_embeddings: Tensor | None = None, ref_labels: Tensor | None = None
    ) -> Tensor:
        indices_tuple = self.miner(embeddings, labels, ref_embeddings, ref_labels)
        return self.loss(embeddings, labels, ref_embeddings, ref_labels, indices_tuple=indices_tuple)
