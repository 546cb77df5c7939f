"""The learned pairwise re-ranker at search, serve, ``index evaluate`` and ``test`` time (issue 30 s.1,
lightning_dml/index/pairwise.py, lightning_dml/callbacks/pairwise_test.py).

Acceptance (issue 30): on a tiny Glyphs-like set (the index CLI tests' SmallConvNet of width 8, a 16-d embedding,
a random-init checkpoint; 4 classes x 5 gallery PNGs, 2 queries per class), a FeatureDistanceSiamese re-ranker
through ``lightning-dml search`` gives the ranked ids of ``lightning-dml test --rerank``'s post-processing, and
``index evaluate --rerank`` its Recall@1 and MAP@R; the figures are also checked against a loop written from the
definitions over the searched lists."""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

from lightning_dml.checkpoints import checkpoint_record
from lightning_dml.index import pairwise as P
from lightning_dml.index.rerank import RerankOptionError, parse_rerank
from lightning_dml.rerank import FeatureDistanceSiamese, save_reranker
from tests.test_index_cli import QUIET, ROOT, _checkpoint, _main_capture, _one_error

TOP_N = 4


def _images(root: Path, per_class: dict[str, int], seed: int) -> None:
    """Class folders of grey 32 x 32 PNGs: class c's images are its base pattern (seeded by c) plus noise."""
    rng = np.random.default_rng(seed)
    for name, count in per_class.items():
        base = np.random.default_rng(int(name[-1])).integers(0, 255, (32, 32))
        for i in range(count):
            pixels = np.clip(base + rng.normal(0, 60, (32, 32)), 0, 255).astype(np.uint8)
            path = root / name / f"{i}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels, "L").save(path)


def tiny_set(root: Path, queries: dict[str, int] | None = None) -> dict:
    """The tiny labelled set, its config (a width-8 SmallConvNet, 16-d embedding) and a random-init checkpoint in
    ``root``: 4 classes x 5 gallery PNGs, ``queries`` query PNGs per class (default 2 each), 2 x 2 training PNGs
    (the module docstring); also used by tests/test_pairwise_ddp.py."""
    classes = [f"class{c}" for c in range(4)]
    _images(root / "gallery", dict.fromkeys(classes, 5), seed=1)
    _images(root / "queries", queries or dict.fromkeys(classes, 2), seed=2)
    _images(root / "train", {"class8": 2, "class9": 2}, seed=3)
    rows = ["path,label,split,is_query,is_gallery"]
    for split, q, g in (("train", "false", "false"), ("gallery", "false", "true"), ("queries", "true", "false")):
        for path in sorted((root / split).glob("*/*.png")):
            rows.append(f"{path},{path.parent.name},{'train' if split == 'train' else 'test'},{q},{g}")
    (root / "table.csv").write_text("\n".join(rows) + "\n")
    cfg = yaml.safe_load((ROOT / "configs" / "glyphs.yaml").read_text())
    cfg["trainer"] = {"logger": False, "enable_checkpointing": False, "accelerator": "cpu", "devices": 1}
    cfg["model"]["backbone"]["init_args"]["width"] = 8
    cfg["model"]["embedding_dim"] = 16
    cfg["model"]["clustering"] = False
    cfg["data"] = {"class_path": "lightning_dml.data.CSVDataModule",
                   "init_args": {"root": str(root / "table.csv"), "image_size": 32, "classes_per_batch": 2,
                                 "samples_per_class": 2, "num_workers": 0, "eval_batch_size": 64}}
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    return {"root": root, "config": config, "ckpt": _checkpoint(config, root / "model.ckpt", 0)}


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("pairwise")
    tiny = tiny_set(root)
    config, ckpt = tiny["config"], tiny["ckpt"]
    other = _checkpoint(config, root / "other.ckpt", 1)
    code, _, err = _main_capture(["index", "build", "--config", str(config), "--ckpt_path", str(ckpt), "--gallery",
                                  str(root / "gallery"), "--kind", "flat", "--out", str(root / "flat"), *QUIET])
    assert code == 0, err[-3000:]
    torch.manual_seed(5)
    model = FeatureDistanceSiamese(16, identity_init=False)  # a random map: a re-ranking unlike the base order
    save_reranker(model, root / "rr", base_checkpoint_sha256=checkpoint_record(ckpt)["sha256"])
    save_reranker(model, root / "rr_other", base_checkpoint_sha256=checkpoint_record(other)["sha256"])
    return {"root": root, "config": config, "ckpt": ckpt, "flat": root / "flat", "rr": root / "rr",
            "rr_other": root / "rr_other"}


