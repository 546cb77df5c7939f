"""Embedding heads: map pooled backbone features to the embedding space."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from lightning_dml.models.records import RecordsInitArgs


class LinearEmbedding(RecordsInitArgs, nn.Module):
    """A linear layer from ``in_features`` to ``embedding_dim``, optionally followed by BatchNorm or LayerNorm.

    The output is the *raw* embedding: losses and metrics L2-normalise it where their paper does (SPEC 9.2).
    The weight is Kaiming-initialised, as in the MS authors' ``linear_norm`` head.
    """

    def __init__(
        self, in_features: int, embedding_dim: int = 512, norm: Literal["none", "batch", "layer"] = "none"
    ) -> None:
        super().__init__()
        if in_features < 1 or embedding_dim < 1:
            raise ValueError(f"in_features and embedding_dim must be >= 1, got {in_features}, {embedding_dim}")
        self.fc = nn.Linear(in_features, embedding_dim)
        nn.init.kaiming_normal_(self.fc.weight, mode="fan_out")
        nn.init.zeros_(self.fc.bias)
        if norm == "batch":
            self.norm: nn.Module = nn.BatchNorm1d(embedding_dim)
        elif norm == "layer":
            self.norm = nn.LayerNorm(embedding_dim)
        elif norm == "none":
            self.norm = nn.Identity()
        else:
            raise ValueError(f"norm must be 'none', 'batch' or 'layer', got {norm!r}")
        self.embedding_dim = embedding_dim

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.norm(self.fc(features))


class MultiLevelEmbedding(RecordsInitArgs, nn.Module):
    """One :class:`LinearEmbedding` per backbone level, concatenated: multi-level feature fusion.

    RLL (Sec. 4.4) attaches a 512-d embedding to each of BN-Inception's inception-3c / 4e / 5b outputs ("L, M,
    H") and evaluates their concatenation, RLL-(L,M,H); GPW (Sec. IV, "v2") concatenates three ``d``-wide FC
    outputs of the same levels into a ``3d`` feature. Each FC follows global pooling of its level (SPEC 2.7 [I]).

    ``forward`` returns the concatenation ``[B, len(in_features) * embedding_dim]``; ``forward_levels`` returns
    the per-level embeddings (for one loss per level, as RLL trains them).

    Args:
        in_features: width of each level's pooled features (``backbone.level_features``).
        embedding_dim: width of each level's embedding.
        norm: normalisation after each level's linear layer (``"none"``, ``"batch"``, ``"layer"``).
        normalize_levels: L2-normalise each level's embedding before concatenating, so every level weighs the
            same in the fused embedding (the papers do not say; off by default, the losses normalise the fused
            vector themselves).
    """

    def __init__(
        self,
        in_features: Sequence[int],
        embedding_dim: int = 512,
        norm: Literal["none", "batch", "layer"] = "none",
        normalize_levels: bool = False,
    ) -> None:
        super().__init__()
        if len(in_features) < 1:
            raise ValueError("in_features must name at least one level width")
        self.levels = nn.ModuleList(LinearEmbedding(int(c), embedding_dim, norm) for c in in_features)
        self.normalize_levels = normalize_levels
        self.embedding_dim = embedding_dim * len(in_features)

    def forward_levels(self, features: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if len(features) != len(self.levels):
            raise ValueError(f"expected {len(self.levels)} levels of features, got {len(features)}")
        out = [head(f) for head, f in zip(self.levels, features)]
        if self.normalize_levels:
            out = [F.normalize(e, dim=1) for e in out]
        return out

    def forward(self, features: Sequence[torch.Tensor]) -> torch.Tensor:
        return torch.cat(self.forward_levels(features), dim=1)
