"""What a user of the ``lightning-dml`` command can trust (issue 19, sections 3, 4 and 6): the checkpoint a run
starts from (none: one warning and ``checkpoint: null``; a config that disagrees with it: an error naming the key
and both values), one line for every mistake (a misspelt loss, a missing, truncated or foreign checkpoint, a
checkpoint of another architecture), a terminal without our noise, a help that names the library and every
command, and a fit that always ends with its validation metrics.

Most cases run the CLI in this process through ``main([...])`` (exit status 1 and one ``lightning-dml: error:``
line on stderr, no traceback); the terminal-noise and DDP cases run it in a subprocess.
"""

from __future__ import annotations

import csv
import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import pytorch_lightning as pl
import torch
import yaml

from lightning_dml.callbacks import load_predictions
from lightning_dml.checkpoints import CheckpointMismatchError, checkpoint_record, read_checkpoint
from lightning_dml.cli import COMMANDS, TRAINER_COMMANDS, build_cli, main
from lightning_dml.data import GlyphsDataModule
from lightning_dml.errors import CorruptFileError, MissingFileError, UserInputError
from lightning_dml.losses import build_loss
from lightning_dml.losses.registry import UnknownLossError
from lightning_dml.models import SmallConvNet
from lightning_dml.module import DMLModule
from tests import glyph_cache
from tests.test_cli import FAST, GLYPHS

ROOT = Path(__file__).resolve().parents[1]
RUNNER = ROOT / "tests" / "distributed" / "run_demo_ddp.py"  # main(argv) with the glyph cache of the test session
QUIET = ["--trainer.callbacks=[]", "--trainer.logger=false"]
CSV = ["--trainer.callbacks=[]", "--trainer.logger=pytorch_lightning.loggers.CSVLogger"]


class CountValidations(pl.Callback):
    """Counts the validations of a run (every ``on_validation_end`` outside the sanity check)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.count += 1


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """Runs write their config and logs into the working directory: keep it the test's own."""
    monkeypatch.chdir(tmp_path)


@pytest.fixture(scope="module")
def glyph_renderings(tmp_path_factory) -> Path:
    path = tmp_path_factory.getbasetemp() / glyph_cache.FILENAME
    glyph_cache.install(path)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, glyph_renderings) -> Path:
    """``last.ckpt`` of a one-epoch fit of the fast Glyphs config (SmallConvNet width 8: 32 features, embedding
    width 16, ``recall_at`` [1, 2])."""
    root = tmp_path_factory.mktemp("trained")
    build_cli(
        ["fit", "--config", str(GLYPHS), *FAST, *QUIET, "--trainer.enable_checkpointing=true",
         f"--trainer.default_root_dir={root}", "--model.recall_at=[1,2]"]
    )
    path = root / "checkpoints" / "last.ckpt"
    assert path.is_file()
    return path


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """``main(args)``: (exit status, stdout, stderr)."""
    try:
        main(list(args))
        code = 0
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out = capsys.readouterr()
    return code, out.out, out.err


def _one_error_line(code: int, err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("lightning-dml: error: ")]
    assert code == 1, err[-3000:]
    assert len(errors) == 1, err[-3000:]
    assert "Traceback" not in err
    return errors[0]