def _search(setup: dict, rerank: str | None, k: int = 20, *options: str) -> dict[str, list[dict]]:
    args = ["search", "--index", str(setup["flat"]), "--k", str(k), *options, str(setup["root"] / "queries")]
    code, out, err = _main_capture(args + (["--rerank", rerank] if rerank else []))
    assert code == 0, err[-3000:]
    return {row["query"]: row["results"] for row in map(json.loads, out.splitlines())}


def _reference_metrics(lists: dict[str, list[dict]], r: int) -> tuple[float, float]:
    """Recall@1 and MAP@R of result lists written from the definitions (Musgrave et al. 2020): a query's label is
    its folder's name; R = the gallery items of its class."""
    recall, ap = [], []
    for query, results in lists.items():
        label = Path(query).parent.name
        rel = [res["label"] == label for res in results[:r]]
        recall.append(float(rel[0]))
        ap.append(sum(sum(rel[: i + 1]) / (i + 1) for i in range(r) if rel[i]) / r)
    return sum(recall) / len(recall), sum(ap) / len(ap)


def test_search_equals_the_test_post_processing_and_index_evaluate(setup, capsys):
    from lightning_dml.callbacks.pairwise_test import PairwiseRerankTest
    from lightning_dml.cli import build_cli

    spec = f"pairwise:model={setup['rr']},top_n={TOP_N}"
    searched = _search(setup, spec)
    base = _search(setup, None)
    assert any([r["id"] for r in searched[q]] != [r["id"] for r in base[q]] for q in base)  # it re-ranks
    for q in base:  # beyond top_n: the base order; within: the base's top_n re-ordered
        assert [r["id"] for r in searched[q][TOP_N:]] == [r["id"] for r in base[q][TOP_N:]]
        assert sorted(r["id"] for r in searched[q][:TOP_N]) == sorted(r["id"] for r in base[q][:TOP_N])

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")
        cli = build_cli(["test", "--config", str(setup["config"]), "--ckpt_path", str(setup["ckpt"]),
                         "--rerank", spec, "--trainer.enable_progress_bar=false",
                         f"--trainer.default_root_dir={setup['root'] / 'run'}"])
    printed = capsys.readouterr().out
    callback = next(cb for cb in cli.trainer.callbacks if isinstance(cb, PairwiseRerankTest))
    result = callback.result
    paths = [str(p) for p in cli.datamodule.test_dataset.paths]
    for q, ranked in zip(result["query"].tolist(), result["ranked"].tolist()):
        ids = [paths[i] for i in ranked if i >= 0]
        assert [r["path"] for r in searched[paths[q]][: len(ids)]] == ids, paths[q]
    logged = {k: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("test/pairwise/")}
    assert "pairwise/recall@1" in printed and "pairwise/map@r" in printed

    code, out, err = _main_capture(["index", "evaluate", "--index", str(setup["flat"]), "--queries",
                                    str(setup["root"] / "queries"), "--rerank", spec, "--format", "json"])
    assert code == 0, err[-3000:]
    row = json.loads(out)["rows"][f"exact + {spec}"]
    assert row["recall@1"] == result["metrics"]["recall@1"] and row["map@r"] == result["metrics"]["map@r"]
    for name in ("recall@1", "map@r"):  # logged as float32 by Lightning
        assert logged[f"test/pairwise/{name}"] == pytest.approx(row[name], abs=1e-7)
    ref_r1, ref_map = _reference_metrics(searched, r=5)
    assert row["recall@1"] == pytest.approx(ref_r1, abs=1e-12) and row["map@r"] == pytest.approx(ref_map, abs=1e-12)


