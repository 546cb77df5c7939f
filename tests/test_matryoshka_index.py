"""``lightning-dml index build --width N`` (issue 31 s.2): the index holds the leading N dimensions of the model's
embeddings, re-normalised; the manifest records N; ``search`` embeds and cuts its queries the same way and refuses
queries of another width in one line. Fixture: tests/test_index_cli.py's (random-init Glyphs model, 16-d)."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from lightning_dml.index import EmbeddingIndex
from lightning_dml.index.embed import ImageEmbedder
from lightning_dml.index.manifest import IndexMismatchError
from lightning_dml.widths import LeadingDims
from tests.test_index_cli import QUIET, ROOT, _checkpoint, _main_capture, _one_error, _write_gallery

WIDTH = 8


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("matryoshka_index")
    cfg = yaml.safe_load((ROOT / "configs" / "glyphs.yaml").read_text())
    cfg["trainer"] = {"logger": False, "enable_checkpointing": False, "accelerator": "cpu", "devices": 1}
    cfg["model"]["backbone"]["init_args"]["width"] = 8
    cfg["model"]["embedding_dim"] = 16
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    _write_gallery(root / "gallery", range(4))
    ckpt = _checkpoint(config, root / "model.ckpt", 0)
    args = ["index", "build", "--config", str(config), "--ckpt_path", str(ckpt), "--gallery", str(root / "gallery"),
            *QUIET]
    code, out, err = _main_capture([*args, "--out", str(root / "w8"), "--width", str(WIDTH)])
    assert code == 0, err[-3000:]
    assert f"size {WIDTH}" in out
    return {"root": root, "args": args, "index": root / "w8", "gallery": root / "gallery"}


def test_index_holds_the_cut_renormalised_vectors_and_search_cuts_queries(built):
    index = EmbeddingIndex.load(built["index"])
    assert (index.manifest.width, index.dim, len(index)) == (WIDTH, WIDTH, 20)
    assert json.loads((built["index"] / "manifest.json").read_text())["width"] == WIDTH
    assert isinstance(index.embedder.model, LeadingDims)
    # the model's full 16-d output, embedded without the cut
    full = ImageEmbedder(built["index"] / index.manifest.model, index.embedder.spec, index.manifest.preprocess)
    raw = full(index.table.paths)
    assert raw.shape[1] == 16
    cut = torch.nn.functional.normalize(raw[:, :WIDTH], dim=1)
    torch.testing.assert_close(index.embeddings, cut, atol=1e-5, rtol=0)
    assert index.embed_images(index.table.paths[:2]).shape == (2, WIDTH)
    # search (the CLI) ranks by the cosine of the cut query against the cut gallery
    query = str(built["gallery"] / "class2" / "3.png")
    code, out, err = _main_capture(["search", "--index", str(built["index"]), "--k", "5", query])
    assert code == 0, err
    results = json.loads(out)["results"]
    q = torch.nn.functional.normalize(full([query])[:, :WIDTH], dim=1)
    scores = (q.double() @ cut.double().T)[0]
    want = torch.argsort(scores, descending=True, stable=True)[:5]
    assert [r["id"] for r in results] == [int(index.table.ids[i]) for i in want]
    assert [r["score"] for r in results] == pytest.approx(scores[want].tolist(), abs=1e-5)


def test_queries_of_another_width_and_bad_widths_are_one_line(built, tmp_path):
    index = EmbeddingIndex.load(built["index"])
    with pytest.raises(IndexMismatchError, match=r"embedding size 16, .* size 8 \(the leading 8 dimensions"):
        index.search(torch.randn(2, 16), 3)
    line = _one_error([*built["args"], "--out", str(tmp_path / "w32"), "--width", "32"])
    assert "index build --width: width 32 exceeds the embedding width D = 16" in line
    assert not (tmp_path / "w32").exists()
    line = _one_error([*built["args"], "--out", str(tmp_path / "w0"), "--width", "0"])
    assert "--width must be >= 1" in line


def test_index_add_cuts_the_new_images(built, tmp_path):
    import shutil

    folder = tmp_path / "w8"
    shutil.copytree(built["index"], folder)
    _write_gallery(tmp_path / "more", range(4, 5), seed=1, per_class=2)
    code, out, err = _main_capture(["index", "add", "--index", str(folder), "--gallery", str(tmp_path / "more")])
    assert code == 0, err[-3000:]
    index = EmbeddingIndex.load(folder)
    assert (len(index), index.dim) == (22, WIDTH)
    full = ImageEmbedder(folder / index.manifest.model, index.embedder.spec, index.manifest.preprocess)
    new = index.table.paths[-2:]
    want = torch.nn.functional.normalize(full(new)[:, :WIDTH], dim=1)
    torch.testing.assert_close(index.embeddings[-2:], want, atol=1e-5, rtol=0)
