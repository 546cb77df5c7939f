"""ONNX export and ONNX Runtime (issue 31 s.1 and its acceptance): the export verified against PyTorch (and failing
with the difference), ``search --runtime onnx`` giving the torch runtime's ids on the index tests' Glyphs-config
gallery, its import graph free of torch, the int8 model's error recorded, the pixels equal to the torch runtime's,
and the options the ONNX path does not serve refused in one line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image

pytest.importorskip("onnxruntime", reason="the onnx extra (pip install 'lightning-dml[onnx]') is not installed")
pytest.importorskip("onnx", reason="the onnx extra (pip install 'lightning-dml[onnx]') is not installed")
pytest.importorskip("faiss")

from lightning_dml.cli import main  # noqa: E402
from lightning_dml.export import EmbeddingModel, export_embedding_model  # noqa: E402
from lightning_dml.models import LinearEmbedding, SmallConvNet  # noqa: E402
from lightning_dml.onnx import export as onnx_export  # noqa: E402
from lightning_dml.onnx.export import TOLERANCE, OnnxExportError, embedding_error  # noqa: E402
from lightning_dml.onnx.runtime import PixelTransform  # noqa: E402
from tests.test_index_cli import QUIET, _checkpoint, _main_capture, _one_error, _write_gallery  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _model(seed: int = 0) -> EmbeddingModel:
    torch.manual_seed(seed)
    backbone = SmallConvNet(in_channels=1, width=8)
    return EmbeddingModel(backbone, LinearEmbedding(backbone.out_features, 16)).eval()


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> dict[str, Path]:
    """The index tests' fixture (the Glyphs config, SmallConvNet width 8, 16-d, a random-init checkpoint, 4 class
    folders x 4 grey PNGs) indexed twice: by the torch runtime (Lightning's predict loop) and by ``--runtime
    onnx``."""
    root = tmp_path_factory.mktemp("onnx")
    cfg = yaml.safe_load((ROOT / "configs" / "glyphs.yaml").read_text())
    cfg["trainer"] = {"logger": False, "enable_checkpointing": False, "accelerator": "cpu", "devices": 1}
    cfg["model"]["backbone"]["init_args"]["width"] = 8
    cfg["model"]["embedding_dim"] = 16
    cfg["model"]["clustering"] = False
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    _write_gallery(root / "gallery", range(4), per_class=4)
    ckpt = _checkpoint(config, root / "model.ckpt", 0)
    common = ["--config", str(config), "--ckpt_path", str(ckpt), "--gallery", str(root / "gallery"), *QUIET]
    for name, extra in (("torch_index", []), ("onnx_index", ["--runtime", "onnx", "--accelerator", "cpu"])):
        code, _, err = _main_capture(["index", "build", *common, "--out", str(root / name), *extra])
        assert code == 0, err[-3000:]
    return {"root": root, "gallery": root / "gallery", "torch": root / "torch_index", "onnx": root / "onnx_index"}


def _search(args: list[str]) -> list[dict]:
    code, out, err = _main_capture(["search", *args])
    assert code == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines()]


def test_search_runtime_onnx_gives_the_torch_runtimes_ids(built):
    """Acceptance: every gallery image as a query, k = 6: ``search --runtime onnx`` on the folder the ONNX runtime
    built gives the ids, paths and labels of ``search`` (torch) on the folder Lightning's predict loop built, and
    scores within the export tolerance."""
    queries = [str(built["gallery"])]
    torch_rows = _search(["--index", str(built["torch"]), "--k", "6", *queries])
    onnx_rows = _search(["--index", str(built["onnx"]), "--k", "6", "--runtime", "onnx", *queries])
    assert len(torch_rows) == len(onnx_rows) == 16
    for mine, theirs in zip(onnx_rows, torch_rows):
        assert mine["query"] == theirs["query"]
        assert [(r["id"], r["path"], r["label"]) for r in mine["results"]] == \
            [(r["id"], r["path"], r["label"]) for r in theirs["results"]]
        assert np.allclose([r["score"] for r in mine["results"]], [r["score"] for r in theirs["results"]], atol=1e-4)
    record = json.loads((built["onnx"] / "onnx_export.json").read_text())
    assert record["max_relative_error"] <= record["tolerance"] == TOLERANCE


def test_the_onnx_search_path_imports_no_torch(built):
    """Acceptance: ``lightning-dml search --runtime onnx`` in a fresh interpreter answers (the query image itself
    first, score 1) with no ``torch`` module imported."""
    query = str(built["gallery"] / "class2" / "1.png")
    probe = ("import contextlib, io, json, sys\nfrom lightning_dml.entry import main\nout = io.StringIO()\n"
             "with contextlib.redirect_stdout(out):\n    main(sys.argv[1:])\n"
             "print(json.dumps({'out': out.getvalue(), 'torch': sorted(m for m in sys.modules "
             "if m == 'torch' or m.startswith('torch.'))}))")
    proc = subprocess.run([sys.executable, "-c", probe, "search", "--runtime", "onnx", "--index", str(built["onnx"]),
                           "--k", "2", query], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "LIGHTNING_DML_HELP_CACHE": "0"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.splitlines()[-1])
    assert result["torch"] == []
    best = json.loads(result["out"])["results"][0]
    assert best["path"] == query and abs(best["score"] - 1) < 1e-5


def test_export_verifies_the_onnx_model_and_records_the_int8_error(tmp_path):
    """``--formats onnx --quantize int8``: the float model reproduces PyTorch on a batch size the export never saw
    (dynamic batch) within the tolerance; the int8 model's recorded error is what it measures again here."""
    model = _model()
    example = torch.randn(2, 1, 32, 32)
    written = export_embedding_model(model, tmp_path, example, formats=("onnx",), quantize="int8")
    record = json.loads(written["onnx_record"].read_text())
    import onnxruntime as ort

    batch = torch.randn(5, 1, 32, 32)
    with torch.no_grad():
        reference = model(batch).numpy()
    float_model = ort.InferenceSession(str(written["onnx"]), providers=["CPUExecutionProvider"])
    assert embedding_error(float_model.run(None, {"images": batch.numpy()})[0], reference) <= TOLERANCE
    assert record["max_relative_error"] <= TOLERANCE and record["int8"]["file"] == written["onnx_int8"].name
    samples = torch.cat([example, example[:1].flip(-1)])  # what the export verified on
    with torch.no_grad():
        sample_reference = model(samples).numpy()
    int8 = ort.InferenceSession(str(written["onnx_int8"]), providers=["CPUExecutionProvider"])
    again = embedding_error(int8.run(None, {"images": samples.numpy()})[0], sample_reference)
    assert again == pytest.approx(record["int8"]["max_relative_error"], rel=1e-6)
    assert 0 < again < 0.5  # int8 differs, but is still the model


def test_an_onnx_model_that_differs_fails_the_export_with_the_difference(tmp_path, monkeypatch):
    """The exporter monkeypatched to write another model's graph (weights of another seed): the export stops with
    one error giving the difference against the tolerance, and leaves no ONNX file."""
    real = onnx_export._onnx_export
    monkeypatch.setattr(onnx_export, "_onnx_export", lambda model, example, path: real(_model(1), example, path))
    model = _model(0)
    with pytest.raises(OnnxExportError, match=r"max relative error \d\S* > tolerance 0.0001 on 3 sample images"):
        export_embedding_model(model, tmp_path, torch.randn(2, 1, 32, 32), formats=("onnx",))
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_pixels_equal_the_torch_runtimes(tmp_path):
    """:class:`PixelTransform` (NumPy) equals :class:`~lightning_dml.data.pil_eval.PILEvalTransform` (torch) bit for
    bit: a BGR spec at scale 255 with bicubic resizing of an RGB image, and a grey image."""
    from lightning_dml.data.pil_eval import PILEvalTransform
    from lightning_dml.models.input_spec import InputSpec

    rng = np.random.default_rng(0)
    rgb = Image.fromarray(rng.integers(0, 256, (41, 57, 3), dtype=np.uint8), "RGB")
    grey = Image.fromarray(rng.integers(0, 256, (30, 34), dtype=np.uint8), "L")
    cases = [(InputSpec(color="BGR", scale=255.0, mean=(104.0, 117.0, 123.0), std=(1.0, 1.0, 1.0),
                        interpolation="bicubic"), {"crop_size": 24, "resize_size": 28, "mode": "RGB"}, rgb),
             (InputSpec(color="L", mean=(0.5,), std=(0.25,)), {"crop_size": 32, "resize_size": 36, "mode": "L"}, grey)]
    import dataclasses

    for spec, preprocess, image in cases:
        expected = PILEvalTransform(spec, preprocess["crop_size"], preprocess["resize_size"])(image).numpy()
        assert np.array_equal(PixelTransform(dataclasses.asdict(spec), preprocess)(image), expected)


def test_options_the_onnx_path_does_not_serve_are_one_line(built):
    query = str(built["gallery"] / "class0" / "0.png")
    line = _one_error(["search", "--index", str(built["onnx"]), "--runtime", "onnx", "--rerank", "aqe", query])
    assert "--rerank needs the torch runtime" in line
    line = _one_error(["search", "--index", str(built["onnx"]), "--runtime", "onnx", "--adaptive", "2", query])
    assert "--adaptive needs the torch runtime (the adaptive cut runs on torch tensors)" in line
    line = _one_error(["search", "--index", str(built["onnx"]), "--runtime", "onnx", "--threshold", "x", query])
    assert "--threshold 'x' is not a number" in line
    line = _one_error(["search", "--index", str(built["onnx"]), "--runtime", "onnx", "--matches_only", query])
    assert "--matches_only: the index" in line and "has no calibrated threshold" in line
    line = _one_error(["search", "--index", str(built["torch"]), "--runtime", "onnx", query])
    assert "has no embedding_model.onnx: build it with lightning-dml index build --runtime onnx" in line
    line = _one_error(["serve", "--index", str(built["torch"]), "--runtime", "onnx", "--port", "0"])
    assert "has no embedding_model.onnx" in line  # before any server process starts


def test_serve_runtime_onnx_answers_as_search_runtime_onnx(built):
    """The server's worker with ``--runtime onnx`` (a JSON batch of two images, decoded and embedded as the server
    does) answers the ids and scores of ``search --runtime onnx``."""
    import base64

    from lightning_dml.index import server as S

    queries = [str(built["gallery"] / "class1" / "2.png"), str(built["gallery"] / "class3" / "0.png")]
    expected = _search(["--index", str(built["onnx"]), "--k", "5", "--runtime", "onnx", *queries])
    api = S.SearchAPI(str(built["onnx"]), runtime="onnx")
    api.setup("cpu")
    payload = {"images": [base64.b64encode(Path(q).read_bytes()).decode() for q in queries], "single": False, "k": 5,
               "rerank": None, "threshold": None, "adaptive": None, "matches_only": False}
    served = api.predict([api.decode_request(payload)])[0]["batch"]
    for mine, theirs in zip(served, expected):
        assert [r["id"] for r in mine["results"]] == [r["id"] for r in theirs["results"]]
        assert np.allclose([r["score"] for r in mine["results"]], [r["score"] for r in theirs["results"]], atol=1e-6)


def test_build_options_of_the_torch_runtime_are_refused_with_onnx(built, tmp_path):
    line = _one_error(["index", "build", "--config", str(built["root"] / "config.yaml"), "--ckpt_path",
                       str(built["root"] / "model.ckpt"), "--gallery", str(built["gallery"]), "--out",
                       str(tmp_path / "x"), "--runtime", "onnx", "--devices", "2"])
    assert "--devices is an option of the torch runtime" in line and not (tmp_path / "x").exists()


def test_the_execution_providers_of_each_device():
    """``cpu``: the CPU provider; ``auto``: CUDA first where onnxruntime has it; ``cuda`` without it, or another
    device, is one line."""
    import onnxruntime as ort

    from lightning_dml.onnx.runtime import OnnxRuntimeError, providers_for

    assert providers_for("cpu") == ["CPUExecutionProvider"]
    with pytest.raises(OnnxRuntimeError, match="--device tpu: the ONNX runtime runs on cpu, cuda or auto"):
        providers_for("tpu")
    if "CUDAExecutionProvider" in ort.get_available_providers():
        assert providers_for("auto")[0] == providers_for("cuda:0")[0] == "CUDAExecutionProvider"
    else:
        assert providers_for("auto") == ["CPUExecutionProvider"]
        with pytest.raises(OnnxRuntimeError, match="has no CUDAExecutionProvider.*pip install onnxruntime-gpu"):
            providers_for("cuda")


def _calibrated_copy(built, tmp_path) -> Path:
    """A copy of the ONNX-built index calibrated (``index calibrate --fmr 0.1``) on classes 0 and 1 of the gallery
    (the queries of the tests below are classes 2 and 3: no query pair is the one whose score is the threshold)."""
    import shutil

    copy = tmp_path / "calibrated"
    shutil.copytree(built["onnx"], copy)
    labelled = tmp_path / "labelled"
    for c in (0, 1):
        shutil.copytree(built["gallery"] / f"class{c}", labelled / f"class{c}")
    code, _, err = _main_capture(["index", "calibrate", "--index", str(copy), "--labelled", str(labelled),
                                  "--fmr", "0.1"])
    assert code == 0, err[-3000:]
    return copy


def _ids_and_marks(rows: list[dict]) -> list[tuple[str, list]]:
    return [(r["query"], [(x["id"], x.get("match")) for x in r["results"]]) for r in rows]


def test_calibrated_matches_and_threshold_with_onnx_equal_the_torch_runtimes(built, tmp_path):
    """``search --runtime onnx`` on a calibrated index gives the torch runtime's ids and ``match`` flags (plain,
    ``--matches_only``, and with a constant ``--threshold``), both flags occurring; CSV has the ``match`` column; and
    ``serve --runtime onnx`` (the server's worker) flags its results as the search does."""
    import base64

    from lightning_dml.index import server as S

    index = _calibrated_copy(built, tmp_path)
    theta = json.loads((index / "manifest.json").read_text())["calibration"]["threshold"]
    queries = [str(built["gallery"] / f"class{c}") for c in (2, 3)]
    common = ["--index", str(index), "--k", "6"]
    plain, torch_plain = _search([*common, "--runtime", "onnx", *queries]), _search([*common, *queries])
    assert _ids_and_marks(plain) == _ids_and_marks(torch_plain)
    scores = [x["score"] for r in plain for x in r["results"]]
    marks = [x["match"] for r in plain for x in r["results"]]
    # the runtimes' scores differ (float32 kernels of two engines); no score is that close to the threshold, so
    # equal flags are what the definition gives, not luck (a random-init model: its cosines all lie near 1)
    differ = max(abs(s - t) for s, t in zip(scores, [x["score"] for r in torch_plain for x in r["results"]]))
    assert differ < 1e-5 and min(abs(s - theta) for s in scores) > 2 * differ
    assert any(marks) and not all(marks)
    assert all(m == (s > theta) for s, m in zip(scores, marks))
    only = _search([*common, "--runtime", "onnx", "--matches_only", *queries])
    assert _ids_and_marks(only) == _ids_and_marks(_search([*common, "--matches_only", *queries]))
    assert sum(len(r["results"]) for r in only) == sum(marks)
    distinct = sorted(set(scores))
    widest = max(range(len(distinct) - 1), key=lambda i: distinct[i + 1] - distinct[i])
    cut = (distinct[widest] + distinct[widest + 1]) / 2  # a constant threshold between two scores, far from both
    assert min(abs(s - cut) for s in scores) > 2 * differ
    with_threshold = _search([*common, "--runtime", "onnx", "--threshold", repr(cut), *queries])
    assert _ids_and_marks(with_threshold) == _ids_and_marks(_search([*common, "--threshold", repr(cut), *queries]))
    assert sum(len(r["results"]) for r in with_threshold) == sum(s >= cut for s in scores)
    code, out, err = _main_capture(["search", *common, "--runtime", "onnx", "--format", "csv", queries[0]])
    assert code == 0 and out.splitlines()[0] == "query,rank,id,path,label,score,match", err[-2000:]
    images = sorted((built["gallery"] / "class2").iterdir())[:2]
    api = S.SearchAPI(str(index), runtime="onnx")
    api.setup("cpu")
    payload = {"images": [base64.b64encode(p.read_bytes()).decode() for p in images], "single": False, "k": 6,
               "rerank": None, "threshold": None, "adaptive": None, "matches_only": False}
    served = api.predict([api.decode_request(payload)])[0]["batch"]
    assert [[(x["id"], x["match"]) for x in r["results"]] for r in served] == \
        [[(x["id"], x["match"]) for x in r["results"]] for r in plain[:2]]


def test_width_index_built_and_searched_with_onnx_cuts_as_the_torch_runtime(built, tmp_path):
    """``index build --runtime onnx --width 8``: the stored vectors are the full torch index's cut to 8 and
    re-normalised (within the export tolerance); ``search --runtime onnx`` and the server's ONNX worker give the
    ids of ``search`` (torch, which cuts with :class:`~lightning_dml.widths.LeadingDims`) on that folder."""
    import base64

    from lightning_dml.index import EmbeddingIndex
    from lightning_dml.index import server as S

    out = tmp_path / "w8"
    code, _, err = _main_capture(["index", "build", "--config", str(built["root"] / "config.yaml"), "--ckpt_path",
                                  str(built["root"] / "model.ckpt"), "--gallery", str(built["gallery"]), "--out",
                                  str(out), "--runtime", "onnx", "--accelerator", "cpu", "--width", "8", *QUIET])
    assert code == 0, err[-3000:]
    index, full = EmbeddingIndex.load(out), EmbeddingIndex.load(built["torch"])
    assert index.manifest.width == index.dim == 8
    cut = torch.nn.functional.normalize(full.embeddings[:, :8], dim=1)
    assert embedding_error(index.embeddings.numpy(), cut.numpy()) <= 1e-4
    queries = [str(built["gallery"])]
    onnx_rows = _search(["--index", str(out), "--k", "5", "--runtime", "onnx", *queries])
    torch_rows = _search(["--index", str(out), "--k", "5", *queries])
    assert [[x["id"] for x in r["results"]] for r in onnx_rows] == [[x["id"] for x in r["results"]] for r in torch_rows]
    assert np.allclose([x["score"] for r in onnx_rows for x in r["results"]],
                       [x["score"] for r in torch_rows for x in r["results"]], atol=1e-4)
    api = S.SearchAPI(str(out), runtime="onnx")
    api.setup("cpu")
    image = built["gallery"] / "class1" / "3.png"
    payload = {"images": [base64.b64encode(image.read_bytes()).decode()], "single": False, "k": 5, "rerank": None,
               "threshold": None, "adaptive": None, "matches_only": False}
    served = api.predict([api.decode_request(payload)])[0]["batch"]
    expected = _search(["--index", str(out), "--k", "5", "--runtime", "onnx", str(image)])
    assert [x["id"] for x in served[0]["results"]] == [x["id"] for x in expected[0]["results"]]


def test_compressed_indexes_built_and_searched_with_onnx_give_the_torch_runtimes_ids(built, tmp_path):
    """``index build --runtime onnx --vectors binary`` (Hamming scores: many ties, ordered by the smaller id) and
    ``--vectors int8 --rescore 4``: ``search --runtime onnx`` gives the ids and scores of ``search`` (torch) on the
    same folder, every gallery image a query, k = 6."""
    queries = [str(built["gallery"])]
    for name, options in (("binary", ["--vectors", "binary"]), ("int8", ["--vectors", "int8", "--rescore", "4"])):
        out = tmp_path / name
        code, _, err = _main_capture(["index", "build", "--config", str(built["root"] / "config.yaml"),
                                      "--ckpt_path", str(built["root"] / "model.ckpt"), "--gallery",
                                      str(built["gallery"]), "--out", str(out), "--runtime", "onnx", "--accelerator",
                                      "cpu", *options, *QUIET])
        assert code == 0, err[-3000:]
        assert json.loads((out / "manifest.json").read_text())["options"]["vectors"] == name
        onnx_rows = _search(["--index", str(out), "--k", "6", "--runtime", "onnx", *queries])
        torch_rows = _search(["--index", str(out), "--k", "6", *queries])
        assert [[x["id"] for x in r["results"]] for r in onnx_rows] == \
            [[x["id"] for x in r["results"]] for r in torch_rows], name
        assert np.allclose([x["score"] for r in onnx_rows for x in r["results"]],
                           [x["score"] for r in torch_rows for x in r["results"]], atol=1e-4), name
        if name == "binary":  # integer scores: ties at the k-th place occur, and are settled by the smaller id
            assert any(r["results"][4]["score"] == r["results"][5]["score"] for r in onnx_rows)


def test_the_arrays_tie_rule_is_the_indexs():
    """:func:`~lightning_dml.index.faiss_search.best_k_arrays` (NumPy, the ONNX path's) and
    :func:`~lightning_dml.index.index.best_k` (torch) give the same results, and both the brute-force order (score
    descending, then the smaller id), from a store returning its top-n in a scrambled order of ties, for every k."""
    from lightning_dml.index.faiss_search import best_k_arrays
    from lightning_dml.index.index import best_k

    rng = np.random.default_rng(0)
    scores = rng.integers(0, 4, (5, 12)).astype(np.float32)  # 4 distinct values over 12 items: many ties
    ids = np.stack([rng.permutation(12) for _ in range(5)]).astype(np.int64)

    def store(x: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:  # top-n by score, ties in the row's order
        rows = x[:, 0].astype(int)
        order = np.argsort(-scores[rows], axis=1, kind="stable")[:, :n]
        return np.take_along_axis(scores[rows], order, 1), np.take_along_axis(ids[rows], order, 1)

    x = np.arange(5, dtype=np.float32)[:, None]
    for k in (1, 3, 5, 12, 14):
        got = best_k_arrays(store, x, k, 12)
        theirs = best_k(lambda q, n: tuple(map(torch.from_numpy, store(q, n))), x, k, 12)
        assert np.array_equal(got[0], theirs[0].numpy()) and np.array_equal(got[1], theirs[1].numpy())
        for q in range(5):
            brute = sorted(zip(-scores[q], ids[q]))[:k]
            assert got[1][q, : len(brute)].tolist() == [int(i) for _, i in brute]
            assert (got[1][q, len(brute):] == -1).all()


def test_device_cuda_without_the_cuda_provider_is_one_line(built):
    """``search --runtime onnx --device cuda`` where onnxruntime has no CUDAExecutionProvider (this CPU machine):
    one line naming what is missing; with the provider, it is the session's first."""
    import onnxruntime as ort

    from lightning_dml.onnx.folder_search import FolderSearch

    query = str(built["gallery"] / "class0" / "0.png")
    if "CUDAExecutionProvider" in ort.get_available_providers():
        embedder = FolderSearch.load(built["onnx"]).embedder(device="cuda")
        assert embedder.session.get_providers()[0] == "CUDAExecutionProvider" and embedder.device == "cuda"
    else:
        line = _one_error(["search", "--index", str(built["onnx"]), "--runtime", "onnx", "--device", "cuda", query])
        assert "--device cuda: this onnxruntime has no CUDAExecutionProvider" in line
