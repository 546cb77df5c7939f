"""What ``lightning-dml index build`` (and ``index add``, ``index evaluate``, ``search`` after it) print on stderr:
none of Lightning's device lines ("GPU available: ...", "TPU available: ...") nor torch's ``LeafSpec`` deprecation
warning raised inside Lightning's predict loop (:func:`lightning_dml.index.build.quiet_lightning`); and
``import lightning_dml.index`` exporting the store API without importing torch or pymilvus. Subprocesses: Lightning's
log handler writes to the stderr of its import and pytest records warnings itself, so only a fresh process's stderr
shows what a user sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import yaml

from tests.test_index_cli import ROOT, _checkpoint, _write_gallery

pytest.importorskip("faiss")

NOISE = ("GPU available", "TPU available", "LeafSpec", "LOCAL_RANK", "HPU available")

# the commands in one process (one torch import), each through the CLI's entry point as `lightning-dml` runs it
_COMMANDS = """
import json, sys
from lightning_dml.cli import main
for argv in json.loads(sys.argv[1]):
    try:
        main(argv)
    except SystemExit as exit_:
        if exit_.code:
            raise
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> dict:
    """test_index_cli's tiny Glyphs model (SmallConvNet width 8, 16-d) and a gallery of 2 classes x 2 images."""
    root = tmp_path_factory.mktemp("index_build_quiet")
    cfg = yaml.safe_load((ROOT / "configs" / "glyphs.yaml").read_text())
    cfg["trainer"] = {"logger": False, "enable_checkpointing": False, "accelerator": "cpu", "devices": 1}
    cfg["model"]["backbone"]["init_args"]["width"] = 8
    cfg["model"]["embedding_dim"] = 16
    cfg["model"]["clustering"] = False
    config = root / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    _write_gallery(root / "gallery", range(2), per_class=2)
    return {"root": root, "config": config, "gallery": root / "gallery",
            "ckpt": _checkpoint(config, root / "model.ckpt", 0)}


def _run(code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONWARNINGS": "default"}  # every warning shown, as a user's first run shows it
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=120)


def test_index_build_add_evaluate_and_search_print_no_lightning_device_lines(tiny):
    out = tiny["root"] / "flat"
    commands = [
        ["index", "build", "--config", str(tiny["config"]), "--ckpt_path", str(tiny["ckpt"]), "--gallery",
         str(tiny["gallery"]), "--out", str(out), "--progress_bar", "false"],
        ["index", "add", "--index", str(out), "--gallery", str(tiny["gallery"])],
        ["index", "evaluate", "--index", str(out), "--k", "2", "--recall_at", "1"],
        ["search", "--index", str(out), "--k", "1", str(tiny["gallery"] / "class1" / "0.png")],
    ]
    done = _run(_COMMANDS, json.dumps(commands))
    assert done.returncode == 0, done.stderr[-3000:]
    assert "4 items indexed" in done.stdout and "0 added" in done.stdout and "class1/0.png" in done.stdout
    noise = [line for line in done.stderr.splitlines() if any(word in line for word in NOISE)]
    assert noise == [], done.stderr[-3000:]


def test_the_store_api_is_exported_without_importing_torch_or_pymilvus():
    done = _run("import sys, lightning_dml.index as I\n"
                "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'pymilvus', 'milvus_lite')))\n"
                "print(sorted(set(I.__all__) - set(dir(I))))")
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.splitlines() == ["[]", "[]"]
    import lightning_dml.index as index
    from lightning_dml.index import calibrate, milvus, stores

    assert index.MilvusIndex is milvus.MilvusIndex and index.MilvusStoreError is milvus.MilvusStoreError
    assert index.open_index is stores.open_index and index.close_index is stores.close_index
    assert index.build_milvus_index is milvus.build_milvus_index and index.calibrate_index is calibrate.calibrate_index
    assert all(getattr(index, name) is not None for name in index.__all__)
