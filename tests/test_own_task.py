"""Your own task end to end: an open-metric-learning table trains and tests through the module and the CLI, the
table's query/gallery flags, sequences and categories reach the metrics (against a brute force on the model's
embeddings), the extra metrics are an option of the module, and the tables print overall and per category."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import yaml

from lightning_dml import DMLModule
from lightning_dml.callbacks import ValidationSummary
from lightning_dml.callbacks.summary import format_metrics, split_categories
from lightning_dml.data import CategoryBalancedSampler, CSVDataModule
from lightning_dml.models import SmallConvNet
from tests.fixtures_table import make_oml_table

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "glyphs_table.yaml"


def test_the_metrics_option_is_checked_when_the_module_is_built():
    with pytest.raises(ValueError, match="bogus"):
        DMLModule(SmallConvNet(width=4), embedding_dim=8, metrics=["precision@10", "bogus"])
    module = DMLModule(SmallConvNet(width=4), embedding_dim=8, metrics="mrr")  # one name
    assert module.test_metrics.metrics == ("mrr",) and module.val_metrics.metrics == ("mrr",)
    assert module.hparams["metrics"] == "mrr"  # recorded as given
    config = yaml.safe_load(CONFIG.read_text())
    assert config["model"]["metrics"] == ["precision@4", "mrr", "ndcg@10", "map", "fnmr@fmr=0.01"]


def test_format_metrics_splits_overall_and_per_category():
    values = {"recall@1": 0.5, "threshold@fmr=0.01": 0.71234, "category/shoes/recall@1": 0.25,
              "category/a/b/recall@1": 1.0, "category/shoes/precision@10": 0.125, "fnmr@fmr=0.01": 0.3}
    overall, per_category = split_categories(values)
    assert overall == {"recall@1": 0.5, "threshold@fmr=0.01": 0.71234, "fnmr@fmr=0.01": 0.3}
    assert per_category == {"shoes": {"recall@1": 0.25, "precision@10": 0.125}, "a/b": {"recall@1": 1.0}}
    table, categories = format_metrics(values)
    rows = {line.split()[0]: line.split()[1:] for line in table.splitlines()[1:]}
    # rates in percent (two decimals), the threshold as the score it is
    assert rows == {"recall@1": ["50.00"], "threshold@fmr=0.01": ["0.7123"], "fnmr@fmr=0.01": ["30.00"]}
    lines = categories.splitlines()
    assert lines[0].split() == ["category", "recall@1", "precision@10"]
    assert lines[1].split() == ["shoes", "25.00", "12.50"] and lines[2].split() == ["a/b", "100.00", "-"]
    assert format_metrics({"recall@1": 0.5})[1] is None


def _brute_force(embeddings: torch.Tensor, dataset, names: list[str]) -> dict[str, float]:
    """recall@1 and mrr (docs/metrics.md) of the queries against the gallery, without the query itself and the
    gallery items of its sequence, ties by index; overall and per category of the queries. float64."""
    x = torch.nn.functional.normalize(embeddings.double(), dim=1)
    scores = x @ x.T
    labels, seq, cat = dataset.labels, dataset.sequence, dataset.category
    query, gallery = dataset.query_mask, dataset.gallery_mask
    hits, rr, cats = [], [], []
    for q in torch.nonzero(query).squeeze(1).tolist():
        allowed = gallery.clone()
        allowed[q] = False
        if seq[q] >= 0:
            allowed &= seq != seq[q]
        candidates = torch.nonzero(allowed).squeeze(1).tolist()
        ranked = sorted(candidates, key=lambda g: (-float(scores[q, g]), g))
        relevant = [labels[g] == labels[q] for g in ranked]
        hits.append(float(relevant[0]))
        rr.append(1.0 / (relevant.index(True) + 1) if any(relevant) else 0.0)
        cats.append(int(cat[q]))
    out = {"recall@1": float(np.mean(hits)), "mrr": float(np.mean(rr))}
    for c in sorted(set(cats)):
        chosen = [i for i, k in enumerate(cats) if k == c]
        out[f"category/{names[c]}/recall@1"] = float(np.mean([hits[i] for i in chosen]))
        out[f"category/{names[c]}/mrr"] = float(np.mean([rr[i] for i in chosen]))
    return out


def test_table_flags_sequences_and_categories_reach_the_metrics(tmp_path):
    """After a few training steps with the category sampler, ``trainer.test`` logs recall@1 and mrr overall and per
    category exactly as a brute force over the model's embeddings computes them with the table's query/gallery
    flags and sequence exclusion, names from the table's categories."""
    table = make_oml_table(tmp_path, train_labels=6, validation_labels=6, per_label=4, boxes=False)
    pl.seed_everything(0)
    data = CSVDataModule(table.file, classes_per_batch=2, samples_per_class=2, num_workers=0, eval_batch_size=7,
                         sampler="category", categories_per_batch=2)
    model = DMLModule(SmallConvNet(in_channels=1, width=4), embedding_dim=8, clustering=False, recall_at=(1,),
                      metrics=["mrr"])
    summary = ValidationSummary()
    trainer = pl.Trainer(max_steps=3, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, num_sanity_val_steps=0, callbacks=[summary],
                         default_root_dir=tmp_path)
    trainer.fit(model, datamodule=data)
    assert isinstance(trainer.train_dataloader.batch_sampler, CategoryBalancedSampler)
    (result,) = trainer.test(model, datamodule=data, verbose=False)
    dataset = data.test_dataset
    model.eval()
    with torch.no_grad():
        embeddings = torch.cat([model(batch[0]) for batch in data.test_dataloader()])
    expected = _brute_force(embeddings, dataset, data.category_names)
    assert set(expected) <= {k[len("test/"):] for k in result}
    for key, value in expected.items():
        assert result[f"test/{key}"] == pytest.approx(value, abs=1e-6), key
    assert summary.category_table is not None and summary.category_table.splitlines()[1].split()[0] == "dresses"
    # without the sequence exclusion the figures differ (the fixture's sequences hold relevant items)
    dataset.sequence = torch.full_like(dataset.sequence, -1)
    assert _brute_force(embeddings, dataset, data.category_names) != expected


