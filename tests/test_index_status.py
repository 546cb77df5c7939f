"""``lightning-dml index status`` sees a checkpoint that changed since the index was built (issue 27, section 4):
the file's sha256 is compared with the one recorded at build, so a re-trained checkpoint of the same size, copied
with its modification time kept, is seen too."""

from __future__ import annotations

import os

import pytest
import torch

from lightning_dml.checkpoints import checkpoint_record
from lightning_dml.index import EmbeddingIndex
from tests.test_index_cli import _main_capture


@pytest.fixture
def built(tmp_path):
    checkpoint = tmp_path / "last.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(8)}}, checkpoint)
    index = EmbeddingIndex.build(torch.randn(6, 4), kind="flat", manifest={"checkpoint": checkpoint_record(checkpoint)})
    index.save(tmp_path / "index")
    return checkpoint, tmp_path / "index"


def test_status_says_the_checkpoint_is_unchanged(built):
    _, folder = built
    code, out, err = _main_capture(["index", "status", "--index", str(folder)])
    assert code == 0, err
    assert "checkpoint unchanged since the index was built" in out and "checkpoint changed" not in out


def test_status_sees_a_changed_checkpoint_of_the_same_size_and_time(built):
    checkpoint, folder = built
    stat = checkpoint.stat()
    torch.save({"state_dict": {"w": torch.ones(8)}}, checkpoint)  # re-trained: other weights, the same size
    os.utime(checkpoint, ns=(stat.st_atime_ns, stat.st_mtime_ns))  # copied with its time kept (cp -p)
    assert checkpoint.stat().st_size == stat.st_size
    code, out, err = _main_capture(["index", "status", "--index", str(folder)])
    assert code == 0, err
    (line,) = [line for line in out.splitlines() if line.startswith("checkpoint changed: ")]
    assert str(checkpoint) in line and "changed since the index was built" in line and "rebuild" in line
    checkpoint.unlink()
    code, out, _ = _main_capture(["index", "status", "--index", str(folder)])
    assert f"checkpoint changed: the checkpoint {checkpoint} the index was built from is missing" in out
