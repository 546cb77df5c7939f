"""pytorch-metric-learning's reducers: a loss's per-element terms -> one scalar (pml 2.9 ``reducers``).

A reducer takes the unreduced terms of a loss, ``losses [M]``, with what each term belongs to (pml's
``loss_dict`` entry): ``kind`` ``"element"`` (one term per embedding, ``indices`` their rows), ``"pos_pair"`` /
``"neg_pair"`` (``indices = (anchors, others)``), ``"triplet"`` (``indices = (anchors, positives, negatives)``), or
``"already_reduced"`` (a scalar, returned as it is), and the batch's ``labels``::

    reducer(losses, kind="pos_pair", indices=(anchors, positives), labels=labels)

================================  =================================================================================
``MeanReducer()``                 the mean of the terms
``SumReducer()``                  their sum
``ThresholdReducer(low, high)``   the mean of the terms with ``low < term < high`` (either bound may be left out)
``AvgNonZeroReducer()``           ``ThresholdReducer(low=0)``: the mean of the positive terms
``ClassWeightedReducer(weights)`` the mean of ``term * weights[label of its anchor]``
``PerAnchorReducer(reducer)``     pairs: each anchor's mean over its pairs (0 for an anchor without pairs), then
                                  ``reducer`` (a ``MeanReducer`` by default) over the ``B`` anchors; elements:
                                  ``reducer`` on the terms; triplets are refused (as in pml)
================================  =================================================================================

Each equals pml's reducer on the same terms (tests/test_reducers.py), with two deliberate differences: no terms at
all give 0 (pml's mean of an empty tensor is NaN), and a pair given twice counts twice in
:class:`PerAnchorReducer` (pml writes both into one cell of a ``B x B`` matrix and keeps one). The means and the
sum divide by :func:`~lightning_dml.losses.base.batch_normaliser` of their count, the divisor the library's own
reductions use (``max(count, 1)`` in one process; all-reduced inside
:func:`~lightning_dml.losses.base.global_reduction`). The losses that take a ``reducer``
(:class:`~lightning_dml.losses.SupConLoss`, :class:`~lightning_dml.losses.NCALoss`,
:class:`~lightning_dml.losses.ContrastiveLoss`, :class:`~lightning_dml.losses.TripletLoss`) with one equal one
process holding the global batch under ``gather_distributed`` (``tests/distributed/run_gather_loss.py``).
"""

from __future__ import annotations

import difflib
from collections.abc import Sequence
from typing import Any, Callable, TypeVar

import torch
from torch import Tensor, nn

from lightning_dml.errors import UserInputError
from lightning_dml.losses.base import batch_normaliser

__all__ = [
    "KINDS",
    "REDUCERS",
    "AvgNonZeroReducer",
    "ClassWeightedReducer",
    "MeanReducer",
    "PerAnchorReducer",
    "Reducer",
    "SumReducer",
    "ThresholdReducer",
    "UnknownReducerError",
    "build_reducer",
]

#: pml's reduction types
KINDS = ("element", "pos_pair", "neg_pair", "triplet", "already_reduced")

_INDEX_COUNT = {"pos_pair": 2, "neg_pair": 2, "triplet": 3}

Indices = Tensor | Sequence[Tensor] | None


class UnknownReducerError(UserInputError, ValueError):
    """A reducer name that is not registered: one line with the valid names and the closest ones."""


REDUCERS: dict[str, type[nn.Module]] = {}

T = TypeVar("T", bound=type[nn.Module])


def _register(name: str) -> Callable[[T], T]:
    def deco(cls: T) -> T:
        REDUCERS[name] = cls
        return cls

    return deco


def build_reducer(name: str, **init_args: Any) -> nn.Module:
    """The reducer registered as ``name`` built with ``init_args``; an unknown name raises
    :class:`UnknownReducerError` listing the valid names."""
    if name not in REDUCERS:
        closest = difflib.get_close_matches(str(name), sorted(REDUCERS), n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(repr(c) for c in closest)}?" if closest else ""
        raise UnknownReducerError(f"unknown reducer {name!r}; valid names: {', '.join(sorted(REDUCERS))}.{hint}")
    return REDUCERS[name](**init_args)


