"""A training DataLoader that Lightning can resume mid-epoch.

Lightning (``FitLoop.on_save_checkpoint`` / ``_load_combined_loader_states``) stores the state of a training
loader only when the loader itself implements ``state_dict()`` / ``load_state_dict()``; a plain
``torch.utils.data.DataLoader`` restarts the interrupted epoch from its first batch, so a run resumed from a
mid-epoch checkpoint sees different batches than an uninterrupted one. :class:`ResumableDataLoader` records

* the sampler's epoch and seed (batches depend only on them, see
  :class:`~lightning_dml.data.samplers.BalancedClassSampler`),
* how many batches of the current epoch the training loop has consumed (counted where batches leave the loader,
  in the main process, so worker prefetching does not shift the count), and
* the global random number generators (``random``, NumPy, torch CPU and CUDA) at the moment of the checkpoint,
  so random augmentation, dropout and random tuplet selection continue as they would have.

On resume the sampler skips the consumed batches without loading their images, and the generators are restored
just after the new epoch iterator is created (creating it draws a worker base seed from torch's generator, which
the uninterrupted run had already done before the checkpoint).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader


def _capture_rng() -> dict[str, Any]:
    """The global generators' states as plain Python values and tensors (``torch.load(weights_only=True)`` safe)."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _restore_rng(state: dict[str, Any]) -> None:
    random.setstate(state["python"])
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a resumable batch sampler, with ``state_dict()`` / ``load_state_dict()``.

    The batch sampler must implement ``state_dict()`` and ``load_state_dict()`` with a ``"position"`` entry (the
    number of batches of its current epoch to skip), as :class:`BalancedClassSampler` does. Any other argument is
    passed to ``DataLoader``.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not (hasattr(self.batch_sampler, "state_dict") and hasattr(self.batch_sampler, "load_state_dict")):
            raise ValueError(
                f"ResumableDataLoader needs a batch sampler with state_dict()/load_state_dict(), "
                f"got {type(self.batch_sampler).__name__}"
            )
        self._start = 0  # batches of the current epoch skipped by the sampler at the start of this iteration
        self._yielded = 0  # batches handed out by the current iteration
        self._pending_rng: dict[str, Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        self._start = int(self.batch_sampler.state_dict()["position"])
        self._yielded = 0
        iterator = super().__iter__()  # draws the worker base seed from torch's generator
        if self._pending_rng is not None:
            _restore_rng(self._pending_rng)
            self._pending_rng = None
        return self._count(iterator)

    def _count(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for batch in iterator:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Sampler state with the position of the next batch, plus the global RNG states."""
        sampler_state = dict(self.batch_sampler.state_dict())
        sampler_state["position"] = self._start + self._yielded
        return {"batch_sampler": sampler_state, "rng": _capture_rng()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next iteration continue the saved epoch after its consumed batches, with the saved RNGs."""
        if "batch_sampler" not in state_dict:
            raise ValueError(f"not a ResumableDataLoader state: keys {sorted(state_dict)}")
        self.batch_sampler.load_state_dict(state_dict["batch_sampler"])
        self._pending_rng = state_dict.get("rng")


__all__ = ["ResumableDataLoader"]
