"""The Milvus gallery store (issue 31 s.4, :mod:`lightning_dml.index.milvus`) against Milvus Lite (a tmp ``.db``):
exact (FLAT) search equal to the exact engine's neighbours and to the faiss flat index's, ties across the k-th place,
add/remove, refusal of another model's queries, and the commands (``index build|add|evaluate``, ``search``, the
``serve`` model worker) with ``--store milvus --uri``. One Milvus Lite database per module; skipped with the reason
where pymilvus or milvus-lite cannot be imported or started."""

from __future__ import annotations

import base64
import dataclasses
import fcntl
import hashlib
import json
import os
import shutil

import numpy as np
import pytest
import torch

pytest.importorskip("pymilvus", reason="the Milvus store needs pymilvus: pip install 'lightning-dml[milvus]'")
pytest.importorskip("milvus_lite", reason="a .db URI needs milvus-lite: pip install 'lightning-dml[milvus]'")

from lightning_dml.checkpoints import checkpoint_record  # noqa: E402
from lightning_dml.index import EmbeddingIndex, IndexTable  # noqa: E402
from lightning_dml.index.index import MODEL  # noqa: E402
from lightning_dml.index.manifest import IndexFolderError, IndexMismatchError  # noqa: E402
from lightning_dml.index.milvus import MilvusIndex, MilvusStoreError  # noqa: E402
from lightning_dml.metrics import functional as MF  # noqa: E402
from tests.test_index_cli import QUIET, _checkpoint, _main_capture, _one_error, _write_gallery  # noqa: E402

ROOT_CONFIG = "configs/glyphs.yaml"


@pytest.fixture(scope="module")
def db(tmp_path_factory) -> str:
    """One Milvus Lite database for the module (started on first use; skipped where it cannot start)."""
    path = str(tmp_path_factory.mktemp("milvus") / "gallery.db")
    try:
        from lightning_dml.index.milvus import connect

        connect(path)
    except MilvusStoreError as error:
        pytest.skip(f"Milvus Lite cannot start here: {error}")
    return path


def _data(seed: int = 0, n: int = 60, d: int = 16) -> tuple[torch.Tensor, torch.Tensor, IndexTable]:
    """Clustered gallery with exact duplicates (tied scores) and shuffled sparse ids; queries include gallery rows."""
    g = torch.Generator().manual_seed(seed)
    centres = torch.randn(4, d, generator=g)
    x = centres[torch.arange(n) % 4] + 0.3 * torch.randn(n, d, generator=g)
    x[[r for r in (7, 19, 33, 41, 50) if r < n]] = x[2].clone()  # copies of row 2: tied scores for any query
    queries = torch.cat([x[[2, 5]], centres + 0.1 * torch.randn(4, d, generator=g)])
    ids = torch.randperm(n, generator=g).numpy() * 3 + 5  # not in insertion order: Milvus's order of ties is not ours
    table = IndexTable(ids, [f"img{i}.png" for i in range(n)], [f"c{i % 4}" for i in range(n)])
    return x, queries, table


def _assert_same_ranking(ids: torch.Tensor, ref: torch.Tensor, table: IndexTable, exact: torch.Tensor) -> None:
    """``ids`` ranks as ``ref`` does: the same float64 score at every rank, the same items above the last tied
    score, and the smaller ids first among equal float64 scores (the exact engine's tie rule)."""
    for q in range(ids.shape[0]):
        a = table.rows_of(ids[q].numpy())
        b = table.rows_of(ref[q].numpy())
        assert (a >= 0).all() and (b >= 0).all()
        sa, sb = exact[q, a], exact[q, b]
        assert torch.allclose(sa, sb, atol=1e-6), (q, ids[q], ref[q])
        above = sb > sb[-1] + 1e-6
        assert set(a[above.numpy()].tolist()) == set(b[above.numpy()].tolist())
        for i in range(len(a) - 1):  # within exact float64 ties: ascending ids
            if exact[q, a[i]] == exact[q, a[i + 1]]:
                assert ids[q, i] < ids[q, i + 1]


