"""Base class and registry of the regularizers: ``REGULARIZERS`` (name -> class) and :func:`build_regularizer`.

A regularizer maps one matrix ``x [N, D]`` (a batch of embeddings, or a loss's class weights / proxies, one row per
weight vector) to a scalar penalty that needs no labels: pytorch-metric-learning's ``BaseRegularizer`` contract
(pml 2.9 ``regularizers``). Each subclass gives the per-row penalties (:meth:`Regularizer.per_row`) and reduces them
as pml's default reducer does (the mean; SparseCenters divides a sum by its own divisor). Values are computed in
fp32 from fp16 / bf16 inputs, with autocast disabled (as the losses), and in fp64 from fp64 inputs (the exactness
tests).
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, TypeVar

import torch
from torch import Tensor, nn

from lightning_dml.errors import UserInputError
from lightning_dml.losses.base import upcast

__all__ = ["REGULARIZERS", "Regularizer", "UnknownRegularizerError", "build_regularizer", "register_regularizer"]


class UnknownRegularizerError(UserInputError, ValueError):
    """A regularizer name that is not registered: one line with the valid names and the closest ones."""


REGULARIZERS: dict[str, type[nn.Module]] = {}

T = TypeVar("T", bound=type[nn.Module])


def register_regularizer(name: str) -> Callable[[T], T]:
    """Class decorator adding a regularizer to :data:`REGULARIZERS` under ``name``."""

    def deco(cls: T) -> T:
        if name in REGULARIZERS and REGULARIZERS[name] is not cls:
            raise ValueError(f"regularizer name {name!r} is already registered to {REGULARIZERS[name].__name__}")
        REGULARIZERS[name] = cls
        cls.registry_name = name
        return cls

    return deco


def build_regularizer(name: str, **hparams: Any) -> nn.Module:
    """Build the regularizer registered as ``name`` with ``hparams``; an unknown name raises
    :class:`UnknownRegularizerError` listing the valid names and the closest ones."""
    if name not in REGULARIZERS:
        closest = difflib.get_close_matches(str(name), sorted(REGULARIZERS), n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(repr(c) for c in closest)}?" if closest else ""
        raise UnknownRegularizerError(
            f"unknown regularizer {name!r}; valid names: {', '.join(sorted(REGULARIZERS))}.{hint}"
        )
    return REGULARIZERS[name](**hparams)


class Regularizer(nn.Module):
    """A label-free penalty of a matrix ``x [N, D]``: the mean of :meth:`per_row` (pml's ``MeanReducer``).

    Class attributes read by :class:`~lightning_dml.regularizers.terms.RegularizationTerms`:
    ``default_target`` (``"embeddings"`` or ``"loss_weights"``: what the paper regularises; either may be chosen)
    and ``stateful`` (whether a call updates a running statistic).
    """

    #: the registry name (set by :func:`register_regularizer`)
    registry_name: str = ""
    #: what the paper applies the regularizer to
    default_target: str = "embeddings"
    #: whether calling the regularizer updates a running statistic
    stateful: bool = False

    def per_row(self, x: Tensor) -> Tensor:
        """The penalty of each row, ``[N]``."""
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        if x.ndim != 2 or x.shape[0] == 0:
            raise ValueError(f"{type(self).__name__} takes a non-empty [N, D] matrix, got shape {tuple(x.shape)}")
        with torch.autocast(device_type=x.device.type, enabled=False):  # fp32 under mixed precision, as the losses
            return torch.mean(self.per_row(upcast(x)))
