"""Registry of the losses: ``LOSSES`` (name -> class) and :func:`build_loss`.

Every loss registers itself where it is defined, with the class decorator ``@register_loss("name")`` (as timm's
``register_model``), and declares what it needs and supports as class attributes (``needs_positive_pairs``,
``supports_ref``, ``has_parameters``, ``needs_num_classes``, ``needs_embedding_dim``, ``required_sampler``,
``gather_mode``: see :class:`~lightning_dml.losses.base.PairLoss`).
"""

from __future__ import annotations

import difflib
from typing import Any, Callable, TypeVar

from torch import nn

from lightning_dml.errors import UserInputError

__all__ = ["LOSSES", "UnknownLossError", "register_loss", "build_loss"]


class UnknownLossError(UserInputError, ValueError):
    """A loss name that is not registered (``--model.loss multi_similarty``): one line with the valid names and the
    closest ones."""

LOSSES: dict[str, type[nn.Module]] = {}

T = TypeVar("T", bound=type[nn.Module])


def register_loss(name: str) -> Callable[[T], T]:
    """Class decorator adding a loss to :data:`LOSSES` under ``name``."""

    def deco(cls: T) -> T:
        if name in LOSSES and LOSSES[name] is not cls:
            raise ValueError(f"loss name {name!r} is already registered to {LOSSES[name].__name__}")
        LOSSES[name] = cls
        return cls

    return deco


def build_loss(name: str, **hparams: Any) -> nn.Module:
    """Build the loss registered as ``name`` with ``hparams``; an unknown name raises :class:`UnknownLossError` (a
    ``ValueError``) listing the valid names and the closest ones (``difflib``)."""
    if name not in LOSSES:
        closest = difflib.get_close_matches(str(name), sorted(LOSSES), n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(repr(c) for c in closest)}?" if closest else ""
        raise UnknownLossError(f"unknown loss {name!r}; valid names: {', '.join(sorted(LOSSES))}.{hint}")
    return LOSSES[name](**hparams)
