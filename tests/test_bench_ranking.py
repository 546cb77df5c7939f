"""The Glyphs ranking script (bench/ranking.py): the arguments of a run and the table it assembles. No training
here (the runs are ordinary CLI fits, tested elsewhere); the table is checked against figures computed by hand."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from lightning_dml.cli import build_cli
from lightning_dml.losses import LOSSES, NPairLoss

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "ranking.py"


@pytest.fixture(scope="module")
def ranking():
    spec = importlib.util.spec_from_file_location("ranking", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _value(args: list[str], key: str) -> str:
    return args[args.index(key) + 1]


def test_run_args_fix_steps_seed_and_loss(ranking, tmp_path: Path) -> None:
    args = ranking.run_args("multi_similarity", 3, 17, str(tmp_path))
    assert _value(args, "--model.loss") == "multi_similarity"
    assert _value(args, "--trainer.max_steps") == "17"
    assert _value(args, "--seed_everything") == "3" and _value(args, "--data.init_args.seed") == "3"
    assert _value(args, "--trainer.limit_val_batches") == "0"
    assert "--data.init_args.sampler" not in args


def test_npair_gets_its_sampler_with_the_same_batch_size(ranking, tmp_path: Path) -> None:
    args = ranking.run_args("npair", 0, 5, str(tmp_path))
    cli = build_cli(args, run=False)
    assert isinstance(cli.model.loss, NPairLoss)
    dm = cli.datamodule
    assert dm.sampler == "npair"
    p, k = ranking.BATCH
    assert dm.classes_per_batch * dm.samples_per_class == p * k


def test_every_registered_loss_has_run_args(ranking, tmp_path: Path) -> None:
    for name in LOSSES:
        assert _value(ranking.run_args(name, 0, 1, str(tmp_path)), "--model.loss") == name


def test_table_orders_by_mean_recall_and_lists_failures_last(ranking) -> None:
    results = {
        "a": [{"recall@1": 0.5, "map@r": 0.1, "seconds": 10.0}, {"recall@1": 0.7, "map@r": 0.3, "seconds": 20.0}],
        "b": [{"recall@1": 0.8, "map@r": 0.2, "seconds": 4.0}],
        "c": [{"recall@1": 0.9, "map@r": 0.2, "seconds": 1.0}, {"error": "RuntimeError: boom"}],
    }
    lines = ranking.ranking_table(results).splitlines()
    assert lines[2].startswith("| 1 | `b` | 80.0 | 20.0 | 1 | 4 |")
    # a: mean 60.0, sample standard deviation of (50, 70) = 14.1; MAP@R 20.0 +- 14.1; 15 s per run
    assert lines[3] == "| 2 | `a` | 60.0 ± 14.1 | 20.0 ± 14.1 | 2 | 15 |"
    assert lines[4].startswith("| - | `c` | failed: RuntimeError: boom")
