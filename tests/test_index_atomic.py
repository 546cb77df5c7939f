"""An index folder survives a killed writer and concurrent writers (issue 26 s.2; ``lightning_dml/index/folder.py``).

A forked child saves a new index over an old one and is stopped (``SIGINT`` or ``SIGKILL``, sent to itself) at every
stage the test can hook: after the model is written, after the faiss file, the table, the vectors, the manifest,
after each rename of the swap and while the old folder is deleted. The folder must then load as exactly the old
index (stopped before the commit point) or exactly the new one (after it), model file included, and the next save
must clean every leftover. Concurrent writers (forked processes) never hand out an id twice and never lose items;
a reader loading while a writer saves in a loop always gets one consistent folder.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_dml.index import EmbeddingIndex, IndexFolderError, IndexTable, Manifest
from lightning_dml.index import folder as F

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="the writers are forked processes")

MODEL_FILE = "model.bin"  # stands for the exported model: the folder code must not care what the folder holds


def _vectors(n: int, first_id: int = 0, d: int = 8) -> torch.Tensor:
    """Rows that carry their id (column 0) so that a table mixed with other vectors shows (euclidean: kept raw)."""
    g = torch.Generator().manual_seed(first_id)
    x = torch.randn(n, d, generator=g)
    x[:, 0] = torch.arange(first_id, first_id + n, dtype=torch.float32)
    return x


def _index(n: int, tag: str) -> EmbeddingIndex:
    x = _vectors(n)
    return EmbeddingIndex.build(x, {"paths": [f"/{tag}/{i}.png" for i in range(n)], "labels": [tag] * n},
                                metric="euclidean")


def _model(content: bytes):
    def write(staged: Path) -> None:
        (staged / MODEL_FILE).write_bytes(content)
        _hit("export")

    return write


# ----------------------------------------------------------------------------------------------- the killed child
_STAGE: dict[str, object] = {}


def _hit(name: str) -> None:
    """In the child: send the chosen signal to itself when ``name`` is the chosen stage."""
    if _STAGE.get("stage") != name:
        return
    os.kill(os.getpid(), _STAGE["signal"])
    time.sleep(0.2)  # a SIGINT (KeyboardInterrupt) lands here unless it is held back


def _hook(module: object, name: str, stage: str, count: bool = False) -> None:
    real = getattr(module, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        out = real(*args, **kwargs)
        calls[0] += 1
        _hit(f"{stage}-{calls[0]}" if count else stage)
        return out

    setattr(module, name, wrapper)


def _install_hooks() -> None:
    from lightning_dml.index import kinds

    _hook(kinds.faiss_module(), "write_index", "faiss")
    _hook(IndexTable, "write", "table")
    _hook(np, "save", "vectors")
    _hook(Manifest, "write", "manifest")
    _hook(os, "rename", "rename", count=True)  # the swap: P -> old, new -> P, old -> trash
    real_rmtree = F.shutil.rmtree

    def rmtree(path, *args, **kwargs):  # stopped with the old folder half deleted
        if ".trash-" in str(path):
            victims = sorted(Path(path).iterdir())
            victims[0].unlink()
            _hit("trash")
        return real_rmtree(path, *args, **kwargs)

    F.shutil.rmtree = rmtree


def _save_in_child(index: EmbeddingIndex, folder: Path, stage: str | None, sig: int, content: bytes) -> int:
    """Fork; the child saves ``index`` into ``folder`` with hooks armed; returns the child's wait status."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            _STAGE.update(stage=stage, signal=sig)
            _install_hooks()
            index.save(folder, add_files=_model(content))
        except BaseException:  # noqa: BLE001 - KeyboardInterrupt: the save cleaned up, the child ends
            code = 3
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    return status


def _state(folder: Path, old: EmbeddingIndex, new: EmbeddingIndex) -> str:
    """``"old"`` or ``"new"`` when the folder is exactly one of them (vectors, table, model file, answers)."""
    loaded = EmbeddingIndex.load(folder)
    model = (folder / MODEL_FILE).read_bytes()
    for name, index in (("old", old), ("new", new)):
        if len(loaded) == len(index) and torch.equal(loaded.embeddings, index.embeddings):
            assert loaded.table.paths == index.table.paths and model == name.encode(), (name, model)
            assert (loaded.embeddings[:, 0] == torch.from_numpy(loaded.table.ids).float()).all()
            scores, ids = loaded.search(index.embeddings[::5], 1)  # every item its own nearest (distance 0)
            assert torch.equal(ids[:, 0], torch.from_numpy(index.table.ids[::5])) and (scores == 0).all()
            return name
    raise AssertionError(f"{folder} is neither the old nor the new index: {len(loaded)} items, model {model!r}")


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}.")
                  and not p.name.startswith(f".{folder.name}.lock"))


