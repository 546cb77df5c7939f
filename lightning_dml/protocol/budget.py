"""The budget of a comparison, read from one YAML file that ``lightning-dml sweep`` and ``lightning-dml cv`` both
take (``--budget``), so every method of a comparison is tuned and evaluated with the same budget by construction::

    trials: 20     # sweep: trials of the study (complete, pruned or diverged)
    steps: 500     # training steps of every fit (trainer.max_steps), in the sweep and in cv
    folds: 4       # class-disjoint folds, in the sweep and in cv
    repeats: 3     # cv: repetitions with different seeds
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass

import yaml

from lightning_dml.errors import UserInputError


class ProtocolError(UserInputError, ValueError):
    """A wrong ``cv``/``sweep`` invocation, budget, search space or run folder (printed without traceback by the
    CLI)."""


@dataclass(frozen=True)
class Budget:
    """The budget of one comparison (see the module docstring); every value >= 1, ``folds`` >= 2."""

    trials: int = 20
    steps: int = 500
    folds: int = 4
    repeats: int = 1

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            low = 2 if name == "folds" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ProtocolError(f"budget: {name} must be an integer >= {low}, got {value!r}")

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


def load_budget(path: str | os.PathLike) -> Budget:
    """The :class:`Budget` of a YAML file (unknown keys are an error naming them)."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml.safe_load(handle) or {}
    except OSError as error:
        raise ProtocolError(f"budget file {path}: {error.strerror or error}") from None
    if not isinstance(data, dict):
        raise ProtocolError(f"budget file {path}: expected a mapping of trials/steps/folds/repeats")
    unknown = sorted(set(data) - set(Budget.__dataclass_fields__))
    if unknown:
        raise ProtocolError(f"budget file {path}: unknown keys {unknown} (known: trials, steps, folds, repeats)")
    try:
        return Budget(**data)
    except ProtocolError as error:
        raise ProtocolError(f"budget file {path}: {error}") from None


__all__ = ["Budget", "ProtocolError", "load_budget"]
