"""Several processes and ``download: true``: one download, the same data everywhere (``run_download_ddp.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.download_fixtures import FileServer, cub_archive, md5, write_overrides

SCRIPT = os.path.join(os.path.dirname(__file__), "run_download_ddp.py")


@pytest.fixture
def served_cub(tmp_path):
    """A loopback server with a CUB archive (answering after 1 s, so concurrent clients overlap) and the env."""
    data = cub_archive(tmp_path / "src")
    with FileServer() as server:
        server.files["CUB_200_2011.tgz"] = data
        server.delay = 1.0
        archive = {"url": server.url("CUB_200_2011.tgz"), "file_name": "CUB_200_2011.tgz", "md5": md5(data)}
        overrides = write_overrides(tmp_path / "resources.json", datasets={"cub200": {"archives": [archive]}})
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", LIGHTNING_DML_OFFLINE="0",
                   LIGHTNING_DML_RESOURCES=str(overrides))
        env.pop("LOCAL_RANK", None)
        yield server, env


@pytest.mark.skipif(sys.platform == "win32", reason="gloo")
def test_ddp_fit_downloads_once_and_every_rank_loads_the_same_data(tmp_path, served_cub):
    server, env = served_cub
    proc = subprocess.run(
        [sys.executable, SCRIPT, "ddp", str(tmp_path)], capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert "DOWNLOAD-DDP-OK" in proc.stdout
    assert server.count("CUB_200_2011.tgz") == 1


def test_two_nodes_on_a_shared_file_system_download_once(tmp_path, served_cub):
    """Each node's local rank 0 runs prepare_data at the same time: the file lock lets one download."""
    server, env = served_cub
    procs = [
        subprocess.Popen([sys.executable, SCRIPT, "node", str(tmp_path), f"node{i}"], env=env, cwd=tmp_path,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(2)
    ]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, out[-3000:] + err[-3000:]
    assert server.count("CUB_200_2011.tgz") == 1
    first, second = (json.loads((tmp_path / f"node{i}.json").read_text()) for i in range(2))
    assert first == second and first["count"] == 400


@pytest.mark.slow
@pytest.mark.skipif(sys.platform == "win32", reason="gloo")
def test_ddp_cli_user_error_exits_with_the_message_and_no_traceback(tmp_path):
    """A 2-process CLI fit whose dataset is missing: every process exits with the message, status 1, no traceback."""
    config = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "cub200", "multi_similarity.yaml")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_dml", "fit", "--config", config, "--data.init_args.root", str(tmp_path / "nowhere"),
         "--model.backbone.init_args.pretrained", "false", "--trainer.logger", "false", "--trainer.accelerator", "cpu",
         "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.enable_checkpointing", "false"],
        capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output
    assert f"lightning-dml: error: CUB-200-2011: root folder {tmp_path / 'nowhere'} does not exist" in output