BEFORE = ["export", "faiss", "table", "vectors", "manifest", "rename-1"]
AFTER = ["rename-2", "rename-3", "trash"]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["SIGKILL", "SIGINT"])
def test_a_save_stopped_at_any_stage_leaves_the_old_or_the_new_index_whole(tmp_path, sig):
    old, new = _index(30, "old"), _index(45, "new")
    folder = tmp_path / "idx"
    _index(30, "old").save(folder, add_files=_model(b"old"))
    for stage in BEFORE + AFTER:
        status = _save_in_child(new, folder, stage, sig, b"new")
        if sig == signal.SIGKILL:
            assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, stage
        else:
            assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3, stage  # the KeyboardInterrupt arrived
        # SIGINT is held back during the renames, so it stops the save only after the commit (the 2nd rename)
        committed = stage in AFTER or (sig == signal.SIGINT and stage.startswith("rename"))
        assert _state(folder, old, new) == ("new" if committed else "old"), stage
        if sig == signal.SIGINT and stage != "trash":  # the interrupted save removed what it had written
            assert _leftovers(folder) == [], (stage, _leftovers(folder))
        if committed:
            _index(30, "old").save(folder, add_files=_model(b"old"))  # back to the old index for the next stage
        # the leftovers of the stopped save never break a load, and the next save removes them all
        again = EmbeddingIndex.load(folder)
        again.save(folder)
        assert _leftovers(folder) == [], stage
        assert _state(folder, old, new) == "old"
    assert _save_in_child(new, folder, None, sig, b"new") == 0  # unhooked: the save completes
    assert _state(folder, old, new) == "new" and _leftovers(folder) == []


def test_a_folder_missing_after_a_stopped_swap_is_restored_on_load(tmp_path):
    old = _index(30, "old")
    folder = tmp_path / "idx"
    old.save(folder, add_files=_model(b"old"))
    status = _save_in_child(_index(45, "new"), folder, "rename-1", signal.SIGKILL, b"new")
    assert os.WIFSIGNALED(status)
    assert not folder.exists() and [n.split("-")[0] for n in _leftovers(folder)] == [".idx.building", ".idx.old"]
    loaded = EmbeddingIndex.load(folder)  # restores the old folder (under the lock), removes the new one
    assert len(loaded) == 30 and (folder / MODEL_FILE).read_bytes() == b"old" and _leftovers(folder) == []


# ------------------------------------------------------------------------------------------- concurrent writers
def _fork(work) -> int:
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 0
        try:
            work()
        except BaseException as error:  # noqa: BLE001
            code = 4 if isinstance(error, F.IndexBusyError) else 5
        os._exit(code)
    return pid


def _wait(pid: int) -> int:
    _, status = os.waitpid(pid, 0)
    return os.WEXITSTATUS(status) if os.WIFEXITED(status) else -1


def _locked_add(folder: Path, n: int, seed: int, pause: float):
    def work() -> None:
        with F.locked(folder, timeout=30, what=f"test add {seed}"):
            index = EmbeddingIndex.load(folder)
            time.sleep(pause)  # the other writer tries meanwhile
            index.add(_vectors(n, int(index.manifest.next_id)), [f"/add{seed}/{i}.png" for i in range(n)])
            index.save(folder)

    return work


def test_concurrent_locked_adds_keep_every_item_and_distinct_ids(tmp_path):
    folder = tmp_path / "idx"
    _index(15, "base").save(folder, add_files=_model(b"old"))
    pids = [_fork(_locked_add(folder, 3, seed, 0.3)) for seed in (1, 2)]
    assert [_wait(p) for p in pids] == [0, 0]
    index = EmbeddingIndex.load(folder)
    assert len(index) == 21 and sorted(index.table.ids.tolist()) == list(range(21))
    assert index.manifest.next_id == 21 and (folder / MODEL_FILE).read_bytes() == b"old"
    assert sum(p.startswith("/add") for p in index.table.paths) == 6


