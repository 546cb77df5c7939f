"""A backbone or head as plain data, and rebuilt from it: what a safe model file records instead of pickled code.

* :class:`RecordsInitArgs`: the library's backbones and heads remember the arguments their constructor was called
  with (``init_args``: defaults filled in, ``**kwargs`` merged), so the module can be rebuilt without its file
  holding anything but tensors and JSON.
* :func:`module_record`: ``{"class_path", "init_args"}`` of such a module, JSON only; the weights come from the
  file, so ``pretrained`` is recorded as ``False`` and ``weights_path`` as ``None`` (nothing is downloaded or read
  when it is rebuilt). Another class (a user's own backbone, a subclass) is an :class:`UnsupportedModelError`.
* :func:`build_module`: the module of a record, from an allow-list only (:data:`ALLOWED`: the library's classes
  under ``lightning_dml.models``, timm models by name through :class:`~lightning_dml.models.TimmBackbone`). A
  record is never an import path: any other ``class_path``, an argument the class does not take, a timm name timm
  does not know or an argument that would make timm read a file is one
  :class:`~lightning_dml.errors.CorruptFileError` naming the file.
"""

from __future__ import annotations

import inspect
import json
import re
from typing import Any

from torch import nn

from lightning_dml.errors import CorruptFileError, UserInputError

__all__ = ["ALLOWED", "RecordsInitArgs", "UnsupportedModelError", "build_module", "module_record"]

#: the classes a record may name: ``class_path`` (as configs write it) -> class name in :mod:`lightning_dml.models`
ALLOWED: dict[str, str] = {
    f"lightning_dml.models.{name}": name
    for name in ("SmallConvNet", "BNInception", "GoogLeNet", "ResNet50", "ResNet101", "TimmBackbone",
                 "LinearEmbedding", "MultiLevelEmbedding")
}
#: ``timm.create_model`` arguments that read files or fetch configurations: never recorded, refused in a record
TIMM_REFUSED = ("checkpoint_path", "pretrained_cfg", "pretrained_cfg_overlay", "cache_dir", "pretrained")
_TIMM_NAME = re.compile(r"^[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)?$")


class UnsupportedModelError(UserInputError, ValueError):
    """A model the safe format cannot record (a class outside :data:`ALLOWED`, arguments that are not plain data)."""


class RecordsInitArgs:
    """Mixin of ``nn.Module`` classes: ``self.init_args`` is the arguments the constructor was called with
    (``None`` where they do not fit its signature). Set in ``__new__``, before ``__init__`` runs; a copy
    (``copy.deepcopy``, pickling) keeps the original's."""

    init_args: dict[str, Any] | None

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        self = super().__new__(cls)
        object.__setattr__(self, "init_args", _bound_arguments(cls, args, kwargs))
        return self


def _bound_arguments(cls: type, args: tuple, kwargs: dict[str, Any]) -> dict[str, Any] | None:
    signature = inspect.signature(cls.__init__)
    try:
        bound = signature.bind(None, *args, **kwargs)
    except TypeError:
        return None  # __init__ raises the error itself
    bound.apply_defaults()
    out: dict[str, Any] = {}
    for name, parameter in list(signature.parameters.items())[1:]:
        value = bound.arguments.get(name)
        if parameter.kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                return None
        elif parameter.kind is inspect.Parameter.VAR_KEYWORD:
            out.update(value or {})
        else:
            out[name] = value
    return out


