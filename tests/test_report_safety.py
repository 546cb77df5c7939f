"""The report never destroys what it did not write and never leaves half a file (issue 26 s.2): a folder that is not
empty and not an earlier report is refused (one line, untouched) unless --overwrite; an earlier report, with or
without its marker, is written again; a write killed midway leaves the previous results.npz whole."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from lightning_dml.cli import main
from lightning_dml.data.cache_dir import atomic_path
from lightning_dml.report import ReportFolderError, is_report_folder, write_report
from lightning_dml.report.command import main as report_main
from lightning_dml.retrieval import RetrievalResults
from tests.test_report import make_items, read_js

FOREIGN_PAGE = "<html><body>my own page, not a report</body></html>"


@pytest.fixture
def predictions(tmp_path: Path) -> Path:
    data = make_items(tmp_path / "images")
    data.pop("sequence")
    path = tmp_path / "predictions.pt"
    torch.save(data, path)
    return path


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _foreign(folder: Path) -> dict[str, bytes]:
    folder.mkdir(parents=True)
    (folder / "index.html").write_text(FOREIGN_PAGE)
    (folder / "notes.txt").write_text("keep me")
    return _snapshot(folder)


def test_a_foreign_folder_is_refused_in_one_line_and_left_untouched(predictions: Path, tmp_path: Path,
                                                                    capsys) -> None:
    out = tmp_path / "site"
    before = _foreign(out)
    with pytest.raises(SystemExit) as exit_info:
        main(["report", "--out", str(out), "--predictions", str(predictions)])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("lightning-dml: error: ") and "\n" not in err and "Traceback" not in err
    assert re.search(r"site is not empty and holds no earlier report \(it holds index.html, notes.txt\).*--overwrite",
                     err), err
    assert _snapshot(out) == before and sorted(p.name for p in out.iterdir()) == ["index.html", "notes.txt"]


def test_overwrite_replaces_the_reports_files_and_keeps_the_others(predictions: Path, tmp_path: Path) -> None:
    out = tmp_path / "site"
    _foreign(out)
    report_main(["--out", str(out), "--predictions", str(predictions), "--overwrite"])
    assert (out / "index.html").read_text() != FOREIGN_PAGE and "report.js" in (out / "index.html").read_text()
    assert (out / "notes.txt").read_text() == "keep me"
    assert is_report_folder(out) and (out / "report.json").is_file()
    report_main(["--out", str(out), "--predictions", str(predictions)])  # a report now: no --overwrite needed


def test_a_rerun_into_an_earlier_report_works_with_or_without_its_marker(predictions: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    first = report_main(["--out", str(out), "--predictions", str(predictions), "--queries", "all", "--per_page", "7"])
    assert first.pages == 5 and is_report_folder(out)
    second = report_main(["--out", str(out), "--predictions", str(predictions), "--queries", "10", "--per_page", "7"])
    assert second.pages == 2
    # the previous run's pages beyond this run's are gone, the others rewritten
    assert sorted(p.name for p in (out / "data").glob("queries-*.js")) == ["queries-00000.js", "queries-00001.js"]
    assert (read_js(out / "data" / "summary.js")[0])["pages"] == 2
    (out / "report.json").unlink()  # a report of the code before the marker: recognised by its files
    assert is_report_folder(out)
    report_main(["--out", str(out), "--predictions", str(predictions)])
    assert not list(out.rglob(".*.tmp*"))  # no temporary file left behind


def test_the_write_of_a_foreign_folder_is_refused_by_the_library_too(tmp_path: Path) -> None:
    data = make_items(tmp_path / "images")
    res = RetrievalResults.compute(data["embeddings"], data["labels"], top_k=3)
    out = tmp_path / "site"
    before = _foreign(out)
    with pytest.raises(ReportFolderError, match="overwrite=True"):
        write_report(res, out)
    assert _snapshot(out) == before
    (tmp_path / "afile").write_text("x")
    with pytest.raises(ReportFolderError, match="is a file, not a folder"):
        write_report(res, tmp_path / "afile")
    write_report(res, out, overwrite=True)
    assert (out / "notes.txt").read_text() == "keep me" and is_report_folder(out)


def test_a_write_killed_midway_leaves_the_previous_results_whole(predictions: Path, tmp_path: Path,
                                                                 monkeypatch) -> None:
    out = tmp_path / "report"
    report_main(["--out", str(out), "--predictions", str(predictions), "--top_k", "4"])
    old = (out / "results.npz").read_bytes()
    old_summary = (out / "data" / "summary.js").read_bytes()
    real = np.savez_compressed

    def killed(file, *args, **kwargs) -> None:
        """Writes half the file, then the process is 'killed' (an interrupt the writer does not catch)."""
        real(file, *args, **kwargs)
        whole = Path(file).read_bytes()
        Path(file).write_bytes(whole[: len(whole) // 2])
        raise KeyboardInterrupt

    monkeypatch.setattr(np, "savez_compressed", killed)
    with pytest.raises(KeyboardInterrupt):
        report_main(["--out", str(out), "--predictions", str(predictions), "--top_k", "6"])
    assert (out / "results.npz").read_bytes() == old
    assert RetrievalResults.load(out / "results.npz").neighbors.shape[1] == 4
    assert (out / "data" / "summary.js").read_bytes() == old_summary  # nothing written after the failed file
    assert not list(out.rglob(".*.tmp*"))


def test_atomic_path_keeps_the_old_file_on_failure_and_gives_ordinary_permissions(tmp_path: Path) -> None:
    target = tmp_path / "a" / "file.npz"
    with atomic_path(target) as temporary:
        assert temporary.suffix == ".npz" and temporary.parent == target.parent and temporary.exists()
        temporary.write_bytes(b"one")
    with pytest.raises(RuntimeError), atomic_path(target) as temporary:
        temporary.write_bytes(b"tw")
        raise RuntimeError("killed")
    assert target.read_bytes() == b"one" and sorted(p.name for p in target.parent.iterdir()) == ["file.npz"]
    probe = tmp_path / "probe"
    probe.write_bytes(b"")  # what an ordinary open gives under this umask (mkstemp would give 0600)
    assert target.stat().st_mode & 0o777 == probe.stat().st_mode & 0o777
    assert hashlib.sha256(target.read_bytes()).hexdigest() == hashlib.sha256(b"one").hexdigest()


def test_the_callback_refuses_a_foreign_folder_before_the_test_runs(tmp_path: Path) -> None:
    import pytorch_lightning as pl

    from lightning_dml.callbacks import RetrievalReport
    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule
    from tests.random_images import RandomImages

    out = tmp_path / "site"
    before = _foreign(out)
    data = RandomImages(classes_per_batch=4, samples_per_class=3, eval_batch_size=16)
    model = DMLModule(SmallConvNet(width=4), embedding_dim=8, clustering=False, recall_at=(1,))
    report = RetrievalReport(folder=str(out), log_queries=0, bins=0)
    trainer = pl.Trainer(logger=False, callbacks=[report], enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=tmp_path, enable_checkpointing=False)
    with pytest.raises(ReportFolderError, match=r"RetrievalReport: report folder .*site is not empty.*overwrite=True"):
        trainer.test(model, datamodule=data, verbose=False)
    assert _snapshot(out) == before and report.results is None  # refused before the test ran
    report.overwrite = True
    trainer.test(model, datamodule=data, verbose=False)
    assert is_report_folder(out) and (out / "notes.txt").read_text() == "keep me"


def test_a_second_report_into_the_same_folder_waits_for_the_first(tmp_path: Path) -> None:
    """Shared folders are locked: while one run holds the report folder's lock, another writes nothing."""
    import threading

    from filelock import FileLock

    from lightning_dml.report.folder import LOCK

    data = make_items(tmp_path / "images")
    res = RetrievalResults.compute(data["embeddings"], data["labels"], top_k=3)
    out = tmp_path / "site"
    write_report(res, out)
    before = _snapshot(out)
    holder = FileLock(str(out / LOCK))
    holder.acquire()
    done = threading.Event()
    worker = threading.Thread(target=lambda: (write_report(res, out, title="second"), done.set()), daemon=True)
    try:
        worker.start()
        done.wait(timeout=2.0)
        assert not done.is_set() and _snapshot(out) == before  # waiting: not one file changed
    finally:
        holder.release()
    worker.join(timeout=60)
    assert done.is_set() and '"second"' in (out / "data" / "summary.js").read_text()
    # the lock file is not content: a folder holding only it is still "empty" for a new report
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / LOCK).touch()
    write_report(res, empty)