@pytest.mark.parametrize("metric", ["cosine", "euclidean"])
def test_flat_search_equals_the_exact_engine_and_the_faiss_flat_index(db, metric):
    x, queries, table = _data()
    milvus = MilvusIndex.build(x, table, metric, uri=db, collection=f"exact_{metric}")
    faiss_flat = EmbeddingIndex.build(x, table, "flat", metric)
    gallery = faiss_flat.embeddings.double()
    qv = torch.nn.functional.normalize(queries, dim=1) if metric == "cosine" else queries
    exact = qv.double() @ gallery.T if metric == "cosine" else -torch.cdist(qv.double(), gallery) ** 2
    for k in (1, 3, 6, len(x)):  # k = 3, 6: the cut falls inside the six tied copies of row 2 (query 0)
        scores, ids = milvus.search(queries, k)
        f_scores, f_ids = faiss_flat.search(queries, k)
        assert torch.equal(ids, f_ids), k  # the faiss flat index's ids, also inside the ties
        assert torch.allclose(scores, f_scores, atol=1e-5)
        e_scores, e_rows = MF.knn(queries, torch.as_tensor(x), k=k, metric=metric)
        _assert_same_ranking(ids, torch.from_numpy(table.ids[e_rows.numpy()]), table, exact)
        assert torch.allclose(scores.double(), e_scores, atol=1e-5)
    # query 0 is row 2: its six copies first, in id order (the exact engine's tie rule), whatever Milvus's order
    copies = sorted(table.ids[[2, 7, 19, 33, 41, 50]].tolist())
    assert milvus.search(queries[:1], 4)[1][0].tolist() == copies[:4]
    rows = milvus.results(*milvus.search(queries[1:2], 2))
    assert rows[0][0] == {"id": int(table.ids[5]), "path": "img5.png", "label": "c1",
                          "score": pytest.approx(rows[0][0]["score"])}
    assert torch.equal(milvus.vectors(torch.tensor([int(table.ids[3]), int(table.ids[0])])),
                       faiss_flat.vectors(torch.tensor([int(table.ids[3]), int(table.ids[0])])))
    assert len(milvus) == len(x) and milvus.metric == metric and milvus.dim == x.shape[1]
    milvus.close()


def test_add_remove_reopen_as_the_faiss_index_does(db):
    x, queries, table = _data(seed=1, n=30)
    milvus = MilvusIndex.build(x, table, "cosine", uri=db, collection="changes")
    faiss_flat = EmbeddingIndex.build(x, table, "flat", "cosine")
    extra = torch.randn(4, x.shape[1], generator=torch.Generator().manual_seed(2))
    calibration = {"threshold": 0.5, "checkpoint_sha256": None}  # stored by another handle (index calibrate)
    MilvusIndex.open(db, "changes").update_manifest(lambda manifest: setattr(manifest, "calibration", calibration))
    added = milvus.add(extra, ["n0", "n1", "n2", "n3"], ["a", "b", "a", "b"])
    assert torch.equal(added, faiss_flat.add(extra, ["n0", "n1", "n2", "n3"], ["a", "b", "a", "b"]))
    gone = [int(table.ids[0]), int(added[-1]), int(table.ids[9])]
    assert milvus.remove(gone) == faiss_flat.remove(gone) == 3
    with pytest.raises(KeyError):
        milvus.remove([int(table.ids[0])])
    milvus.close()
    again = MilvusIndex.open(db, "changes")  # the store holds it: reopened, same answers, ids never reused
    assert len(again) == len(faiss_flat) == 30 + 4 - 3
    assert again.manifest.calibration == calibration  # kept by the add of a handle opened before it was stored
    probe = torch.cat([queries, extra])
    assert torch.equal(again.search(probe, 5)[1], faiss_flat.search(probe, 5)[1])
    assert not set(gone) & set(again.search(probe, len(again))[1].flatten().tolist())
    assert torch.equal(again.add(extra[:1])[0:1], faiss_flat.add(extra[:1])[0:1])  # next_id kept across the reopen
    rows = lambda t: {i: (p, v) for i, p, v in zip(t.ids.tolist(), t.paths, t.labels)}  # noqa: E731
    assert rows(again.table) == rows(faiss_flat.table)  # (Milvus keeps no insertion order: its table is in id order)
    assert torch.equal(again.embeddings, faiss_flat.vectors(torch.from_numpy(again.table.ids)))
    again.close()


