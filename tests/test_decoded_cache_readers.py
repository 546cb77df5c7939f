"""The decoded-image cache under concurrent runs (issue 26 s.2): a rebuild never removes a data file a reader has
opened (another process or this one), the reader gets the pixels it opened, a new reader the new ones, and old
files go once nobody reads them; the freshness rule (path + size + mtime) and the opt-in content check (sha256)."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from lightning_dml.data.decoded_cache import CHECK_ENV, decode_resized, open_decoded_cache
from tests.test_decoded_cache import _split

REBUILD = """
import sys
from pathlib import Path
from lightning_dml.data.decoded_cache import open_decoded_cache
paths = [Path(p) for p in sys.argv[2:]]
view, info = open_decoded_cache(paths, Path(sys.argv[1]), "train", 20, progress=False)
print("BUILT" if info.built else "FOUND", view.data_file.name)
"""


@pytest.fixture(autouse=True)
def _own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LIGHTNING_DML_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(CHECK_ENV, raising=False)


def _change(path: Path, value: int) -> None:
    Image.fromarray(np.full((30, 40, 3), value, dtype=np.uint8)).save(path)
    os.utime(path, ns=(10**18 + value, 10**18 + value))


def _pixels(view) -> list[torch.Tensor]:
    return [view.pixels(i).permute(1, 2, 0).clone() for i in range(len(view))]


def _rebuild_in_a_new_interpreter(top: Path, paths: list[Path]) -> tuple[str, str]:
    proc = subprocess.run([sys.executable, "-c", REBUILD, str(top), *map(str, paths)], capture_output=True,
                          text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    verdict, name = proc.stdout.split()
    return verdict, name


def _rebuild_child(top: Path, paths: list[Path], queue) -> None:
    import lightning_dml.data.decoded_cache as decoded_cache

    try:
        # another process: it knows nothing of this one's readers but their locks
        getattr(decoded_cache, "_HOLDS", {}).clear()
        view, info = open_decoded_cache(paths, top, "train", 20, progress=False)
        queue.put(("BUILT" if info.built else "FOUND", view.data_file.name))
    except BaseException as error:  # noqa: BLE001 - reported to the test
        queue.put(("ERROR", repr(error)))


def _rebuild_in_a_forked_process(top: Path, paths: list[Path]) -> tuple[str, str]:
    """Another process without the cost of a new interpreter's imports (a fork of this one)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_rebuild_child, args=(top, paths, queue))
    child.start()
    result = queue.get(timeout=120)
    child.join(60)
    assert child.exitcode == 0
    return result


@pytest.mark.parametrize("rebuild", [
    pytest.param(_rebuild_in_a_forked_process, marks=pytest.mark.skipif(sys.platform == "win32", reason="no fork")),
    pytest.param(_rebuild_in_a_new_interpreter, marks=pytest.mark.slow),  # ~5 s of imports
])
def test_a_rebuild_by_another_process_never_removes_the_file_a_reader_opened(tmp_path: Path, rebuild) -> None:
    top, paths = _split(tmp_path)
    old = [torch.from_numpy(decode_resized(p, "RGB", None, 20, "bilinear").copy()) for p in paths]
    reader, info = open_decoded_cache(paths, top, "train", 20, progress=False)  # opened, not yet mapped
    assert info.built and reader._map is None
    old_file = reader.data_file
    _change(paths[0], 7)
    verdict, new_name = rebuild(top, paths)
    assert verdict == "BUILT" and new_name != old_file.name
    assert old_file.is_file()  # held by this process's reader: not removed by the other's rebuild
    got = _pixels(reader)  # maps now: the old build's pixels, without an error
    assert all(torch.equal(a, b) for a, b in zip(got, old)) and int(got[0].max()) > 7
    fresh, info = open_decoded_cache(paths, top, "train", 20, progress=False)  # a new reader: the new build
    assert not info.built and fresh.data_file.name == new_name and int(fresh.pixels(0).max()) == 7
    assert old_file.is_file()
    del reader, got
    gc.collect()
    open_decoded_cache(paths, top, "train", 20, progress=False)  # nobody reads the old file: removed
    assert not old_file.exists() and fresh.data_file.is_file()


