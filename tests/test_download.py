"""Downloads of datasets and weights against a loopback HTTP server: verify, resume, extract atomically, offline.

Nothing here reaches outside the machine: every URL is ``http://127.0.0.1:<port>`` of a server the test starts
(``tests/download_fixtures.py``), reached through ``LIGHTNING_DML_RESOURCES`` overrides.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import lightning_dml
from lightning_dml.data import RESOURCES, CUB200DataModule, Cars196DataModule, InShopDataModule, SOPDataModule
from lightning_dml.download import RemoteFile, download_file, fetch_weights, is_offline, set_offline
from lightning_dml.errors import (
    ChecksumError,
    DownloadError,
    ManualDownloadError,
    NotEnoughDiskSpaceError,
    OfflineError,
    UserInputError,
)
from lightning_dml.models import WEIGHTS, GoogLeNet
from tests.download_fixtures import FileServer, cub_archive, md5, sha256, sop_archive, write_overrides
from tests.download_fixtures import restore_switches  # noqa: F401 - autouse fixture: restores os.environ switches


@pytest.fixture
def online(monkeypatch):
    """Downloads allowed (the test suite runs offline by default); nothing is inherited from the environment."""
    monkeypatch.setenv("LIGHTNING_DML_OFFLINE", "0")
    monkeypatch.delenv("LIGHTNING_DML_RESOURCES", raising=False)


@pytest.fixture
def server():
    with FileServer() as s:
        yield s


@pytest.fixture(scope="module")
def cub_bytes(tmp_path_factory):
    return cub_archive(tmp_path_factory.mktemp("cub"))


def _point_cub_at(server: FileServer, data: bytes, tmp_path: Path, monkeypatch, **fields) -> None:
    server.files["CUB_200_2011.tgz"] = data
    archive = {"url": server.url("CUB_200_2011.tgz"), "file_name": "CUB_200_2011.tgz", "md5": md5(data), **fields}
    path = write_overrides(tmp_path / "resources.json", datasets={"cub200": {"archives": [archive]}})
    monkeypatch.setenv("LIGHTNING_DML_RESOURCES", str(path))


def _cub(root: Path, **kwargs) -> CUB200DataModule:
    return CUB200DataModule(root=str(root), download=True, num_workers=0, classes_per_batch=2, samples_per_class=2,
                            **kwargs)


def _leftovers(root: Path) -> list[str]:
    """Partial or complete downloads, staging folders and archives left in ``root``."""
    left = [p.name for p in root.iterdir() if p.name.endswith((".part", ".tgz", ".zip")) or p.name.startswith(".extracting")]
    if (root / ".downloads").is_dir():
        left += [f".downloads/{p.name}" for p in (root / ".downloads").iterdir()]
    return sorted(left)


# ----------------------------------------------------------------------------------------- tables
def test_weights_table_matches_torchvision_and_pretrainedmodels():
    import torchvision.models as tvm
    from pretrainedmodels.models.bninception import pretrained_settings

    torchvision_urls = {
        "resnet50": tvm.ResNet50_Weights.IMAGENET1K_V1.url,
        "resnet101": tvm.ResNet101_Weights.IMAGENET1K_V1.url,
        "googlenet": tvm.GoogLeNet_Weights.IMAGENET1K_V1.url,
        "bninception": pretrained_settings["bninception"]["imagenet"]["url"],
    }
    assert set(WEIGHTS) == set(torchvision_urls)
    for name, url in torchvision_urls.items():
        entry = WEIGHTS[name]
        assert entry.url == url and entry.file_name == os.path.basename(url)
        # torch hub's convention: <name>-<sha256 prefix>.pth; the table holds the prefix apart from the name
        assert entry.file_name.rsplit("-", 1)[1].split(".")[0] == entry.sha256


def test_resources_table_lists_archives_with_checksums_or_manual_instructions():
    assert set(RESOURCES) == {"cub200", "sop", "cars196", "inshop"}
    assert RESOURCES["cub200"].archives[0].md5 == "97eceeb196236b17998738112f37df78"
    assert RESOURCES["sop"].archives[0].file_name == "Stanford_Online_Products.zip"
    for name in ("cars196", "inshop"):
        assert not RESOURCES[name].archives and RESOURCES[name].manual
    for resource in RESOURCES.values():
        for archive in resource.archives:
            assert archive.md5 or archive.sha256 or archive.size


def test_remote_file_needs_a_check_and_mirrors_need_a_checksum():
    with pytest.raises(UserInputError, match="md5, sha256 or size"):
        RemoteFile(url="http://x/a.zip", file_name="a.zip")
    with pytest.raises(UserInputError, match="mirrors need a checksum"):
        RemoteFile(url="http://x/a.zip", file_name="a.zip", size=3, mirrors=("http://y/a.zip",))


def test_user_errors_keep_the_builtin_bases():
    assert issubclass(OfflineError, FileNotFoundError) and issubclass(OfflineError, lightning_dml.UserInputError)
    assert issubclass(ChecksumError, ValueError) and issubclass(DownloadError, OSError)
    from lightning_dml.data import DatasetLayoutError

    assert issubclass(DatasetLayoutError, FileNotFoundError) and issubclass(DatasetLayoutError, UserInputError)


def test_overrides_from_yaml_replace_fields_and_reject_unknown_ones(tmp_path, monkeypatch, online):
    from lightning_dml.data.resources import dataset_resource
    from lightning_dml.models.weights import weights_entry

    path = tmp_path / "mirror.yaml"
    path.write_text("weights:\n  resnet50: {url: 'http://127.0.0.1:1/r50.pth'}\n")
    monkeypatch.setenv("LIGHTNING_DML_RESOURCES", str(path))
    entry = weights_entry("resnet50")
    assert entry.url == "http://127.0.0.1:1/r50.pth"
    assert entry.sha256 == WEIGHTS["resnet50"].sha256 and entry.file_name == WEIGHTS["resnet50"].file_name
    assert dataset_resource("cub200") == RESOURCES["cub200"]
    path.write_text("weights:\n  resnet50: {adress: 'http://x'}\n")
    with pytest.raises(UserInputError, match="adress"):
        weights_entry("resnet50")
    path.write_text("nonsense: 1\n")
    with pytest.raises(UserInputError, match="'weights' and/or 'datasets'"):
        weights_entry("resnet50")
    monkeypatch.setenv("LIGHTNING_DML_RESOURCES", str(tmp_path / "missing.yaml"))
    with pytest.raises(UserInputError, match="missing.yaml: no such file"):
        dataset_resource("cub200")


# ----------------------------------------------------------------------------------------- datasets
def test_cub_downloads_verifies_extracts_and_loads_from_an_empty_folder(tmp_path, monkeypatch, online, server, cub_bytes):
    _point_cub_at(server, cub_bytes, tmp_path, monkeypatch)
    root = tmp_path / "data"
    dm = _cub(root)
    dm.prepare_data()
    assert server.count("CUB_200_2011.tgz") == 1
    assert (root / "CUB_200_2011" / "images.txt").is_file() and (root / "attributes.txt").is_file()
    assert _leftovers(root) == []  # archive deleted after extraction, no .part, no staging folder
    with pytest.warns(UserWarning, match="differs from the copy the papers use"):
        dm.setup("fit")
    assert len(dm.train_dataset) == 200 and len(dm.test_dataset) == 200  # classes 1-100 / 101-200, 2 images each
    image, label, index = dm.train_dataset[0]
    assert image.shape[0] == 3 and label == 1 and index == 0
    # a second run (another job on the same root) finds the data and makes no request
    _cub(root).prepare_data()
    assert server.count("CUB_200_2011.tgz") == 1


def test_sop_zip_downloads_and_loads(tmp_path, monkeypatch, online, server):
    data = sop_archive(tmp_path)
    server.files["Stanford_Online_Products.zip"] = data
    archive = {"url": server.url("Stanford_Online_Products.zip"), "file_name": "Stanford_Online_Products.zip",
               "md5": md5(data), "size": len(data)}
    monkeypatch.setenv("LIGHTNING_DML_RESOURCES", str(write_overrides(tmp_path / "r.json", datasets={"sop": {"archives": [archive]}})))
    root = tmp_path / "data"
    dm = SOPDataModule(root=str(root), download=True, num_workers=0, classes_per_batch=2, samples_per_class=2)
    dm.prepare_data()
    with pytest.warns(UserWarning):
        dm.setup("fit")
    assert len(dm.train_dataset) == 16 and len(dm.test_dataset) == 12
    assert _leftovers(root) == []


def test_tampered_archive_is_rejected_and_nothing_is_extracted(tmp_path, monkeypatch, online, server, cub_bytes):
    _point_cub_at(server, cub_bytes, tmp_path, monkeypatch)
    tampered = bytearray(cub_bytes)
    tampered[len(tampered) // 2] ^= 0xFF
    server.files["CUB_200_2011.tgz"] = bytes(tampered)  # the table keeps the md5 of the genuine archive
    root = tmp_path / "data"
    with pytest.raises(ChecksumError, match="md5 .* instead of") as err:
        _cub(root).prepare_data()
    assert "was deleted" in str(err.value)
    assert not (root / "CUB_200_2011").exists() and _leftovers(root) == []


def test_corrupt_archive_with_a_matching_checksum_leaves_nothing_half_extracted(tmp_path, monkeypatch, online, server, cub_bytes):
    truncated = cub_bytes[: len(cub_bytes) * 2 // 3]  # its own md5 in the table: verification passes, extraction fails
    _point_cub_at(server, truncated, tmp_path, monkeypatch)
    root = tmp_path / "data"
    with pytest.raises(DownloadError, match="cannot extract"):
        _cub(root).prepare_data()
    assert not (root / "CUB_200_2011").exists() and not (root / "attributes.txt").exists()
    assert not any(p.name.startswith(".extracting") for p in root.iterdir())


def test_a_dropped_connection_is_resumed_with_a_range_request(tmp_path, monkeypatch, online, server, cub_bytes):
    _point_cub_at(server, cub_bytes, tmp_path, monkeypatch)
    server.drop["CUB_200_2011.tgz"] = 1  # the first response stops halfway and closes the connection
    root = tmp_path / "data"
    _cub(root).prepare_data()
    assert [r for n, r in server.requests if n == "CUB_200_2011.tgz"] == [None, f"bytes={len(cub_bytes) // 2}-"]
    assert (root / "CUB_200_2011" / "images.txt").is_file() and _leftovers(root) == []


def test_an_interrupted_run_resumes_from_its_part_file(tmp_path, online, server):
    data = os.urandom(300_000)
    server.files["blob.bin"] = data
    dest = tmp_path / "blob.bin"
    (tmp_path / "blob.bin.part").write_bytes(data[:100_000])  # what a killed process left
    remote = RemoteFile(url=server.url("blob.bin"), file_name="blob.bin", sha256=sha256(data))
    download_file(remote, dest, "blob", "", progress=False)
    assert dest.read_bytes() == data and server.requests == [("blob.bin", "bytes=100000-")]
    assert not (tmp_path / "blob.bin.part").exists()


def test_mirror_is_tried_when_the_primary_url_fails(tmp_path, online, server):
    data = b"x" * 1000
    server.files["mirror/blob.bin"] = data
    server.status["blob.bin"] = 503
    remote = RemoteFile(url=server.url("blob.bin"), file_name="blob.bin", md5=md5(data),
                        mirrors=(server.url("mirror/blob.bin"),))
    download_file(remote, tmp_path / "blob.bin", "blob", "", progress=False, retries=0)
    assert (tmp_path / "blob.bin").read_bytes() == data


def test_a_failed_download_names_the_url_and_what_to_do(tmp_path, monkeypatch, online, server, cub_bytes):
    _point_cub_at(server, cub_bytes, tmp_path, monkeypatch)
    server.status["CUB_200_2011.tgz"] = 404
    with pytest.raises(DownloadError) as err:
        _cub(tmp_path / "data").prepare_data()
    message = str(err.value)
    assert "could not download CUB-200-2011" in message and "404" in message
    assert server.url("CUB_200_2011.tgz") in message and "unpack it into" in message


def test_free_disk_space_is_checked_before_downloading(tmp_path, monkeypatch, online, server, cub_bytes):
    _point_cub_at(server, cub_bytes, tmp_path, monkeypatch, size=len(cub_bytes))
    import shutil
    from types import SimpleNamespace

    monkeypatch.setattr(shutil, "disk_usage", lambda path: SimpleNamespace(total=10**9, used=10**9 - 1000, free=1000))
    with pytest.raises(NotEnoughDiskSpaceError, match="GB free"):
        _cub(tmp_path / "data").prepare_data()
    assert server.requests == []


def test_offline_with_an_empty_folder_gives_the_clear_message(tmp_path, monkeypatch, server, cub_bytes):
    _point_cub_at(server, cub_bytes, tmp_path, monkeypatch)
    set_offline(True)
    assert is_offline() and os.environ["HF_HUB_OFFLINE"] == "1"
    with pytest.raises(OfflineError) as err:
        _cub(tmp_path / "data").prepare_data()
    message = str(err.value)
    assert "downloads are switched off" in message and "LIGHTNING_DML_OFFLINE" in message
    assert f"CUB-200-2011 is not in {tmp_path / 'data'}" in message and server.url("CUB_200_2011.tgz") in message
    assert server.requests == []


def test_download_false_never_requests(tmp_path, monkeypatch, online, server, cub_bytes):
    _point_cub_at(server, cub_bytes, tmp_path, monkeypatch)
    dm = CUB200DataModule(root=str(tmp_path / "data"), num_workers=0)
    dm.prepare_data()
    from lightning_dml.data import DatasetLayoutError

    with pytest.raises(DatasetLayoutError, match="Or set download: true"):
        dm.setup("fit")
    assert server.requests == []
    with pytest.raises(DatasetLayoutError) as err:  # no such hint where there is nothing to download
        Cars196DataModule(root=str(tmp_path / "cars"), num_workers=0).setup("fit")
    assert "download: true" not in str(err.value)


def test_a_mirror_entry_makes_cars196_downloadable_archives_and_plain_files(tmp_path, monkeypatch, online, server):
    """An override with archives for a manual dataset: ``car_ims.tgz`` is extracted, ``cars_annos.mat`` (a plain
    file, the layout's marker) is placed after it."""
    import tarfile

    from tests.fixtures_data import make_cars196

    source = make_cars196(tmp_path / "src", layout="annos", images_per_class=1)
    with tarfile.open(tmp_path / "car_ims.tgz", "w:gz") as tar:
        tar.add(source / "car_ims", arcname="car_ims")
    archives = []
    for name, data in (("car_ims.tgz", (tmp_path / "car_ims.tgz").read_bytes()),
                       ("cars_annos.mat", (source / "cars_annos.mat").read_bytes())):
        server.files[name] = data
        archives.append({"url": server.url(name), "file_name": name, "sha256": sha256(data)})
    overrides = write_overrides(tmp_path / "r.json", datasets={"cars196": {"archives": archives}})
    monkeypatch.setenv("LIGHTNING_DML_RESOURCES", str(overrides))
    root = tmp_path / "data"
    dm = Cars196DataModule(root=str(root), download=True, num_workers=0, check_counts=False)
    dm.prepare_data()
    dm.setup("fit")
    assert len(dm.train_dataset) == 98 and len(dm.test_dataset) == 98
    assert (root / "cars_annos.mat").is_file() and not (root / ".downloads").exists() and _leftovers(root) == []


@pytest.mark.parametrize(
    ("cls", "page", "files"),
    [
        (Cars196DataModule, "https://ai.stanford.edu/~jkrause/cars/car_dataset.html", ["cars_annos.mat", "car_ims"]),
        (InShopDataModule, "http://mmlab.ie.cuhk.edu.hk/projects/DeepFashion/InShopRetrieval.html",
         ["img.zip", "list_eval_partition.txt"]),
    ],
)
def test_datasets_without_a_download_name_the_page_and_the_files(tmp_path, online, cls, page, files):
    with pytest.raises(ManualDownloadError) as err:
        cls(root=str(tmp_path), download=True, num_workers=0).prepare_data()
    message = str(err.value)
    assert "cannot be downloaded automatically" in message and page in message
    for name in files:
        assert name in message


# ----------------------------------------------------------------------------------------- weights
def test_weights_download_once_verified_then_cached(tmp_path, online, server):
    state = nn.Linear(4, 3).state_dict()
    path = tmp_path / "src.pth"
    torch.save(state, path)
    data = path.read_bytes()
    server.files["w.pth"] = data
    remote = RemoteFile(url=server.url("w.pth"), file_name="w-cached.pth", sha256=sha256(data)[:10])
    cache = tmp_path / "cache"
    got = fetch_weights(remote, cache, "linear", "", progress=False)
    assert got == cache / "w-cached.pth" and got.read_bytes() == data
    assert fetch_weights(remote, cache, "linear", "", progress=False) == got
    assert server.count("w.pth") == 1
    bad = RemoteFile(url=server.url("w.pth"), file_name="other.pth", sha256="0" * 16)
    with pytest.raises(ChecksumError, match="sha256"):
        fetch_weights(bad, cache, "linear", "", progress=False)
    assert not (cache / "other.pth").exists()


def test_pretrained_backbone_downloads_its_weights_into_the_torch_cache(tmp_path, monkeypatch, online, server):
    import torchvision

    reference = torchvision.models.GoogLeNet(aux_logits=True, transform_input=True, init_weights=True)
    torch.save(reference.state_dict(), tmp_path / "g.pth")
    data = (tmp_path / "g.pth").read_bytes()
    server.files["googlenet.pth"] = data
    overrides = {"googlenet": {"url": server.url("googlenet.pth"), "sha256": sha256(data)}}
    monkeypatch.setenv("LIGHTNING_DML_RESOURCES", str(write_overrides(tmp_path / "r.json", weights=overrides)))
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(torch.hub, "_hub_dir", None, raising=False)
    model = GoogLeNet(pretrained=True)
    cached = tmp_path / "torch" / "hub" / "checkpoints" / WEIGHTS["googlenet"].file_name
    assert cached.is_file() and server.count("googlenet.pth") == 1
    torch.testing.assert_close(model.stages[0][0].conv.weight, reference.conv1.conv.weight)
    GoogLeNet(pretrained=True)
    assert server.count("googlenet.pth") == 1


def test_offline_weights_and_corrupt_weights_give_clear_errors(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setattr(torch.hub, "_hub_dir", None, raising=False)
    with pytest.raises(OfflineError) as err:
        GoogLeNet(pretrained=True)
    assert WEIGHTS["googlenet"].file_name in str(err.value) and "downloads are switched off" in str(err.value)
    corrupt = tmp_path / "corrupt.pth"
    corrupt.write_bytes(b"PK\x03\x04 not really a zip")
    from lightning_dml.errors import CorruptFileError

    with pytest.raises(CorruptFileError, match="cannot read .*corrupt.pth"):
        GoogLeNet(pretrained=True, weights_path=str(corrupt))


def test_resources_override_file_may_be_json(tmp_path, monkeypatch, online):
    from lightning_dml.models.weights import weights_entry

    path = tmp_path / "r.json"
    path.write_text(json.dumps({"weights": {"resnet101": {"mirrors": ["http://127.0.0.1:1/r101.pth"]}}}))
    monkeypatch.setenv("LIGHTNING_DML_RESOURCES", str(path))
    assert weights_entry("resnet101").mirrors == ("http://127.0.0.1:1/r101.pth",)


def test_offline_variable_also_switches_hugging_face_hub_offline(tmp_path):
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env["LIGHTNING_DML_OFFLINE"] = "1"
    code = "import os, lightning_dml; print(os.environ.get('HF_HUB_OFFLINE'))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.stdout.strip() == "1", out.stderr
    env["LIGHTNING_DML_OFFLINE"] = "0"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert out.stdout.strip() == "None", out.stderr
