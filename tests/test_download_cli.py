"""User errors through the ``lightning-dml`` command: one message, exit status 1, no traceback; and the
acceptance run (slow): from an empty folder to a finished fit with the CUB archive and BN-Inception weights
served by a loopback server."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dml import cli
from lightning_dml.errors import UserInputError
from tests.download_fixtures import FileServer, cub_archive, md5, sha256, write_overrides
from tests.download_fixtures import restore_switches  # noqa: F401 - autouse fixture: restores os.environ switches

ROOT = Path(__file__).resolve().parents[1]
CUB_CONFIG = ROOT / "configs" / "cub200" / "multi_similarity.yaml"
CARS_CONFIG = ROOT / "configs" / "cars196" / "multi_similarity.yaml"
SMALL = [
    "--trainer.logger", "false",
    "--trainer.max_steps", "2",
    "--trainer.enable_progress_bar", "false",
    "--data.init_args.classes_per_batch", "2",
    "--data.init_args.samples_per_class", "2",
    "--data.init_args.num_workers", "0",
    "--data.init_args.eval_batch_size", "16",
]

#: 64-pixel crops for the acceptance fit: BN-Inception pools globally, so every step of the run is the same as at the
#: config's 227 (the downloaded weights load, the fit and its validations run) at a twelfth of the compute
SMALL_IMAGES = ["--data.init_args.image_size", "64", "--data.init_args.resize_size", "72"]


@pytest.fixture
def env(tmp_path, monkeypatch):
    """An empty torch cache, no overrides, the working folder in tmp_path, and the command line of main()."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(torch.hub, "_hub_dir", None, raising=False)
    monkeypatch.delenv("LIGHTNING_DML_RESOURCES", raising=False)
    monkeypatch.delenv("LIGHTNING_DML_DEBUG", raising=False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dml"])
    return tmp_path


@pytest.fixture(scope="module")
def cub_bytes(tmp_path_factory):
    return cub_archive(tmp_path_factory.mktemp("cub"))


def run_main(capsys, *args: str) -> str:
    """Run ``main(args)``; assert it exits with status 1 and no traceback; return stderr."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(list(args))
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.count("lightning-dml: error:") == 1
    return err


def fit_args(config: Path, root: Path, *extra: str, pretrained: bool = False) -> list[str]:
    return [
        "fit", "--config", str(config), "--data.init_args.root", str(root),
        "--model.backbone.init_args.pretrained", str(pretrained).lower(), "--trainer.default_root_dir", str(root.parent / "run"),
        *SMALL, *extra,
    ]


def serve_cub(server: FileServer, data: bytes, genuine: bytes, tmp_path: Path, monkeypatch) -> None:
    """Serve ``data`` as the CUB archive while the override file holds the md5 of ``genuine``."""
    server.files["CUB_200_2011.tgz"] = data
    archive = {"url": server.url("CUB_200_2011.tgz"), "file_name": "CUB_200_2011.tgz", "md5": md5(genuine)}
    path = write_overrides(tmp_path / "resources.json", datasets={"cub200": {"archives": [archive]}})
    monkeypatch.setenv("LIGHTNING_DML_RESOURCES", str(path))
    monkeypatch.setenv("LIGHTNING_DML_OFFLINE", "0")


def test_missing_dataset(env, capsys):
    err = run_main(capsys, *fit_args(CUB_CONFIG, env / "nowhere"))
    assert f"CUB-200-2011: root folder {env / 'nowhere'} does not exist" in err
    assert "images.txt" in err  # the expected layout


def test_checksum_mismatch(env, capsys, monkeypatch, cub_bytes):
    tampered = cub_bytes[:-100] + bytes(100)
    with FileServer() as server:
        serve_cub(server, tampered, cub_bytes, env, monkeypatch)
        err = run_main(capsys, *fit_args(CUB_CONFIG, env / "data", "--data.init_args.download", "true"))
    assert "md5" in err and "was deleted" in err
    assert not (env / "data" / "CUB_200_2011").exists()


def test_failed_download(env, capsys, monkeypatch, cub_bytes):
    with FileServer() as server:
        serve_cub(server, cub_bytes, cub_bytes, env, monkeypatch)
        server.status["CUB_200_2011.tgz"] = 404
        err = run_main(capsys, *fit_args(CUB_CONFIG, env / "data", "--data.init_args.download", "true"))
    assert "could not download CUB-200-2011" in err and "404" in err


def test_refused_download_offline(env, capsys, monkeypatch, cub_bytes):
    with FileServer() as server:
        serve_cub(server, cub_bytes, cub_bytes, env, monkeypatch)
        err = run_main(capsys, "--offline", *fit_args(CUB_CONFIG, env / "data", "--data.init_args.download", "true"))
        assert server.requests == []
    assert "downloads are switched off" in err and "CUB_200_2011.tgz" in err


def test_dataset_without_a_download(env, capsys):
    err = run_main(capsys, *fit_args(CARS_CONFIG, env / "cars", "--data.init_args.download", "true"))
    assert "Cars196 cannot be downloaded automatically" in err
    assert "https://ai.stanford.edu/~jkrause/cars/car_dataset.html" in err and "cars_annos.mat" in err


def test_corrupt_weights_file(env, capsys):
    weights = env / "bn.pth"
    weights.write_bytes(b"\x80\x02 truncated")
    err = run_main(capsys, *fit_args(CUB_CONFIG, env / "data", "--model.backbone.init_args.weights_path", str(weights),
                                     pretrained=True))
    assert f"cannot read {weights}" in err


def test_debug_shows_the_traceback_of_a_user_error(env):
    with pytest.raises(UserInputError, match="does not exist"):
        cli.main(["--debug", *fit_args(CUB_CONFIG, env / "nowhere")])


def test_a_bug_keeps_its_traceback(env, monkeypatch):
    def broken(args=None, run=True):
        raise RuntimeError("a real bug")

    monkeypatch.setattr(cli, "build_cli", broken)
    with pytest.raises(RuntimeError, match="a real bug"):
        cli.main(["fit"])


def test_missing_weights_offline_in_a_real_process(tmp_path):
    """The installed command (a subprocess): status 1, the message, no traceback on stderr."""
    env = {**os.environ, "LIGHTNING_DML_OFFLINE": "1", "TORCH_HOME": str(tmp_path / "torch"), "OMP_NUM_THREADS": "1"}
    env.pop("LIGHTNING_DML_RESOURCES", None)
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_dml", *fit_args(CUB_CONFIG, tmp_path / "data", pretrained=True)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "lightning-dml: error: pretrained weights for bninception" in proc.stderr
    assert str(tmp_path / "torch" / "hub" / "checkpoints" / "bn_inception-52deb4733.pth") in proc.stderr


@pytest.mark.slow
def test_acceptance_fit_from_an_empty_folder_downloads_dataset_and_weights(tmp_path, cub_bytes):
    """``lightning-dml fit`` of the CUB MS config with ``download: true``: archive and BN-Inception weights come
    from the loopback server (a random-valued state dict of the pretrainedmodels architecture, 45 MB), once."""
    from pretrainedmodels.models.bninception import BNInception

    torch.save(BNInception(num_classes=1000).state_dict(), tmp_path / "bn.pth")
    weights = (tmp_path / "bn.pth").read_bytes()
    with FileServer() as server:
        server.files["CUB_200_2011.tgz"] = cub_bytes
        server.files["bn_inception.pth"] = weights
        overrides = write_overrides(
            tmp_path / "resources.json",
            weights={"bninception": {"url": server.url("bn_inception.pth"), "sha256": sha256(weights),
                                     "file_name": "bn_inception-test.pth"}},
            datasets={"cub200": {"archives": [{"url": server.url("CUB_200_2011.tgz"), "file_name": "CUB_200_2011.tgz",
                                               "md5": md5(cub_bytes)}]}},
        )
        # one thread, as the suite's other processes (beside another pytest worker a second one spins: 23 -> 16 s CPU)
        env = {**os.environ, "LIGHTNING_DML_RESOURCES": str(overrides), "LIGHTNING_DML_OFFLINE": "0",
               "TORCH_HOME": str(tmp_path / "torch"), "OMP_NUM_THREADS": "1"}
        root = tmp_path / "empty"
        root.mkdir()
        proc = subprocess.run(
            [sys.executable, "-m", "lightning_dml", *fit_args(CUB_CONFIG, root, "--data.init_args.download", "true",
                                                               *SMALL_IMAGES, pretrained=True)],
            cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        assert "`Trainer.fit` stopped: `max_steps=2` reached" in proc.stdout + proc.stderr
        assert sorted(name for name, _ in server.requests) == ["CUB_200_2011.tgz", "bn_inception.pth"]
    assert (tmp_path / "torch" / "hub" / "checkpoints" / "bn_inception-test.pth").read_bytes() == weights
    assert (root / "CUB_200_2011" / "images.txt").is_file()