def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "offline", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "lightning_dml", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


@pytest.mark.slow
def test_an_oml_table_trains_and_tests_through_the_cli(tmp_path):
    """The issue's acceptance: an OML-format CSV with query/gallery flags, categories and sequences trains and tests
    through ``lightning-dml fit``/``test`` (the worked example's config, on a tiny generated table), printing the
    overall and the per-category metrics."""
    table = make_oml_table(tmp_path / "data", train_labels=8, validation_labels=6, per_label=4)
    common = [
        "--config", str(CONFIG), "--data.init_args.root", str(table.file), "--trainer.max_epochs", "2",
        "--trainer.check_val_every_n_epoch", "1", "--trainer.enable_progress_bar", "false",
        "--trainer.default_root_dir", str(tmp_path / "run"), "--data.init_args.categories_per_batch", "2",
        "--data.init_args.classes_per_batch", "2", "--data.init_args.samples_per_class", "2",
        "--data.init_args.num_workers", "0", "--model.backbone.init_args.width", "8",
    ]
    fit = _run("fit", *common, cwd=tmp_path)
    assert fit.returncode == 0, fit.stderr[-3000:]
    out = fit.stdout
    assert out.count("Last validation (epoch 2, step 8)") == 1, out[-3000:]
    overall = out.split("Last validation")[1].split("Per category")[0]
    for metric in ("recall@1", "recall@4", "precision@4", "mrr", "ndcg@10", "map", "fnmr@fmr=0.01",
                   "threshold@fmr=0.01"):
        assert f"\n{metric} " in overall, metric
    categories = out.split("Per category (queries of each category), %:\n")[1].splitlines()
    assert categories[0].split()[:3] == ["category", "recall@1", "recall@4"]
    assert [line.split()[0] for line in categories[1:3]] == ["dresses", "shoes"]
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert last.is_file()
    test = _run("test", *common, "--ckpt_path", str(last), cwd=tmp_path)
    assert test.returncode == 0, test.stderr[-3000:]
    printed = test.stdout.split("Per category (test, queries of each category), %:\n")[1].splitlines()
    assert [line.split()[0] for line in printed[1:3]] == ["dresses", "shoes"]
    assert "DataLoader 0" not in test.stdout  # one table: Lightning's own, of the logged fractions, is off
    assert "Test metrics, %:" in test.stdout