def test_an_unlocked_save_over_a_folder_changed_since_its_load_is_refused(tmp_path):
    """Without the lock, the second of two load-add-save rounds would drop the first one's items (the lost update
    of issue 26): the save notices the folder's new uid and refuses, naming the reason."""
    folder = tmp_path / "idx"
    _index(15, "base").save(folder)
    first, second = EmbeddingIndex.load(folder), EmbeddingIndex.load(folder)
    first.add(_vectors(3, 100), [f"/a/{i}" for i in range(3)])
    first.save(folder)
    second.add(_vectors(3, 200), [f"/b/{i}" for i in range(3)])
    with pytest.raises(F.IndexBusyError, match="saved by another process since this index was loaded"):
        second.save(folder)
    assert len(EmbeddingIndex.load(folder)) == 18
    with pytest.raises(F.IndexBusyError, match="was replaced since this index was loaded"):
        second.save(tmp_path / "elsewhere")  # nor elsewhere: the files carried along may be another index's


def test_a_second_writer_waits_then_stops_naming_the_holder(tmp_path, capfd):
    folder = tmp_path / "idx"
    index = _index(15, "base")
    index.save(folder)
    ready = tmp_path / "held"

    def hold() -> None:
        with F.locked(folder, what="the holder of the test"):
            ready.touch()
            end = time.monotonic() + 10
            while ready.exists() and time.monotonic() < end:  # until the parent is done
                time.sleep(0.02)

    pid = _fork(hold)
    while not ready.exists():
        time.sleep(0.01)
    began = time.monotonic()
    with pytest.raises(F.IndexBusyError) as error:
        index.save(folder, lock_timeout=0.3)
    assert 0.3 <= time.monotonic() - began < 2.5
    message = str(error.value)
    assert f"pid {pid}" in message and "the holder of the test" in message and str(F.lock_file(folder)) in message
    waiting = [line for line in capfd.readouterr().err.splitlines() if "waiting up to 0.3 s" in line]
    assert len(waiting) == 1 and f"is locked by pid {pid}" in waiting[0] and "the holder of the test" in waiting[0]
    ready.unlink()
    assert _wait(pid) == 0
    index.save(folder, lock_timeout=0.3)  # free again
    assert sorted(p.name for p in tmp_path.iterdir()) == [".idx.lock", "idx"]  # the holder's note is gone


def test_readers_never_see_a_half_written_folder(tmp_path):
    folder = tmp_path / "idx"
    _index(10, "base").save(folder)
    rounds = 15

    def writer() -> None:
        for r in range(rounds):
            with F.locked(folder, timeout=30):
                index = EmbeddingIndex.load(folder)
                index.add(_vectors(2, int(index.manifest.next_id)))
                index.save(folder)

    pid = _fork(writer)
    seen = set()
    while True:
        done = os.waitpid(pid, os.WNOHANG)[0] == pid
        index = EmbeddingIndex.load(folder)
        ids = torch.from_numpy(index.table.ids).float()
        assert torch.equal(index.embeddings[:, 0], ids) and index.manifest.count == len(index)
        seen.add(len(index))
        if done:
            break
    assert len(EmbeddingIndex.load(folder)) == 10 + 2 * rounds and len(seen) > 1


def test_save_refuses_a_folder_that_is_not_an_index(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(IndexFolderError, match="non-empty folder that is not an index"):
        _index(5, "x").save(mine)
    assert (mine / "notes.txt").read_text() == "keep me" and _leftovers(mine) == []
    (tmp_path / "empty").mkdir()
    _index(5, "x").save(tmp_path / "empty")
    with pytest.raises(IndexFolderError, match="index folder already"):
        _index(5, "x").save(tmp_path / "empty", replace=False)


def test_a_link_stays_a_link_the_folder_keeps_its_permissions_and_the_working_folder_is_refused(tmp_path,
                                                                                               monkeypatch):
    import stat

    from lightning_dml.errors import MissingFileError
    from lightning_dml.index import add_gallery

    real = tmp_path / "real"
    _index(5, "a").save(real)
    os.chmod(real, 0o750)
    link = tmp_path / "link"
    link.symlink_to(real)
    index = EmbeddingIndex.load(link)
    index.add(_vectors(2, 5))
    index.save(link)  # the folder the link points to is replaced, under its own lock
    assert link.is_symlink() and len(EmbeddingIndex.load(real)) == 7 and stat.S_IMODE(real.stat().st_mode) == 0o750
    assert sorted(p.name for p in tmp_path.iterdir()) == [".real.lock", "link", "real"]
    monkeypatch.chdir(real)
    with pytest.raises(IndexFolderError, match="is the working folder"):
        index.save(".")
    with pytest.raises(MissingFileError, match="does not exist"):  # reported before anything is locked
        add_gallery(tmp_path / "none", tmp_path)
    assert not (tmp_path / ".none.lock").exists()
