"""Checks of option combinations that cannot train, run before any work is done (and on the first batch).

Every loss of this library learns from positive pairs (two images of one class in a batch): the P x K sampler
provides them when K >= 2, the N-pair sampler by construction. A batch without any positive pair gives a zero
or meaningless loss, and a run configured that way would train for hours without learning, so it is an error.

The checks read what each loss declares as class attributes (its anatomy, see
:class:`~lightning_dml.losses.base.PairLoss`: ``needs_positive_pairs``, ``required_sampler``, ``gather_mode``),
never its class name.

Label sets (training labels ``[B, L]`` padded with -1, several labels per item) reach only the losses that declare
``supports_label_sets``; the others are rejected when fit starts (the data module says it yields label sets: its
``sampler`` is ``"label_sets"`` or its training labels are ``[N, L]``) and on the first batch, with one message
naming the loss, why, and what to use instead (:func:`lightning_dml.losses.base.label_sets_error`).
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_dml.input_checks import check_integer_labels
from lightning_dml.losses.base import label_sets_error
from lightning_dml.miners.pairs import label_masks


def _loss_name(loss: Any) -> str:
    return type(loss).__name__


def _yields_label_sets(datamodule: Any) -> bool:
    """Whether the data module's training batches hold label sets ``[B, L]`` (read without building anything)."""
    if getattr(datamodule, "sampler", None) == "label_sets":
        return True
    dataset = getattr(datamodule, "train_dataset", None)
    labels = getattr(dataset, "labels", None) if dataset is not None else None
    return getattr(labels, "ndim", 1) == 2


def check_fit_combination(loss: Any, datamodule: Any) -> None:
    """Raise ``ValueError`` when ``datamodule``'s training batches cannot give ``loss`` any positive pair, or hold
    label sets that ``loss`` cannot take.

    Reads the data module's ``samples_per_class`` (K of the P x K sampler) and ``sampler`` where it has them;
    other data modules are checked on their first batch by :func:`check_training_batch`.
    """
    if datamodule is None:
        return
    if not getattr(loss, "supports_label_sets", False) and _yields_label_sets(datamodule):
        raise label_sets_error(loss)
    views = getattr(datamodule, "views", None)
    if type(loss).__name__ == "SelfSupervisedLoss" and views is not None and int(views) < 2:
        # its labels must be item ids: class labels that happen to repeat V times would train the inner loss
        # supervised, silently
        raise ValueError(
            f"{_loss_name(loss)} needs two or more augmented views of each item, but {type(datamodule).__name__} "
            f"gives views={views}: set views: 2 (or more) on the data module"
        )
    if not getattr(loss, "needs_positive_pairs", True):
        return
    if views is not None and int(views) >= 2:
        return  # every item's other views are its positives (labels are item ids)
    k = getattr(datamodule, "samples_per_class", None)
    if k is not None and int(k) < 2:
        sampler = getattr(loss, "required_sampler", None)
        hint = f"set samples_per_class: 2 with sampler: {sampler}" if sampler else "set samples_per_class >= 2"
        raise ValueError(
            f"{_loss_name(loss)} needs positive pairs, but {type(datamodule).__name__} draws samples_per_class={k} "
            f"image per class per batch, so no batch holds two images of one class: {hint}"
        )


def check_training_batch(loss: Any, labels: torch.Tensor) -> None:
    """Raise ``ValueError`` when a training batch has no two items of the same class (no positive pair), or holds
    label sets ``[B, L]`` that the loss cannot take (a pair of label sets is positive when they intersect)."""
    sets = isinstance(labels, torch.Tensor) and labels.ndim == 2
    if sets and not getattr(loss, "supports_label_sets", False):
        raise label_sets_error(loss, tuple(labels.shape))
    if not isinstance(labels, torch.Tensor) or labels.ndim not in (1, 2):
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(
            f"training labels must be a 1-D tensor of class ids (or [B, L] label sets for a loss that takes them), "
            f"got shape {shape}"
        )
    check_integer_labels(labels, "training labels (class ids)")
    if not getattr(loss, "needs_positive_pairs", True):  # proxy losses learn from single images of a class
        return
    if sets:
        if labels.numel() and not bool(label_masks(labels)[0].any()):
            n = labels.shape[0]
            raise ValueError(
                f"{_loss_name(loss)} needs positive pairs, but no two of the {n} items of the training batch share a "
                "label (their label sets do not intersect): use sampler: label_sets with samples_per_class >= 2"
            )
        return
    if labels.numel() and torch.unique(labels).numel() == labels.numel():
        n = labels.numel()
        sampler = getattr(loss, "required_sampler", None)
        use = f"the {sampler} sampler" if sampler else "the P x K sampler with samples_per_class >= 2"
        raise ValueError(
            f"{_loss_name(loss)} needs positive pairs, but the training batch of {n} items has {n} distinct "
            f"labels (no two images of one class): use {use}"
        )


def check_gather_combination(loss: Any, gather_distributed: bool) -> None:
    """Raise ``ValueError`` naming the loss and ``gather_distributed`` when the loss declares that it cannot run
    with ``gather_distributed=True`` (``gather_mode = None``; see :mod:`lightning_dml.losses.distributed`)."""
    if not gather_distributed or getattr(loss, "gather_mode", None) is not None:
        return
    name = _loss_name(loss)
    if getattr(loss, "required_sampler", None):
        reason = (
            f"its batch structure is fixed ({loss.required_sampler} sampler), so it cannot score its batch against "
            "the other processes' embeddings"
        )
    elif not getattr(loss, "needs_positive_pairs", True):
        reason = (
            "its per-sample terms against the class proxies need no other process's batch: under DDP it already "
            "equals one process holding the global batch"
        )
    else:
        reason = "it declares gather_mode=None"
    raise ValueError(
        f"gather_distributed=True cannot be used with {name}: {reason}. Set gather_distributed: false "
        f"(DMLModule) or choose a loss that supports gathering"
    )


__all__ = ["check_fit_combination", "check_gather_combination", "check_training_batch"]
