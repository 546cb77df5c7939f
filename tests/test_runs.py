"""Nothing a user made is lost by running a command again, and evaluation settings may differ from a checkpoint's
(issue 27, sections 1 and 2; lightning_dml/runs.py):

* a second ``fit`` into the folder of a first one is refused (one line, the checkpoints untouched) unless it
  resumes (``--ckpt_path last``) or is told to replace them (``--overwrite_checkpoints true``);
* ``predict`` writes into the run's own folder, never the shared ``logs/predictions.pt``, and says what it wrote;
* ``test --ckpt_path X --model.metrics "[mrr, ndcg@5]"`` computes these metrics with X's model, while an
  architecture setting that differs stays an error.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest
import torch
import wandb

from lightning_dml.callbacks import load_predictions
from lightning_dml.cli import build_cli, main
from tests.test_cli import FAST, GLYPHS
from tests.test_cli_trust import glyph_renderings  # noqa: F401 - the fixture: glyphs rendered once per session

QUIET = ["--trainer.callbacks=[]", "--trainer.logger=false"]
FIT = ["fit", "--config", str(GLYPHS), *FAST, *QUIET, "--trainer.enable_checkpointing=true",
       "--model.recall_at=[1,2]", "--trainer.limit_val_batches=2"]


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    yield
    # commands run in this process with the default (W&B) logger: end their runs and tear W&B down, as
    # protocol.launch.finish_runs does, so the next test's fits in this worker start from a fresh W&B set-up
    wandb.finish()
    wandb.teardown()


def _main(capsys, *args: str) -> tuple[int, str, str]:
    try:
        main(list(args))
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


def _digests(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.glob("*.ckpt"))}


@pytest.fixture(scope="module")
def trained(tmp_path_factory, glyph_renderings) -> Path:
    """``last.ckpt`` of a one-epoch fit of the fast Glyphs config (embedding width 16, recall_at [1, 2])."""
    root = tmp_path_factory.mktemp("runs_trained")
    build_cli([*FIT, f"--trainer.default_root_dir={root}"])
    return root / "checkpoints" / "last.ckpt"


def test_a_second_fit_never_replaces_another_runs_checkpoints(trained, tmp_path, capsys):
    run = tmp_path / "run"
    folder = run / "checkpoints"  # the folder of a first run (a copy of the fixture's: one fit less)
    folder.mkdir(parents=True)
    for name in ("last.ckpt", "best-epoch=0-step=3.ckpt"):
        (folder / name).write_bytes(trained.read_bytes())
    first = _digests(folder)
    # the same command again (a re-run, or a typo fixed): refused in one line, the trained model untouched
    code, _, err = _main(capsys, *FIT, f"--trainer.default_root_dir={run}", "--trainer.max_epochs=2")
    lines = [line for line in err.splitlines() if line.startswith("lightning-dml: error:")]
    assert code == 1 and len(lines) == 1 and "Traceback" not in err, err[-2000:]
    assert str(folder) in lines[0] and "last.ckpt" in lines[0]
    for way in ("--ckpt_path last", "--trainer.default_root_dir", "--overwrite_checkpoints true"):
        assert way in lines[0]
    assert _digests(folder) == first
    # starting from another run's checkpoint into this folder would replace them too
    other = tmp_path / "other.ckpt"
    other.write_bytes((folder / "last.ckpt").read_bytes())
    code, _, err = _main(capsys, *FIT, f"--trainer.default_root_dir={run}", f"--ckpt_path={other}",
                         "--trainer.max_epochs=2")
    assert code == 1 and "from another checkpoint" in err and _digests(folder) == first
    # resuming the run itself is allowed: last.ckpt is the resumed run's, one epoch further; an evaluation setting
    # may differ from the checkpoint's on resume too (an extra metric: before, "metrics is ['mrr'] here, [] in the
    # checkpoint" stopped the run)
    cli = build_cli([*FIT, f"--trainer.default_root_dir={run}", "--ckpt_path=last", "--trainer.max_epochs=2",
                     "--model.metrics=[mrr]"])
    assert cli.trainer.current_epoch == 2 and "val/mrr" in cli.trainer.callback_metrics
    resumed = torch.load(folder / "last.ckpt", weights_only=True)
    assert resumed["global_step"] == 6 and _digests(folder)["last.ckpt"] != first["last.ckpt"]
    # told to overwrite: only the new run's checkpoints remain (last and best are the new run's)
    before = set(_digests(folder).values())
    cli = build_cli([*FIT, f"--trainer.default_root_dir={run}", "--overwrite_checkpoints=true",
                     "--trainer.limit_train_batches=2"])
    after = _digests(folder)
    assert not before & set(after.values())
    assert set(after) == {"last.ckpt", Path(cli.trainer.checkpoint_callback.best_model_path).name}
    assert torch.load(folder / "last.ckpt", weights_only=True)["global_step"] == 2


def test_predict_writes_into_its_run_folder_and_says_what_it_wrote(trained, tmp_path, capsys):
    """With the default (W&B, offline) logger in the working directory, two predicts wrote the same
    ``logs/predictions.pt`` and printed nothing; each now writes into its own run folder."""
    args = ["predict", "--config", str(GLYPHS), *FAST, "--trainer.callbacks=[]", "--model.recall_at=[1,2]",
            "--trainer.limit_predict_batches=2", f"--ckpt_path={trained}"]
    written = []
    for _ in range(2):
        wandb.finish()  # as a new command does: a new W&B run (in one process the logger reuses the open run)
        code, out, err = _main(capsys, *args)
        assert code == 0, err[-2000:]
        (line,) = [line for line in out.splitlines() if line.startswith("lightning-dml predict: wrote ")]
        path = Path(re.match(r"lightning-dml predict: wrote (.+?\.pt): ", line).group(1))
        data = load_predictions(path)
        rows, width = data["embeddings"].shape
        assert f"{rows} rows, embeddings of width {width} " in line and width == 16
        assert f"one class label per row ({len(set(data['labels'].tolist()))} classes with names)" in line
        assert str(trained.resolve()) in line
        written.append(path)
    assert written[0] != written[1] and all(p.is_file() for p in written)
    assert not (tmp_path / "logs" / "predictions.pt").exists()
    assert all(p.is_relative_to(tmp_path / "logs" / "wandb") for p in written)
    wandb.finish()
    # a run folder given by --trainer.default_root_dir holds its predictions
    code, out, err = _main(capsys, *args, "--trainer.logger=false", "--trainer.default_root_dir=runs/p")
    assert code == 0 and (tmp_path / "runs" / "p" / "predictions.pt").is_file(), err[-2000:]
    assert f"wrote {tmp_path / 'runs' / 'p' / 'predictions.pt'}: " in out


def test_evaluation_settings_may_differ_from_the_checkpoint(trained, capsys):
    base = ["test", "--config", str(GLYPHS), *FAST, *QUIET, "--trainer.limit_test_batches=2", f"--ckpt_path={trained}"]
    cli = build_cli([*base, "--model.metrics=[mrr, ndcg@5]", "--model.recall_at=[1,4]", "--model.clustering=true"])
    metrics = cli.trainer.callback_metrics
    for key in ("test/mrr", "test/ndcg@5", "test/recall@4", "test/nmi"):
        assert key in metrics, sorted(metrics)
    assert "test/recall@2" not in metrics
    # the weights are the checkpoint's: the same Recall@1 as a test with the checkpoint's own settings
    same = build_cli(base).trainer.callback_metrics
    assert float(same["test/recall@1"]) == pytest.approx(float(metrics["test/recall@1"]))
    # an architecture setting that differs stays an error, naming the key and both values
    code, _, err = _main(capsys, *base, "--model.metrics=[mrr]", "--model.embedding_dim=32")
    assert code == 1 and "model.embedding_dim" in err and "32" in err and "metrics" not in err.split("error:")[1]


def test_a_requeued_slurm_job_resumes_and_is_not_refused(tmp_path, monkeypatch):
    """A SLURM script that Lightning requeues runs without ``--ckpt_path`` (docs/cluster.md): Lightning resumes
    it from ``<default_root_dir>/hpc_ckpt_<n>.ckpt``, so its own checkpoints are not another run's."""
    from lightning_dml.runs import RunFolderError, check_checkpoint_folders, slurm_requeue_resumes

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "last.ckpt").write_bytes(b"x")
    monkeypatch.delenv("SLURM_NTASKS", raising=False)
    with pytest.raises(RunFolderError, match="already holds the checkpoints of a run"):
        check_checkpoint_folders([folder], None, overwrite=False)
    (tmp_path / "hpc_ckpt_1.ckpt").write_bytes(b"x")
    assert not slurm_requeue_resumes(tmp_path)  # not under SLURM: Lightning does not resume from it
    monkeypatch.setenv("SLURM_NTASKS", "1")
    monkeypatch.setenv("SLURM_JOB_NAME", "train")
    assert slurm_requeue_resumes(tmp_path)
    assert check_checkpoint_folders([folder], "hpc", overwrite=False) == []
    assert check_checkpoint_folders([folder], None, overwrite=True) == [folder / "last.ckpt"]