def test_predict_on_a_table_writes_what_the_results_read(tmp_path):
    """``predict`` on a table writes the query/gallery masks, sequences, categories and names of the items beside
    their embeddings, so ``RetrievalResults.from_predictions`` ranks as the test metrics do: queries against the
    gallery, the query's sequence ignored, classes and categories named."""
    from lightning_dml.callbacks import PredictionWriter, load_predictions
    from lightning_dml.retrieval import RetrievalResults

    table = make_oml_table(tmp_path, train_labels=4, validation_labels=5, per_label=4, boxes=False)
    data = CSVDataModule(table.file, classes_per_batch=2, samples_per_class=2, num_workers=0, eval_batch_size=6)
    model = DMLModule(SmallConvNet(in_channels=1, width=4), embedding_dim=8, clustering=False)
    out = tmp_path / "predictions.pt"
    trainer = pl.Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[PredictionWriter(str(out))], default_root_dir=tmp_path)
    trainer.predict(model, datamodule=data)
    written = load_predictions(out)
    dataset = data.test_dataset
    n = len(dataset)
    assert written["indices"].tolist() == list(range(n))
    for name in ("query_mask", "gallery_mask", "sequence", "category"):
        assert torch.equal(written[name], getattr(dataset, name)), name
    assert not bool(written["query_mask"].all()) and bool((written["sequence"] >= 0).all())
    assert written["class_names"] == data.class_names and written["category_names"] == ["dresses", "shoes"]
    results = RetrievalResults.from_predictions(out, top_k=3)
    expected = RetrievalResults.compute(
        written["embeddings"], written["labels"], top_k=3, indices=written["indices"],
        query_mask=dataset.query_mask, gallery_mask=dataset.gallery_mask, sequence=dataset.sequence,
        category=dataset.category, class_names=data.class_names, category_names=data.category_names,
    )
    np.testing.assert_array_equal(results.query, expected.query)
    np.testing.assert_array_equal(results.neighbors, expected.neighbors)
    assert results.query.size == int(dataset.query_mask.sum()) < n
    assert results.category_names == ["dresses", "shoes"] and results.class_names == data.class_names


