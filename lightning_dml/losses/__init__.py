"""Pair losses of the five papers (SPEC sections 2-6), built on :mod:`lightning_dml.miners`.

``LOSSES`` maps a registry name to its class; ``build_loss(name, **hparams)`` builds one.
"""

from lightning_dml.losses.base import PairLoss
from lightning_dml.losses.multi_similarity import MultiSimilarityLoss
from lightning_dml.losses.registry import LOSSES, build_loss, register_loss

register_loss("multi_similarity")(MultiSimilarityLoss)

__all__ = ["LOSSES", "build_loss", "register_loss", "PairLoss", "MultiSimilarityLoss"]
