"""The miner contract of pytorch-metric-learning (pml): ``miner(embeddings, labels[, ref_emb, ref_labels])``
returns an indices tuple, pairs ``(a1, p, a2, n)`` or triplets ``(a, p, n)`` (:mod:`lightning_dml.miners.indices`).

:class:`Miner` validates the call, L2-normalises the embeddings (pml's default distance is ``LpDistance`` with
``normalize_embeddings=True``), builds the ``B x N`` similarities ``S`` and Euclidean distances
``D = sqrt(max(2 - 2 S, 1e-12))`` of the anchors against the gallery (the batch, then the references), and the
label masks (:func:`~lightning_dml.miners.pairs.label_masks`: labels or label sets, self-pairs removed by index),
all without gradient; a subclass's :meth:`Miner.mine` turns them into index tensors with batched tensor code.
The returned tensors are ``torch.long`` on the embeddings' device. Unlike pml with ``ref_emb``, the gallery always
starts with the batch itself, so the tuple indexes the same gallery the losses score against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from lightning_dml.input_checks import check_embeddings, check_finite, check_same_device
from lightning_dml.miners.pairs import cat_labels, label_masks
from lightning_dml.scaling import l2_normalize

__all__ = ["MiningBatch", "Miner", "pairs_from_masks", "triplets_from_keep"]

#: floor of ``2 - 2 S`` before the square root, as the losses (SPEC 0.3 rule 2)
_DIST_EPS = 1e-12


@dataclass
class MiningBatch:
    """What a miner mines from: unit-norm ``anchors [B, D]`` and ``gallery [N, D]`` (its first ``B`` rows the
    anchors), ``sim`` and ``dist`` (``B x N``), the label masks ``pos`` / ``neg`` (``B x N``, no self-pairs) and the
    labels (``[B]`` / ``[N]`` or label sets)."""

    anchors: Tensor
    gallery: Tensor
    sim: Tensor
    dist: Tensor
    pos: Tensor
    neg: Tensor
    labels: Tensor
    gallery_labels: Tensor


def pairs_from_masks(pos: Tensor, neg: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(a1, p, a2, n)`` of the True entries of two ``B x N`` masks (row-major order)."""
    a1, p = pos.nonzero(as_tuple=True)
    a2, n = neg.nonzero(as_tuple=True)
    return a1, p, a2, n


def triplets_from_keep(index: Tensor, keep: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(a, p, n)`` of the True entries of ``keep [B, K, N]``, where ``index [B, K]`` holds the gallery column of
    each anchor's ``r``-th positive (:func:`~lightning_dml.miners.pairs.positive_index`)."""
    a, r, n = keep.nonzero(as_tuple=True)
    return a, index[a, r], n


class Miner(nn.Module):
    """Base class of the miners: ``forward(embeddings, labels, ref_emb=None, ref_labels=None) -> indices tuple``.

    Subclasses implement :meth:`mine` and declare:

    * ``output``: ``"pairs"`` (``(a1, p, a2, n)``) or ``"triplets"`` (``(a, p, n)``);
    * ``per_anchor``: True when an anchor's tuples depend on its own row of ``S`` alone (then, under
      ``DMLModule(gather_distributed=True)``, each process may mine its own anchors against the gathered batch;
      otherwise the whole gathered batch is mined on every process: :mod:`lightning_dml.miners.mined_loss`);
    * ``random``: True when it samples (a ``seed`` option makes it repeatable).
    """

    output: str = "pairs"
    per_anchor: bool = True
    random: bool = False

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_emb: Tensor | None = None,
        ref_labels: Tensor | None = None,
    ) -> tuple[Tensor, ...]:
        where = type(self).__name__
        batch = mining_batch(embeddings, labels, ref_emb, ref_labels, where)
        with torch.no_grad():
            out = self.mine(batch)
        return tuple(t.long() for t in out)

    def mine(self, batch: MiningBatch) -> tuple[Tensor, ...]:
        """The indices tuple of ``batch`` (no gradient is recorded)."""
        raise NotImplementedError

    def generator(self, device: torch.device) -> torch.Generator | None:
        """A random miner's generator on ``device``, seeded once with its ``seed`` (``None`` without a seed: torch's
        global generator)."""
        seed = getattr(self, "seed", None)
        if seed is None:
            return None
        generators = self.__dict__.setdefault("_generators", {})
        if device not in generators:
            generators[device] = torch.Generator(device=device).manual_seed(int(seed))
        return generators[device]


def mining_batch(
    embeddings: Tensor,
    labels: Tensor,
    ref_emb: Tensor | None,
    ref_labels: Tensor | None,
    where: str,
) -> MiningBatch:
    """Validate a miner call (``ValueError`` naming the problem) and build its :class:`MiningBatch` (fp32, fp64
    stays fp64; autocast off; no gradient)."""
    _check_call(embeddings, labels, ref_emb, ref_labels, where)
    with torch.no_grad(), torch.autocast(device_type=embeddings.device.type, enabled=False):
        x = embeddings.detach()
        x = x if x.dtype == torch.float64 else x.float()
        anchors = l2_normalize(x, dim=1, eps=1e-12)
        if ref_emb is None:
            gallery, gallery_labels = anchors, labels
        else:
            r = ref_emb.detach()
            r = r if r.dtype == torch.float64 else r.float()
            gallery = torch.cat([anchors, l2_normalize(r, dim=1, eps=1e-12)])
            gallery_labels = cat_labels(labels, ref_labels)
        sim = (anchors @ gallery.T).clamp(-1.0, 1.0)
        dist = torch.sqrt(torch.clamp(2.0 - 2.0 * sim, min=_DIST_EPS))
        pos, neg = label_masks(labels, gallery_labels)
    return MiningBatch(anchors, gallery, sim, dist, pos, neg, labels, gallery_labels)


def _check_call(
    embeddings: Tensor, labels: Tensor, ref_emb: Tensor | None, ref_labels: Tensor | None, where: str
) -> None:
    from lightning_dml.losses.base import check_label_sets  # late: lightning_dml.losses imports this package

    check_embeddings(embeddings, "embeddings", where=where)
    check_label_sets(labels, embeddings.shape[0], "labels", where=where)
    check_same_device(labels, embeddings, "labels", where=where)
    check_finite(embeddings, "embeddings", where=where)
    if (ref_emb is None) != (ref_labels is None):
        raise ValueError(f"{where}: ref_emb and ref_labels must be given together")
    if ref_emb is None:
        return
    check_embeddings(ref_emb, "ref_emb", where=where, allow_empty=True)
    check_label_sets(ref_labels, ref_emb.shape[0], "ref_labels", of="ref_emb", where=where)
    if ref_emb.shape[1] != embeddings.shape[1]:
        raise ValueError(f"{where}: ref_emb has dim {ref_emb.shape[1]} but embeddings have dim {embeddings.shape[1]}")
    check_same_device(ref_emb, embeddings, "ref_emb", where=where)
    check_same_device(ref_labels, embeddings, "ref_labels", where=where)
    check_finite(ref_emb, "ref_emb", where=where)
