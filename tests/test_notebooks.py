"""The notebooks run from top to bottom (nbclient, the test's own Python as kernel), so they cannot rot.

``quickstart.ipynb`` trains, evaluates and saves a checkpoint and the test embeddings into the working folder;
``embeddings.ipynb`` then loads them from the same folder. The only changes made to the notebooks are a first cell
that serves the Glyphs font renderings from the session's cache (tests/glyph_cache.py) and a cell after each one's
``parameters`` cell: one torch thread and, in the quickstart, fewer training steps, all to save time.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from tests import glyph_cache

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
#: What the test sets in quickstart.ipynb's parameters cell: fewer training steps (the notebook's 3 epochs of 20
#: steps were most of the suite's longest test); the notebook still asserts that training improved Recall@1.
QUICKSTART_TEST_PARAMETERS = "EPOCHS = 2\nSTEPS_PER_EPOCH = 10"
#: Run after every notebook's parameters cell: one torch thread, as every process of the suite, for the notebooks'
#: two (beside another pytest worker the second thread mostly spins: the quickstart's fit took 5x the CPU time)
ONE_THREAD = "torch.set_num_threads(1)"


def _run(name: str, workdir: Path, cache: Path, parameters: str = "") -> nbformat.NotebookNode:
    """Execute notebook ``name`` in ``workdir``; ``parameters``: code run right after its cell tagged
    ``parameters`` (as papermill does), replacing the values set there (after :data:`ONE_THREAD`)."""
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
    tagged = [i for i, cell in enumerate(notebook.cells) if "parameters" in cell.metadata.get("tags", [])]
    assert len(tagged) == 1, f"{name}: one cell tagged 'parameters'"
    notebook.cells.insert(tagged[0] + 1, nbformat.v4.new_code_cell(f"{ONE_THREAD}\n{parameters}"))
    setup = (
        f"import sys; sys.path.insert(0, {str(ROOT)!r})\n"
        f"from tests.glyph_cache import install; install({str(cache)!r})"
    )
    notebook.cells.insert(0, nbformat.v4.new_code_cell(setup))
    client = NotebookClient(
        notebook,
        timeout=300,
        kernel_name="python3",
        resources={"metadata": {"path": str(workdir)}},
    )
    client.execute()
    return notebook


def _text(notebook: nbformat.NotebookNode) -> str:
    chunks = []
    for cell in notebook.cells:
        for output in cell.get("outputs", []):
            chunks.append(output.get("text", "") or "".join(output.get("data", {}).get("text/plain", "")))
    return "\n".join(chunks)


def _images(notebook: nbformat.NotebookNode) -> int:
    return sum("image/png" in o.get("data", {}) for c in notebook.cells for o in c.get("outputs", []))


@pytest.mark.slow
def test_quickstart_then_embeddings_notebook(tmp_path, tmp_path_factory, monkeypatch):
    cache = tmp_path_factory.getbasetemp() / glyph_cache.FILENAME
    glyph_cache.install(cache)  # written once per session
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel's OpenMP (t-SNE's too); torch's: ONE_THREAD
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend puts the figures in the outputs
    assert sys.executable  # the kernel is this interpreter's ipykernel

    # 2 x 10 training steps instead of the notebook's 3 x 20 (a third of its time): still enough for its own check
    # that training improves Recall@1 on the test characters, and every cell runs (2 points on the recall curve)
    quick = _run("quickstart.ipynb", tmp_path, cache, QUICKSTART_TEST_PARAMETERS)
    text = _text(quick)
    assert "recall@1" in text and "training characters" in text
    assert _images(quick) >= 3  # samples, similarity histograms, retrieval grid
    outputs = tmp_path / "quickstart_outputs"
    assert {"glyphs.ckpt", "test_predictions.pt", "recall_curve.csv", "recall_curve.png"} <= set(os.listdir(outputs))

    emb = _run("embeddings.ipynb", tmp_path, cache)
    text = _text(emb)
    assert "checkpoint reproduces the saved embeddings" in text
    assert "most confused" in text
    assert _images(emb) >= 3  # t-SNE, retrieval grid, per-class recall

    # a predict output alone (no checkpoint): the same metrics as with the checkpoint
    only = _text(_run("embeddings.ipynb", tmp_path, cache, "CHECKPOINT = None"))
    assert "checkpoint reproduces" not in only and _recall_at_1(only) == _recall_at_1(text)


@pytest.mark.slow
def test_embeddings_notebook_reads_a_checkpoint_with_its_run_config(tmp_path, tmp_path_factory, capsys, monkeypatch):
    """Issue 27 s.2: embeddings.ipynb loads a lightning-dml checkpoint with the config its run saved (not only the
    quickstart's files), embeds the test split and shows the same Recall@1 as the library's metrics."""
    import torch
    import yaml

    from lightning_dml.data import GlyphsDataModule
    from lightning_dml.metrics import functional
    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule
    from tests.test_export import saved_config

    cache = tmp_path_factory.getbasetemp() / glyph_cache.FILENAME
    glyph_cache.install(cache)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    config = {
        "model": {"backbone": {"class_path": "lightning_dml.models.SmallConvNet", "init_args": {"width": 4}},
                  "embedding_dim": 8, "clustering": False},
        "data": {"class_path": "lightning_dml.data.GlyphsDataModule", "init_args": {"image_size": 16}},
    }
    path = saved_config("fit", config, tmp_path, capsys)
    assert "weights_only" in yaml.safe_load(path.read_text())
    torch.manual_seed(4)
    module = DMLModule(SmallConvNet(width=4), embedding_dim=8, clustering=False).eval()
    torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": "2.6.0"}, tmp_path / "last.ckpt")
    data = GlyphsDataModule(image_size=16)
    data.setup("test")
    with torch.no_grad():
        embeddings = torch.cat([module(batch[0]) for batch in data.test_dataloader()])
    expected = functional.retrieval_metrics(embeddings, data.test_dataset.labels, recall_at=(1,))["recall@1"]

    text = _text(_run("embeddings.ipynb", tmp_path, cache,
                      f"PREDICTIONS = None\nCHECKPOINT = Path({str(tmp_path / 'last.ckpt')!r})\n"
                      f"CONFIG = Path({str(path)!r})"))
    assert f"{len(embeddings)} test embeddings of dimension 8" in text
    assert _recall_at_1(text) == pytest.approx(100 * float(expected), abs=0.05)


def _recall_at_1(text: str) -> float:
    return float(next(line.split()[1] for line in text.splitlines() if line.startswith("recall@1 ")))


@pytest.mark.slow
def test_embeddings_notebook_says_what_is_missing(tmp_path, tmp_path_factory):
    from nbclient.exceptions import CellExecutionError

    with pytest.raises(CellExecutionError, match="run notebooks/quickstart.ipynb first"):
        _run("embeddings.ipynb", tmp_path, tmp_path_factory.getbasetemp() / glyph_cache.FILENAME)