def test_a_rebuild_in_the_same_process_keeps_the_file_of_a_live_view_and_its_subsets(tmp_path: Path) -> None:
    top, paths = _split(tmp_path)
    view, _ = open_decoded_cache(paths, top, "train", 20, progress=False)
    part = view.subset([1, 0])
    expected = view.pixels(0).clone()  # mapped
    old_file = view.data_file
    del view
    _change(paths[0], 9)
    new, info = open_decoded_cache(paths, top, "train", 20, progress=False)
    assert info.built and new.data_file != old_file and old_file.is_file()
    assert torch.equal(part.pixels(1), expected) and int(new.pixels(0).max()) == 9
    del part
    gc.collect()
    open_decoded_cache(paths, top, "train", 20, progress=False)
    assert not old_file.exists()


def test_a_killed_builds_temporary_file_is_removed_by_the_next_open(tmp_path: Path) -> None:
    top, paths = _split(tmp_path)
    view, info = open_decoded_cache(paths, top, "train", 20, progress=False)
    left = info.index_file.parent / f".{view.data_file.stem.rsplit('.', 1)[0]}.0123456789ab.u8.5555.tmp.u8"
    left.write_bytes(b"half a build")
    open_decoded_cache(paths, top, "train", 20, progress=False)
    assert not left.exists() and view.data_file.is_file()


def _bmp_split(tmp_path: Path) -> tuple[Path, list[Path]]:
    """BMP files: the size of a file depends on its dimensions only, so new pixels keep size and mtime."""
    top = tmp_path / "bmp"
    (top / "a").mkdir(parents=True)
    paths = []
    for i in range(3):
        path = top / "a" / f"{i}.bmp"
        Image.fromarray(np.full((24, 32, 3), 40 * (i + 1), dtype=np.uint8)).save(path)
        paths.append(path)
    return top, paths


def test_the_freshness_rule_is_size_and_mtime_and_the_content_check_sees_the_rest(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    top, paths = _bmp_split(tmp_path)
    view, info = open_decoded_cache(paths, top, "train", 20, progress=False, content_check=True)
    assert info.built and int(view.pixels(0).max()) == 40
    stat = paths[0].stat()
    Image.fromarray(np.full((24, 32, 3), 200, dtype=np.uint8)).save(paths[0])  # same size, then the same mtime
    os.utime(paths[0], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert paths[0].stat().st_size == stat.st_size
    stale, info = open_decoded_cache(paths, top, "train", 20, progress=False)  # the default rule cannot see it
    assert not info.built and int(stale.pixels(0).max()) == 40
    checked, info = open_decoded_cache(paths, top, "train", 20, progress=False, content_check=True)
    assert info.built and int(checked.pixels(0).max()) == 200
    assert not open_decoded_cache(paths, top, "train", 20, progress=False, content_check=True)[1].built
    monkeypatch.setenv(CHECK_ENV, "content")  # what the data modules' caches follow
    Image.fromarray(np.full((24, 32, 3), 90, dtype=np.uint8)).save(paths[1])
    os.utime(paths[1], ns=(stat.st_atime_ns, paths[1].stat().st_mtime_ns))
    os.utime(paths[1], ns=(stat.st_atime_ns, stat.st_mtime_ns - 1))
    view, info = open_decoded_cache(paths, top, "train", 20, progress=False)
    assert info.built and int(view.pixels(1).max()) == 90
    monkeypatch.setenv(CHECK_ENV, "sha")
    with pytest.raises(ValueError, match=f"{CHECK_ENV} must be 'stat' .* or 'content', got 'sha'"):
        open_decoded_cache(paths, top, "train", 20, progress=False)


def test_an_index_naming_a_file_outside_its_folder_is_rebuilt(tmp_path: Path) -> None:
    import json

    top, paths = _split(tmp_path)
    view, info = open_decoded_cache(paths, top, "train", 20, progress=False)
    index = json.loads(info.index_file.read_text())
    outside = tmp_path / "elsewhere.u8"
    outside.write_bytes(view.data_file.read_bytes())  # the right size: only its place is wrong
    index["data_file"] = f"../../../{outside.name}"
    info.index_file.write_text(json.dumps(index))
    again, info = open_decoded_cache(paths, top, "train", 20, progress=False)
    assert info.built and again.data_file.parent == view.data_file.parent and outside.is_file()
