"""Embedding heads: map pooled backbone features to the embedding space."""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn


class LinearEmbedding(nn.Module):
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