def test_another_models_queries_are_refused(db):
    x, queries, table = _data(seed=3, n=12)
    manifest = {"checkpoint": {"path": "/ckpt/a.ckpt", "sha256": "a" * 64}}
    milvus = MilvusIndex.build(x, table, "cosine", manifest, uri=db, collection="identity")
    with pytest.raises(IndexMismatchError, match="embedding size 8.*size 16"):
        milvus.search(torch.randn(2, 8), 3)
    with pytest.raises(IndexMismatchError, match=f"{'b' * 64}.*{'a' * 64}"):
        milvus.search(queries, 3, checkpoint_sha256="b" * 64)
    with pytest.raises(IndexMismatchError, match="added embeddings have embedding size 8"):
        milvus.add(torch.randn(1, 8))
    assert milvus.search(queries, 3, checkpoint_sha256="a" * 64)[1].shape == (len(queries), 3)
    with pytest.raises(MilvusStoreError, match="exists; .*--overwrite"):
        MilvusIndex.build(x, table, "cosine", uri=db, collection="identity")
    # rebuilt under the same name (another model's vectors): the name moves, the gallery opened before refuses
    rebuilt = MilvusIndex.build(x[:, :8], None, "cosine", uri=db, collection="identity", replace=True)
    with pytest.raises(IndexFolderError, match="was rebuilt .* open it again"):
        milvus.search(queries, 3)
    assert MilvusIndex.open(db, "identity").dim == 8 and len(rebuilt) == len(x)
    milvus.close()


def test_a_rebuild_replaces_the_model_folder_and_nothing_else(db, tmp_path):
    x, _, table = _data(seed=4, n=10)
    (tmp_path / "model.safetensors").write_bytes(b"weights")  # copied and hashed, not loaded, by build
    (tmp_path / "models" / "keep").mkdir(parents=True)
    first = MilvusIndex.build(x, table, "cosine", uri=db, collection="models",
                              model_file=tmp_path / "model.safetensors", model_dir=tmp_path / "models")
    second = MilvusIndex.build(x, table, "cosine", uri=db, collection="models", replace=True,
                               model_file=tmp_path / "model.safetensors", model_dir=tmp_path / "models")
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == sorted(["keep", second.collection])
    assert second.manifest.model == str(tmp_path / "models" / second.collection / MODEL) != first.manifest.model
    assert second.model_sha256 == hashlib.sha256(b"weights").hexdigest()
    second.close()


@pytest.fixture(scope="module")
def cli(db, tmp_path_factory) -> dict:
    """One checkpoint and gallery (test_index_cli's tiny Glyphs model), built into a faiss folder and into Milvus."""
    import yaml

    from tests.test_index_cli import ROOT

    root = tmp_path_factory.mktemp("milvus_cli")
    cfg = yaml.safe_load((ROOT / ROOT_CONFIG).read_text())
    cfg["trainer"] = {"logger": False, "enable_checkpointing": False, "accelerator": "cpu", "devices": 1}
    cfg["model"]["backbone"]["init_args"]["width"] = 8
    cfg["model"]["embedding_dim"] = 16
    cfg["model"]["clustering"] = False
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    _write_gallery(root / "gallery", range(3), per_class=4)
    ckpt = _checkpoint(config, root / "model.ckpt", 0)
    code, out, err = _main_capture(["index", "build", "--config", str(config), "--ckpt_path", str(ckpt), "--gallery",
                                    str(root / "gallery"), *QUIET, "--store", "milvus", "--uri", db, "--out", "glyphs"])
    assert code == 0, err[-3000:]
    assert "in Milvus collection glyphs" in out
    # the faiss folder of the same vectors, table, manifest and model (one predict run for both stores)
    milvus = MilvusIndex.open(db, "glyphs")
    manifest = {**dataclasses.asdict(milvus.manifest), "model": MODEL}
    model = milvus.manifest.model
    assert model.startswith(f"{db}.models/glyphs__") and milvus.manifest.checkpoint == checkpoint_record(ckpt)
    EmbeddingIndex.build(milvus.embeddings, milvus.table, "flat", milvus.metric, manifest).save(
        root / "flat", add_files=lambda staged: shutil.copy2(model, staged / MODEL))
    return {"root": root, "config": config, "ckpt": ckpt, "gallery": root / "gallery", "flat": root / "flat",
            "db": db}