# ------------------------------------------------------------------ one answer in one format (issue 27 s.3)
def _printed_values(out: str, title: str) -> dict[str, str]:
    """``{metric: printed value}`` of the table under ``title`` in ``out`` (rows ``name  value`` to a blank line)."""
    rows = out.split(title, 1)[1].strip("\n").split("\n\n", 1)[0].splitlines()[1:]
    return dict(line.split() for line in rows)


def test_test_and_validate_print_one_table_in_the_one_format(trained, capsys):
    """``test`` prints ONE table of its metrics, in percent with two decimals (threshold@fmr a score with four): on
    main Lightning's own "Test metric / DataLoader 0" table of the logged fractions (0.7875) followed ours (78.75).
    ``validate --verbose false`` prints neither."""
    from lightning_dml.metrics_format import format_metric

    args = ["--config", str(GLYPHS), *FAST, *QUIET, "--trainer.limit_test_batches=2", "--trainer.limit_val_batches=2",
            "--model.recall_at=[1,2]", "--model.metrics=[mrr, fnmr@fmr=0.1]", f"--ckpt_path={trained}"]
    cli = build_cli(["test", *args])
    out = capsys.readouterr().out
    logged = {k.split("/", 1)[1]: float(v) for k, v in cli.trainer.callback_metrics.items() if k.startswith("test/")}
    assert {"recall@1", "mrr", "fnmr@fmr=0.1", "threshold@fmr=0.1"} <= set(logged)
    assert out.count("Test metrics, %:") == 1, out
    printed = _printed_values(out, "Test metrics, %:")
    assert printed == {name: format_metric(name, value) for name, value in logged.items()}
    # Lightning's table ("Test metric  DataLoader 0", then "test/recall@1  0.78750...") is off
    assert "DataLoader 0" not in out and "test/recall@1" not in out, out
    assert not re.search(r"\b0\.\d{5,}", out), out  # no fraction in Lightning's full precision
    cli = build_cli(["validate", *args, "--verbose=false"])
    out = capsys.readouterr().out
    assert "val/recall@1" in cli.trainer.callback_metrics  # it ran, and printed no table
    assert "metrics, %:" not in out and "DataLoader 0" not in out and "val/recall@1" not in out, out