def test_refusals_are_one_line(setup, tmp_path):
    query = str(setup["root"] / "queries" / "class0" / "0.png")
    search = ["search", "--index", str(setup["flat"]), "--k", "3", query, "--rerank"]
    line = _one_error([*search, f"pairwise:model={setup['rr_other']},top_n=3"])
    assert "another base model" in line and checkpoint_record(setup["ckpt"])["sha256"] in line
    line = _one_error([*search, f"pairwise:model={tmp_path / 'missing'},top_n=3"])
    assert "missing" in line and "no such folder" in line
    for bad, message in (("top_n=0", "outside [1, 1000]"), ("top_n=x", "not an integer"), ("size=3", "unknown key")):
        assert message in _one_error([*search, f"pairwise:model={setup['rr']},{bad}"])
    assert "needs model=DIR" in _one_error([*search, "pairwise:top_n=3"])
    assert "once, last" in _one_error([*search, f"pairwise:model={setup['rr']}+pairwise:model={setup['rr']}"])
    line = _one_error(["index", "evaluate", "--index", str(setup["flat"]), "--rerank",
                       f"aqe:alpha=3,n=2+pairwise:model={setup['rr']},top_n=3"])
    assert "pairwise alone" in line
    run = f"--trainer.default_root_dir={tmp_path}"  # nothing written into the working folder
    line = _one_error(["test", "--config", str(setup["config"]), "--ckpt_path", str(setup["ckpt"]), "--rerank",
                       "aqe:alpha=3", run])
    assert "test re-ranks with pairwise" in line
    line = _one_error(["test", "--config", str(setup["config"]), "--ckpt_path", str(setup["ckpt"]), "--rerank",
                       f"pairwise:model={setup['rr_other']},top_n=3", run])
    assert "another base model" in line
    line = _one_error(["validate", "--config", str(setup["config"]), "--rerank", f"pairwise:model={setup['rr']}",
                       run])
    assert "--rerank is an option of test" in line


def test_a_training_free_reranker_first_then_pairwise(setup):
    spec = f"aqe:alpha=3,n=2+pairwise:model={setup['rr']},top_n={TOP_N}"
    chained = parse_rerank(spec)
    assert isinstance(chained, P.PairwiseRerank) and chained.first == parse_rerank("aqe:alpha=3,n=2")
    assert parse_rerank(chained.spec()) == chained
    # --device cuda: the index and its model fall back to the CPU without a GPU, and so does the re-ranker
    combined, expanded = _search(setup, spec, 20, "--device", "cuda"), _search(setup, "aqe:alpha=3,n=2")
    for q in expanded:  # the pairwise re-ranker re-orders aqe's top_n and keeps the rest
        assert [r["id"] for r in combined[q][TOP_N:]] == [r["id"] for r in expanded[q][TOP_N:]]
        assert sorted(r["id"] for r in combined[q][:TOP_N]) == sorted(r["id"] for r in expanded[q][:TOP_N])