def _search(args: list[str]) -> list[dict]:
    code, out, err = _main_capture(["search", *args])
    assert code == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines()]


def _same_results(a: list[dict], b: list[dict]) -> None:
    assert [[r["id"] for r in q["results"]] for q in a] == [[r["id"] for r in q["results"]] for q in b]
    for qa, qb in zip(a, b):
        for ra, rb in zip(qa["results"], qb["results"]):
            assert (ra["path"], ra["label"]) == (rb["path"], rb["label"])
            assert ra["score"] == pytest.approx(rb["score"], abs=1e-5)


def test_search_and_evaluate_commands_answer_as_on_the_faiss_folder(cli):
    store = ["--store", "milvus", "--uri", cli["db"], "--index", "glyphs"]
    queries = [str(cli["gallery"] / "class1"), str(cli["gallery"] / "class2" / "0.png")]
    milvus = _search([*store, "--k", "5", *queries])
    _same_results(milvus, _search(["--index", str(cli["flat"]), "--k", "5", *queries]))
    assert milvus[-1]["results"][0]["path"] == str(cli["gallery"] / "class2" / "0.png")  # itself first
    _same_results(_search([*store, "--k", "4", "--rerank", "kreciprocal:k1=4,k2=2", queries[1]]),
                  _search(["--index", str(cli["flat"]), "--k", "4", "--rerank", "kreciprocal:k1=4,k2=2", queries[1]]))
    code, out, err = _main_capture(["index", "evaluate", *store, "--k", "4", "--format", "json"])
    assert code == 0, err[-3000:]
    code, ref, err = _main_capture(["index", "evaluate", "--index", str(cli["flat"]), "--k", "4", "--format", "json"])
    assert code == 0, err[-3000:]
    mine, theirs = json.loads(out), json.loads(ref)
    assert mine["rows"] == theirs["rows"] and mine["neighbour_recall@k"] == theirs["neighbour_recall@k"] == 1.0
    assert mine["bytes_per_vector"] == 4 * 16 + 8  # a float32 vector and an int64 id


def test_index_add_and_the_serve_worker_on_the_store(cli, tmp_path):
    from lightning_dml.index import server as S

    gallery = tmp_path / "gallery"
    shutil.copytree(cli["gallery"], gallery)
    _write_gallery(gallery, range(3, 4), seed=5, per_class=2)  # a new class folder
    store = ["--store", "milvus", "--uri", cli["db"], "--index", "glyphs"]
    code, out, err = _main_capture(["index", "add", *store, "--gallery", str(gallery)])
    assert code == 0, err[-3000:]
    assert "14 added, 0 re-embedded (changed files), 0 unchanged" in out  # the copied files are new paths
    new = str(gallery / "class3" / "1.png")
    found = _search([*store, "--k", "2", new])[0]["results"]
    assert found[0]["path"] == new and found[0]["label"] == "class3"
    # the serve model worker (LitServe's setup / decode_request / predict, no HTTP) answers as search does
    api = S.SearchAPI("glyphs", store="milvus", uri=cli["db"])
    api.setup("cpu")
    request = {"images": [base64.b64encode(open(new, "rb").read()).decode()], "single": True, "k": 2,
               "rerank": None, "threshold": None, "adaptive": None}
    answer = api.predict(api.batch([api.decode_request(request)]))[0]
    assert [r["id"] for r in answer["results"]] == [r["id"] for r in found]