# ------------------------------------------------------------------ predict --output (issue 27 s.1)
def test_predict_output_writes_the_named_file(trained, tmp_path, capsys):
    """``predict --output PATH`` writes the file there (folders created, an old file replaced whole, nothing left
    beside it), prints its path and what it holds, and nothing goes to the run's folder; a folder as ``--output``
    is one error line before the model runs, the old file untouched."""
    args = ["predict", "--config", str(GLYPHS), *FAST, *QUIET, "--model.recall_at=[1,2]",
            "--trainer.limit_predict_batches=2", f"--ckpt_path={trained}", "--trainer.default_root_dir=runs/p"]
    target = tmp_path / "out" / "glyphs" / "embeddings.pt"
    target.parent.mkdir(parents=True)
    target.write_bytes(b"an older file")
    code, out, err = _main(capsys, *args, "--output=out/glyphs/embeddings.pt")
    assert code == 0, err[-2000:]
    data = load_predictions(target)
    rows, width = data["embeddings"].shape
    (line,) = [line for line in out.splitlines() if line.startswith("lightning-dml predict: wrote ")]
    assert line.startswith(f"lightning-dml predict: wrote {target}: {rows} rows, embeddings of width {width} ")
    assert width == 16 and str(trained.resolve()) in line and data["checkpoint"]["path"] == str(trained.resolve())
    assert sorted(p.name for p in target.parent.iterdir()) == ["embeddings.pt"]  # no temporary or probe file
    assert not (tmp_path / "runs" / "p" / "predictions.pt").exists()
    before = target.read_bytes()
    code, out, err = _main(capsys, *args, "--output=out/glyphs")
    (message,) = [line for line in err.splitlines() if "error" in line]
    assert code == 1 and "Traceback" not in err and "--output out/glyphs: is a folder" in message, err[-2000:]
    assert "lightning-dml predict: wrote" not in out and target.read_bytes() == before