@pytest.mark.slow
def test_the_worked_examples_glyphs_table(tmp_path):
    """``examples/export_glyphs_table.py`` (docs/own_task.md) writes a table CSVDataModule reads without a warning
    about unanswerable queries: look-alike characters as label sets, each group in one evaluation split, training
    rows with one label, scripts as categories, font families as sequences, only regular fonts in the gallery."""
    import csv
    import importlib.util
    import warnings

    spec = importlib.util.spec_from_file_location("export_glyphs_table", ROOT / "examples" / "export_glyphs_table.py")
    export = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(export)
    file = export.export(tmp_path / "glyphs_table")
    with file.open(encoding="utf-8") as handle:
        rows = list(csv.DictReader(handle))
    groups = {r["labels"] for r in rows if r["labels"]}
    assert "A;Α;А" in groups and all(len(g.split(";")) >= 2 for g in groups)
    for group in groups:  # a group in one split, every member of it listed with the whole group
        members = [r for r in rows if r["label"] in group.split(";")]
        assert {r["split"] for r in members} <= {"validation"} or {r["split"] for r in members} <= {"test"}
        assert {r["labels"] for r in members} == {group}
    assert {r["category"] for r in rows} == {"latin", "greek", "cyrillic", "digit", "symbol"}
    train_chars = {r["label"] for r in rows if r["split"] == "train"}
    assert not train_chars & {r["label"] for r in rows if r["split"] != "train"}
    evaluated = [r for r in rows if r["split"] != "train"]
    assert all(r["is_query"] == "true" for r in evaluated)
    styles = ("Bold", "Bol", "Oblique", "Italic", "Ita", "cmb10", "cmti10", "cmmi10")  # bold, oblique, italic fonts
    assert all((r["is_gallery"] == "true") == (not any(s in r["path"] for s in styles)) for r in evaluated)
    assert sum(r["is_gallery"] == "true" for r in evaluated) < len(evaluated) / 2
    data = CSVDataModule(file, classes_per_batch=5, samples_per_class=4, num_workers=0, sampler="category",
                         categories_per_batch=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no unanswerable queries, no shared classes
        data.setup("fit")
    assert data.train_dataset.labels.ndim == 1 and data.test_dataset.labels.ndim == 2
    assert data.val_dataset is not data.test_dataset and data.category_names == sorted(data.category_names)
    assert set(data.sequence_names) == {"Computer Modern", "DejaVu Sans", "DejaVu Sans Mono", "DejaVu Serif",
                                        "STIX General"}


def _newest(root: Path, pattern: str) -> Path:
    """The newest file matching ``pattern`` under ``root`` (fit folders, predict's output: where a run puts them)."""
    found = sorted(root.rglob(pattern), key=lambda p: p.stat().st_mtime_ns)
    assert found, f"no {pattern} under {root}"
    return found[-1]


def _printed_table(text: str, title: str) -> dict[str, str]:
    """``{metric: printed value}`` of the overall table that follows ``title`` in a command's output."""
    block = text.split(title, 1)[1].split("\n\n", 1)[0]
    return {line.split()[0]: line.split()[1] for line in block.strip().splitlines()[1:] if len(line.split()) == 2}


@pytest.mark.slow
def test_the_first_day_walk_through(tmp_path, monkeypatch, capsys):
    """docs/own_task.md section 6, on a tiny table: own table -> fit -> test -> report -> index -> search -> serve ->
    predict -> export -> plain PyTorch. Checks the structure, not figures: every command succeeds, its output exists,
    and the outputs agree (report's Recall@1 is test's, printed alike; search finds a gallery image itself, and
    serve answers as search; plain PyTorch on the export folder gives predict's embedding of the same image)."""
    import json
    import shutil
    import signal
    import time

    from PIL import Image
    from torchvision.transforms import InterpolationMode
    from torchvision.transforms import functional as TF

    from lightning_dml.cli import main
    from lightning_dml.export import load_embedding_model
    from lightning_dml.export import main as export_main
    from tests.test_serve import _free_port, _request

    monkeypatch.chdir(tmp_path)
    table = make_oml_table(tmp_path / "shop", train_labels=6, validation_labels=4, per_label=4, boxes=False)
    tiny = ["--data.init_args.root", str(table.file), "--data.init_args.categories_per_batch", "2",
            "--data.init_args.classes_per_batch", "2", "--data.init_args.samples_per_class", "2",
            "--data.init_args.num_workers", "0", "--model.backbone.init_args.width", "4",
            "--trainer.enable_progress_bar", "false"]
    main(["fit", "--config", str(CONFIG), *tiny, "--trainer.max_epochs", "1"])
    last = _newest(tmp_path / "logs", "last.ckpt")
    # the config fit saves: every later command takes it (a copy: a later command may save its own beside it)
    saved = Path(shutil.copy(_newest(tmp_path / "logs", "config.yaml"), tmp_path / "fit_config.yaml"))
    capsys.readouterr()

    main(["test", "--config", str(saved), "--ckpt_path", str(last)])
    tested = _printed_table(capsys.readouterr().out, "Test metrics, %:")
    assert {"recall@1", "mrr", "ndcg@10", "threshold@fmr=0.01"} <= set(tested)

    main(["report", "--out", "report", "--config", str(saved), "--ckpt_path", str(last), "--queries", "5"])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    reported = dict(item.rsplit(" ", 1) for item in line.strip().split(", "))
    assert reported["recall@1"] == tested["recall@1"] and reported["mrr"] == tested["mrr"]  # one answer, one format
    assert (tmp_path / "report" / "index.html").is_file()

    main(["index", "build", "--config", str(saved), "--ckpt_path", str(last), "--gallery", str(table.file),
          "--split", "validation", "--kind", "flat", "--out", "shop_index"])
    query = next(Path(table.file.parent, r["path"]) for r in table.rows if r["split"] == "validation")
    capsys.readouterr()
    main(["search", "--index", "shop_index", "--k", "3", str(query)])
    (found,) = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert Path(found["results"][0]["path"]).resolve() == query.resolve()
    assert found["results"][0]["score"] == pytest.approx(1.0, abs=1e-4)

    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "lightning_dml", "serve", "--index", "shop_index", "--port",
                               str(port), "--accelerator", "cpu", "--k", "3"], cwd=tmp_path, start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        main(["predict", "--config", str(saved), "--ckpt_path", str(last)])
        predictions = _newest(tmp_path, "predictions.pt")
        export_main(["--config", str(saved), "--ckpt_path", str(last), "--output", "exported"])

        # plain PyTorch, the lines of docs/models.md
        model = load_embedding_model("exported")
        pre = json.loads(Path("exported/input_spec.json").read_text())
        spec = pre["input_spec"]
        image = Image.open(query).convert(pre["mode"])
        image = TF.resize(image, pre["resize_size"], InterpolationMode(spec["interpolation"]), antialias=True)
        x = TF.pil_to_tensor(TF.center_crop(image, pre["crop_size"])).float() * (spec["scale"] / 255)
        x = x.flip(0) if spec["color"] == "BGR" else x
        x = (x - torch.tensor(spec["mean"]).view(-1, 1, 1)) / torch.tensor(spec["std"]).view(-1, 1, 1)
        with torch.no_grad():
            plain = torch.nn.functional.normalize(model(x[None]), dim=1)[0]
        data = torch.load(predictions, weights_only=True)
        row = [Path(p).resolve() for p in data["paths"]].index(query.resolve())
        predicted = torch.nn.functional.normalize(data["embeddings"][row], dim=0)
        assert float(plain @ predicted) == pytest.approx(1.0, abs=1e-4)

        deadline = time.monotonic() + 120
        while True:
            try:
                if _request(port, "GET", "/health", timeout=5)[0] == 200:
                    break
            except OSError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "serve did not start"
            time.sleep(0.5)
        status, answer = _request(port, "POST", "/search?k=3", query.read_bytes(), "image/jpeg")
        assert status == 200 and [r["id"] for r in answer["results"]] == [r["id"] for r in found["results"]]
        assert _request(port, "GET", "/nope")[1] == {"error": "Not Found"}
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
