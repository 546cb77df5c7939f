"""The metrics engine's ``_`` modules are private to ``lightning_dml/metrics/`` (issue 26, acceptance): every other
package of the library uses the public face, ``lightning_dml.metrics.functional`` (its ``__all__`` and stated
contracts) or ``lightning_dml.metrics``. Checked on the source, import by import (``import``, ``from ... import``,
relative imports, and ``importlib.import_module("...")`` with a literal name)."""

from __future__ import annotations

import ast
from pathlib import Path

import lightning_dml
from lightning_dml.metrics import functional as F

PACKAGE = Path(lightning_dml.__file__).parent
METRICS = PACKAGE / "metrics"


def _is_private(dotted: str) -> bool:
    """A module or name under ``lightning_dml.metrics`` with a ``_`` component (``metrics._scores``,
    ``metrics.functional._items``)."""
    parts = dotted.split(".")
    return parts[:2] == ["lightning_dml", "metrics"] and any(p.startswith("_") for p in parts[2:])


def _absolute(node: ast.ImportFrom, path: Path) -> str:
    if not node.level:
        return node.module or ""
    package = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_metric_imports(root: Path = PACKAGE) -> list[str]:
    """``file:line: name`` for every import of a private name of ``lightning_dml.metrics`` outside it."""
    found = []
    for path in sorted(root.rglob("*.py")):
        if METRICS in path.parents:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            hits: list[str] = []
            if isinstance(node, ast.Import):
                hits = [a.name for a in node.names if _is_private(a.name)]
            elif isinstance(node, ast.ImportFrom):
                module = _absolute(node, path)
                hits = [module] if _is_private(module) else [
                    f"{module}.{a.name}" for a in node.names if _is_private(f"{module}.{a.name}")
                ]
            elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
                  and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
                hits = [node.args[0].value] if _is_private(node.args[0].value) else []
            found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {h}" for h in hits]
    return found


def test_no_package_imports_private_names_of_metrics() -> None:
    assert private_metric_imports() == []


def test_the_check_finds_each_kind_of_private_import(tmp_path) -> None:
    pkg = tmp_path / "lightning_dml"
    (pkg / "metrics").mkdir(parents=True)
    (pkg / "metrics" / "_scores.py").write_text("from lightning_dml.metrics._task import X\n")  # inside: allowed
    (pkg / "retrieval").mkdir()
    (pkg / "retrieval" / "a.py").write_text(
        "from lightning_dml.metrics._scores import score_tile\n"
        "import lightning_dml.metrics._ranks as r\n"
        "from lightning_dml.metrics import _statistics\n"
        "from ..metrics._task import RetrievalTask\n"
        "import importlib\nimportlib.import_module('lightning_dml.metrics._ddp')\n"
        "from lightning_dml.metrics.functional import score_tile, exact_mean\n"  # public: allowed
        "from lightning_dml.metrics import functional, RetrievalMetrics\n"
        "from lightning_dml.metrics.functional import _items\n"
    )
    global PACKAGE, METRICS
    saved = PACKAGE, METRICS
    PACKAGE, METRICS = pkg, pkg / "metrics"
    try:
        found = private_metric_imports(pkg)
    finally:
        PACKAGE, METRICS = saved
    assert sorted(f.split(": ")[1] for f in found) == sorted([
        "lightning_dml.metrics._scores", "lightning_dml.metrics._ranks", "lightning_dml.metrics._statistics",
        "lightning_dml.metrics._task", "lightning_dml.metrics._ddp", "lightning_dml.metrics.functional._items",
    ]), found


def test_the_public_face_names_what_retrieval_uses() -> None:
    for name in ("score_tile", "exact_mean", "per_query", "parse_metric", "exact_rate", "build_search", "prepare",
                 "retrieval_stats", "MetricName", "RetrievalStats"):
        assert name in F.__all__ and callable(getattr(F, name)), name
