"""Registry of the losses: ``LOSSES`` (name -> class) and :func:`build_loss`.

Every loss registers itself where it is defined, with the class decorator ``@register_loss("name")`` (as timm's
``register_model``), and declares what it needs and supports as class attributes (``needs_positive_pairs``,
``supports_ref``, ``has_parameters``, ``needs_num_classes``, ``needs_embedding_dim``, ``required_sampler``,
``gather_mode``: see :class:`~lightning_dml.losses.base.PairLoss`).
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

from torch import nn

__all__ = ["LOSSES", "register_loss", "build_loss"]

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
    """Build the loss registered as ``name`` with ``hparams``; an unknown name raises ``ValueError``."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid names: {', '.join(sorted(LOSSES))}")
    return LOSSES[name](**hparams)
