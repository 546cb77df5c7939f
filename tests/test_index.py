"""``EmbeddingIndex`` from tensors (issue 23): every kind's save/load round trip, ``flat`` equal to the exact engine
(ties by the smaller id), padding, add/remove, sharded equal to one index, mismatch errors, changed files, broken
folders, the gallery readers and ``evaluate_index`` against a reference written here."""

from __future__ import annotations

import json
import os

import pytest
import torch
from PIL import Image

from lightning_dml.index import (
    KINDS,
    EmbeddingIndex,
    IndexFolderError,
    IndexMismatchError,
    IndexOptionError,
    IndexTable,
)
from lightning_dml.index.evaluate import EvaluationError, evaluate_index
from lightning_dml.index.gallery import read_items
from lightning_dml.metrics import functional as MF


def clustered(n_classes: int = 12, per_class: int = 25, d: int = 16, noise: float = 0.3, seed: int = 0):
    """Embeddings around ``n_classes`` random centres, and their labels (as text)."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(n_classes, d, generator=g)
    labels = torch.arange(n_classes).repeat_interleave(per_class)
    x = centres[labels] + noise * torch.randn(len(labels), d, generator=g)
    return x, [f"c{int(v)}" for v in labels]


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_flat_search_equals_the_exact_engine(metric):
    x, _ = clustered()
    q = torch.randn(17, 16, generator=torch.Generator().manual_seed(1))
    index = EmbeddingIndex.build(x, kind="flat", metric=metric)
    scores, ids = index.search(q, 10)
    ref_scores, ref_ids = MF.knn(q, x, k=10, metric=metric)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(scores.double(), ref_scores, rtol=0, atol=1e-4 * (1 if metric == "cosine" else 100))
    assert scores.dtype == torch.float32 and ids.dtype == torch.int64


def test_equal_scores_are_ordered_by_smaller_id_as_the_exact_engine():
    base = torch.randn(6, 8, generator=torch.Generator().manual_seed(3))
    x = base.repeat(5, 1)  # every vector five times: ids i, i+6, i+12, ... tie exactly
    index = EmbeddingIndex.build(x, kind="flat")
    _, ids = index.search(base, 5)
    _, ref = MF.knn(base, x, k=5)
    assert torch.equal(ids, ref)
    assert torch.equal(ids, torch.arange(6).unsqueeze(1) + 6 * torch.arange(5))
    # five equal scores across the 2nd place: the two smaller ids, for every kind and with two shards
    for kind, shards in (("flat", 1), ("flat", 2), ("hnsw", 1), ("ivf_flat", 2)):
        index = EmbeddingIndex.build(x, kind=kind, shards=shards, **({"nlist": 2} if kind == "ivf_flat" else {}))
        _, ids = index.search(base, 2)
        assert torch.equal(ids, torch.arange(6).unsqueeze(1) + 6 * torch.arange(2)), (kind, shards)


@pytest.mark.parametrize("kind", list(KINDS))
def test_save_load_round_trip_per_kind(kind, tmp_path):
    x, labels = clustered()
    paths = [f"/nowhere/{i}.png" for i in range(len(labels))]
    index = EmbeddingIndex.build(x, {"paths": paths, "labels": labels}, kind=kind, metric="cosine")
    q = x[::7] + 0.05
    scores, ids = index.search(q, 5)
    assert (scores[:, :-1] >= scores[:, 1:]).all()
    index.save(tmp_path / "idx")
    manifest = json.loads((tmp_path / "idx" / "manifest.json").read_text())
    assert manifest["kind"] == kind and manifest["embedding_dim"] == 16 and manifest["count"] == len(labels)
    assert manifest["metric"] == "cosine" and manifest["faiss"] and manifest["library"]
    loaded = EmbeddingIndex.load(tmp_path / "idx")
    scores2, ids2 = loaded.search(q, 5)
    assert torch.equal(ids, ids2) and torch.equal(scores, scores2)
    assert loaded.table.paths == paths and loaded.table.labels == labels
    torch.testing.assert_close(loaded.vectors(torch.tensor([3, 0])),
                               torch.nn.functional.normalize(x[[3, 0]], dim=1))
    # clustered data: the approximate kinds find most of each query's own class
    hits = [labels[int(i)] == labels[7 * r] for r, i in enumerate(ids[:, 0])]
    assert sum(hits) >= 0.8 * len(hits)


def test_rows_with_fewer_than_k_results_are_padded():
    x, _ = clustered(n_classes=1, per_class=5)
    scores, ids = EmbeddingIndex.build(x).search(x[:2], 8)
    assert (ids[:, 5:] == -1).all() and torch.isinf(scores[:, 5:]).all() and (ids[:, :5] >= 0).all()


@pytest.mark.parametrize("kind", ["flat", "ivf_flat", "hnsw"])
def test_add_then_remove(kind, tmp_path):
    x, labels = clustered()
    index = EmbeddingIndex.build(x, {"labels": labels}, kind=kind)
    new = torch.randn(3, 16, generator=torch.Generator().manual_seed(9)) * 5
    ids = index.add(new, paths=["a", "b", "c"], labels=["new"] * 3)
    assert ids.tolist() == [len(labels), len(labels) + 1, len(labels) + 2] and len(index) == len(labels) + 3
    _, found = index.search(new, 1)
    assert found[:, 0].tolist() == ids.tolist()
    assert index.remove([ids[0].item(), 0]) == 2
    _, found = index.search(torch.cat([new[:1], x[:1]]), 5)
    assert ids[0].item() not in found.tolist()[0] and 0 not in found.tolist()[1]
    again = index.add(new[:1])  # ids are never reused
    assert again.item() == len(labels) + 3
    with pytest.raises(KeyError, match="not in the index"):
        index.remove([10_000])
    index.save(tmp_path / "i")
    loaded = EmbeddingIndex.load(tmp_path / "i")
    assert len(loaded) == len(labels) + 2 and loaded.table.labels[-1] == ""
    assert torch.equal(loaded.search(new, 3)[1], index.search(new, 3)[1])


@pytest.mark.parametrize("kind", ["flat", "ivf_flat", "ivf_pq"])
def test_two_shards_search_as_one_index(kind, tmp_path):
    x, _ = clustered(per_class=40)
    q = torch.randn(30, 16, generator=torch.Generator().manual_seed(4))
    options = {} if kind == "flat" else {"nlist": 8, "nprobe": 3, **({"m": 4, "nbits": 3} if kind == "ivf_pq" else {})}
    one = EmbeddingIndex.build(x, kind=kind, **options)
    two = EmbeddingIndex.build(x, kind=kind, shards=2, **options)
    assert torch.equal(one.search(q, 10)[1], two.search(q, 10)[1])
    two.save(tmp_path / "s")
    assert sorted(p.name for p in (tmp_path / "s").glob("*.faiss")) == ["shard-0.faiss", "shard-1.faiss"]
    loaded = EmbeddingIndex.load(tmp_path / "s")
    assert torch.equal(loaded.search(q, 10)[1], one.search(q, 10)[1])
    added = loaded.add(q[:1])
    assert loaded.search(q[:1], 1)[1].item() == added.item()


def test_queries_of_another_model_are_one_error_naming_both():
    x, _ = clustered()
    index = EmbeddingIndex.build(x, manifest={"checkpoint": {"path": "/m.ckpt", "sha256": "aaa"}})
    with pytest.raises(IndexMismatchError, match="embedding size 32.*size 16"):
        index.search(torch.randn(2, 32), 3)
    with pytest.raises(IndexMismatchError, match="sha256 bbb.*sha256 aaa"):
        index.search(x[:2], 3, checkpoint_sha256="bbb")
    with pytest.raises(IndexMismatchError, match="sha256 bbb.*sha256 aaa"):
        index.add(x[:2], checkpoint_sha256="bbb")
    index.search(x[:2], 3, checkpoint_sha256="aaa")  # the same model


def test_bad_options_and_inputs():
    x, _ = clustered()
    with pytest.raises(IndexOptionError, match="unknown index kind 'ivf'"):
        EmbeddingIndex.build(x, kind="ivf")
    with pytest.raises(IndexOptionError, match="has no option nprobe"):
        EmbeddingIndex.build(x, kind="hnsw", nprobe=3)
    with pytest.raises(IndexOptionError, match="m = 5 must divide the embedding size 16"):
        EmbeddingIndex.build(x, kind="ivf_pq", m=5)
    bad = x.clone()
    bad[4, 2] = float("nan")
    with pytest.raises(ValueError, match="row 4 is not finite"):
        EmbeddingIndex.build(bad)


def test_changed_files_names_modified_and_missing_files(tmp_path):
    files = []
    for i in range(3):
        path = tmp_path / f"{i}.bin"
        path.write_bytes(b"x" * (i + 1))
        files.append(str(path))
    index = EmbeddingIndex.build(torch.randn(3, 4), {"paths": files, "labels": ["a", "b", "c"]})
    index.save(tmp_path / "idx")
    assert EmbeddingIndex.load(tmp_path / "idx").changed_files() == []
    (tmp_path / "1.bin").write_bytes(b"changed!")
    os.remove(files[2])
    changed = EmbeddingIndex.load(tmp_path / "idx").changed_files()
    assert changed == [(1, files[1], "modified"), (2, files[2], "missing")]


def test_broken_index_folders_are_one_error_naming_the_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        EmbeddingIndex.load(tmp_path / "none")
    (tmp_path / "empty").mkdir()
    with pytest.raises(IndexFolderError, match="no manifest.json"):
        EmbeddingIndex.load(tmp_path / "empty")
    EmbeddingIndex.build(torch.randn(10, 4)).save(tmp_path / "idx")
    table = (tmp_path / "idx" / "table.csv").read_text().splitlines()
    (tmp_path / "idx" / "table.csv").write_text("\n".join(table[:-1]) + "\n")
    with pytest.raises(IndexFolderError, match="embeddings.npy has shape \\(10, 4\\), expected \\(9, 4\\)"):
        EmbeddingIndex.load(tmp_path / "idx")
    (tmp_path / "idx" / "index.faiss").unlink()
    with pytest.raises(IndexFolderError, match="index.faiss is missing"):
        EmbeddingIndex.load(tmp_path / "idx")


def _image(path, value: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("L", (8, 8), value).save(path)


def test_gallery_folder_and_table_reading(tmp_path):
    _image(tmp_path / "g" / "cat" / "1.png", 1)
    _image(tmp_path / "g" / "cat" / "sub" / "2.png", 2)
    _image(tmp_path / "g" / "dog" / "3.jpg", 3)
    _image(tmp_path / "g" / "top.png", 4)
    _image(tmp_path / "g" / ".hidden" / "4.png", 5)
    (tmp_path / "g" / "dog" / "notes.txt").write_text("x")
    (tmp_path / "g" / "dog" / "._3.jpg").write_bytes(b"")
    items = read_items(tmp_path / "g")
    assert [p.relative_to(tmp_path / "g").as_posix() for p in items.paths] == [
        "top.png", "cat/1.png", "cat/sub/2.png", "dog/3.jpg"]
    assert items.labels == ["", "cat", "cat", "dog"]
    (tmp_path / "t.csv").write_text("path,label,split\ng/cat/1.png,cat,test\ng/dog/3.jpg,7.0,train\n")
    table = read_items(tmp_path / "t.csv")
    assert table.labels == ["cat", "7"] and table.paths[0] == (tmp_path / "g" / "cat" / "1.png").absolute()
    assert read_items(tmp_path / "t.csv", split="train").labels == ["7"]
    (tmp_path / "bad.csv").write_text("path,label\ng/cat/1.png,cat\ng/none.png,x\n")
    with pytest.raises(ValueError, match="row 3: no file"):
        read_items(tmp_path / "bad.csv")
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match="no image file in folder"):
        read_items(tmp_path / "none")


def _reference_metrics(index, queries, query_labels, length, loo):
    """Recall@1 and MAP@R of the index's lists, one query at a time in plain Python."""
    gallery_labels = index.table.labels
    recall1, aps = [], []
    for qi in range(queries.shape[0]):
        _, ids = index.search(queries[qi : qi + 1], length + 1)
        ranked = [int(i) for i in ids[0].tolist() if i >= 0 and not (loo and int(i) == qi)][:length]
        rel = [gallery_labels[i] == query_labels[qi] for i in ranked]
        r = sum(v == query_labels[qi] for v in gallery_labels) - (1 if loo else 0)
        recall1.append(float(bool(rel) and rel[0]))
        hits, ap = 0, 0.0
        for pos, is_rel in enumerate(rel[:r]):
            if is_rel:
                hits += 1
                ap += hits / (pos + 1)
        aps.append(ap / r)
    return sum(recall1) / len(recall1), sum(aps) / len(aps)


