"""Issue 27 s.3, one answer in one format (:mod:`lightning_dml.metrics_format`, ``docs/metrics.md`` "Printed
values"): the commands not covered by ``tests/test_formats.py``. ``test``/``validate``'s single table is tested on a
real run in ``tests/test_runs.py`` (its fitted checkpoint)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from lightning_dml.metrics_format import format_metric

optuna = pytest.importorskip("optuna")


def test_sweep_prints_its_objective_by_the_rule(tmp_path: Path, monkeypatch, capsys):
    """``sweep``'s last line gives the best trial's mean MAP@R as every command prints it (41.20, in percent); on
    main ``val/map@r 0.4120``. ``sweep.json`` keeps the fraction. A study that already holds its budget's trials runs
    no fit."""
    from lightning_dml.protocol import sweep
    from lightning_dml.protocol.budget import Budget

    run = tmp_path / "run"
    run.mkdir()
    space = {"model.embedding_dim": {"choices": [8, 16]}}
    budget = Budget(trials=2, steps=3, folds=2)
    study = optuna.create_study(study_name="sweep", storage=f"sqlite:///{run / 'study.db'}", direction="maximize")
    study.set_user_attr("budget", budget.as_dict())
    study.set_user_attr("space", space)
    choice = optuna.distributions.CategoricalDistribution([8, 16])
    for value, dim in ((0.2, 8), (0.41204, 16)):
        study.add_trial(optuna.trial.create_trial(params={"model.embedding_dim": dim},
                                                  distributions={"model.embedding_dim": choice}, value=value))
    (tmp_path / "space.yaml").write_text(yaml.safe_dump(space))
    (tmp_path / "budget.yaml").write_text(yaml.safe_dump(budget.as_dict()))
    written = []
    monkeypatch.setattr(sweep, "write_best_config", lambda *args: written.append(args))  # no config to parse
    sweep.main(["--space", str(tmp_path / "space.yaml"), "--budget", str(tmp_path / "budget.yaml"),
                "--run_dir", str(run), "--config", "fit.yaml"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("sweep sweep: 2 finished trials")
    assert f"best trial 1: map@r {format_metric('map@r', 0.41204)} (%, mean over 2 folds)" in line, line
    assert "41.20" in line and "0.4120" not in line
    assert json.loads((run / "sweep.json").read_text())["best"]["value"] == 0.41204  # the file keeps the fraction
    assert written and written[0][1] == {"model.embedding_dim": 16}
