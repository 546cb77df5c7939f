"""``lightning-dml cv`` (issue 15): the t confidence interval against a hand computation, the concatenated
evaluation against a manual concatenation scored with RetrievalMetrics, and a 2-fold x 1-repeat run of the real
command on a small Glyphs subset."""

from __future__ import annotations

import csv
import json
import math
import warnings
from pathlib import Path

import pytest
import yaml
import torch
import wandb

from lightning_dml.cli import main
from lightning_dml.metrics import RetrievalMetrics
from lightning_dml.protocol import cv
from tests.test_protocol_folds import glyph_subset  # noqa: F401  (fixture)

#: t quantile 0.975 with 2 degrees of freedom, from a printed t table (Student t, two-sided 95%)
T_975_DF2 = 4.302652729911275


def test_confidence_interval_by_hand():
    values = [0.5, 0.6, 0.7]
    # mean 0.6; sample standard deviation sqrt(((-0.1)^2 + 0 + 0.1^2) / 2) = 0.1
    half = T_975_DF2 * 0.1 / math.sqrt(3)
    mean, low, high = cv.confidence_interval(values)
    assert mean == pytest.approx(0.6)
    assert (low, high) == pytest.approx((0.6 - half, 0.6 + half), rel=1e-9)
    assert cv.confidence_interval([0.3, 0.3]) == pytest.approx((0.3, 0.3, 0.3))
    single = cv.confidence_interval([0.4])
    assert single[0] == 0.4 and math.isnan(single[1]) and math.isnan(single[2])