def _run(args: list[str], cwd: Path, cache: Path, timeout: int = 420) -> subprocess.CompletedProcess:
    """The command in a fresh process, with the environment of a user's terminal: no ``WANDB_MODE`` or
    ``WANDB_SILENT`` (the default logger is W&B offline by its config; without an API key an online run would
    stop at once), no DDP variables."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", glyph_cache.ENV: str(cache)}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "WANDB_SILENT", "WANDB_MODE",
                "WANDB_API_KEY"):
        env.pop(key, None)
    return subprocess.run(
        [sys.executable, str(RUNNER), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


# ------------------------------------------------------------------------------------------ 3.2 no checkpoint
@pytest.mark.parametrize("command", ["test", "predict"])
def test_evaluating_without_a_checkpoint_warns_once_and_records_null(command, tmp_path, capsys, glyph_renderings):
    args = [command, "--config", str(GLYPHS), *FAST, *CSV, f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--trainer.limit_test_batches=2", "--trainer.limit_predict_batches=2"]
    code, out, err = _main(capsys, *args)
    assert code == 0, err[-3000:]
    warnings = [line for line in err.splitlines() if line.startswith("lightning-dml: warning:")]
    assert len(warnings) == 1 and f"{command} without --ckpt_path" in warnings[0], err[-3000:]
    assert "initial weights" in warnings[0]
    (hparams,) = tmp_path.glob("**/hparams.yaml")
    logged = yaml.safe_load(hparams.read_text())
    assert "checkpoint" in logged and logged["checkpoint"] is None
    if command == "predict":
        (predictions,) = tmp_path.glob("**/predictions.pt")
        data = load_predictions(predictions)
        assert "checkpoint" in data and data["checkpoint"] is None


def test_evaluating_a_checkpoint_records_its_path_and_digest(trained, tmp_path, capsys):
    args = ["predict", "--config", str(GLYPHS), *FAST, *CSV, f"--trainer.logger.init_args.save_dir={tmp_path}",
            "--model.recall_at=[1,2]", "--trainer.limit_predict_batches=2", f"--ckpt_path={trained}"]
    code, out, err = _main(capsys, *args)
    assert code == 0, err[-3000:]
    assert "lightning-dml: warning" not in err
    expected = {"path": str(trained.resolve()), "sha256": hashlib.sha256(trained.read_bytes()).hexdigest()}
    assert checkpoint_record(trained) == expected
    (predictions,) = tmp_path.glob("**/predictions.pt")
    assert load_predictions(predictions)["checkpoint"] == expected
    (hparams,) = tmp_path.glob("**/hparams.yaml")
    assert yaml.safe_load(hparams.read_text())["checkpoint"] == expected
    assert checkpoint_record(None) is None


# ------------------------------------------------------------------------------------------ 3.3 config vs checkpoint
def test_a_given_value_that_disagrees_with_the_checkpoint_is_an_error(trained, tmp_path, capsys):
    base = ["test", "--config", str(GLYPHS), *FAST, *QUIET, "--model.recall_at=[1,2]", f"--ckpt_path={trained}"]
    line = _one_error_line(*_main(capsys, *base, "--model.embedding_dim=32")[::2])
    assert "model.embedding_dim" in line and "32" in line and "16" in line and str(trained) in line
    # the same value given in a config file instead of the command line
    config = tmp_path / "wide.yaml"
    config.write_text("model:\n  embedding_dim: 32\n  head_norm: layer\n  clustering: true\n")
    line = _one_error_line(*_main(capsys, *base, "--config", str(config))[::2])
    assert "model.embedding_dim" in line and "model.head_norm" in line and "'layer'" in line and "'none'" in line
    assert "clustering" not in line  # an evaluation setting may differ from the checkpoint's (issue 27)


def test_values_not_given_come_from_the_checkpoint(trained, tmp_path, capsys):
    """The demo config without its recall_at and embedding_dim: the checkpoint's [1, 2] and 16 are used."""
    text = GLYPHS.read_text()
    for line in ("  recall_at: [1, 2, 4, 8]\n", "  embedding_dim: 128\n"):
        assert line in text
        text = text.replace(line, "")
    config = tmp_path / "glyphs_without.yaml"
    config.write_text(text)
    fast = [a for a in FAST if not a.startswith("--model.embedding_dim")]
    cli = build_cli(["test", "--config", str(config), *fast, *QUIET, "--trainer.limit_test_batches=2",
                     f"--ckpt_path={trained}"])
    assert cli.model.hparams.embedding_dim == 16 and list(cli.model.hparams.recall_at) == [1, 2]
    assert "test/recall@2" in cli.trainer.callback_metrics and "test/recall@4" not in cli.trainer.callback_metrics


