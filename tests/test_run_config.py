"""Where a run's resolved config goes (issue 19): ``config.yaml`` in the run's own folders
(:mod:`lightning_dml.run_config`), never the logger's shared ``save_dir`` where the next run replaces it."""

from __future__ import annotations

import pytest
import yaml

from lightning_dml.cli import build_cli
from lightning_dml.protocol.launch import finish_runs
from tests.test_protocol_cv import tiny_fit_args
from tests.test_protocol_folds import glyph_subset  # noqa: F401  (fixture)


def _dim(path) -> int:
    return yaml.safe_load(path.read_text())["model"]["embedding_dim"]


@pytest.mark.slow  # three tiny fits and a validation, about 15 s on the shared 2-core machine
def test_each_run_saves_its_config_in_its_own_folders(glyph_subset, tmp_path, monkeypatch):
    """Regression: with the default W&B logger every fit wrote ``logs/config.yaml`` of the working directory
    (replaced by the next fit), and ``--trainer.default_root_dir`` did not move it."""
    monkeypatch.chdir(tmp_path)
    quiet = ["--trainer.enable_checkpointing=false", "--trainer.limit_val_batches=1"]
    for name, dim in (("a", 16), ("b", 8)):
        build_cli(["fit", *tiny_fit_args(tmp_path / "csv"), *quiet, f"--model.embedding_dim={dim}",
                   f"--trainer.default_root_dir={tmp_path / name}"])
    assert _dim(tmp_path / "a" / "config.yaml") == 16 and _dim(tmp_path / "b" / "config.yaml") == 8
    versions = sorted((tmp_path / "csv").glob("**/version_*/config.yaml"))
    assert [_dim(path) for path in versions] == [16, 8]  # the CSV logger's version folders keep theirs

    # another subcommand in a fit's folder keeps the fit's config
    build_cli(["validate", *tiny_fit_args(tmp_path / "csv"), *quiet, "--model.embedding_dim=32",
               f"--trainer.default_root_dir={tmp_path / 'a'}"])
    assert _dim(tmp_path / "a" / "config_validate.yaml") == 32 and _dim(tmp_path / "a" / "config.yaml") == 16

    # the default logger (W&B, save_dir logs/) in the working directory: the W&B run's own folder, neither the
    # shared logs/config.yaml nor the working directory (shared by every run started there)
    cli = build_cli(["fit", *tiny_fit_args(None, "default"), *quiet, "--model.embedding_dim=24"])
    try:
        (run_folder,) = (tmp_path / "logs" / "wandb").glob(f"offline-run-*-{cli.trainer.logger.experiment.id}")
    finally:
        finish_runs(cli.trainer)
    assert _dim(run_folder / "config.yaml") == 24
    assert not (tmp_path / "logs" / "config.yaml").exists() and not (tmp_path / "config.yaml").exists()


def test_another_command_in_the_fits_logger_folder_keeps_the_fits_config(tmp_path, monkeypatch):
    """Regression: with a logger folder shared with the fit (a CSV logger given ``version: 0``, as a fit's saved
    config repeats it), ``test``/``predict`` wrote ``config.yaml`` over the fit's there; now ``config_<command>.yaml``
    (Lightning passes the stage as its ``TrainerFn``)."""
    from types import SimpleNamespace

    from pytorch_lightning.loggers import CSVLogger
    from pytorch_lightning.trainer.states import TrainerFn

    from lightning_dml.run_config import config_paths

    monkeypatch.chdir(tmp_path)
    trainer = SimpleNamespace(loggers=[CSVLogger(tmp_path / "logs", name="glyphs", version=0)],
                              default_root_dir=str(tmp_path))
    folder = tmp_path / "logs" / "glyphs" / "version_0"
    assert config_paths(trainer, TrainerFn.FITTING) == [str(folder / "config.yaml")]
    assert config_paths(trainer, TrainerFn.TESTING) == [str(folder / "config_test.yaml")]
    assert config_paths(trainer, "predict") == [str(folder / "config_predict.yaml")]
    trainer.default_root_dir = str(tmp_path / "run")  # and in a run folder of its own
    assert config_paths(trainer, "validate") == [str(tmp_path / "run" / "config_validate.yaml"),
                                                 str(folder / "config_validate.yaml")]
