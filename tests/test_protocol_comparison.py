"""The worked comparison script (bench/protocol_comparison.py, `make compare`): its budget, search spaces and
commands, and the table it assembles from cv results. No training here: the steps are replaced by fakes that
write what the real commands write (the real commands have their own tests in test_protocol_cv/sweep.py)."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
from pathlib import Path

import pytest
from scipy import stats

from lightning_dml.cli import build_cli
from lightning_dml.protocol.budget import load_budget
from lightning_dml.protocol.cv import table_rows
from lightning_dml.protocol.sweep import load_space, override_args

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "protocol_comparison.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("protocol_comparison", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


pc = _load_script()
ALL_SPACES = sorted(p.stem.removeprefix("space_") for p in (ROOT / pc.DEFAULT_SPACE_DIR).glob("space_*.yaml"))


# ------------------------------------------------------------------------------------------- files
def test_budget_and_spaces_are_fair():
    budget = load_budget(ROOT / pc.DEFAULT_BUDGET)
    assert budget.folds >= 2 and budget.repeats >= 3 and budget.trials >= 2
    assert len(pc.DEFAULT_LOSSES) >= 3 and set(pc.DEFAULT_LOSSES) <= set(ALL_SPACES)
    spaces = {loss: load_space(pc.space_file(ROOT / pc.DEFAULT_SPACE_DIR, loss)) for loss in ALL_SPACES}
    # every loss tunes the learning rate over the same range, plus at most two knobs of its own
    lr = "model.optimizer.init_args.lr"
    assert all(space[lr] == spaces[pc.DEFAULT_LOSSES[0]][lr] for space in spaces.values())
    assert all(2 <= len(space) <= 3 for space in spaces.values())
    # the default losses tune the same number of knobs
    assert len({len(spaces[loss]) for loss in pc.DEFAULT_LOSSES}) == 1


def _mid(spec: dict) -> object:
    if "choices" in spec:
        return spec["choices"][0]
    if spec.get("log"):
        value = math.sqrt(spec["low"] * spec["high"])
    else:
        value = (spec["low"] + spec["high"]) / 2
    return int(value) if spec.get("type") == "int" else float(value)


@pytest.mark.parametrize("loss", ALL_SPACES)
def test_space_keys_are_config_keys_of_the_loss(loss, monkeypatch):
    """The fit arguments of the loss with a value of every space key build (jsonargparse rejects unknown keys
    and wrong types), and the values arrive where the space says."""
    monkeypatch.setattr("sys.argv", ["lightning-dml"])
    space = load_space(pc.space_file(ROOT / pc.DEFAULT_SPACE_DIR, loss))
    values = {key: _mid(spec) for key, spec in space.items()}
    args = pc.fit_args(loss, [str(ROOT / c) for c in pc.DEFAULT_CONFIGS], steps=7)
    cli = build_cli([*args, *override_args(values), "--trainer.max_steps=7"], run=False)
    assert type(cli.model.loss).__name__ == pc.loss_class_path(loss).rsplit(".", 1)[1]
    config = cli.config
    for key, value in values.items():
        node = config
        for part in key.split("."):
            node = node[part]
        assert node == pytest.approx(value)
    assert config["model"]["lr_scheduler"]["init_args"]["T_max"] == 7
    assert cli.trainer.max_steps == 7 and cli.trainer.max_epochs == -1 and cli.trainer.loggers == []


# ------------------------------------------------------------------------------------------- arguments
def test_commands(tmp_path):
    options = pc.parse_args(["--out", str(tmp_path / "out"), "--losses", "contrastive", "proxy_anchor"])
    assert options.losses == ["contrastive", "proxy_anchor"] and options.out == tmp_path / "out"
    assert options.budget_values == load_budget(ROOT / pc.DEFAULT_BUDGET).as_dict()
    exe = Path("/venv/bin/lightning-dml")
    sweep = pc.sweep_command(exe, "contrastive", options, steps=80)
    assert sweep[:2] == [str(exe), "sweep"]
    assert sweep[sweep.index("--space") + 1] == str(ROOT / "configs/protocol/space_contrastive.yaml")
    assert sweep[sweep.index("--run_dir") + 1] == str(tmp_path / "out/contrastive/sweep")
    assert [sweep[i + 1] for i, a in enumerate(sweep) if a == "--config"] == [str(ROOT / c) for c in pc.DEFAULT_CONFIGS]
    assert "--model.loss=lightning_dml.losses.ContrastiveLoss" in sweep
    assert "--model.lr_scheduler.init_args.T_max=80" in sweep
    cv = pc.cv_command(exe, "contrastive", options)
    assert cv[:2] == [str(exe), "cv"] and cv[cv.index("--budget") + 1] == str(ROOT / pc.DEFAULT_BUDGET)
    assert cv[cv.index("--config") + 1] == str(tmp_path / "out/contrastive/sweep/best.yaml")
    assert cv[cv.index("--run_dir") + 1] == str(tmp_path / "out/contrastive/cv")


@pytest.mark.parametrize(
    "args, message",
    [
        (["--losses", "contrastive", "contrastive"], "lists a loss twice"),
        (["--losses", "no_such_loss"], "unknown loss 'no_such_loss'"),
        (["--losses", "triplet"], "space_triplet.yaml"),  # registered, but no search space
        (["--budget", "missing.yaml"], "missing.yaml"),
        (["--config", "missing.yaml"], "config file(s) not found"),
    ],
)
def test_bad_arguments(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        pc.parse_args(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- results
def _write_cv_results(path: Path, values: dict[str, list[float]], budget: dict) -> None:
    """A results.csv as cv writes it (cv.aggregate's columns, rows from cv.table_rows): ``values`` gives per
    metric the repeats' values of the separate evaluation; the concatenated one is 0.1 higher."""
    repeats = [
        {"separate": {m: v[r] for m, v in values.items()}, "concatenated": {m: v[r] + 0.1 for m, v in values.items()}}
        for r in range(len(next(iter(values.values()))))
    ]
    rows = table_rows(repeats)
    recorded = {"num_folds": budget["folds"], "repeats": budget["repeats"], "max_steps": budget["steps"],
                "max_epochs": -1, "limit_train_batches": None}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=[*rows[0], *recorded])
        writer.writeheader()
        writer.writerows({**row, **recorded} for row in rows)


