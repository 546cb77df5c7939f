"""Indices tuples, pytorch-metric-learning's mining output: pairs ``(a1, p, a2, n)`` or triplets ``(a, p, n)``.

A miner (:class:`lightning_dml.miners.base.Miner`) returns one; a loss that accepts ``indices_tuple``
(:class:`lightning_dml.losses.base.PairLoss`) restricts its pairs or triplets to it. Conventions:

* ``a1``, ``a2``, ``a`` are rows of the batch (``0 .. B-1``);
* ``p``, ``n`` are columns of the gallery the loss scores against: the batch itself (``0 .. B-1``), followed by the
  ``M`` reference items when ``ref_embeddings`` are given (``B .. B+M-1``), as everywhere in this library
  (pml's miners index ``ref_emb`` alone instead; without references the two agree);
* ``(a1, p)`` must be positive pairs and ``(a2, n)`` negative pairs by the labels
  (:mod:`lightning_dml.miners.pairs`, label sets included): a listed pair that is not is refused by name.

Losses see the tuple as boolean ``B x N`` masks (:func:`pair_masks`), so a pair listed twice counts once; a
triplet tuple given to a pair loss becomes its pairs ``(a, p)`` and ``(a, n)`` (pml's ``convert_to_pairs``), a pair
tuple given to a triplet loss every triplet ``(a, p, n)`` of a mined positive and a mined negative of the same
anchor (pml's ``convert_to_triplets``).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["check_indices_tuple", "pair_masks", "to_pairs", "restrict_masks"]


def check_indices_tuple(
    indices_tuple: object, num_anchors: int, num_gallery: int, device: torch.device, where: str | None = None
) -> tuple[Tensor, ...]:
    """``indices_tuple`` as a tuple of 3 or 4 integer ``[T]`` tensors on ``device`` whose anchors lie in
    ``0 .. num_anchors-1`` and others in ``0 .. num_gallery-1``; ``ValueError`` naming what is wrong (one host
    read for the ranges)."""
    prefix = f"{where}: " if where else ""
    if not isinstance(indices_tuple, (tuple, list)) or len(indices_tuple) not in (3, 4):
        raise ValueError(
            f"{prefix}indices_tuple must be pairs (a1, p, a2, n) or triplets (a, p, n) of index tensors, got "
            f"{type(indices_tuple).__name__}"
            + (f" of length {len(indices_tuple)}" if isinstance(indices_tuple, (tuple, list)) else "")
        )
    names = ("a1", "p", "a2", "n") if len(indices_tuple) == 4 else ("a", "p", "n")
    for name, t in zip(names, indices_tuple):
        if not isinstance(t, Tensor) or t.ndim != 1 or t.dtype.is_floating_point or t.dtype == torch.bool:
            got = f"{t.dtype} tensor of shape {list(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
            raise ValueError(f"{prefix}indices_tuple's {name} must be a 1-D integer tensor, got {got}")
        if t.device != device:
            raise ValueError(f"{prefix}indices_tuple's {name} is on {t.device} but the embeddings are on {device}")
    groups = [(0, 1)] if len(indices_tuple) == 3 else [(0, 1), (2, 3)]
    if len(indices_tuple) == 3 and not len(indices_tuple[0]) == len(indices_tuple[1]) == len(indices_tuple[2]):
        raise ValueError(f"{prefix}indices_tuple's a, p, n have different lengths {[len(t) for t in indices_tuple]}")
    for i, j in groups:
        if len(indices_tuple[i]) != len(indices_tuple[j]):
            raise ValueError(
                f"{prefix}indices_tuple's {names[i]} and {names[j]} have different lengths "
                f"{len(indices_tuple[i])} and {len(indices_tuple[j])}"
            )
    tensors = tuple(t.long() for t in indices_tuple)
    anchors = torch.cat([tensors[0], tensors[2]] if len(tensors) == 4 else [tensors[0]])
    others = torch.cat([tensors[1], tensors[-1]])
    if anchors.numel() or others.numel():
        lows = torch.stack([anchors.min() if anchors.numel() else anchors.new_zeros(()),
                            others.min() if others.numel() else others.new_zeros(())])
        highs = torch.stack([anchors.max() if anchors.numel() else anchors.new_zeros(()),
                             others.max() if others.numel() else others.new_zeros(())])
        lo_a, lo_o, hi_a, hi_o = torch.cat([lows, highs]).tolist()
        if lo_a < 0 or hi_a >= num_anchors:
            raise ValueError(
                f"{prefix}indices_tuple's anchors must be batch rows 0..{num_anchors - 1}, "
                f"found {lo_a if lo_a < 0 else hi_a}"
            )
        if lo_o < 0 or hi_o >= num_gallery:
            raise ValueError(
                f"{prefix}indices_tuple's positives/negatives must be gallery columns 0..{num_gallery - 1} (the batch, "
                f"then the references), found {lo_o if lo_o < 0 else hi_o}"
            )
    return tensors


def to_pairs(indices_tuple: tuple[Tensor, ...]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Pairs ``(a1, p, a2, n)``: a triplet tuple ``(a, p, n)`` gives ``(a, p, a, n)`` (pml's ``convert_to_pairs``)."""
    if len(indices_tuple) == 4:
        return indices_tuple  # type: ignore[return-value]
    a, p, n = indices_tuple
    return a, p, a, n


def pair_masks(indices_tuple: tuple[Tensor, ...], num_anchors: int, num_gallery: int) -> tuple[Tensor, Tensor]:
    """``B x N`` boolean masks of the tuple's positive pairs ``(a1, p)`` and negative pairs ``(a2, n)``."""
    a1, p, a2, n = to_pairs(indices_tuple)
    pos = torch.zeros(num_anchors, num_gallery, dtype=torch.bool, device=a1.device)
    neg = torch.zeros_like(pos)
    pos[a1, p] = True
    neg[a2, n] = True
    return pos, neg


def restrict_masks(
    indices_tuple: tuple[Tensor, ...], pos: Tensor, neg: Tensor, where: str | None = None
) -> tuple[Tensor, Tensor]:
    """The label masks ``pos``, ``neg`` restricted to the tuple's pairs; ``ValueError`` when the tuple lists a pair
    as positive (negative) that the labels do not make positive (negative), e.g. a self-pair (one host read)."""
    mined_pos, mined_neg = pair_masks(indices_tuple, pos.shape[0], pos.shape[1])
    bad_pos, bad_neg = mined_pos & ~pos, mined_neg & ~neg
    flags = torch.stack([bad_pos.any(), bad_neg.any()]).tolist()
    if any(flags):
        kind, bad = ("positive", bad_pos) if flags[0] else ("negative", bad_neg)
        i, j = (int(v) for v in bad.nonzero()[0])
        prefix = f"{where}: " if where else ""
        raise ValueError(
            f"{prefix}indices_tuple lists ({i}, {j}) as a {kind} pair but by the labels it is not one "
            "(a self-pair, or labels that differ from the ones the miner saw)"
        )
    return mined_pos, mined_neg