def test_rerank_top_n_against_a_loop():
    scores = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.5], [0.9, 0.8, float("-inf"), float("-inf"), float("-inf")]])
    ids = torch.tensor([[4, 2, 7, 1, 3], [5, 6, -1, -1, -1]])
    logits = torch.tensor([[0.5, 2.0, 0.5, -1.0], [1.0, 1.0, 9.0, 9.0]])  # ties; padding logits ignored
    new_scores, new_ids, perm = P.rerank_top_n(scores, ids, logits)
    for q in range(2):
        n = logits.shape[1]
        pairs = [(float(logits[q, j]), -j, int(ids[q, j])) for j in range(n) if ids[q, j] >= 0]
        loop = [i for _, _, i in sorted(pairs, reverse=True)]  # larger logit first, ties: base order
        assert new_ids[q, : len(loop)].tolist() == loop
        assert new_ids[q, n:].tolist() == ids[q, n:].tolist()
    assert new_ids[1, 2:].tolist() == [-1, -1, -1]
    # beyond top_n: the base score shifted to 1 below the smallest logit
    assert new_scores[0, 4].item() == pytest.approx(-2.0) and new_scores[0, 1].item() == 0.5
    with pytest.raises(ValueError, match="non-finite"):
        P.rerank_top_n(scores, ids, torch.tensor([[float("nan"), 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]))


class _PixelDistance(torch.nn.Module):
    """An images re-ranker for the test: minus the mean squared pixel difference."""

    inputs = "images"
    input_spec = None

    def __init__(self, sha: str) -> None:
        super().__init__()
        self.base_checkpoint_sha256 = sha
        self.w = torch.nn.Parameter(torch.ones(()))

    def score(self, query: torch.Tensor, candidates: torch.Tensor) -> torch.Tensor:
        return -self.w * ((query.unsqueeze(1) - candidates) ** 2).flatten(2).mean(-1)


def test_an_images_reranker_reads_the_query_and_the_gallery_images(setup, monkeypatch):
    from lightning_dml.data.image_list import load_image
    from lightning_dml.index import EmbeddingIndex

    model = _PixelDistance(checkpoint_record(setup["ckpt"])["sha256"])
    monkeypatch.setattr(P, "load_pairwise_model", lambda folder, device="cpu": model)
    spec = f"pairwise:model={setup['rr']},top_n=6"
    searched, base = _search(setup, spec, k=8), _search(setup, None, k=8)
    index = EmbeddingIndex.load(setup["flat"])
    embedder = index.embedder

    def pixels(path: str) -> torch.Tensor:
        return embedder.transform(load_image(Path(path), embedder.mode))

    for q, results in base.items():
        top = results[:6]
        dist = [float(((pixels(q) - pixels(r["path"])) ** 2).mean()) for r in top]
        loop = [r["id"] for _, _, r in sorted(((d, j, r) for j, (d, r) in enumerate(zip(dist, top))),
                                              key=lambda t: (t[0], t[1]))]
        assert [r["id"] for r in searched[q]] == loop + [r["id"] for r in results[6:]]
    with pytest.raises(RerankOptionError, match="compares images, and index evaluate --queries hands over"):
        parse_rerank(spec).check_index(index, queries_are_images=False)  # index evaluate --queries


def test_serve_bounds_the_pairwise_work_and_serves_its_own_folder_only(setup, tmp_path):
    pytest.importorskip("litserve")
    from lightning_dml.index import server as S

    served = parse_rerank(f"pairwise:model={setup['rr']},top_n=10")
    defaults = {"k": 5, "rerank": served.spec(), "threshold": None, "adaptive": None}
    assert S.parse_query(f"rerank=pairwise:model={setup['rr']},top_n=3", defaults)["rerank"].endswith("top_n=3")
    for query, message in ((f"rerank=pairwise:model={setup['rr']},top_n={S.MAX_PAIRWISE_TOP_N + 1}", "limit"),
                           (f"rerank=pairwise:model={setup['rr_other']},top_n=3", "not this server's re-ranker")):
        with pytest.raises(S.BadRequest, match=message) as error:
            S.parse_query(query, defaults)
        assert error.value.status == 400
    with pytest.raises(S.BadRequest, match="not this server's"):
        S.parse_query(f"rerank=pairwise:model={setup['rr']},top_n=3", {**defaults, "rerank": None})
    S.check_pairs({"rerank": served.spec()}, S.MAX_PAIRWISE_PAIRS // 10)
    with pytest.raises(S.BadRequest, match="pairs to re-rank") as error:
        S.check_pairs({"rerank": served.spec()}, S.MAX_PAIRWISE_PAIRS // 10 + 1)
    assert error.value.status == 413


def test_serve_and_test_time_give_an_images_reranker_the_same_pixels(setup, monkeypatch):
    """The served answer equals the search command's (the request's decoded pixels as query inputs), and the test
    post-processing reads the dataset's items: its lists equal the exact lists with the top_n re-sorted by a loop."""
    import base64

    from lightning_dml.callbacks.pairwise_test import rerank_test_set
    from lightning_dml.index import EmbeddingIndex
    from lightning_dml.metrics import functional as MF

    model = _PixelDistance(checkpoint_record(setup["ckpt"])["sha256"])
    monkeypatch.setattr(P, "load_pairwise_model", lambda folder, device="cpu": model)
    spec = f"pairwise:model={setup['rr']},top_n=6"
    query = setup["root"] / "queries" / "class2" / "1.png"
    if importlib.util.find_spec("litserve"):  # serve's model worker, without the HTTP server
        from lightning_dml.index import server as S

        api = S.SearchAPI(str(setup["flat"]))
        api.setup("cpu")
        payload = {"images": [base64.b64encode(query.read_bytes()).decode()], "single": True, "k": 8,
                   "rerank": spec, "threshold": None, "adaptive": None}
        served = api.predict([api.decode_request(payload)])[0]["results"]
        assert [r["id"] for r in served] == [r["id"] for r in _search(setup, spec, k=8)[str(query)]]

    index = EmbeddingIndex.load(setup["flat"])
    images = P.candidate_images(index)
    ids = torch.as_tensor(index.table.ids)
    pixels = images(ids.unsqueeze(1)).squeeze(1)  # the gallery's model inputs, as a dataset gives them
    labels = torch.tensor([int(v[-1]) for v in index.table.labels])
    dataset = [(pixels[i], labels[i]) for i in range(len(ids))]
    data = {"embeddings": index.embeddings, "labels": labels, "indices": None, "query_mask": None,
            "gallery_mask": None, "sequence": None, "category": None}
    out = rerank_test_set(parse_rerank(spec), data, "cosine", (1, 2), dataset)
    _, exact = MF.knn(index.embeddings, None, k=out["ranked"].shape[1], metric="cosine")
    for q in range(len(ids)):
        top = exact[q, :6].tolist()
        dist = [float(((pixels[q] - pixels[j]) ** 2).mean()) for j in top]
        loop = [j for _, _, j in sorted(zip(dist, range(6), top))]
        assert out["ranked"][q].tolist() == loop + exact[q, 6:].tolist()


def test_the_test_post_processing_follows_masks_and_sequences_as_a_loop(monkeypatch):
    """``rerank_test_set`` on a set with query/gallery roles, sequences and tied embeddings against a loop written
    from the definitions: each query's gallery items outside its sequence by exact score (ties: smaller index),
    the first top_n re-sorted by the re-ranker's logit (ties: that order), Recall@K and MAP@R."""
    from lightning_dml.callbacks.pairwise_test import rerank_test_set

    g = torch.Generator().manual_seed(3)
    centres = torch.randn(3, 8, generator=g)
    labels = torch.arange(24) % 3
    emb = centres[labels] + 0.6 * torch.randn(24, 8, generator=g)
    emb[5] = emb[2]  # an exact tie
    sequence = torch.arange(24) // 4
    is_query, is_gallery = torch.arange(24) % 2 == 0, torch.arange(24) % 3 != 1
    indices = torch.randperm(24, generator=g) + 100
    torch.manual_seed(7)
    model = FeatureDistanceSiamese(8, identity_init=False)
    monkeypatch.setattr(P, "load_pairwise_model", lambda folder, device="cpu": model)
    data = {"embeddings": emb, "labels": labels, "indices": indices, "query_mask": is_query,
            "gallery_mask": is_gallery, "sequence": sequence, "category": None}
    out = rerank_test_set(P.PairwiseRerank(model="unused", top_n=5), data, "cosine", (1, 2), None)

    unit = torch.nn.functional.normalize(emb.double(), dim=1)
    stored = torch.nn.functional.normalize(emb, dim=1)
    recall1, recall2, aps, queries = [], [], [], []
    for q in sorted(range(24), key=lambda i: int(indices[i])):
        if not is_query[q]:
            continue
        gallery = [j for j in range(24) if is_gallery[j] and j != q and sequence[j] != sequence[q]]
        base = sorted(gallery, key=lambda j: (-float(unit[q] @ unit[j]), int(indices[j])))
        logits = model.score(stored[q : q + 1], stored[base[:5]].unsqueeze(0))[0].tolist()
        head = [j for _, _, j in sorted(zip(logits, range(5), base[:5]), key=lambda t: (-t[0], t[1]))]
        ranked = head + base[5:]
        queries.append(int(indices[q]))
        listed = [i for i in out["ranked"][len(queries) - 1].tolist() if i >= 0]  # as long as R and top_n need
        r = sum(bool(labels[j] == labels[q]) for j in ranked)
        assert len(listed) >= max(r, 5) and listed == [int(indices[j]) for j in ranked[: len(listed)]]
        rel = [bool(labels[j] == labels[q]) for j in ranked]
        recall1.append(float(rel[0]))
        recall2.append(float(any(rel[:2])))
        if r:
            aps.append(sum(sum(rel[: i + 1]) / (i + 1) for i in range(r) if rel[i]) / r)
    assert out["query"].tolist() == queries
    assert out["metrics"]["recall@1"] == pytest.approx(sum(recall1) / len(recall1), abs=1e-12)
    assert out["metrics"]["recall@2"] == pytest.approx(sum(recall2) / len(recall2), abs=1e-12)
    assert out["metrics"]["map@r"] == pytest.approx(sum(aps) / len(aps), abs=1e-12)


def test_an_index_the_reranker_cannot_serve_is_refused(setup, tmp_path):
    from lightning_dml.index import EmbeddingIndex

    save_reranker(FeatureDistanceSiamese(8), tmp_path / "narrow",
                  base_checkpoint_sha256=checkpoint_record(setup["ckpt"])["sha256"])
    query = str(setup["root"] / "queries" / "class0" / "0.png")
    line = _one_error(["search", "--index", str(setup["flat"]), "--k", "3", query, "--rerank",
                       f"pairwise:model={tmp_path / 'narrow'},top_n=3"])
    assert "compares embeddings of size 8, the index holds size 16" in line
    from_tensors = EmbeddingIndex.build(torch.randn(6, 16), kind="flat")
    with pytest.raises(RerankOptionError, match="records no checkpoint sha256"):
        parse_rerank(f"pairwise:model={setup['rr']},top_n=3").check_index(from_tensors)


def test_an_untrained_residual_reranker_searches_as_the_base_and_refuses_a_chain(setup, tmp_path):
    """Through ``search``: an untrained residual re-ranker's lists are the index's (ids and order); after a
    training-free re-ranker it is refused in one line (it adds to the base search's scores it was trained on)."""
    save_reranker(FeatureDistanceSiamese(16, residual=True), tmp_path / "res",
                  base_checkpoint_sha256=checkpoint_record(setup["ckpt"])["sha256"])
    searched = _search(setup, f"pairwise:model={tmp_path / 'res'},top_n=10", 12)
    base = _search(setup, None, 12)
    assert {q: [r["id"] for r in rows] for q, rows in searched.items()} == {
        q: [r["id"] for r in rows] for q, rows in base.items()}
    query = str(setup["root"] / "queries" / "class0" / "0.png")
    line = _one_error(["search", "--index", str(setup["flat"]), "--k", "3", query, "--rerank",
                       f"aqe:alpha=3,n=2+pairwise:model={tmp_path / 'res'},top_n=3"])
    assert "is residual" in line and "not after aqe" in line