def _fold_embeddings(seed: int, scale: float = 1.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(10).repeat_interleave(4)
    centres = torch.randn(10, 6, generator=g)
    embeddings = centres[labels] + 0.9 * torch.randn(40, 6, generator=g)
    return {"embeddings": scale * embeddings, "labels": labels, "indices": torch.arange(40)}


def _scores(embeddings: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    metric = RetrievalMetrics(recall_at=(1, 2), clustering=False)
    metric.update(embeddings, labels, torch.arange(len(labels)))
    return {k: float(v) for k, v in metric.compute().items()}


def test_concatenated_evaluation_equals_a_manual_concatenation():
    folds = [_fold_embeddings(0), _fold_embeddings(1, scale=50.0), _fold_embeddings(2, scale=0.1)]
    got = cv.evaluate_repeat(folds, recall_at=(1, 2))
    normalised = [torch.nn.functional.normalize(f["embeddings"], dim=1) for f in folds]
    manual = _scores(torch.cat(normalised, dim=1), folds[0]["labels"])
    assert got["concatenated"] == pytest.approx(manual, abs=1e-12)
    # each fold's embedding is normalised first: without it the large-scale fold would dominate
    raw = _scores(torch.cat([f["embeddings"] for f in folds], dim=1), folds[0]["labels"])
    assert raw != pytest.approx(manual, abs=1e-6)
    per_fold = [_scores(f["embeddings"], f["labels"]) for f in folds]
    for i, scores in enumerate(per_fold):
        assert got[f"fold {i}"] == pytest.approx(scores, abs=1e-12)
    assert got["separate"]["map@r"] == pytest.approx(sum(s["map@r"] for s in per_fold) / 3)
    assert {"recall@1", "recall@2", "map@r", "r_precision"} <= set(got["separate"]) == set(per_fold[0])


def test_folds_with_different_test_splits_are_refused():
    other = _fold_embeddings(1)
    other["labels"] = other["labels"].flip(0)
    with pytest.raises(cv.ProtocolError, match="same test split"):
        cv.concatenate_folds([_fold_embeddings(0), other])


def test_table_rows_and_markdown():
    repeats = [
        {"separate": {"map@r": 0.5}, "concatenated": {"map@r": 0.6}},
        {"separate": {"map@r": 0.6}, "concatenated": {"map@r": 0.6}},
        {"separate": {"map@r": 0.7}, "concatenated": {"map@r": 0.6}},
    ]
    rows = cv.table_rows(repeats)
    assert rows[0]["evaluation"] == "separate" and rows[0]["ci_high"] == pytest.approx(0.6 + T_975_DF2 * 0.1 / 3**0.5)
    text = cv.markdown_table(rows, {"num_folds": 4, "max_steps": 10})
    half = f"{100 * T_975_DF2 * 0.1 / 3**0.5:.2f}"
    assert f"| separate | 60.00 ± {half} |" in text and "| concatenated | 60.00 ± 0.00 |" in text
    assert "num_folds=4, max_steps=10" in text


def test_cv_help_lists_its_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["cv", "--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for option in ("--num_folds", "--repeats", "--seed", "--run_dir", "--fold", "--repeat", "--aggregate"):
        assert option in out


@pytest.mark.parametrize(
    "args, match",
    [
        (["cv"], "needs the fit's config"),
        (["cv", "--config", "x.yaml", "--fold", "0"], "together"),
        (["cv", "--config", "x.yaml", "--num_folds", "1"], "num_folds >= 2"),
        (["cv", "--aggregate", "nowhere"], "cv.json"),
    ],
)
def test_bad_invocations_are_one_message(args, match, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("lightning-dml: error:") and match in err and "Traceback" not in err


def tiny_fit_args(root, logger: str = "csv") -> list[str]:
    """A few training steps of a tiny network on the Glyphs subset (fixture ``glyph_subset``), logged by a
    CSVLogger (``logger="csv"``) or an offline W&B logger (``"wandb"``, project ``protocol-test``) into ``root``, or
    the command's default logger (``"default"``: W&B, offline, into ``logs/`` of the working directory)."""
    loggers = {
        "default": [],
        "csv": ["--trainer.logger=pytorch_lightning.loggers.CSVLogger", f"--trainer.logger.init_args.save_dir={root}"],
        "wandb": ["--trainer.logger=pytorch_lightning.loggers.WandbLogger", f"--trainer.logger.init_args.save_dir={root}",
                  "--trainer.logger.init_args.offline=true", "--trainer.logger.init_args.project=protocol-test"],
    }
    return [
        "--trainer.accelerator=cpu", "--trainer.devices=1", "--trainer.max_epochs=1", "--trainer.max_steps=3",
        "--trainer.limit_train_batches=3", "--trainer.enable_progress_bar=false",
        "--trainer.enable_model_summary=false", "--trainer.callbacks=[]",
        "--model.backbone=lightning_dml.models.SmallConvNet", "--model.backbone.init_args.width=8",
        "--model.embedding_dim=16", "--model.optimizer=torch.optim.Adam", "--model.recall_at=[1,2]",
        "--data=lightning_dml.data.GlyphsDataModule", "--data.init_args.classes_per_batch=4",
        "--data.init_args.samples_per_class=4", *loggers[logger],
    ]


def wandb_runs(save_dir) -> dict[str, dict]:
    """The offline W&B runs under ``save_dir``: run id -> its folder and the raw bytes of its ``.wandb`` record
    (where W&B stores the run's name, group and job type)."""
    runs = {}
    for folder in sorted(Path(save_dir).glob("wandb/offline-run-*")):
        record = next(folder.glob("run-*.wandb"))
        runs[record.stem[len("run-"):]] = {"dir": folder, "record": record.read_bytes()}
    return runs


def check_class_lists(folders, num_folds: int) -> None:
    """``classes.json`` of every fold: validation and training classes disjoint, together the training classes;
    the validation classes of the folds partition them; the test classes are apart."""
    lists = [json.loads((folder / cv.CLASSES).read_text()) for folder in folders]
    everything = set(lists[0]["train"]) | set(lists[0]["validation"])
    for i, classes in enumerate(lists):
        assert (classes["fold"], classes["num_folds"]) == (i, num_folds)
        train, val, test = set(classes["train"]), set(classes["validation"]), set(classes["test"])
        assert train and val and not train & val and train | val == everything and not test & everything
    assert sorted(c for classes in lists for c in classes["validation"]) == sorted(everything)


@pytest.mark.slow  # about 30 s on the shared 2-core machine (two fits, their validations and test embeddings)
def test_two_folds_one_repeat_through_the_command(glyph_subset, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "cv"
    main(["cv", "--num_folds", "2", "--run_dir", str(run_dir), *tiny_fit_args(tmp_path / "logs")])
    out = capsys.readouterr().out
    assert "| evaluation | recall@1 | recall@2 |" in out
    saved = [torch.load(cv.fold_dir(run_dir, 0, i) / cv.EMBEDDINGS, weights_only=False) for i in range(2)]
    for fold in saved:
        assert fold["checkpoint"].endswith(".ckpt")  # the best validation checkpoint embedded the test split
        assert "val/map@r" in fold["val"] and fold["embeddings"].shape[1] == 16
    assert torch.equal(saved[0]["labels"], saved[1]["labels"])
    assert not torch.equal(saved[0]["embeddings"], saved[1]["embeddings"])
    expected = cv.evaluate_repeat(saved, (1, 2))
    with open(run_dir / "results.csv") as handle:
        rows = list(csv.DictReader(handle))
    got = {(r["evaluation"], r["metric"]): float(r["mean"]) for r in rows}
    for evaluation in ("separate", "concatenated"):
        for metric in ("recall@1", "map@r", "r_precision"):
            assert got[(evaluation, metric)] == pytest.approx(expected[evaluation][metric])
    assert {r["num_folds"] for r in rows} == {"2"} and {r["max_steps"] for r in rows} == {"3"}
    assert json.loads((run_dir / cv.MANIFEST).read_text())["num_folds"] == 2
    # the table went to the configured logger (CSVLogger: metrics.csv of a run under the save_dir)
    logged = [p for p in (tmp_path / "logs").rglob("metrics.csv") if "cv/concatenated/map@r/mean" in p.read_text()]
    assert len(logged) == 1
    # --aggregate recomputes the same table from the run folder; a repeat that did not run is named
    table = (run_dir / "results.csv").read_text()
    (run_dir / "results.csv").unlink()
    main(["cv", "--aggregate", str(run_dir)])
    assert (run_dir / "results.csv").read_text() == table
    manifest = json.loads((run_dir / cv.MANIFEST).read_text())
    (run_dir / cv.MANIFEST).write_text(json.dumps({**manifest, "repeats": 2}))
    with pytest.raises(cv.ProtocolError, match="2 fold x repeat runs have not finished"):
        cv.aggregate(run_dir, log=False)


@pytest.mark.slow  # about 30 s on the shared 2-core machine (two fits with W&B runs, test embeddings)
def test_every_fit_is_its_own_wandb_run_with_its_config_and_class_lists(glyph_subset, tmp_path, monkeypatch):
    """Regressions (issue 19): every fold wrote into the first fold's W&B run ("There is a wandb run already in
    progress ... will reuse this run"); each fit's config.yaml went to the logger's shared save_dir, overwritten by
    the next fit; the folds' class lists were written nowhere; results.csv had the column ``repeats`` twice;
    test_embeddings.pt recorded ``repeats = 0``; every fit warned "LightningCLI's args parameter is intended ..."."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.argv", ["lightning-dml", "cv", "--num_folds", "2"])  # as the console script sees it
    # start from W&B's state in a fresh process (the command's): an earlier test in this xdist worker may have left
    # a run or W&B's set-up behind
    wandb.finish()
    wandb.teardown()
    run_dir, save_dir = tmp_path / "cv", tmp_path / "wb"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        main(["cv", "--num_folds", "2", "--run_dir", str(run_dir), *tiny_fit_args(save_dir, "wandb")])
    assert not [str(w.message) for w in caught if "args parameter" in str(w.message)]
    folders = [cv.fold_dir(run_dir, 0, i) for i in range(2)]
    saved = [torch.load(folder / cv.EMBEDDINGS, weights_only=False) for folder in folders]
    runs = wandb_runs(save_dir)
    assert len(runs) == 3, sorted(runs)  # one run per fit, and the run of the table
    group = f"cv {run_dir.resolve()}"
    for i, (folder, fold) in enumerate(zip(folders, saved)):
        run = fold["wandb"]
        assert run["name"] == f"repeat 0 fold {i}" and run["group"] == group and run["job_type"] == "repeat 0"
        assert Path(run["dir"]) == runs[run["id"]]["dir"].resolve()
        record = runs[run["id"]]["record"]
        assert run["name"].encode() in record and group.encode() in record  # what W&B will sync
        # the fit's resolved config: in its run folder and in its W&B run's folder, with its own fold
        for config in (folder / "config.yaml", runs[run["id"]]["dir"] / "config.yaml"):
            data = yaml.safe_load(config.read_text())
            assert data["data"]["init_args"]["fold"] == i and data["trainer"]["default_root_dir"] == str(folder)
        assert fold["budget"]["repeats"] == 1 and fold["budget"]["num_folds"] == 2 and fold["world_size"] == 1
    assert saved[0]["wandb"]["id"] != saved[1]["wandb"]["id"]
    (table,) = [r for r in runs.values() if b"cv results" in r["record"]]
    assert group.encode() in table["record"]
    assert not (save_dir / "config.yaml").exists() and not (tmp_path / "logs" / "config.yaml").exists()
    check_class_lists(folders, 2)
    with open(run_dir / "results.csv") as handle:
        header = next(csv.reader(handle))
    assert header.count("repeats") == 1 and len(set(header)) == len(header), header


def test_the_budget_file_sets_folds_repeats_and_steps(tmp_path, monkeypatch):
    budget = tmp_path / "budget.yaml"
    budget.write_text("trials: 5\nsteps: 7\nfolds: 3\nrepeats: 2\n")
    calls = []
    monkeypatch.setattr(cv, "run_fold", lambda *args: calls.append(args))
    monkeypatch.setattr(cv, "aggregate", lambda run_dir: [])
    monkeypatch.setattr(cv.Path, "read_text", lambda self: "")
    cv.main(["--budget", str(budget), "--run_dir", str(tmp_path / "cv"), "--config", "c.yaml"])
    assert [(c[2], c[3], c[4]) for c in calls] == [(3, fold, repeat) for repeat in range(2) for fold in range(3)]
    assert all(c[0] == ["--config", "c.yaml", "--trainer.max_steps=7"] for c in calls)
    with pytest.raises(cv.ProtocolError, match="leave out --num_folds"):
        cv.main(["--budget", str(budget), "--num_folds", "2", "--config", "c.yaml"])
