"""Registry of the pair losses: ``LOSSES`` (name -> class) and :func:`build_loss`."""

from __future__ import annotations

from typing import Any, Callable, Dict, Type, TypeVar

from torch import nn

__all__ = ["LOSSES", "register_loss", "build_loss"]

LOSSES: Dict[str, Type[nn.Module]] = {}

T = TypeVar("T", bound=Type[nn.Module])


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