def _anchor_rows(kind: str, indices: Indices, count: int) -> Tensor:
    """The row (anchor) each term belongs to."""
    if kind == "element":
        return torch.as_tensor(indices) if indices is not None else torch.arange(count)
    return indices[0]


def _check(losses: Tensor, kind: str, indices: Indices) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if kind == "already_reduced":
        if losses.numel() != 1:
            raise ValueError(f"already_reduced losses must hold one value, got shape {tuple(losses.shape)}")
        return
    if losses.ndim != 1:
        raise ValueError(f"{kind} losses must be one-dimensional, got shape {tuple(losses.shape)}")
    if kind == "element":
        if indices is not None and torch.as_tensor(indices).shape != losses.shape:
            raise ValueError(f"element indices must have the losses' shape {tuple(losses.shape)}")
        return
    expected = _INDEX_COUNT[kind]
    if indices is None or isinstance(indices, Tensor) or len(indices) != expected:
        raise ValueError(f"{kind} losses need a tuple of {expected} index tensors")
    if any(index.shape != losses.shape for index in indices):
        raise ValueError(f"each of the {kind} index tensors must have the losses' shape {tuple(losses.shape)}")


def _mean(losses: Tensor) -> Tensor:
    """``sum / max(count, 1)`` with the count's batch-wide normaliser (0 for no terms)."""
    return losses.sum() / batch_normaliser(losses.numel(), losses)


class Reducer(nn.Module):
    """Base class: validates the terms, returns ``already_reduced`` ones as they are, and calls :meth:`reduce`."""

    def forward(
        self,
        losses: Tensor,
        kind: str = "element",
        indices: Indices = None,
        labels: Tensor | None = None,
        batch_size: int | None = None,
    ) -> Tensor:
        """Args:
            losses: the terms, ``[M]``.
            kind: what they are (module docstring).
            indices: ``[M]`` rows (elements, default ``0 .. M - 1``), or the tuple of index tensors of the pairs or
                triplets.
            labels: the batch's labels (:class:`ClassWeightedReducer`).
            batch_size: the number of anchors ``B`` (:class:`PerAnchorReducer`; default: the largest anchor + 1,
                or the labels' length).
        """
        _check(losses, kind, indices)
        if kind == "already_reduced":
            return losses.reshape(())
        return self.reduce(losses, kind, indices, labels, batch_size)

    def reduce(self, losses: Tensor, kind: str, indices: Indices, labels: Tensor | None,
               batch_size: int | None) -> Tensor:
        raise NotImplementedError


@_register("mean")
class MeanReducer(Reducer):
    """The mean of the terms (pml ``MeanReducer``; pml's default)."""

    def reduce(self, losses: Tensor, kind: str, indices: Indices, labels: Tensor | None,
               batch_size: int | None) -> Tensor:
        return _mean(losses)


@_register("sum")
class SumReducer(Reducer):
    """The sum of the terms (pml ``SumReducer``)."""

    def reduce(self, losses: Tensor, kind: str, indices: Indices, labels: Tensor | None,
               batch_size: int | None) -> Tensor:
        return losses.sum() / batch_normaliser(None, losses)


@_register("threshold")
class ThresholdReducer(Reducer):
    """The mean of the terms strictly between ``low`` and ``high`` (pml ``ThresholdReducer``; 0 when none is)."""

    def __init__(self, low: float | None = None, high: float | None = None) -> None:
        super().__init__()
        if low is None and high is None:
            raise ValueError("ThresholdReducer needs low or high (or both)")
        if low is not None and high is not None and not low < high:
            raise ValueError(f"ThresholdReducer needs low < high, got low={low}, high={high}")
        self.low = None if low is None else float(low)
        self.high = None if high is None else float(high)

    def extra_repr(self) -> str:
        return f"low={self.low}, high={self.high}"

    def reduce(self, losses: Tensor, kind: str, indices: Indices, labels: Tensor | None,
               batch_size: int | None) -> Tensor:
        keep = torch.ones_like(losses, dtype=torch.bool)
        if self.low is not None:
            keep &= losses > self.low
        if self.high is not None:
            keep &= losses < self.high
        return torch.where(keep, losses, torch.zeros_like(losses)).sum() / batch_normaliser(keep.sum(), losses)


