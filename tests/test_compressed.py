"""Compressed vectors of a flat index (issue 31 s.3, :mod:`lightning_dml.index.vectors`): int8 and binary search
against numpy references of the same codes written from their definitions, exact re-scoring against float64 brute
force, the memory-mapped full-precision vectors, add/remove, ``index evaluate`` and the one-line refusals."""

from __future__ import annotations

import contextlib
import io

import numpy as np
import pytest
import torch

pytest.importorskip("faiss")

from lightning_dml.index import EmbeddingIndex, IndexFolderError  # noqa: E402
from lightning_dml.index import vectors as V  # noqa: E402
from lightning_dml.index.evaluate import evaluate_index  # noqa: E402


def _gallery(n: int = 120, d: int = 16, seed: int = 0) -> torch.Tensor:
    """Clustered vectors with exact duplicates (tied scores) and exact zeros (the sign bit of 0)."""
    centres = torch.randn(6, d, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(seed)
    x = centres[torch.randint(6, (n,), generator=g)] + 0.6 * torch.randn(n, d, generator=g)
    if n > 20:
        x[10:14] = x[3]  # duplicates: equal scores under every metric and code
        x[20, :3] = 0.0
    return x


def _ids(n: int) -> np.ndarray:
    return 1000 - 7 * np.arange(n)  # ids decreasing with the row: the tie rule is by id, not by row


def _unit(x: torch.Tensor) -> np.ndarray:
    return torch.nn.functional.normalize(x.float(), dim=1).numpy().astype(np.float64)


def _top(scores: np.ndarray, ids: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Best ``k`` per row by score, then the smaller id (the library's rule)."""
    order = np.lexsort((np.broadcast_to(ids, scores.shape), -scores), axis=-1)[:, :k]
    return np.take_along_axis(scores, order, 1), np.broadcast_to(ids, scores.shape)[np.arange(len(scores))[:, None],
                                                                                     order]


def _hamming_reference(gallery: torch.Tensor, queries: torch.Tensor) -> np.ndarray:
    bits_g, bits_q = _unit(gallery) >= 0, _unit(queries) >= 0  # bit = x >= 0
    return (bits_q[:, None, :] != bits_g[None, :, :]).sum(-1).astype(np.float64)


def _exact_reference(gallery: torch.Tensor, queries: torch.Tensor, metric: str) -> np.ndarray:
    if metric == "cosine":
        return _unit(queries) @ _unit(gallery).T
    g, q = gallery.double().numpy(), queries.double().numpy()
    return -((q[:, None, :] - g[None, :, :]) ** 2).sum(-1)


@pytest.fixture(scope="module")
def data() -> dict:
    gallery = _gallery()
    queries = torch.cat([gallery[[3, 20, 57]], _gallery(9, seed=1)])  # duplicates' twin, a zero, fresh draws
    return {"gallery": gallery, "queries": queries, "ids": _ids(len(gallery))}


def test_binary_search_is_hamming_over_sign_bits_with_ties_by_id(data):
    table = {"ids": data["ids"]}
    ref_scores, ref_ids = _top(-_hamming_reference(data["gallery"], data["queries"]), data["ids"], 15)
    for shards in (1, 3):
        index = EmbeddingIndex.build(data["gallery"], table, vectors="binary", shards=shards)
        scores, ids = index.search(data["queries"], 15)
        np.testing.assert_array_equal(ids.numpy(), ref_ids)
        np.testing.assert_array_equal(scores.numpy(), ref_scores)
    assert (np.diff(ref_scores, axis=1) == 0).sum() > 50  # the check is about ties


def test_int8_search_scores_the_decoded_codes_of_the_gallery_range(data):
    index = EmbeddingIndex.build(data["gallery"], {"ids": data["ids"]}, vectors="int8")
    g = _unit(data["gallery"]).astype(np.float32).astype(np.float64)
    lo, hi = g.min(0), g.max(0)  # the range of each dimension, calibrated on the gallery
    codes = np.floor(255 * np.clip((g - lo) / (hi - lo), 0, 1))
    decoded = lo + (codes + 0.5) / 255 * (hi - lo)
    ref_scores, ref_ids = _top(_unit(data["queries"]) @ decoded.T, data["ids"], 10)
    scores, ids = index.search(data["queries"], 10)
    np.testing.assert_allclose(scores.numpy(), ref_scores, rtol=0, atol=1e-5)
    np.testing.assert_array_equal(ids.numpy(), ref_ids)
    assert not np.allclose(decoded, g, atol=1e-4)  # codes, not the vectors


@pytest.mark.parametrize("vectors,metric", [("binary", "cosine"), ("int8", "euclidean")])
def test_rescore_is_the_exact_ranking_of_the_code_candidates(data, vectors, metric):
    gallery, queries, ids_ = data["gallery"], data["queries"], data["ids"]
    exact = _exact_reference(gallery, queries, metric)
    full_scores, full_ids = _top(exact, ids_, 12)
    flat = EmbeddingIndex.build(gallery, {"ids": ids_}, metric=metric)
    for n in (len(gallery), len(gallery) + 5):  # N >= gallery size: exact search
        index = EmbeddingIndex.build(gallery, {"ids": ids_}, metric=metric, vectors=vectors, rescore=n)
        scores, ids = index.search(queries, 12)
        np.testing.assert_array_equal(ids.numpy(), full_ids)
        np.testing.assert_allclose(scores.numpy(), full_scores, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(ids.numpy(), flat.search(queries, 12)[1].numpy())
    if vectors == "binary":  # N < gallery: the exact best of the N best by Hamming distance (then id)
        n = 20
        _, candidates = _top(-_hamming_reference(gallery, queries), ids_, n)
        rows = {int(i): r for r, i in enumerate(ids_)}
        cand_exact = np.take_along_axis(exact, np.vectorize(rows.get)(candidates), 1)
        want_scores, want_ids = _top(cand_exact, candidates, 5)
        index = EmbeddingIndex.build(gallery, {"ids": ids_}, vectors="binary", rescore=n)
        scores, ids = index.search(queries, 5)
        np.testing.assert_array_equal(ids.numpy(), want_ids)
        assert not np.array_equal(want_ids, full_ids[:, :5])  # the candidates matter here


def test_rescore_reads_only_the_candidates_rows_of_the_memory_map(data, tmp_path):
    index = EmbeddingIndex.build(data["gallery"], vectors="binary", rescore=7)
    index.save(tmp_path / "idx")
    loaded = EmbeddingIndex.load(tmp_path / "idx")
    stored = loaded._vectors
    assert isinstance(stored, np.memmap) and str(stored.filename).endswith("embeddings.npy") and stored.mode == "r"
    np.testing.assert_array_equal(loaded.search(data["queries"], 3)[1].numpy(), index.search(data["queries"], 3)[1])

    class Recording:
        shape = stored.shape

        def __init__(self) -> None:
            self.rows: list[int] = []

        def __getitem__(self, rows):
            self.rows += np.asarray(rows).tolist()
            return stored[rows]

    seen = Recording()
    q = _unit(data["queries"][:2]).astype(np.float32)
    _, candidates = index._faiss_search(q, 7)
    V.rescore(q, candidates, seen, index.table.rows_of, "cosine", 3)
    assert sorted(seen.rows) == sorted(set(candidates.reshape(-1).tolist())) and len(seen.rows) <= 14


@pytest.mark.parametrize("vectors", ["binary", "int8"])
def test_add_and_remove_keep_the_codes_and_the_exact_rescore(data, vectors, tmp_path):
    gallery, more = data["gallery"], _gallery(8, seed=3)
    index = EmbeddingIndex.build(gallery, vectors=vectors, rescore=1000)
    new = index.add(more)
    assert index.remove([0, 5, int(new[2])]) == 3
    kept = torch.cat([gallery, more])[[i for i in range(len(gallery) + 8) if i not in (0, 5, len(gallery) + 2)]]
    kept_ids = np.asarray([i for i in range(len(gallery) + 8) if i not in (0, 5, len(gallery) + 2)])
    _, want = _top(_exact_reference(kept, data["queries"], "cosine"), kept_ids, 9)
    np.testing.assert_array_equal(index.search(data["queries"], 9)[1].numpy(), want)
    index.save(tmp_path / "idx")
    loaded = EmbeddingIndex.load(tmp_path / "idx")
    assert len(loaded) == len(kept) and loaded.options == {"vectors": vectors, "rescore": 1000}
    np.testing.assert_array_equal(loaded.search(data["queries"], 9)[1].numpy(), want)
    if vectors == "binary":  # the codes of the kept and added items, searched without re-scoring
        codes = EmbeddingIndex.build(kept, {"ids": kept_ids}, vectors="binary")
        bare = EmbeddingIndex.build(gallery, vectors="binary")
        bare.add(more)
        bare.remove([0, 5, len(gallery) + 2])
        np.testing.assert_array_equal(bare.search(data["queries"], 9)[1].numpy(),
                                      codes.search(data["queries"], 9)[1].numpy())


def test_index_evaluate_reports_bytes_time_and_the_exact_judge(data):
    labels = [str(i % 6) for i in range(len(data["gallery"]))]
    results = {}
    for name, opts in {"float32": {}, "int8": {"vectors": "int8"}, "binary": {"vectors": "binary"},
                       "rescored": {"vectors": "binary", "rescore": 10_000}}.items():
        index = EmbeddingIndex.build(data["gallery"], {"labels": labels}, **opts)
        results[name] = evaluate_index(index, k=5, recall_at=(1,))
    d = data["gallery"].shape[1]
    assert results["binary"]["bytes_per_vector"] < results["int8"]["bytes_per_vector"] < \
        results["float32"]["bytes_per_vector"]
    assert results["float32"]["bytes_per_vector"] >= 4 * d > results["int8"]["bytes_per_vector"] >= d > \
        results["binary"]["bytes_per_vector"] >= d / 8
    rescored = results["rescored"]
    assert set(rescored["rows"]) == {"exact", "index (flat, binary + rescore 10000)"}
    assert rescored["neighbour_recall@k"] == 1.0 and rescored["search_ms_per_query"] > 0
    assert rescored["rows"]["index (flat, binary + rescore 10000)"] == pytest.approx(rescored["rows"]["exact"])
    assert results["binary"]["neighbour_recall@k"] < 1.0  # the judge sees what the codes lose


def test_refusals_are_one_line(data, tmp_path, monkeypatch):
    g = data["gallery"]
    cases = [
        (dict(rescore=5), "--rescore re-scores the candidates of compressed vectors: it needs --vectors"),
        (dict(vectors="binary", rescore=0), "--rescore must be an integer >= 1"),
        (dict(vectors="int8", rescore=2.5), "--rescore must be an integer >= 1"),
        (dict(vectors="binary", metric="euclidean"), "--vectors binary compares sign bits (angles): it needs the "
                                                      "cosine metric"),
        (dict(vectors="int8", kind="hnsw"), "--vectors int8 is a scan of compressed codes: it needs --kind flat"),
        (dict(vectors="int4"), "--vectors must be one of float32, int8, binary"),
    ]
    for kwargs, message in cases:
        with pytest.raises(V.VectorsOptionError) as error:
            EmbeddingIndex.build(g, **kwargs)
        assert str(error.value).startswith(message) and "\n" not in str(error.value)
    # a re-scoring folder whose full-precision vectors are gone is refused at load
    EmbeddingIndex.build(g, vectors="binary", rescore=4).save(tmp_path / "idx")
    (tmp_path / "idx" / "embeddings.npy").unlink()
    with pytest.raises(IndexFolderError, match="embeddings.npy is missing"):
        EmbeddingIndex.load(tmp_path / "idx")

    from lightning_dml import cli

    seen = {}
    monkeypatch.setattr("lightning_dml.index.build.build_index", lambda *a, **kw: seen.update(kw))
    base = ["index", "build", "--config", "c.yaml", "--ckpt_path", "m.ckpt", "--gallery", "g", "--out",
            str(tmp_path / "new")]
    for extra, message in ([["--vectors", "binary", "--rescore", "-3"], "--rescore must be an integer >= 1"],
                           [["--rescore", "8"], "--rescore re-scores the candidates"]):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exit_:
            cli.main(base + extra)
        lines = [line for line in err.getvalue().splitlines() if line.startswith("lightning-dml: error: ")]
        assert exit_.value.code == 1 and len(lines) == 1 and message in lines[0], err.getvalue()[-2000:]
    with contextlib.redirect_stdout(io.StringIO()):
        cli.main(base + ["--vectors", "binary", "--rescore", "8"])
    assert seen["vectors"] == "binary" and seen["rescore"] == 8
