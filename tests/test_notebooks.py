"""The notebooks run from top to bottom (nbclient, the test's own Python as kernel), so they cannot rot.

``quickstart.ipynb`` trains, evaluates and saves a checkpoint and the test embeddings into the working folder;
``embeddings.ipynb`` then loads them from the same folder. The only change made to the notebooks is a first cell
that serves the Glyphs font renderings from the session's cache (tests/glyph_cache.py) to save time.
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


def _run(name: str, workdir: Path, cache: Path) -> nbformat.NotebookNode:
    notebook = nbformat.read(NOTEBOOKS / name, as_version=4)
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
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the kernel's inline backend puts the figures in the outputs
    assert sys.executable  # the kernel is this interpreter's ipykernel

    quick = _run("quickstart.ipynb", tmp_path, cache)
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


@pytest.mark.slow
def test_embeddings_notebook_says_what_is_missing(tmp_path, tmp_path_factory):
    from nbclient.exceptions import CellExecutionError

    with pytest.raises(CellExecutionError, match="run notebooks/quickstart.ipynb first"):
        _run("embeddings.ipynb", tmp_path, tmp_path_factory.getbasetemp() / glyph_cache.FILENAME)