def test_resuming_with_other_settings_is_an_error(trained, tmp_path, capsys):
    """``fit --ckpt_path last``: Lightning finds the file when the run starts; every hyper-parameter must agree."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "last.ckpt").write_bytes(trained.read_bytes())
    args = ["fit", "--config", str(GLYPHS), *FAST, *QUIET, "--model.recall_at=[1,2]", "--trainer.max_epochs=2",
            "--trainer.enable_checkpointing=true", f"--trainer.default_root_dir={run}", "--ckpt_path=last"]
    # a setting a resumed run took silently (the optimizer state keeps the checkpoint's learning rates)
    line = _one_error_line(*_main(capsys, *args, "--model.head_lr_multiplier=10")[::2])
    assert "head_lr_multiplier is 10.0 here, 1.0 in the checkpoint" in line and "last.ckpt" in line


def test_a_proxy_loss_checkpoint_can_be_tested(tmp_path, capsys, glyph_renderings):
    """Regression: LightningCLI read the checkpoint's ``loss_sizes`` hyper-parameter, which DMLModule did not take
    ("Parsing of ckpt_path hyperparameters failed!"): a Proxy-Anchor run could not be tested."""
    proxy = [*FAST, *QUIET, "--model.loss=lightning_dml.losses.ProxyAnchorLoss", "--trainer.limit_val_batches=0"]
    build_cli(["fit", "--config", str(GLYPHS), *proxy, "--trainer.enable_checkpointing=true",
               f"--trainer.default_root_dir={tmp_path}"])
    checkpoint = f"--ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}"
    cli = build_cli(["test", "--config", str(GLYPHS), *proxy, "--trainer.limit_test_batches=2", checkpoint])
    assert cli.model.loss.proxies is not None and "test/recall@1" in cli.trainer.callback_metrics
    # with the config the fit saved (every key given, loss_sizes: null): the values agree, loss_sizes is derived
    (saved,) = tmp_path.glob("config.yaml")
    assert yaml.safe_load(saved.read_text())["model"]["loss_sizes"] is None
    cli = build_cli(["test", "--config", str(saved), "--trainer.limit_test_batches=2", checkpoint])
    assert cli.model.hparams.loss_sizes["embedding_dim"] == 16 and "test/recall@1" in cli.trainer.callback_metrics


# ------------------------------------------------------------------------------------------ 4. one line per mistake
def test_a_misspelt_loss_name_is_one_line_with_the_closest_names(tmp_path, capsys, glyph_renderings):
    line = _one_error_line(*_main(capsys, "fit", "--config", str(GLYPHS), *FAST, *QUIET,
                                  "--model.loss=multi_similarty")[::2])
    assert "unknown loss 'multi_similarty'" in line and "Did you mean 'multi_similarity'?" in line
    with pytest.raises(UnknownLossError, match="Did you mean 'proxy_anchor' or 'proxy_nca'"):
        build_loss("proxyanchor")
    with pytest.raises(ValueError, match="Did you mean 'multi_similarity'"):
        DMLModule(SmallConvNet(in_channels=1, width=4), loss="multi_similarty")
    assert issubclass(UnknownLossError, UserInputError)


class Foreign:
    """An object of another program, pickled into a file."""


def _bad_checkpoints(folder: Path, good: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, what the error must say)."""
    data = good.read_bytes()
    files = {
        "missing": (folder / "missing.ckpt", "does not exist"),
        "empty": (folder / "empty.ckpt", "is empty"),
        "truncated": (folder / "truncated.ckpt", "is truncated or corrupt"),
        "text": (folder / "notes.ckpt", "is not a checkpoint"),
        "weights only": (folder / "weights.pt", "weights alone"),
        "pickled object": (folder / "object.ckpt", "pickles the Python object"),
    }
    files["empty"][0].write_bytes(b"")
    files["truncated"][0].write_bytes(data[: len(data) // 2])
    files["text"][0].write_text("not a checkpoint\n")
    torch.save({"head.fc.weight": torch.zeros(2, 2)}, files["weights only"][0])
    torch.save({"state_dict": {}, "pytorch-lightning_version": "2.6.0", "extra": Foreign()}, files["pickled object"][0])
    return files


def test_a_bad_checkpoint_file_is_one_line_naming_it(trained, tmp_path, capsys):
    for name, (path, says) in _bad_checkpoints(tmp_path, trained).items():
        for command in ("test", "fit"):
            code, out, err = _main(capsys, command, "--config", str(GLYPHS), *FAST, *QUIET, f"--ckpt_path={path}")
            line = _one_error_line(code, err)
            assert str(path) in line and says in line, (name, line)
            assert "weights_only" not in out + err, (name, line)  # torch's advice to load the file unsafely
        with pytest.raises(MissingFileError if name == "missing" else CorruptFileError, match=says):
            read_checkpoint(path)
    line = _one_error_line(*_main(capsys, "test", "--config", str(GLYPHS), *FAST, *QUIET,
                                  f"--ckpt_path={trained.parent}")[::2])
    assert "is a folder" in line and "last.ckpt" in line
    line = _one_error_line(*_main(capsys, "test", "--config", str(GLYPHS), *FAST, *QUIET, "--ckpt_path=best")[::2])
    assert "--ckpt_path best" in line


def test_a_checkpoint_of_another_architecture_is_one_line_naming_both(trained, tmp_path, capsys):
    args = ["test", "--config", str(GLYPHS), *FAST, *QUIET, "--model.recall_at=[1,2]", f"--ckpt_path={trained}"]
    line = _one_error_line(*_main(capsys, *args, "--model.backbone.init_args.width=16")[::2])
    assert "SmallConvNet (32 features), embedding width 16" in line  # the checkpoint's
    assert "SmallConvNet (64 features), embedding width 16" in line  # the config's
    assert "size mismatch" not in line and str(trained) in line

    # in Python: restored by a Trainer (the hyper-parameters disagree), or loaded without one (the weights do not fit)
    trainer = pl.Trainer(default_root_dir=tmp_path, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, limit_test_batches=1)
    wide = DMLModule(SmallConvNet(in_channels=1, width=8), embedding_dim=32, recall_at=(1, 2), clustering=False)
    data = GlyphsDataModule(image_size=16, classes_per_batch=16, samples_per_class=4, num_workers=0)
    with pytest.raises(CheckpointMismatchError, match="embedding_dim is 32 here, 16 in the checkpoint"):
        trainer.test(wide, datamodule=data, ckpt_path=str(trained))
    with pytest.raises(CheckpointMismatchError, match=r"embedding width 16, the model .* embedding width 32"):
        DMLModule.load_from_checkpoint(trained, backbone=SmallConvNet(in_channels=1, width=8), embedding_dim=32)


def test_a_bad_checkpoint_through_the_real_command_prints_no_traceback(trained, tmp_path, glyph_renderings):
    truncated = tmp_path / "cut.ckpt"
    truncated.write_bytes(trained.read_bytes()[:1000])
    proc = _run(["test", "--config", str(GLYPHS), *FAST, *QUIET, f"--ckpt_path={truncated}"], tmp_path,
                glyph_renderings)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "Traceback" not in proc.stdout + proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"lightning-dml: error: --ckpt_path {truncated} is truncated"), proc.stderr[-3000:]


# ------------------------------------------------------------------------------------------ 6. terminal and help
def test_help_names_the_library_and_every_command(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "lightning_dml", "--help"], cwd=tmp_path, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Lightning Trainer command line tool" not in proc.stdout
    assert "lightning-dml" in proc.stdout and "deep metric learning" in proc.stdout
    for name in (*TRAINER_COMMANDS, *COMMANDS):
        assert f"  {name} " in proc.stdout, name
    assert {"cv", "sweep"} <= set(COMMANDS)


def test_a_command_registered_in_COMMANDS_is_dispatched_and_listed(tmp_path, monkeypatch, capsys):
    (tmp_path / "hello_command.py").write_text("CALLS = []\ndef main(argv):\n    CALLS.append(list(argv))\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(COMMANDS, "hello", ("hello_command", "say hello"))
    main(["hello", "--name", "x"])
    import hello_command

    assert hello_command.CALLS == [["--name", "x"]]
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert re.search(r"^  hello +say hello$", out, re.M), out  # the column width follows the longest name


def test_fit_prints_no_noise_of_ours_and_ends_with_its_metrics(tmp_path, glyph_renderings):
    """The default logger (W&B, offline): no "anonymous setting" warning, no litlogger tip; a fit stopped at
    max_steps between two validations still ends with its metrics, of its last step."""
    proc = _run(["fit", "--config", str(GLYPHS), *FAST, "--trainer.callbacks=[]", "--trainer.max_epochs=3",
                 "--trainer.max_steps=5"], tmp_path, glyph_renderings)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-3000:]
    assert list(tmp_path.glob("logs/wandb/offline-run-*")), "the W&B logger ran"
    for noise in ("anonymous setting", "litlogger", "litmodels", "💡"):
        assert noise not in output, noise
    assert proc.stdout.count("Last validation") == 1 and "Last validation (epoch 2, step 5)" in proc.stdout


# ------------------------------------------------------------------------------------------ 6. validate at the end
@pytest.mark.parametrize(
    ("max_steps", "option", "validations", "header"),
    [
        (5, None, 2, "Last validation (epoch 2, step 5)"),  # validated at step 3, then once more at the end
        (6, None, 2, "Last validation (epoch 2, step 6)"),  # validated at steps 3 and 6: not twice at the end
        (5, "false", 1, "Last validation (step 3; fit ended at step 5, not validated since)"),
    ],
)
def test_a_fit_validates_once_more_when_its_last_validation_is_stale(
    max_steps, option, validations, header, capsys, glyph_renderings
):
    option_args = [] if option is None else [f"--validate_at_end={option}"]  # on by default
    cli = build_cli(["fit", "--config", str(GLYPHS), *FAST, *QUIET, "--trainer.max_epochs=3",
                     f"--trainer.max_steps={max_steps}", *option_args,
                     "--trainer.callbacks+=tests.test_cli_trust.CountValidations"])
    counter = next(cb for cb in cli.trainer.callbacks if isinstance(cb, CountValidations))
    assert cli.trainer.global_step == max_steps
    assert counter.count == validations
    out = capsys.readouterr().out
    assert out.count("Last validation") == 1 and header in out, out[-2000:]
    assert "val/recall@1" in cli.trainer.callback_metrics


@pytest.mark.slow
def test_the_final_validation_under_two_process_ddp(tmp_path, glyph_renderings):
    """2 processes (gloo), 3 steps an epoch, stopped at step 4: validated at step 3 in fit and at step 4 after it
    (both processes take part, else they would hang); rank 0 prints the table once, of step 4."""
    proc = _run(["fit", "--config", str(GLYPHS), *FAST, *CSV, f"--trainer.logger.init_args.save_dir={tmp_path}",
                 "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.strategy=ddp",
                 "--trainer.max_epochs=3", "--trainer.max_steps=4", "--trainer.limit_train_batches=3"],
                tmp_path, glyph_renderings, timeout=540)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-5000:]
    assert "Traceback" not in output
    assert proc.stdout.count("Last validation") == 1 and "step 4)" in proc.stdout, proc.stdout[-3000:]
    (metrics,) = tmp_path.glob("**/metrics.csv")
    with open(metrics) as handle:
        rows = list(csv.DictReader(handle))
    steps = sorted(int(r["step"]) for r in rows if r.get("val/recall@1"))
    assert len(steps) == 2 and steps[-1] == 4, rows  # the in-fit validation and the final one, logged at step 4
