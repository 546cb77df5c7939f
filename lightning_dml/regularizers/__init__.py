"""Regularizers: label-free penalties of the embeddings or of a loss's class weights (issue 29, pml 2.9's
``regularizers`` and pml 3.0's ``SphericalEmbeddingRegularizer``), and the weighted terms of
:class:`~lightning_dml.module.DMLModule` (``regularizers=[...]``, ``docs/regularizers.md``).

``REGULARIZERS`` maps a registry name to its class; ``build_regularizer(name, **init_args)`` builds one; every
regularizer is called as ``regularizer(x [N, D])`` and returns a scalar.
"""

from lightning_dml.regularizers.base import (
    REGULARIZERS,
    Regularizer,
    UnknownRegularizerError,
    build_regularizer,
    register_regularizer,
)
from lightning_dml.regularizers.class_weights import RegularFaceRegularizer, SparseCentersRegularizer
from lightning_dml.regularizers.norm_spread import CenterInvariantRegularizer, SphericalEmbeddingRegularizer
from lightning_dml.regularizers.norms import LpRegularizer, ZeroMeanRegularizer
from lightning_dml.regularizers.terms import TARGETS, RegularizationTerms, RegularizerSpecError

__all__ = [
    "REGULARIZERS",
    "TARGETS",
    "CenterInvariantRegularizer",
    "LpRegularizer",
    "RegularFaceRegularizer",
    "RegularizationTerms",
    "Regularizer",
    "RegularizerSpecError",
    "SparseCentersRegularizer",
    "SphericalEmbeddingRegularizer",
    "UnknownRegularizerError",
    "ZeroMeanRegularizer",
    "build_regularizer",
    "register_regularizer",
]