BUDGET = {"trials": 2, "steps": 5, "folds": 2, "repeats": 3}
VALUES = {  # loss -> metric -> values over 3 repeats
    "a": {"recall@1": [0.60, 0.62, 0.64], "map@r": [0.30, 0.31, 0.32], "r_precision": [0.4, 0.4, 0.4]},
    "b": {"recall@1": [0.55, 0.60, 0.65], "map@r": [0.20, 0.21, 0.22], "r_precision": [0.3, 0.3, 0.3]},
}


def test_table_from_cv_results(tmp_path):
    for loss, values in VALUES.items():
        _write_cv_results(tmp_path / loss / "results.csv", values, BUDGET)
    results = {loss: pc.read_cv_results(tmp_path / loss / "results.csv") for loss in VALUES}
    assert all(pc.matches_budget(rows, BUDGET) for rows in results.values())
    assert not pc.matches_budget(results["a"], {**BUDGET, "steps": 6})
    rows = pc.combined_rows(results)
    assert len(rows) == 2 * 2 * 3  # losses x evaluations x metrics
    row = next(r for r in rows if (r["loss"], r["evaluation"], r["metric"]) == ("b", "separate", "recall@1"))
    half = stats.t.ppf(0.975, 2) * 0.05 / math.sqrt(3)  # sample std of (0.55, 0.60, 0.65) is 0.05
    assert row["mean"] == pytest.approx(0.60) and row["ci_high"] - row["mean"] == pytest.approx(half)
    assert pc.cell(row) == f"60.00 ± {100 * half:.2f}"
    # a: MAP@R 31 +- 2.5, b: 21 +- 2.5 -> no overlap; Recall@1 62 +- 5.0 and 60 +- 12.4 -> overlap
    found = pc.overlaps(rows)
    assert found[("separate", "map@r")] == ("a", [])
    assert found[("separate", "recall@1")] == ("a", ["b"])
    assert found[("concatenated", "map@r")] == ("a", [])
    sweeps = {loss: {"finished_trials": 2, "best": {"number": 1, "value": 0.25, "params": {"model.x": 0.123456}}}
              for loss in VALUES}
    text = pc.markdown(rows, sweeps, BUDGET)
    assert "| a | concatenated | 72.00 ± " in text and "| b | separate | 60.00 ± " in text
    assert "Budget (every loss): trials=2, steps=5, folds=2, repeats=3" in text
    assert "| a | 2 | 1 | 25.00 | `model.x`=0.1235 |" in text
    assert "separate MAP@R: highest mean a; 95% intervals overlapping it: none" in text


