"""Shared base of the pair losses whose only hyper-parameter is a softmax temperature (SupCon, NT-Xent, Smooth-AP)."""

from __future__ import annotations

from lightning_dml.losses.base import PairLoss

__all__ = ["TemperaturePairLoss"]


class TemperaturePairLoss(PairLoss):
    """A :class:`PairLoss` with a validated ``temperature > 0`` (subclasses set its default in their signature)."""

    def __init__(self, temperature: float) -> None:
        super().__init__()
        if not temperature > 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)

    def extra_repr(self) -> str:
        return f"temperature={self.temperature}"
