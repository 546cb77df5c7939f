"""``ValidationSummary``: the last validation metrics as a table at the end of ``fit`` (and the per-category
metrics of ``validate`` and ``test`` as one table)."""

from __future__ import annotations

import pytorch_lightning as pl
from pytorch_lightning.trainer.states import TrainerFn

from lightning_dml.callbacks.retrieval import RetrievalComparison
from lightning_dml.metrics_format import format_metric
from lightning_dml.widths import split_widths

__all__ = ["ValidationSummary", "format_metrics", "split_categories"]

#: the prefix of the per-category metric keys (``category/<name>/<metric>``, see ``docs/metrics.md``)
CATEGORY_PREFIX = "category/"


def split_categories(values: dict[str, float]) -> tuple[dict[str, float], dict[str, dict[str, float]]]:
    """``(overall, per_category)``: the metrics without the ``category/`` prefix, and ``{category name: {metric:
    value}}`` from the keys ``category/<name>/<metric>`` (a name may hold ``/``: the metric is the last part)."""
    overall: dict[str, float] = {}
    per_category: dict[str, dict[str, float]] = {}
    for key, value in values.items():
        if key.startswith(CATEGORY_PREFIX):
            name, _, metric = key[len(CATEGORY_PREFIX) :].rpartition("/")
            per_category.setdefault(name, {})[metric] = value
        else:
            overall[key] = value
    return overall, per_category


def format_metrics(values: dict[str, float]) -> tuple[str, str | None]:
    """``(overall table, per-category table or None)`` of a stage's metrics (keys without the stage prefix).

    The overall table has one row per metric (``name  value``); the per-category table one row per category and
    one column per metric, in the order the metrics come. Values as every command prints them
    (:func:`lightning_dml.metrics_format.format_metric`: rates in percent with two decimals, ``threshold@fmr=F`` as
    the score it is, four decimals)."""
    overall, per_category = split_categories(values)
    # nested widths (``w<d>/<metric>``, RetrievalMetrics(widths)): one column per width beside the full embedding's
    overall, by_width = split_widths(overall)
    columns = {"value" if not by_width else "full": overall, **{f"w{d}": col for d, col in by_width.items()}}
    names = list(dict.fromkeys(n for col in columns.values() for n in col))
    name_width = max((len(n) for n in names), default=0) + 2
    lines = [f"{'':<{name_width}}" + "".join(f"{c:>10}" for c in columns)]
    lines += [
        f"{name:<{name_width}}"
        + "".join(format_metric(name, col[name], 10) if name in col else f"{'-':>10}" for col in columns.values())
        for name in names
    ]
    if not per_category:
        return "\n".join(lines), None
    metrics = list(dict.fromkeys(m for row in per_category.values() for m in row))
    widths = [max(10, len(m) + 2) for m in metrics]
    row_width = max(len("category"), *(len(n) for n in per_category)) + 2
    table = [f"{'category':<{row_width}}" + "".join(f"{m:>{w}}" for m, w in zip(metrics, widths))]
    for name, row in per_category.items():
        cells = (format_metric(m, row[m], w) if m in row else f"{'-':>{w}}" for m, w in zip(metrics, widths))
        table.append(f"{name:<{row_width}}" + "".join(cells))
    return "\n".join(lines), "\n".join(table)