@pytest.mark.parametrize("kind", ["flat", "ivf_pq"])
def test_evaluate_index_against_exact_and_a_reference(kind):
    x, labels = clustered(per_class=12, noise=0.9)
    index = EmbeddingIndex.build(x, {"labels": labels}, kind=kind, **({"nprobe": 1} if kind == "ivf_pq" else {}))
    result = evaluate_index(index, k=10, recall_at=(1, 4))
    exact = MF.retrieval_metrics(x, torch.tensor([int(v[1:]) for v in labels]), recall_at=(1, 4))
    assert result["rows"]["exact"]["recall@1"] == pytest.approx(exact["recall@1"])
    assert result["rows"]["exact"]["map@r"] == pytest.approx(exact["map@r"])
    approx = result["rows"][f"index ({kind})"]
    ref_r1, ref_map = _reference_metrics(index, index.embeddings, labels, 24, loo=True)
    assert approx["recall@1"] == pytest.approx(ref_r1) and approx["map@r"] == pytest.approx(ref_map)
    if kind == "flat":
        assert result["neighbour_recall@k"] == 1.0 and approx == pytest.approx(result["rows"]["exact"])
    else:
        assert 0 < result["neighbour_recall@k"] < 1
    # given queries: ranked against the whole gallery
    q, q_labels = x[:30] + 0.1, labels[:30]
    given = evaluate_index(index, q, q_labels, k=5, recall_at=(1,))
    ref_r1, ref_map = _reference_metrics(index, q, q_labels, 25, loo=False)
    assert given["rows"][f"index ({kind})"]["recall@1"] == pytest.approx(ref_r1)
    assert given["rows"][f"index ({kind})"]["map@r"] == pytest.approx(ref_map)


def test_evaluate_needs_labels():
    index = EmbeddingIndex.build(torch.randn(5, 4), IndexTable(range(5), ["p"] * 5, ["a", "", "b", "a", "b"]))
    with pytest.raises(EvaluationError, match="1 item\\(s\\) without a label"):
        evaluate_index(index)
