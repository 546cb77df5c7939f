"""The fair-comparison protocol of Musgrave et al. (ECCV 2020): class-disjoint cross-validation folds, the
``lightning-dml cv`` command (k folds x repeats, test evaluation with confidence intervals) in
:mod:`lightning_dml.protocol.cv`, the ``lightning-dml sweep`` command (optuna search on the mean validation MAP@R
over the folds) in :mod:`lightning_dml.protocol.sweep`, the budget both share in
:mod:`lightning_dml.protocol.budget`, and how both run their fits (each with DDP processes of its own, one W&B run
per fit) in :mod:`lightning_dml.protocol.launch`. See docs/protocol.md."""

from lightning_dml.protocol.folds import class_folds

__all__ = ["class_folds"]