class ValidationSummary(pl.Callback):
    """Print the metrics of the last validation (``val/recall@1``, ``val/map@r``, ...) when ``fit`` ends.

    Lightning prints such a table after ``validate`` and ``test`` but not after ``fit``; with the logger off or W&B
    offline the terminal would show no figure at all. The table has one row per metric, values in percent
    (``threshold@fmr=F``: the score itself), and is printed by rank 0 only (the metrics are already global: every
    process holds the same values). Nothing is printed when no validation ran, or when a
    :class:`~lightning_dml.callbacks.RetrievalComparison` prints its own table at the end of the same fit (the demo
    shows one table). The ``lightning-dml`` CLI adds one to every run.

    After ``validate`` and ``test`` the metrics are printed too, in the format every command prints them (percent,
    two decimals; :attr:`verbose` ``False``: not printed). The ``lightning-dml`` CLI turns Lightning's own table of
    the logged fractions off (``Trainer.test(verbose=False)``), so this is the one table (``--verbose false``: none).
    Per-category metrics
    (``category/<name>/<metric>``, evaluation data with categories) are shown apart, as one more table with one row
    per category and one column per metric (:attr:`category_table`), after ``fit``, ``validate`` and ``test``.

    A fit can end after training steps that no validation saw (``max_steps`` or ``max_time`` between two
    validations): :meth:`is_stale` says so, from :attr:`validated_step`. The ``lightning-dml`` CLI then validates
    once more after ``fit`` (``--validate_at_end``, on by default) and sets :attr:`final_validation`, so that the
    table is printed after that validation (:meth:`print_table`) instead of at the end of ``fit``.

    Args:
        prefix: the logged metric prefix to show.
    """

    def __init__(self, prefix: str = "val/") -> None:
        super().__init__()
        self.prefix = prefix
        self.table: str | None = None
        #: the per-category table of the last printed metrics (``None``: none had categories)
        self.category_table: str | None = None
        #: ``trainer.global_step`` when the last validation of the current ``fit`` ended (``None``: none yet)
        self.validated_step: int | None = None
        #: set by a caller that validates once more after a stale fit (the CLI): the table waits for it
        self.final_validation = False
        #: whether ``validate`` and ``test`` print their tables (the CLI sets it from ``--verbose``)
        self.verbose = True

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.validated_step = None
        self.table = None

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking and trainer.state.fn == TrainerFn.FITTING:
            self.validated_step = trainer.global_step
        elif trainer.state.fn == TrainerFn.VALIDATING and not self.final_validation:
            self.print_category_table(trainer, "val/", "validation")

    def on_test_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.print_category_table(trainer, "test/", "test")

    def _values(self, trainer: pl.Trainer, prefix: str) -> dict[str, float]:
        return {k[len(prefix) :]: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(prefix)}

    def print_category_table(self, trainer: pl.Trainer, prefix: str, stage: str) -> str | None:
        """After ``validate`` and ``test``: print (rank 0) the table of the ``prefix`` metrics in the one printed
        format (:mod:`lightning_dml.metrics_format`), and with per-category metrics the per-category table too;
        return the latter (``None`` without categories). Nothing is printed when :attr:`verbose` is ``False``."""
        values = self._values(trainer, prefix)
        self.category_table = None
        if not values:
            return None
        overall, self.category_table = format_metrics(values)
        if trainer.is_global_zero and self.verbose:
            categories = "" if self.category_table is None else (
                f"\nPer category ({stage}, queries of each category), %:\n{self.category_table}\n"
            )
            print(f"\n{stage.capitalize()} metrics, %:\n{overall}\n{categories}", flush=True)
        return self.category_table

    def is_stale(self, trainer: pl.Trainer) -> bool:
        """Whether the fit that just ended trained steps after its last validation (or validated never), while it
        has validation (a validation loader, ``limit_val_batches > 0``). ``False`` when a
        :class:`~lightning_dml.callbacks.RetrievalComparison` ends the fit with its own table."""
        if any(isinstance(cb, RetrievalComparison) for cb in trainer.callbacks):
            return False
        return bool(trainer.enable_validation) and self.validated_step != trainer.global_step

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.table = None
        if self.final_validation and self.is_stale(trainer):
            return  # printed after the final validation
        self.print_table(trainer)

    def print_table(self, trainer: pl.Trainer) -> str | None:
        """Print (rank 0) and return the table of the ``prefix`` metrics in ``trainer.callback_metrics``."""
        self.table = self.category_table = None
        if any(isinstance(cb, RetrievalComparison) for cb in trainer.callbacks):
            return None
        values = self._values(trainer, self.prefix)
        if not values:
            return None
        self.table, self.category_table = format_metrics(values)
        if trainer.is_global_zero:
            if self.validated_step is None or self.validated_step == trainer.global_step:
                when = f"epoch {trainer.current_epoch}, step {trainer.global_step}"
            else:  # a stale table (no final validation): say which step it is of
                when = f"step {self.validated_step}; fit ended at step {trainer.global_step}, not validated since"
            categories = "" if self.category_table is None else (
                f"\nPer category (queries of each category), %:\n{self.category_table}\n"
            )
            print(f"\nLast validation ({when}), %:\n{self.table}\n{categories}", flush=True)
        return self.table
