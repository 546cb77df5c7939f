"""No file the library reads may run code (issue 26 s.1).

A harmless payload (a pickled object whose unpickling creates a marker file) is planted in every kind of file the
library reads: a checkpoint (``--ckpt_path`` of ``test``, ``predict``, ``index build`` and
``python -m lightning_dml.export``), a checkpoint served over HTTP (a loopback server of the test), an index folder
and its model (``search``, ``index add``, ``index evaluate --queries``, the Python API the server uses), a
predictions file, a report's ``results.npz``, a cv fold file, the decoded-image cache index and the verification
cache. Each is refused with one line naming the file (no traceback), or, for the caches (JSON: never unpickled),
rebuilt; the marker never appears. A last test reads the package source for unsafe loaders outside a reviewed
allow-list.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import io
import json
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import pytorch_lightning as pl
import torch
import yaml

from lightning_dml.cli import main
from lightning_dml.errors import CorruptFileError, UserInputError
from lightning_dml.models import SmallConvNet
from lightning_dml.module import DMLModule
from tests.test_index_cli import _write_gallery

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "lightning_dml"
QUIET = ["--progress_bar", "false"]
SAFETENSORS = "embedding_model.safetensors"  # lightning_dml.export.SAFETENSORS, the index folder's model


class Payload:
    """Unpickling this object creates the file ``marker`` (it calls ``open(marker, "w")``): code from the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


@pytest.fixture
def marker(tmp_path) -> Path:
    return tmp_path / "PAYLOAD-RAN"


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DML_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # where Lightning's URL loader would download


