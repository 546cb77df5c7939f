"""Registry of the miners: ``MINERS`` (name -> class) and :func:`build_miner` (``--model.miner <name>``)."""

from __future__ import annotations

import difflib
from typing import Any

from lightning_dml.errors import UserInputError
from lightning_dml.miners.angular_miner import AngularMiner
from lightning_dml.miners.base import Miner
from lightning_dml.miners.batch_easy_hard import BatchEasyHardMiner, BatchHardMiner
from lightning_dml.miners.distance_weighted_miner import DistanceWeightedMiner
from lightning_dml.miners.hdc import HDCMiner
from lightning_dml.miners.multi_similarity_miner import MultiSimilarityMiner
from lightning_dml.miners.pair_margin import PairMarginMiner
from lightning_dml.miners.triplet_margin import TripletMarginMiner
from lightning_dml.miners.uniform_histogram import UniformHistogramMiner

__all__ = ["MINERS", "UnknownMinerError", "build_miner"]

#: registry name -> miner class (pml's class name without "Miner", in snake case)
MINERS: dict[str, type[Miner]] = {
    "angular": AngularMiner,
    "batch_easy_hard": BatchEasyHardMiner,
    "batch_hard": BatchHardMiner,
    "distance_weighted": DistanceWeightedMiner,
    "hdc": HDCMiner,
    "multi_similarity": MultiSimilarityMiner,
    "pair_margin": PairMarginMiner,
    "triplet_margin": TripletMarginMiner,
    "uniform_histogram": UniformHistogramMiner,
}


class UnknownMinerError(UserInputError, ValueError):
    """A miner name that is not registered: one line with the valid names and the closest ones."""


def build_miner(name: str, **hparams: Any) -> Miner:
    """Build the miner registered as ``name``; an unknown name raises :class:`UnknownMinerError`."""
    if name not in MINERS:
        closest = difflib.get_close_matches(str(name), sorted(MINERS), n=3, cutoff=0.6)
        hint = f" Did you mean {' or '.join(repr(c) for c in closest)}?" if closest else ""
        raise UnknownMinerError(f"unknown miner {name!r}; valid names: {', '.join(sorted(MINERS))}.{hint}")
    return MINERS[name](**hparams)
