"""Weighted regularization terms of a :class:`~lightning_dml.module.DMLModule` (``regularizers=[...]``).

Each term is a plain dict (what a config holds)::

    {"regularizer": "spherical_embedding", "weight": 1.0, "target": "embeddings", "init_args": {"momentum": 1.0},
     "name": "sec"}

``regularizer``: a registry name (:data:`~lightning_dml.regularizers.REGULARIZERS`; a class of your own joins it with
:func:`~lightning_dml.regularizers.register_regularizer`), so that the terms stay plain data in a checkpoint's
hyper-parameters (a built module there would be pickled code, which the library's checkpoint reader refuses);
``weight`` (default 1): its factor in the training objective; ``target`` (default: what the paper
regularises, the regularizer's ``default_target``): ``"embeddings"`` (the training batch's raw embeddings) or
``"loss_weights"`` (the rows of the loss's ``proxies``: class weights, proxies, SoftTriple's centres; the loss must
be a :class:`~lightning_dml.losses.ProxyLoss`); ``init_args``: keyword arguments of a named regularizer; ``name``
(default: the registry name, ``_2``, ``_3`` ... for repeats): the term's name in the log, ``train/reg/<name>``.

The key is ``target``, not ``on``: YAML 1.1 (PyYAML, jsonargparse) reads a bare ``on`` as the boolean ``true``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from lightning_dml.errors import UserInputError
from lightning_dml.losses.proxies import ProxyLoss
from lightning_dml.regularizers.base import build_regularizer

__all__ = ["TARGETS", "RegularizerSpecError", "RegularizationTerms"]

#: what a term may regularise
TARGETS = ("embeddings", "loss_weights")

_KEYS = ("regularizer", "weight", "target", "init_args", "name")


class RegularizerSpecError(UserInputError, ValueError):
    """A term of ``regularizers`` that cannot be built: names the term (its index) and what is wrong."""


def _weight(value: Any, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0 or value == float("inf"):
        raise RegularizerSpecError(f"{where}: weight must be a finite number >= 0, got {value!r}")
    return float(value)


def _build(spec: Any, index: int, loss: nn.Module) -> tuple[str, nn.Module, float, str]:
    where = f"regularizers[{index}]"
    if not isinstance(spec, dict):
        raise RegularizerSpecError(
            f"{where} must be a mapping like {{'regularizer': 'lp', 'weight': 0.001, 'target': 'embeddings'}}, "
            f"got {spec!r}"
        )
    if True in spec:
        raise RegularizerSpecError(
            f"{where} has the key true: YAML reads a bare 'on' as true; name what the term regularises with "
            "'target: embeddings' or 'target: loss_weights'"
        )
    unknown = sorted(str(key) for key in set(spec) - set(_KEYS))
    if unknown:
        raise RegularizerSpecError(f"{where}: unknown key(s) {unknown}; a term has the keys {list(_KEYS)}")
    if "regularizer" not in spec:
        raise RegularizerSpecError(f"{where} has no 'regularizer' (a name such as 'lp')")
    chosen, init_args = spec["regularizer"], spec.get("init_args") or {}
    if not isinstance(init_args, dict):
        raise RegularizerSpecError(f"{where}: init_args must be a mapping, got {init_args!r}")
    if isinstance(chosen, str):
        try:
            regularizer = build_regularizer(chosen, **init_args)
        except UserInputError as error:
            raise RegularizerSpecError(f"{where}: {error}") from None
        except (TypeError, ValueError) as error:
            raise RegularizerSpecError(f"{where} ({chosen!r}): {error}") from None
    else:
        raise RegularizerSpecError(
            f"{where}: 'regularizer' must be a registry name (register a class of your own with "
            f"lightning_dml.regularizers.register_regularizer), got {type(chosen).__name__}: the terms are saved as "
            "plain data in the checkpoint's hyper-parameters"
        )
    target = spec.get("target", getattr(regularizer, "default_target", "embeddings"))
    if target not in TARGETS:
        raise RegularizerSpecError(f"{where}: 'target' must be one of {list(TARGETS)}, got {target!r}")
    if target == "loss_weights" and not isinstance(loss, ProxyLoss):
        raise RegularizerSpecError(
            f"{where} has target 'loss_weights' but the loss {type(loss).__name__} has no class weights (a proxy or "
            "classification loss such as proxy_anchor, arcface or soft_triple has)"
        )
    if target == "loss_weights" and loss.sharded:  # a ProxyLoss here (checked above)
        raise RegularizerSpecError(
            f"{where} has target 'loss_weights' but {type(loss).__name__} has sharded=True: each process holds only "
            "its block of the class weights, and the regularizers of the weights need all of them"
        )
    name = spec.get("name", getattr(regularizer, "registry_name", "") or type(regularizer).__name__)
    if not isinstance(name, str) or not name or "/" in name:
        raise RegularizerSpecError(f"{where}: name must be a non-empty string without '/', got {name!r}")
    return name, regularizer, _weight(spec.get("weight", 1.0), where), target


class RegularizationTerms(nn.Module):
    """The weighted terms, built from their dicts (module docstring); ``terms(embeddings, losses)`` returns
    ``{name: weight * value}``, each term's contribution to the training objective.

    Args:
        specs: the terms (an empty sequence: none).
        loss: the module's loss (checked for class weights when a term has ``target: loss_weights``).
        per_level: the module trains one loss per backbone level (``fusion="per_level"``): an embeddings term is
            the sum over the levels' embeddings, a weights term the sum over the levels' losses; a regularizer
            with a running statistic is refused (the levels would share it).
    """

    def __init__(self, specs: Sequence[Any] | None, loss: nn.Module, per_level: bool = False) -> None:
        super().__init__()
        if specs is None:
            specs = ()
        if isinstance(specs, (str, dict)) or not isinstance(specs, Sequence):
            raise RegularizerSpecError(f"regularizers must be a list of terms, got {specs!r}")
        built = [_build(spec, index, loss) for index, spec in enumerate(specs)]
        names: list[str] = []
        for index, (name, regularizer, _, _) in enumerate(built):
            if "name" not in specs[index] and name in names:
                count = 2
                while f"{name}_{count}" in names:
                    count += 1
                name = f"{name}_{count}"
            elif name in names:
                raise RegularizerSpecError(f"regularizers[{index}]: the name {name!r} is already taken")
            if per_level and getattr(regularizer, "stateful", False):
                raise RegularizerSpecError(
                    f"regularizers[{index}] ({name}) keeps a running statistic, which fusion='per_level' would share "
                    "between the levels: use it with fusion 'none' or 'concat' (or momentum=1)"
                )
            names.append(name)
        self.names = names
        self.weights = [weight for _, _, weight, _ in built]
        self.targets = [target for _, _, _, target in built]
        self.regularizers = nn.ModuleList([regularizer for _, regularizer, _, _ in built])
        for index, (regularizer, target) in enumerate(zip(self.regularizers, self.targets)):
            if target == "loss_weights" and hasattr(regularizer, "complete_from"):
                try:
                    regularizer.complete_from(loss)
                except ValueError as error:
                    raise RegularizerSpecError(f"regularizers[{index}]: {error}") from None

    def __len__(self) -> int:
        return len(self.names)

    def forward(self, embeddings: Tensor | Sequence[Tensor], losses: Sequence[nn.Module]) -> dict[str, Tensor]:
        """``{name: weight * value}`` of every term; ``embeddings``: the batch's (a list, one per level, with
        ``per_level`` fusion), ``losses``: the loss instances that train (their ``proxies`` rows)."""
        levels = [embeddings] if isinstance(embeddings, Tensor) else list(embeddings)
        out: dict[str, Tensor] = {}
        for name, regularizer, weight, target in zip(self.names, self.regularizers, self.weights, self.targets):
            try:
                if target == "embeddings":
                    values = [regularizer(level) for level in levels]
                else:
                    for loss in losses:
                        if hasattr(regularizer, "complete_from"):
                            regularizer.complete_from(loss)
                    values = [regularizer(loss.proxies) for loss in losses]
            except ValueError as error:  # the weights' or the batch's shape does not fit the term's settings
                raise RegularizerSpecError(f"regularization term {name!r} ({target}): {error}") from None
            out[name] = weight * torch.stack(values).sum()
        return out