def test_missing_metric_and_bad_file(tmp_path):
    _write_cv_results(tmp_path / "a.csv", {"recall@1": [0.5, 0.6]}, BUDGET)
    with pytest.raises(pc.StepFailed, match="no separate map@r"):
        pc.combined_rows({"a": pc.read_cv_results(tmp_path / "a.csv")})
    (tmp_path / "b.csv").write_text("x,y\n1,2\n")
    with pytest.raises(pc.StepFailed, match="not a cv results.csv"):
        pc.read_cv_results(tmp_path / "b.csv")


# ------------------------------------------------------------------------------------------- the run
def _fake_steps(monkeypatch, calls: list[list[str]], fail: str | None = None) -> None:
    """Replace the subprocesses by fakes writing the sweep's sweep.json/best.yaml and cv's results.csv."""
    monkeypatch.setattr(pc, "executable", lambda: Path("lightning-dml"))

    def run_step(command, log, what):
        calls.append(command)
        if fail and fail in what:
            raise pc.StepFailed(f"{what} failed with exit status 1")
        run_dir = Path(command[command.index("--run_dir") + 1])
        run_dir.mkdir(parents=True, exist_ok=True)
        if command[1] == "sweep":
            best = {"number": 0, "value": 0.3, "params": {"model.optimizer.init_args.lr": 0.001}}
            (run_dir / "sweep.json").write_text(json.dumps({"finished_trials": 4, "best": best}))
            (run_dir / "best.yaml").write_text("model: {}\n")
        else:
            _write_cv_results(run_dir / "results.csv", VALUES["a"], BUDGET)
        return 1.0

    monkeypatch.setattr(pc, "run_step", run_step)


def test_run_writes_table_and_resumes(tmp_path, monkeypatch, capsys):
    budget = tmp_path / "budget.yaml"
    budget.write_text(json.dumps(BUDGET))
    args = ["--out", str(tmp_path / "out"), "--budget", str(budget), "--losses", "multi_similarity", "supcon"]
    calls: list[list[str]] = []
    _fake_steps(monkeypatch, calls)
    assert pc.main(args) == 0
    assert [c[1] for c in calls] == ["sweep", "cv", "sweep", "cv"]
    text = (tmp_path / "out" / "comparison.md").read_text()
    assert "| supcon | separate | 62.00 ± " in text and "Wall time of this invocation" in text
    with open(tmp_path / "out" / "comparison.csv") as handle:
        table = list(csv.DictReader(handle))
    assert len(table) == 2 * 2 * 3 and table[0]["loss"] == "multi_similarity" and table[0]["steps"] == "5"
    # rerun: the sweeps resume (run again, finished at once), the cv results exist and are not recomputed
    calls.clear()
    assert pc.main(args) == 0
    assert [c[1] for c in calls] == ["sweep", "sweep"]
    assert "cv not run for multi_similarity, supcon" in (tmp_path / "out" / "comparison.md").read_text()
    # another budget on the same output folder: a clear error, nothing silently reused
    budget.write_text(json.dumps({**BUDGET, "steps": 6}))
    assert pc.main(args) == 1
    assert "was produced with another budget" in capsys.readouterr().err


def test_failed_step_stops_with_its_message(tmp_path, monkeypatch, capsys):
    calls: list[list[str]] = []
    _fake_steps(monkeypatch, calls, fail="contrastive: sweep")
    assert pc.main(["--out", str(tmp_path), "--losses", "multi_similarity", "contrastive"]) == 1
    assert "contrastive: sweep failed with exit status 1" in capsys.readouterr().err
    assert not (tmp_path / "comparison.md").exists()


def test_sweep_without_complete_trial(tmp_path, monkeypatch, capsys):
    calls: list[list[str]] = []
    _fake_steps(monkeypatch, calls)
    fake = pc.run_step

    def no_best(command, log, what):
        fake(command, log, what)
        (Path(command[command.index("--run_dir") + 1]) / "sweep.json").write_text('{"best": null}')
        return 1.0

    monkeypatch.setattr(pc, "run_step", no_best)
    assert pc.main(["--out", str(tmp_path), "--losses", "contrastive"]) == 1
    assert "the sweep has no complete trial" in capsys.readouterr().err
