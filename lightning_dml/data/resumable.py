"""A training DataLoader that Lightning can resume mid-epoch.

Lightning (``FitLoop.on_save_checkpoint`` / ``_load_combined_loader_states``) stores the state of a training
loader only when the loader itself implements ``state_dict()`` / ``load_state_dict()``; a plain
``torch.utils.data.DataLoader`` restarts the interrupted epoch from its first batch, so a run resumed from a
mid-epoch checkpoint sees different batches than an uninterrupted one. :class:`ResumableDataLoader` records

* the sampler's epoch, seed and augmentation seed (batches and their augmentation seeds depend only on them,
  see :class:`~lightning_dml.data.samplers.BalancedClassSampler`),
* how many batches of the current epoch the training loop has consumed (counted where batches leave the loader,
  in the main process, so worker prefetching does not shift the count), and
* the main process's global random number generators (``random``, NumPy, torch CPU and CUDA; the DataLoader
  draws its workers' base seed from torch's) at the moment of the checkpoint, so dropout and random tuplet
  selection continue as they would have.

On resume the sampler skips the consumed batches without loading their images, and the generators are restored
just after the new epoch iterator is created (creating it draws a worker base seed from torch's generator, which
the uninterrupted run had already done before the checkpoint).

Random augmentation with or without worker processes: the global generators of a worker process cannot be
restored (the worker that loaded batch ``b`` before the interruption is gone, and a new one starts from a fresh
state), so the augmentation of a batch must not depend on them. Each batch from
:class:`~lightning_dml.data.samplers.BalancedClassSampler` is a :class:`~lightning_dml.data.samplers.SeededBatch`
carrying a seed derived from ``(augmentation_seed, epoch, batch number)``; the loader's dataset is wrapped in a
:class:`BatchSeededDataset`, which loads each batch with Python's ``random``, NumPy's global generator and torch's
CPU generator seeded from it. A batch's augmentation is therefore the same in whichever process loads it: a run
resumed with ``num_workers > 0`` is bit-identical to an uninterrupted one, and a run with ``num_workers=2`` to one
with ``num_workers=0``.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


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


@contextmanager
def seeded_generators(seed: int) -> Iterator[None]:
    """Run the block with ``random``, NumPy's global generator and torch's CPU generator seeded with ``seed``, then
    restore their previous states (CUDA generators are not touched)."""
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed([seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF])
    torch.default_generator.manual_seed(seed)
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


class BatchSeededDataset(Dataset):
    """``dataset`` whose batches are loaded under their own augmentation seed.

    The DataLoader's fetcher hands the whole batch of indices to :meth:`__getitems__` (in whichever process loads
    the batch); when the batch carries a ``seed`` (a :class:`~lightning_dml.data.samplers.SeededBatch`), its items
    are loaded inside :func:`seeded_generators`, otherwise as usual. Other attributes (``labels``, ...) are those
    of ``dataset``.
    """

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, index: Any) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: Sequence[Any]) -> list[Any]:
        seed = getattr(indices, "seed", None)
        if seed is None:
            return self._load(indices)
        with seeded_generators(int(seed)):
            return self._load(indices)

    def _load(self, indices: Sequence[Any]) -> list[Any]:
        getitems = getattr(self.dataset, "__getitems__", None)
        return list(getitems(indices)) if getitems else [self.dataset[i] for i in indices]

    def __getattr__(self, name: str) -> Any:
        if name == "dataset":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.dataset, name)


class ResumableDataLoader(DataLoader):
    """A ``DataLoader`` over a resumable batch sampler, with ``state_dict()`` / ``load_state_dict()``.

    The batch sampler must implement ``state_dict()`` and ``load_state_dict()`` with a ``"position"`` entry (the
    number of batches of its current epoch to skip), as :class:`BalancedClassSampler` does. ``dataset`` is wrapped
    in a :class:`BatchSeededDataset` (each batch's augmentation drawn from the seed it carries). Any other argument
    is passed to ``DataLoader``.
    """

    def __init__(self, dataset: Dataset, *args: Any, **kwargs: Any) -> None:
        if not isinstance(dataset, BatchSeededDataset):
            dataset = BatchSeededDataset(dataset)
        super().__init__(dataset, *args, **kwargs)
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
        iterator = super().__iter__()  # draws the worker base seed from `generator` or torch's generator
        if self._pending_rng is not None:
            _restore_rng(self._pending_rng)
            if self.generator is not None and "loader_generator" in self._pending_rng:
                self.generator.set_state(self._pending_rng["loader_generator"])
            self._pending_rng = None
        return self._count(iterator)

    def _count(self, iterator: Iterator[Any]) -> Iterator[Any]:
        for batch in iterator:
            self._yielded += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """Sampler state with the position of the next batch, plus the global RNG states (and the state of the
        loader's own ``generator`` when it has one)."""
        sampler_state = dict(self.batch_sampler.state_dict())
        sampler_state["position"] = self._start + self._yielded
        rng = _capture_rng()
        if self.generator is not None:
            rng["loader_generator"] = self.generator.get_state()
        return {"batch_sampler": sampler_state, "rng": rng}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Make the next iteration continue the saved epoch after its consumed batches, with the saved RNGs."""
        if "batch_sampler" not in state_dict:
            raise ValueError(f"not a ResumableDataLoader state: keys {sorted(state_dict)}")
        self.batch_sampler.load_state_dict(state_dict["batch_sampler"])
        self._pending_rng = state_dict.get("rng")


__all__ = ["BatchSeededDataset", "ResumableDataLoader", "seeded_generators"]
