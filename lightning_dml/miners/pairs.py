"""Which pairs are positive: labels or label sets -> pair masks and positive tables (the one place that decides).

Every loss and miner that takes labels learns which ``(anchor, gallery item)`` pairs are positive and which are
negative from this module, never by comparing labels itself. Two kinds of labels are accepted:

* **labels** ``[N]``: one class id per item; ``(i, j)`` is positive when ``y_i == y_j`` (SPEC 0.2);
* **label sets** ``[N, L]``: each row an item's labels padded with ``-1`` (``L`` the largest set; integer ids
  ``>= 0``); ``(i, j)`` is positive when the two sets intersect. An item whose set is empty (a row of ``-1``) is
  positive to nothing (it is every other item's negative). Different widths ``L`` are fine (:func:`cat_labels`
  pads), and one label per item as ``[N, 1]`` gives exactly the masks of ``[N]``.

In both cases an anchor is never its own positive nor its own negative: the gallery's first ``B`` items are the
``B`` anchors themselves and the self-pair is removed by index (SPEC 0.3 rule 3), so two copies of one item at
different indices (a sampler may draw an item twice) are a positive pair. Everything else is a negative pair.

Single labels keep their fast paths (an equality matrix, positives from the sorted labels); label sets are
compared column by column (``L x L'`` equality passes over the ``B x N`` matrix, no ``B x N x L`` tensor).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = [
    "is_label_sets",
    "as_label_sets",
    "cat_labels",
    "self_pair_mask",
    "same_label_mask",
    "label_masks",
    "negative_mask",
    "positive_table",
    "positive_pairs",
    "positive_index",
]


def is_label_sets(labels: Tensor) -> bool:
    """True for label sets ``[N, L]``, False for labels ``[N]``."""
    return labels.ndim == 2


def as_label_sets(labels: Tensor, width: int | None = None) -> Tensor:
    """Labels ``[N]`` as one-label sets ``[N, 1]``; label sets padded with ``-1`` to ``width`` columns if given."""
    sets = labels[:, None] if labels.ndim == 1 else labels
    if width is not None and sets.shape[1] < width:
        pad = sets.new_full((sets.shape[0], width - sets.shape[1]), -1)
        sets = torch.cat([sets, pad], dim=1)
    return sets


def cat_labels(*parts: Tensor) -> Tensor:
    """Concatenate the labels of several blocks of items (a batch and its references): labels ``[N_k]`` when every
    block has them, else label sets padded with ``-1`` to the widest block."""
    if all(p.ndim == 1 for p in parts):
        return torch.cat(parts)
    width = max(p.shape[1] if p.ndim == 2 else 1 for p in parts)
    return torch.cat([as_label_sets(p, width) for p in parts])


def self_pair_mask(num_anchors: int, num_gallery: int, device: torch.device | None = None) -> Tensor:
    """``B x N`` mask that is True at the self-pairs ``(i, i)``, by index (SPEC 0.3 rule 3).

    The gallery is the batch followed by reference items, so anchor ``i`` is gallery column ``i``.
    """
    rows = torch.arange(num_anchors, device=device)[:, None]
    cols = torch.arange(num_gallery, device=device)[None, :]
    return rows == cols


def same_label_mask(labels: Tensor, gallery_labels: Tensor | None = None) -> Tensor:
    """``B x N`` boolean: same label (``[B]`` / ``[N]``), or intersecting label sets (``[B, L]`` / ``[N, L']``).

    The self-pairs are not treated specially here (see :func:`label_masks`). A label set's ``-1`` padding never
    matches anything.
    """
    if gallery_labels is None:
        gallery_labels = labels
    if labels.ndim == 1 and gallery_labels.ndim == 1:
        return labels[:, None] == gallery_labels[None, :]
    a, g = as_label_sets(labels), as_label_sets(gallery_labels)
    same = torch.zeros(a.shape[0], g.shape[0], dtype=torch.bool, device=a.device)
    valid = a >= 0
    for s in range(a.shape[1]):
        hit = torch.zeros_like(same)
        for t in range(g.shape[1]):
            hit |= a[:, s, None] == g[None, :, t]
        same |= hit & valid[:, s, None]
    return same


def label_masks(labels: Tensor, gallery_labels: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Positive and negative pair masks ``Mpos``, ``Mneg`` (SPEC 0.2; label sets: module docstring).

    Args:
        labels: ``[B]`` labels or ``[B, L]`` label sets of the anchors.
        gallery_labels: ``[N]`` / ``[N, L']`` of the gallery whose first ``B`` entries are the anchors themselves.
            Defaults to ``labels`` (gallery = batch).

    Returns:
        ``(pos, neg)``, both ``B x N`` boolean: ``pos`` = same label (intersecting sets) without the self-pair
        (removed by index), ``neg`` = every other pair except the self-pair.
    """
    if gallery_labels is None:
        gallery_labels = labels
    same = same_label_mask(labels, gallery_labels)
    not_self = ~self_pair_mask(labels.shape[0], gallery_labels.shape[0], labels.device)
    if labels.ndim == 1 and gallery_labels.ndim == 1:
        return same & not_self, ~same  # a label equals itself: ~same already excludes the self-pair
    return same & not_self, ~same & not_self


def negative_mask(labels: Tensor, gallery_labels: Tensor, anchor_index: Tensor | None = None) -> Tensor:
    """``B x N`` negative-pair mask of anchors ``labels`` against ``gallery_labels``.

    ``anchor_index`` (``[B]``) gives each anchor's own gallery column, removed from its negatives (default
    ``0 .. B-1``: the anchors are the gallery's first items); only label sets need it (an empty set is not
    positive to itself, yet the self-pair is no negative).
    """
    if labels.ndim == 1 and gallery_labels.ndim == 1:
        return labels[:, None] != gallery_labels[None, :]
    if anchor_index is None:
        anchor_index = torch.arange(labels.shape[0], device=labels.device)
    cols = torch.arange(gallery_labels.shape[0], device=labels.device)
    return ~same_label_mask(labels, gallery_labels) & (anchor_index[:, None] != cols[None, :])


def positive_index(pos: Tensor) -> tuple[Tensor, Tensor]:
    """Each anchor's positives gathered into a ``[B, K_max]`` index tensor (SPEC 9.2: never a B^3 tensor).

    Returns:
        ``(index, valid)``: ``index[i, r]`` is the gallery column of the ``r``-th positive of anchor ``i``
        (0 where ``valid`` is False).
    """
    counts = pos.sum(dim=1)
    # at least one (invalid) column so that reductions over the positives never see an empty dimension
    k_max = max(int(counts.max().item()) if pos.numel() > 0 else 0, 1)
    # a stable sort puts the True columns first, in increasing index order
    order = torch.sort(pos.to(torch.uint8), dim=1, descending=True, stable=True).indices[:, :k_max]
    valid = torch.arange(k_max, device=pos.device)[None, :] < counts[:, None]
    return order.masked_fill(~valid, 0), valid


def positive_table(labels: Tensor, gallery_labels: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """``[B, K]`` tables ``(rows, cols, valid)`` of each anchor's positives.

    ``cols[i, r]`` is a positive of anchor ``i`` where ``valid[i, r]``. Labels: from the sorted labels, no
    ``B x N`` mask (``K`` the largest class count). Label sets: from :func:`label_masks` (``K`` the largest number
    of positives of an anchor, at least 1).
    """
    if gallery_labels is None:
        gallery_labels = labels
    if labels.ndim == 2 or gallery_labels.ndim == 2:
        pos, _ = label_masks(labels, gallery_labels)
        cols, valid = positive_index(pos)
        rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(cols)
        return rows, cols, valid
    sorted_g, order = torch.sort(gallery_labels, stable=True)
    start = torch.searchsorted(sorted_g, labels, right=False)
    count = torch.searchsorted(sorted_g, labels, right=True) - start
    k_max = int(count.max().item()) if labels.numel() > 0 else 0
    offs = torch.arange(k_max, device=labels.device)
    slot = start[:, None] + offs[None, :]
    valid = offs[None, :] < count[:, None]
    cols = order[slot.clamp(max=max(gallery_labels.numel() - 1, 0))]
    rows = torch.arange(labels.shape[0], device=labels.device)[:, None].expand_as(cols)
    return rows, cols, valid & (cols != rows)


def positive_pairs(labels: Tensor, gallery_labels: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """All positive pairs ``(i, j)`` (same label or intersecting sets, ``j != i`` by index) as index lists.

    Same pairs as ``label_masks(...)[0].nonzero()`` (in another order); for labels in ``O(B K_max + N log N)``
    from sorted labels, where ``K_max`` is the largest class count in the gallery, without a ``B x N`` mask.
    """
    rows, cols, valid = positive_table(labels, gallery_labels)
    return rows[valid], cols[valid]