def test_store_errors_are_one_line(cli, tmp_path):
    query = str(cli["gallery"] / "class0" / "0.png")
    assert "--store milvus needs --uri" in _one_error(["search", "--store", "milvus", "--index", "glyphs", query])
    assert "go with --store milvus" in _one_error(["search", "--index", str(cli["flat"]), "--uri", cli["db"], query])
    line = _one_error(["search", "--store", "milvus", "--uri", cli["db"], "--index", "nothing", query])
    assert "Milvus collection nothing" in line and "does not exist" in line and "glyphs" in line
    assert "ending in .db" in _one_error(["search", "--store", "milvus", "--uri", str(tmp_path / "x"), "--index",
                                          "glyphs", query])
    line = _one_error(["serve", "--store", "milvus", "--uri", cli["db"], "--index", "glyphs",
                       "--workers_per_device", "2"])
    assert "one process opens at a time" in line
    line = _one_error(["serve", "--store", "milvus", "--uri", cli["db"], "--index", "glyphs", "--runtime", "onnx"])
    assert "--runtime onnx" in line and "--store milvus" in line
    line = _one_error(["index", "build", "--config", str(cli["config"]), "--ckpt_path", str(cli["ckpt"]),
                       "--gallery", str(cli["gallery"]), "--store", "milvus", "--uri", cli["db"], "--out", "glyphs"])
    assert "exists" in line and "--overwrite" in line  # before any embedding
    line = _one_error(["index", "build", "--config", str(cli["config"]), "--ckpt_path", str(cli["ckpt"]),
                       "--gallery", str(cli["gallery"]), "--store", "milvus", "--uri", cli["db"], "--out", "g2",
                       "--kind", "hnsw"])
    assert "FLAT" in line


def test_a_replaced_model_file_and_a_database_open_elsewhere_are_refused(cli, tmp_path):
    index = MilvusIndex.open(cli["db"], "glyphs")
    model = index.manifest.model
    saved = tmp_path / "model.bak"
    shutil.copy2(model, saved)
    try:
        with open(model, "ab") as handle:
            handle.write(b"\0")
        line = _one_error(["search", "--store", "milvus", "--uri", cli["db"], "--index", "glyphs",
                           str(cli["gallery"] / "class0" / "0.png")])
        assert "is not the one it was built with" in line
    finally:
        shutil.copy2(saved, model)
    # Milvus Lite opens a database in one process (an flock on its LOCK file): another holder, one line
    index.close()
    handle = os.open(os.path.join(cli["db"], "LOCK"), os.O_RDWR)
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as another process's Milvus Lite holds it
        line = _one_error(["search", "--store", "milvus", "--uri", cli["db"], "--index", "glyphs",
                           str(cli["gallery"] / "class0" / "0.png")])
        assert "cannot be opened" in line and "one process at a time" in line
    finally:
        os.close(handle)