def _run_main(args: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    code = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            main(args)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except Exception:  # noqa: BLE001 - a traceback: reported by the callers' checks, after the marker's
            import traceback

            traceback.print_exc()
            code = -1
    return code, out.getvalue(), err.getvalue()


def _one_error(args: list[str], marker: Path | None = None, prefix: str = "lightning-dml: error: ") -> str:
    """The one error line of a command that must fail with exit status 1 and no traceback (and, first, must not
    have run the payload that creates ``marker``)."""
    code, _, err = _run_main(args)
    assert marker is None or not marker.exists(), f"the payload ran: {' '.join(args)}"
    lines = [line for line in err.splitlines() if line.startswith(prefix)]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err[-3000:]
    return lines[0]


def test_the_payload_runs_when_unpickled_unsafely(tmp_path, marker):
    """The control: the payload is real, so a reader that unpickled it would create the marker."""
    torch.save({"x": Payload(marker)}, tmp_path / "evil.pt")
    torch.load(tmp_path / "evil.pt", weights_only=False)
    assert marker.exists()


# ------------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def run(tmp_path_factory) -> dict[str, Path]:
    """A tiny Glyphs config (SmallConvNet width 8, 16-d), a random-init Lightning checkpoint, a gallery of 3 class
    folders x 3 grey PNGs, and an index built from them (the safe model format)."""
    from tests.test_index_cli import _checkpoint

    root = tmp_path_factory.mktemp("safe_loads")
    cfg = yaml.safe_load((ROOT / "configs" / "glyphs.yaml").read_text())
    cfg["trainer"] = {"logger": False, "enable_checkpointing": False, "accelerator": "cpu", "devices": 1,
                      "enable_progress_bar": False, "enable_model_summary": False}
    cfg["model"]["backbone"]["init_args"]["width"] = 8
    cfg["model"]["embedding_dim"] = 16
    cfg["model"]["clustering"] = False
    cfg["model"]["recall_at"] = [1]
    cfg["data"]["init_args"].update({"image_size": 16, "classes_per_batch": 4, "samples_per_class": 2})
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    _write_gallery(root / "gallery", range(3), per_class=3)
    ckpt = _checkpoint(config, root / "model.ckpt", 0)
    code, _, err = _run_main(["index", "build", "--config", str(config), "--ckpt_path", str(ckpt), "--gallery",
                              str(root / "gallery"), "--out", str(root / "index"), *QUIET])
    assert code == 0, err[-3000:]
    return {"root": root, "config": config, "ckpt": ckpt, "gallery": root / "gallery", "index": root / "index"}


def _evil_checkpoint(path: Path, marker: Path) -> Path:
    torch.save({"state_dict": {}, "pytorch-lightning_version": pl.__version__, "extra": Payload(marker)}, path)
    return path


@contextlib.contextmanager
def _serve(folder: Path):
    """An HTTP server on 127.0.0.1 (a free port) serving ``folder``; yields its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch):
    for key in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(key, raising=False)


# ------------------------------------------------------------------------------------------------ checkpoints
@pytest.mark.parametrize("command", ["test", "predict"])
def test_a_checkpoint_with_code_is_refused_by_the_trainer_commands(run, tmp_path, marker, command, monkeypatch):
    monkeypatch.chdir(tmp_path)
    evil = _evil_checkpoint(tmp_path / "evil.ckpt", marker)
    line = _one_error([command, "--config", str(run["config"]), f"--ckpt_path={evil}"], marker=marker)
    assert str(evil) in line and "pickles the Python object" in line, line
    assert not marker.exists()


def test_a_checkpoint_with_code_is_refused_by_index_build_and_export(run, tmp_path, marker):
    evil = _evil_checkpoint(tmp_path / "evil.ckpt", marker)
    line = _one_error(["index", "build", "--config", str(run["config"]), "--ckpt_path", str(evil), "--gallery",
                       str(run["gallery"]), "--out", str(tmp_path / "idx"), *QUIET], marker=marker)
    assert str(evil) in line and "pickles the Python object" in line, line
    from lightning_dml.export import main as export_main

    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(BaseException) as exit_:
        export_main(["--config", str(run["config"]), "--ckpt_path", str(evil), "--output", str(tmp_path / "out")])
    assert not marker.exists(), "the payload ran"
    assert isinstance(exit_.value, SystemExit) and exit_.value.code == 1, exit_.value
    (line,) = [x for x in err.getvalue().splitlines() if ": error: " in x]
    assert str(evil) in line and "pickles the Python object" in line, line
    assert not marker.exists() and not (tmp_path / "out").exists()


def _served_checkpoints(tmp_path: Path, run: dict[str, Path], marker: Path) -> Path:
    served = tmp_path / "served"
    served.mkdir()
    _evil_checkpoint(served / "evil.ckpt", marker)
    shutil.copy(run["ckpt"], served / "good.ckpt")
    return served


def test_a_url_checkpoint_is_downloaded_and_read_safely(run, tmp_path, marker, monkeypatch):
    """``--ckpt_path http://...``: the file is downloaded to the cache and read like a local one; Lightning never
    loads the URL (it would unpickle it)."""
    monkeypatch.setenv("LIGHTNING_DML_OFFLINE", "0")  # the tests run offline; this server is on the loopback
    monkeypatch.chdir(tmp_path)
    with _serve(_served_checkpoints(tmp_path, run, marker)) as base:
        line = _one_error(["test", "--config", str(run["config"]), f"--ckpt_path={base}/evil.ckpt"], marker)
        assert "pickles the Python object" in line and "evil.ckpt" in line, line
        from lightning_dml.checkpoints import url_checkpoint_path

        assert url_checkpoint_path(f"{base}/evil.ckpt").is_file()  # read from the cache, refused there
        line = _one_error(["index", "build", "--config", str(run["config"]), "--ckpt_path", f"{base}/evil.ckpt",
                           "--gallery", str(run["gallery"]), "--out", str(tmp_path / "idx"), *QUIET], marker=marker)
        assert "pickles the Python object" in line, line
        line = _one_error(["test", "--config", str(run["config"]), f"--ckpt_path={base}/missing.ckpt"], marker)
        assert "could not download" in line and "404" in line, line
        missing = url_checkpoint_path(f"{base}/missing.ckpt")
        assert not missing.exists() and not list(missing.parent.glob("*.part"))  # nothing half-written left
    monkeypatch.setenv("LIGHTNING_DML_OFFLINE", "1")
    line = _one_error(["test", "--config", str(run["config"]), "--ckpt_path=http://127.0.0.1:9/other.ckpt"])
    assert "downloads are switched off" in line, line
    line = _one_error(["test", "--config", str(run["config"]), "--ckpt_path=s3://bucket/x.ckpt"])
    assert "only local files and http(s)" in line, line


@pytest.mark.slow
def test_a_good_url_checkpoint_is_used_from_the_cache(run, tmp_path, marker, monkeypatch, tmp_path_factory):
    """A good one is predicted with, and the recorded checkpoint is its cached copy (path and sha256)."""
    from lightning_dml.callbacks import load_predictions
    from lightning_dml.checkpoints import checkpoint_record, url_checkpoint_path
    from tests import glyph_cache

    glyph_cache.install(tmp_path_factory.getbasetemp() / glyph_cache.FILENAME)
    monkeypatch.setenv("LIGHTNING_DML_OFFLINE", "0")
    monkeypatch.chdir(tmp_path)
    with _serve(_served_checkpoints(tmp_path, run, marker)) as base:
        code, _, err = _run_main(["predict", "--config", str(run["config"]), f"--ckpt_path={base}/good.ckpt",
                                  "--trainer.limit_predict_batches=1"])
        assert code == 0, err[-3000:]
    (out,) = tmp_path.glob("**/predictions.pt")
    cached = url_checkpoint_path(f"{base}/good.ckpt")
    assert cached.read_bytes() == run["ckpt"].read_bytes()
    assert load_predictions(out)["checkpoint"] == checkpoint_record(cached)


# ------------------------------------------------------------------------------------------------ index folders
def _copy_index(run: dict[str, Path], tmp_path: Path) -> Path:
    folder = tmp_path / "index"
    shutil.copytree(run["index"], folder)
    return folder


def _search_error(folder: Path, run: dict[str, Path], marker: Path | None = None) -> str:
    query = str(run["gallery"] / "class0" / "0.png")
    return _one_error(["search", "--index", str(folder), "--k", "2", query], marker)


def _record_of(path: Path) -> dict:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        return json.loads(handle.metadata()["lightning_dml.embedding_model"])


def _rewrite_record(path: Path, record: dict) -> None:
    from safetensors.torch import load_file, save_file

    save_file(load_file(str(path)), str(path), metadata={"lightning_dml.embedding_model": json.dumps(record)})


def test_the_index_model_is_tensors_and_a_record_and_search_works(run):
    folder = run["index"]
    assert (folder / SAFETENSORS).is_file() and not list(folder.glob("*.pt2"))
    assert json.loads((folder / "manifest.json").read_text())["model"] == SAFETENSORS
    record = _record_of(folder / SAFETENSORS)
    assert record["backbone"] == {"class_path": "lightning_dml.models.SmallConvNet",
                                  "init_args": {"in_channels": 1, "width": 8, "double_conv": False, "pooling": "avg"}}
    query = run["gallery"] / "class2" / "1.png"
    code, out, err = _run_main(["search", "--index", str(folder), "--k", "1", str(query)])
    assert code == 0, err[-3000:]
    (best,) = json.loads(out.splitlines()[0])["results"]
    # the rebuilt model embeds the image as the checkpoint's module did when the index was built
    assert Path(best["path"]) == query.absolute() and best["score"] == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("attack", ["pickle_as_model", "old_pt2", "class_path", "timm_checkpoint_path",
                                    "pretrained", "truncated", "wrong_tensors", "huge_record"])
def test_an_index_model_that_is_not_safe_is_refused_in_one_line(run, tmp_path, marker, attack):
    folder = _copy_index(run, tmp_path)
    model = folder / SAFETENSORS
    evil = _evil_checkpoint(tmp_path / "evil.pt", marker)
    record = _record_of(model)
    if attack == "pickle_as_model":  # a pickle under the model's name
        shutil.copy(evil, model)
        says = "not a safetensors file"
    elif attack == "old_pt2":  # an index of the old format (torch.export archive, may hold pickles)
        model.unlink()
        shutil.copy(evil, folder / "embedding_exported.pt2")
        manifest = json.loads((folder / "manifest.json").read_text())
        (folder / "manifest.json").write_text(json.dumps({**manifest, "model": "embedding_exported.pt2"}))
        says = "rebuild the index"
    elif attack == "class_path":  # a record naming something to import
        _rewrite_record(model, {**record, "backbone": {"class_path": "os.system", "init_args": {"command": "x"}}})
        says = "'os.system' is not one the library rebuilds"
    elif attack == "timm_checkpoint_path":  # a timm model told to torch.load a file of the author's choosing
        backbone = {"class_path": "lightning_dml.models.TimmBackbone",
                    "init_args": {"model_name": "resnet18", "pretrained": False, "checkpoint_path": str(evil)}}
        _rewrite_record(model, {**record, "backbone": backbone})
        says = "passes checkpoint_path to timm"
    elif attack == "pretrained":  # a record asking for a download / a weights file
        backbone = {**record["backbone"], "init_args": {"pretrained": True, "weights_path": str(evil)}}
        _rewrite_record(model, {**record, "backbone": {**backbone, "class_path": "lightning_dml.models.ResNet50"}})
        says = "asks for pretrained weights"
    elif attack == "truncated":
        model.write_bytes(model.read_bytes()[: model.stat().st_size // 2])
        says = "truncated or not a safetensors file"
    elif attack == "huge_record":  # a record whose model would need ~10^14 bytes: refused before allocating
        backbone = {**record["backbone"], "init_args": {**record["backbone"]["init_args"], "width": 10**6}}
        _rewrite_record(model, {**record, "backbone": backbone})
        says = "do not fit the recorded architecture"
    else:  # tensors of another width than the record
        _rewrite_record(model, {**record, "head": {**record["head"], "init_args": {**record["head"]["init_args"],
                                                                                  "embedding_dim": 7}}})
        says = "do not fit the recorded architecture"
    line = _search_error(folder, run, marker)
    assert says in line and str(folder) in line, line
    line = _one_error(["index", "evaluate", "--index", str(folder), "--queries", str(run["gallery"])], marker)
    assert says in line, line
    more = tmp_path / "more"
    _write_gallery(more, range(5, 6), per_class=1)  # a new image: `index add` embeds it
    line = _one_error(["index", "add", "--index", str(folder), "--gallery", str(more)], marker=marker)
    assert says in line, line
    from lightning_dml.index import EmbeddingIndex  # what `serve` loads

    with pytest.raises(UserInputError, match=re.escape(says)):
        EmbeddingIndex.load(folder).embed_images([run["gallery"] / "class0" / "0.png"])
    assert not marker.exists()


@pytest.mark.parametrize("name", [
    "manifest.json",
    "table.csv",
    "embeddings.npy",
])
def test_the_other_files_of_an_index_folder_holding_a_pickle_are_one_line(run, tmp_path, marker, name):
    """manifest.json and table.csv are text; embeddings.npy is read with allow_pickle=False."""
    import pickle

    folder = _copy_index(run, tmp_path)
    if name == "embeddings.npy":
        np.save(folder / name, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    else:
        (folder / name).write_bytes(pickle.dumps(Payload(marker)))
    try:
        line = _search_error(folder, run, marker)
        assert name in line, line
    finally:
        assert not marker.exists()


def test_the_other_files_of_an_index_folder_are_never_unpickled(run, tmp_path, marker):
    import pickle

    for name in ("manifest.json", "table.csv", "embeddings.npy"):
        folder = tmp_path / name
        shutil.copytree(run["index"], folder)
        if name == "embeddings.npy":
            np.save(folder / name, np.array([Payload(marker)], dtype=object), allow_pickle=True)
        else:
            (folder / name).write_bytes(pickle.dumps(Payload(marker)))
        with contextlib.suppress(Exception):
            _run_main(["search", "--index", str(folder), "--k", "2", str(run["gallery"] / "class0" / "0.png")])
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ other files
def _evil_predictions(path: Path, marker: Path) -> Path:
    torch.save({"embeddings": torch.zeros(2, 16), "labels": torch.tensor([0, 1]), "indices": torch.arange(2),
                "paths": ["a.png", "b.png"], "checkpoint": None, "extra": Payload(marker)}, path)
    return path


def test_predictions_with_code_are_refused_by_index_evaluate_and_report(run, tmp_path, marker):
    evil = _evil_predictions(tmp_path / "evil.pt", marker)
    line = _one_error(["index", "evaluate", "--index", str(run["index"]), "--queries", str(evil)], marker=marker)
    assert str(evil) in line and "pickles the Python object" in line, line
    line = _one_error(["report", "--out", str(tmp_path / "report"), "--predictions", str(evil)], marker=marker)
    assert str(evil) in line, line
    truncated = tmp_path / "cut.pt"
    truncated.write_bytes(evil.read_bytes()[:300])
    line = _one_error(["index", "evaluate", "--index", str(run["index"]), "--queries", str(truncated)], marker)
    assert str(truncated) in line and "truncated" in line, line
    assert not marker.exists()


def test_results_with_code_are_refused_by_report(tmp_path, marker):
    from lightning_dml.retrieval.results import RetrievalResults

    evil = tmp_path / "results.npz"
    np.savez(evil, meta=np.array(json.dumps({"format": 1})), ranks=np.array([Payload(marker)], dtype=object))
    with pytest.raises(ValueError, match="allow_pickle"):
        RetrievalResults.load(evil)
    line = _one_error(["report", "--out", str(tmp_path / "report"), "--results", str(evil)], marker=marker)
    assert str(evil) in line, line
    assert not marker.exists()


def test_a_cv_fold_file_with_code_is_refused_by_aggregate(tmp_path, marker):
    from lightning_dml.protocol import cv

    run_dir = tmp_path / "cv"
    run_dir.mkdir()
    (run_dir / cv.MANIFEST).write_text(json.dumps({"num_folds": 1, "repeats": 1, "fit_args": [], "seed": 0}))
    fold = cv.fold_dir(run_dir, 0, 0)
    fold.mkdir(parents=True)
    torch.save({"embeddings": torch.zeros(2, 4), "recall_at": [1], "extra": Payload(marker)}, fold / cv.EMBEDDINGS)
    line = _one_error(["cv", "--aggregate", str(run_dir)], marker=marker)
    assert str(fold / cv.EMBEDDINGS) in line and "pickles the Python object" in line, line
    assert not marker.exists()


def test_the_caches_are_json_and_a_pickle_in_them_is_rebuilt_not_run(tmp_path, marker):
    import pickle

    from lightning_dml.data.decoded_cache import open_decoded_cache
    from lightning_dml.data.verify import verify_image_files
    from tests.test_decoded_cache import _split

    top, paths = _split(tmp_path)
    _, info = open_decoded_cache(paths, top, "train", 20, progress=False)
    info.index_file.write_bytes(pickle.dumps(Payload(marker)))
    view, again = open_decoded_cache(paths, top, "train", 20, progress=False)
    assert again.built and len(view) == len(paths)
    first = verify_image_files(paths, "header", top, progress=False)
    first.cache_file.write_bytes(pickle.dumps(Payload(marker)))
    assert verify_image_files(paths, "header", top, progress=False).cached == 0
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------ exported models
def _module(seed: int = 0, **kwargs) -> DMLModule:
    torch.manual_seed(seed)
    module = DMLModule(SmallConvNet(in_channels=1, width=4), embedding_dim=8, head_norm="batch", clustering=False,
                       **kwargs)
    with torch.no_grad():  # BatchNorm statistics that are not the defaults
        module.train()(torch.randn(8, 1, 16, 16))
    return module.eval()


@pytest.mark.parametrize("fusion", ["none", "concat"])
def test_the_safe_format_rebuilds_the_module_exactly(tmp_path, fusion):
    from lightning_dml.export import export_embedding_model, load_embedding_model

    module = _module(fusion=fusion)
    paths = export_embedding_model(module, tmp_path, torch.randn(2, 1, 16, 16), formats=["safetensors"])
    loaded = load_embedding_model(paths["safetensors"])
    images = torch.randn(5, 1, 16, 16)
    with torch.no_grad():
        assert torch.equal(loaded(images), module(images))
    assert not any(p.requires_grad for p in loaded.parameters()) and not loaded.training


def test_the_safe_format_of_a_timm_backbone_needs_no_download(tmp_path, monkeypatch):
    from lightning_dml.export import export_embedding_model, load_embedding_model
    from lightning_dml.models import TimmBackbone

    monkeypatch.setenv("LIGHTNING_DML_OFFLINE", "1")
    torch.manual_seed(0)
    backbone = TimmBackbone("vit_tiny_patch16_224", pretrained=False, img_size=32, depth=1, embed_dim=24, num_heads=1)
    module = DMLModule(backbone, embedding_dim=8, clustering=False).eval()
    paths = export_embedding_model(module, tmp_path, torch.randn(2, 3, 32, 32), formats=["safetensors"])
    assert _record_of(paths["safetensors"])["backbone"]["init_args"]["pretrained"] is False
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(load_embedding_model(paths["safetensors"])(images), module(images))


def test_program_formats_load_only_when_trusted(tmp_path, marker):
    from lightning_dml.export import UnsafeFormatError, export_embedding_model, load_embedding_model

    module = _module()
    paths = export_embedding_model(module, tmp_path, torch.randn(2, 1, 16, 16), formats=["torchscript", "torch_export"])
    images = torch.randn(3, 1, 16, 16)
    for name in ("torchscript", "torch_export"):
        with pytest.raises(UnsafeFormatError, match="runs code chosen by whoever wrote it"):
            load_embedding_model(paths[name])
        with torch.no_grad():
            torch.testing.assert_close(load_embedding_model(paths[name], trust_code=True)(images), module(images))


def test_a_backbone_the_safe_format_cannot_rebuild_is_one_clear_error(tmp_path):
    from lightning_dml.export import export_embedding_model, load_safe_embedding_model
    from lightning_dml.models.records import UnsupportedModelError

    class MyNet(SmallConvNet):
        pass

    module = DMLModule(MyNet(in_channels=1, width=4), embedding_dim=8, clustering=False).eval()
    with pytest.raises(UnsupportedModelError, match="MyNet cannot be recorded in the safe format"):
        export_embedding_model(module, tmp_path / "out", torch.randn(2, 1, 16, 16))
    assert not (tmp_path / "out" / SAFETENSORS).exists()
    with pytest.raises(CorruptFileError, match="not a safetensors file"):
        (tmp_path / "x.safetensors").write_bytes(b"\x00" * 5)
        load_safe_embedding_model(tmp_path / "x.safetensors")


# ------------------------------------------------------------------------------------------------ the source
#: the places where the package may call a loader that can run code, each with the reason it is safe there
ALLOWED = {
    ("lightning_dml/export.py", "torch.export.load"): "load_embedding_model(trust_code=True): the caller vouches "
    "for its own file; refused otherwise, used by no command",
    ("lightning_dml/export.py", "torch.jit.load"): "the same, for TorchScript",
    ("lightning_dml/entry.py", "import_module("): "COMMANDS maps the fixed command names to the library's own "
    "modules; the command line only picks a key",
    ("lightning_dml/data/__init__.py", "import_module("): "lazy attributes: a fixed table of the package's own "
    "modules (_WHERE), looked up by attribute name",
    ("lightning_dml/index/__init__.py", "import_module("): "the same lazy-attribute table for lightning_dml.index",
    ("lightning_dml/cli_parsing.py", "import_module("): "the did-you-mean of a misspelt key imports the class_path "
    "the config or command line names, as jsonargparse does when it parses it: an installed module, never code "
    "read from the file",
}
#: unsafe calls: a pattern, and the regular expression of what makes a match safe on the same line
UNSAFE = {
    "weights_only=False": None,
    "allow_pickle=True": None,
    "torch.export.load": None,
    "torch.jit.load": None,
    "pickle.load": None,
    "pickle.loads": None,
    "cloudpickle": None,
    "dill.load": None,
    "joblib.load": None,
    "marshal.load": None,
    "shelve.open": None,
    "read_pickle": None,
    "jsonpickle": None,
    "PackageImporter": None,
    "torch.load(": r"weights_only=True",
    "np.load(": r"allow_pickle=False",
    "numpy.load(": r"allow_pickle=False",
    "yaml.load(": r"SafeLoader",
    "yaml.unsafe_load": None,
    "yaml.full_load": None,
    "load_state_dict_from_url": None,
    "eval(": None,
    "exec(": None,
    "__import__(": None,
    "import_module(": None,
}


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """``(first line number, code)`` of each logical line of ``path``, its tokens joined without spaces and without
    comments and string literals (docstrings, messages): a call spread over several lines is one entry."""
    import tokenize

    out: list[tuple[int, str]] = []
    parts: list[str] = []
    start = 0
    skip = {tokenize.COMMENT, tokenize.STRING, tokenize.ENCODING, tokenize.NL, tokenize.INDENT, tokenize.DEDENT}
    skip |= {getattr(tokenize, n) for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END") if hasattr(tokenize, n)}
    with open(path, "rb") as handle:
        for token in tokenize.tokenize(handle.readline):
            if token.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
                if parts:
                    out.append((start, "".join(parts)))
                parts = []
            elif token.type not in skip:
                start = start if parts else token.start[0]
                parts.append(token.string)
    return out


def test_no_unsafe_loader_outside_the_reviewed_allow_list():
    found = []
    used = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(ROOT).as_posix()
        for number, line in _code_lines(path):
            code = re.sub(r"\.eval\(\)", "", line)  # nn.Module.eval(), not eval
            for pattern, safe in UNSAFE.items():
                if pattern not in code:
                    continue
                if pattern in ("eval(", "exec(") and re.search(r"[\w.]" + re.escape(pattern), code):
                    continue  # another function ending in eval/exec (literal_eval, model.exec...)
                if safe is not None and re.search(safe, code):
                    continue
                if (relative, pattern) in ALLOWED:
                    used.add((relative, pattern))
                    continue
                found.append(f"{relative}:{number}: {pattern}: {line}")
    assert not found, "unsafe loaders outside the allow-list:\n" + "\n".join(found)
    assert used == set(ALLOWED), f"allow-list entries no longer needed: {set(ALLOWED) - used}"


def test_the_source_check_finds_what_it_looks_for(tmp_path):
    """The check above can fail: each of its patterns is found in a line that has it."""
    sample = tmp_path / "sample.py"
    sample.write_text("import torch\nx = torch.load(p, weights_only=False)\ny = eval(s)\nz = np.load(p)\n"
                      "ok = torch.load(p, weights_only=True)\nmodel.eval()\n# eval(s) in a comment\n"
                      "w = np.load(\n    p,\n    mmap_mode='r',\n    allow_pickle=False,\n)\n")
    lines = dict(_code_lines(sample))
    hits = [n for n, line in lines.items() for pattern, safe in UNSAFE.items()
            if pattern in re.sub(r"\.eval\(\)", "", line) and not (safe and re.search(safe, line))
            and not (pattern in ("eval(", "exec(") and re.search(r"[\w.]" + re.escape(pattern), line))]
    assert sorted(set(hits)) == [2, 3, 4]


@pytest.mark.slow
def test_the_cli_prints_one_line_for_a_pickled_queries_file_in_a_real_process(run, tmp_path, marker):
    evil = _evil_predictions(tmp_path / "evil.pt", marker)
    proc = subprocess.run([sys.executable, "-m", "lightning_dml", "index", "evaluate", "--index", str(run["index"]),
                           "--queries", str(evil)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("lightning-dml: error: "), proc.stderr[-3000:]
    assert not marker.exists()
