"""Class-disjoint cross-validation folds (Musgrave, Belongie, Lim, "A Metric Learning Reality Check", ECCV 2020,
section 4.2): the training classes are split into ``k`` folds of whole classes; fold ``i`` validates on its classes
and trains on the others, so hyper-parameters are chosen without ever looking at the test classes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def class_folds(labels: Sequence[int] | np.ndarray | torch.Tensor, num_folds: int, seed: int = 0) -> list[np.ndarray]:
    """Split the distinct classes of ``labels`` into ``num_folds`` folds of whole classes.

    The classes are shuffled by ``seed`` and dealt into folds whose sizes differ by at most one class, so every
    class is in exactly one fold (validated exactly once over the k folds). Deterministic given ``seed``: the
    folds depend only on the set of classes, ``num_folds`` and ``seed`` (not on the order or number of items).

    Returns:
        ``num_folds`` sorted int64 arrays of class ids; fold ``i`` holds the validation classes of fold ``i``.
    """
    classes = np.unique(torch.as_tensor(labels).cpu().numpy()).astype(np.int64)
    if isinstance(num_folds, bool) or not isinstance(num_folds, (int, np.integer)) or num_folds < 2:
        raise ValueError(f"class_folds: num_folds must be an integer >= 2, got {num_folds!r}")
    if len(classes) < num_folds:
        raise ValueError(
            f"class_folds: {len(classes)} classes cannot fill num_folds={num_folds} folds of whole classes"
        )
    order = np.random.default_rng([int(seed), 0xF01D]).permutation(classes)
    return [np.sort(part) for part in np.array_split(order, num_folds)]


__all__ = ["class_folds"]
