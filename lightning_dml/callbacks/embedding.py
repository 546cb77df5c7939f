"""Embedding a loader with a model in eval mode, without gradient, restoring the model's mode afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

__all__ = ["embed_loader"]


def _device_of(model: Any) -> torch.device:
    if isinstance(model, torch.nn.Module):
        for tensor in (*model.parameters(), *model.buffers()):
            return tensor.device
    return torch.device("cpu")


@torch.no_grad()
def embed_loader(
    model: torch.nn.Module | Callable[[Tensor], Tensor], loader: Iterable[Any], device: torch.device | None = None
) -> tuple[Tensor, list[Tensor]]:
    """Embed every batch of ``loader`` with ``model`` in eval mode, without gradient; the mode is restored after.

    Args:
        model: a module (switched to eval mode for the pass, then back to its previous mode, also on an error)
            or any callable mapping images to embeddings.
        loader: yields image tensors, or sequences ``(images, *rest)`` such as the data modules' ``(image,
            label, index[, is_query, is_gallery])`` batches.
        device: where the images go (the module's device when None; CPU for a plain callable).

    Returns:
        ``(embeddings, rest)``: the float32 ``[N, D]`` embeddings on ``device`` (``[0, 0]`` when the loader is
        empty), and the other batch elements, each concatenated over the batches as the loader yielded them
        (``rest[0]`` the labels, ``rest[1]`` the indices of an evaluation batch; empty when the loader is empty).
    """
    device = _device_of(model) if device is None else device
    is_module = isinstance(model, torch.nn.Module)
    was_training = is_module and model.training
    if is_module:
        model.eval()
    rows: list[Tensor] = []
    others: list[tuple[Tensor, ...]] = []
    try:
        for batch in loader:
            images, rest = (batch, ()) if isinstance(batch, Tensor) else (batch[0], tuple(batch[1:]))
            rows.append(model(images.to(device)).float())
            others.append(rest)
    finally:
        if is_module:
            model.train(was_training)
    if not rows:
        return torch.zeros(0, 0, device=device), []
    return torch.cat(rows), [torch.cat([torch.as_tensor(o[i]) for o in others]) for i in range(len(others[0]))]