def _plain(value: Any) -> Any:
    """``value`` as JSON data (tuples as lists), or a ``TypeError`` naming what is not."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict) and all(isinstance(k, str) for k in value):
        return {k: _plain(v) for k, v in value.items()}
    raise TypeError(f"a {type(value).__name__}")


def _timm_arguments(init_args: dict[str, Any]) -> list[dict[str, Any]]:
    nested = init_args.get("model_kwargs")
    return [init_args, nested] if isinstance(nested, dict) else [init_args]


def module_record(module: nn.Module, role: str) -> dict[str, Any]:
    """``{"class_path", "init_args"}`` of ``module`` (a backbone or head of :data:`ALLOWED`), JSON data only."""
    from lightning_dml import models

    name = type(module).__name__
    class_path = f"lightning_dml.models.{name}"
    if ALLOWED.get(class_path) != name or getattr(models, name) is not type(module):  # by name: timm stays unimported
        class_path = None
    if class_path is None:
        raise UnsupportedModelError(
            f"the {role} {type(module).__module__}.{name} cannot be recorded in the safe format, which rebuilds "
            f"only the library's own classes ({', '.join(sorted(ALLOWED))}); export it with --formats torchscript "
            "or torch_export instead (files that run code when loaded: share them only with people who trust you)"
        )
    recorded = getattr(module, "init_args", None)
    if recorded is None:
        raise UnsupportedModelError(f"the {role} {name} has no recorded constructor arguments (positional extras?)")
    init_args = dict(recorded)
    if "pretrained" in init_args:
        init_args["pretrained"] = False  # the weights come from the file
    if "weights_path" in init_args:
        init_args["weights_path"] = None
    if name == "TimmBackbone":
        for key in TIMM_REFUSED:
            if key != "pretrained":  # TimmBackbone's own `pretrained` is set to False above
                init_args.pop(key, None)
        if isinstance(init_args.get("model_kwargs"), dict):
            init_args["model_kwargs"] = {k: v for k, v in init_args["model_kwargs"].items() if k not in TIMM_REFUSED}
    try:
        init_args = _plain(init_args)
    except TypeError as error:
        bad = [k for k, v in init_args.items() if not _is_plain(v)]
        raise UnsupportedModelError(
            f"the {role} {name} was built with arguments that are not plain data ({', '.join(bad)}: {error}): the "
            "safe format records JSON only; export it with --formats torchscript or torch_export instead"
        ) from None
    return {"class_path": class_path, "init_args": init_args}


def _is_plain(value: Any) -> bool:
    try:
        _plain(value)
    except TypeError:
        return False
    return True


def build_module(record: Any, role: str, where: str) -> nn.Module:
    """The module of a record written by :func:`module_record` (``where`` names the file in errors).

    Only :data:`ALLOWED` classes are built, looked up by name in that table (never imported from the record);
    ``pretrained`` must be false and ``weights_path`` empty; a timm model must be a plain timm name without the
    arguments of :data:`TIMM_REFUSED`. Every problem is one :class:`~lightning_dml.errors.CorruptFileError`.
    """
    from lightning_dml import models

    if not isinstance(record, dict) or not isinstance(record.get("class_path"), str) or \
            not isinstance(record.get("init_args"), dict):
        raise CorruptFileError(f"{where}: the {role} record must be {{'class_path': str, 'init_args': {{...}}}}")
    class_path, init_args = record["class_path"], dict(record["init_args"])
    if class_path not in ALLOWED:
        raise CorruptFileError(
            f"{where}: the {role} class {class_path!r} is not one the library rebuilds (only "
            f"{', '.join(sorted(ALLOWED))}); nothing named by a model file is imported"
        )
    if init_args.get("pretrained", False) is not False or init_args.get("weights_path") is not None:
        raise CorruptFileError(f"{where}: the {role} record asks for pretrained weights; the file holds the weights")
    if ALLOWED[class_path] == "TimmBackbone":
        name = init_args.get("model_name")
        if not isinstance(name, str) or not _TIMM_NAME.match(name):
            raise CorruptFileError(f"{where}: the {role} record's timm model name {name!r} is not a timm model name")
        for level in _timm_arguments(init_args):
            refused = sorted(k for k in level if k in TIMM_REFUSED and (k != "pretrained" or level is not init_args))
            if refused:
                raise CorruptFileError(
                    f"{where}: the {role} record passes {', '.join(refused)} to timm, which would read files; refused"
                )
    cls = getattr(models, ALLOWED[class_path])
    described = f"{class_path}({json.dumps(init_args)[:200]})"
    try:
        return cls(**init_args)
    except Exception as error:  # noqa: BLE001 - whatever fails, the record is not a model this library rebuilds
        first = " ".join(str(error).split())[:300]
        raise CorruptFileError(f"{where}: the recorded {role} {described} cannot be built ({first})") from None