def test_calibrate_on_the_store_stores_the_folders_threshold_and_search_and_serve_mark_matches(cli, tmp_path):
    """``index calibrate --store milvus`` (issue 31: the commands work unchanged on either store): the threshold of
    the folder index of the same checkpoint and gallery, meeting the FMR definition over all labelled pairs (brute
    force), stored in the collection's manifest; ``search`` and the ``serve`` worker mark each result as on the
    folder; a threshold of another checkpoint is refused in one line."""
    from lightning_dml.index import server as S
    from lightning_dml.index.calibrate import as_indexed
    from lightning_dml.index.gallery import read_items
    from tests.test_calibrate import brute_pairs, check_threshold

    db = cli["db"]
    flat_dir = tmp_path / "flat"  # copies: the module's other tests keep an uncalibrated folder and collection
    shutil.copytree(cli["flat"], flat_dir)
    flat = EmbeddingIndex.load(flat_dir)
    MilvusIndex.build(flat.embeddings, flat.table, flat.metric, dataclasses.asdict(flat.manifest), uri=db,
                      collection="calibrated", model_file=flat_dir / MODEL, model_dir=tmp_path / "models").close()
    store = ["--store", "milvus", "--uri", db, "--index", "calibrated"]
    labelled = ["--labelled", str(cli["gallery"]), "--fmr", "0.05"]
    code, out, err = _main_capture(["index", "calibrate", *store, *labelled])
    assert code == 0, err[-3000:]
    assert f"stored in the manifest of Milvus collection calibrated at {db}" in out
    code, _, err = _main_capture(["index", "calibrate", "--index", str(flat_dir), *labelled])
    assert code == 0, err[-3000:]
    index = MilvusIndex.open(db, "calibrated")
    cal, want = index.manifest.calibration, EmbeddingIndex.load(flat_dir).manifest.calibration
    index.close()
    flat = EmbeddingIndex.load(flat_dir)  # (calibrate replaced the folder)
    assert cal["threshold"] == want["threshold"]
    assert {k: v for k, v in cal.items() if k != "computed"} == {k: v for k, v in want.items() if k != "computed"}
    items = read_items(cli["gallery"])
    with torch.no_grad():
        x = as_indexed(flat.embed_images(items.paths), flat.metric).numpy()
    names = sorted(set(items.labels))
    pos, neg = brute_pairs(x, np.array([names.index(v) for v in items.labels]), flat.metric)
    check_threshold(cal, pos, neg, "0.05", tol=1e-12)

    query = cli["gallery"] / "class1" / "0.png"
    mine = _search([*store, "--k", "12", str(query)])
    _same_results(mine, _search(["--index", str(flat_dir), "--k", "12", str(query)]))
    flags = [r["match"] for r in mine[0]["results"]]
    assert flags == [r["match"] for r in _search(["--index", str(flat_dir), "--k", "12", str(query)])[0]["results"]]
    with torch.no_grad():
        q = as_indexed(flat.embed_images([query]), flat.metric).double()
    exact = (q @ flat.vectors(torch.tensor([r["id"] for r in mine[0]["results"]])).double().T)[0]
    far = (exact - cal["threshold"]).abs() > 1e-12  # (a score tied with the threshold: the engine's exact scorer)
    assert torch.equal(torch.tensor(flags)[far], (exact > cal["threshold"])[far]) and any(flags) and not all(flags)
    only = _search([*store, "--k", "12", "--matches_only", str(query)])[0]["results"]
    assert [r["id"] for r in only] == [r["id"] for r, f in zip(mine[0]["results"], flags) if f]
    api = S.SearchAPI("calibrated", store="milvus", uri=db)  # the serve model worker (no HTTP)
    api.setup("cpu")
    request = {"images": [base64.b64encode(query.read_bytes()).decode()], "single": True, "k": 12, "rerank": None,
               "threshold": None, "adaptive": None, "matches_only": True}
    answer = api.predict(api.batch([api.decode_request(request)]))[0]
    assert [(r["id"], r["match"]) for r in answer["results"]] == [(r["id"], True) for r in only]

    index = MilvusIndex.open(db, "calibrated")  # a threshold of another checkpoint's model
    index.update_manifest(lambda manifest: manifest.calibration.update(checkpoint_sha256="0" * 64))
    index.close()
    for command in (["search", *store, str(query)], ["serve", *store]):
        line = _one_error(command)
        assert "calibrated with checkpoint sha256 000000" in line and "another model" in line
    line = _one_error(["index", "calibrate", "--store", "milvus", "--index", "calibrated", *labelled])
    assert "--store milvus needs --uri" in line
    line = _one_error(["index", "calibrate", "--store", "milvus", "--uri", db, "--index", "nothing", *labelled])
    assert "Milvus collection nothing" in line and "does not exist" in line