@_register("avg_non_zero")
class AvgNonZeroReducer(ThresholdReducer):
    """The mean of the positive terms (pml ``AvgNonZeroReducer``: ``ThresholdReducer(low=0)``)."""

    def __init__(self) -> None:
        super().__init__(low=0)


@_register("class_weighted")
class ClassWeightedReducer(Reducer):
    """The mean of ``term * weights[labels[anchor]]`` (pml ``ClassWeightedReducer``; pairs and triplets weighted
    by their anchor's class).

    Args:
        weights: one weight per class (labels index it), a list or a 1-D tensor.
    """

    def __init__(self, weights: Sequence[float] | Tensor) -> None:
        super().__init__()
        weights = torch.as_tensor(weights, dtype=torch.float64).detach()
        if weights.ndim != 1 or weights.numel() == 0 or not bool(torch.isfinite(weights).all()):
            raise ValueError("ClassWeightedReducer needs a non-empty 1-D list of finite weights, one per class")
        self.register_buffer("weights", weights)

    def reduce(self, losses: Tensor, kind: str, indices: Indices, labels: Tensor | None,
               batch_size: int | None) -> Tensor:
        if labels is None:
            raise ValueError("ClassWeightedReducer needs the batch's labels")
        if labels.ndim != 1:
            raise ValueError(
                f"ClassWeightedReducer needs one label per item, got labels of shape {tuple(labels.shape)}"
            )
        classes = labels[_anchor_rows(kind, indices, losses.numel()).to(labels.device)]
        if classes.numel() and (int(classes.min()) < 0 or int(classes.max()) >= self.weights.numel()):
            raise ValueError(
                f"ClassWeightedReducer has {self.weights.numel()} class weights; a label outside 0 .. "
                f"{self.weights.numel() - 1} has none"
            )
        return _mean(losses * self.weights.to(losses)[classes])


@_register("per_anchor")
class PerAnchorReducer(Reducer):
    """Each anchor's mean over its pairs, then ``reducer`` over the anchors (pml ``PerAnchorReducer``).

    Args:
        reducer: the reduction over the ``B`` per-anchor values (a reducer, or a registry name); default
            :class:`MeanReducer`. Anchors without pairs count as 0.
    """

    def __init__(self, reducer: Reducer | str | None = None) -> None:
        super().__init__()
        if isinstance(reducer, str):
            reducer = build_reducer(reducer)
        self.reducer = MeanReducer() if reducer is None else reducer

    def reduce(self, losses: Tensor, kind: str, indices: Indices, labels: Tensor | None,
               batch_size: int | None) -> Tensor:
        if kind == "element":
            return self.reducer(losses, "element", indices, labels, batch_size)
        if kind == "triplet":
            raise ValueError("PerAnchorReducer does not reduce triplets (as pml's)")
        anchors = indices[0].to(losses.device)
        if batch_size is None:
            batch_size = labels.shape[0] if labels is not None else int(anchors.max()) + 1 if anchors.numel() else 0
        sums = torch.zeros(batch_size, dtype=losses.dtype, device=losses.device).index_add(0, anchors, losses)
        counts = torch.zeros(batch_size, dtype=losses.dtype, device=losses.device).index_add(
            0, anchors, torch.ones_like(losses)
        )
        per_anchor = sums / counts.clamp(min=1)
        rows = torch.arange(batch_size, device=losses.device)
        return self.reducer(per_anchor, "element", rows, labels, batch_size)
