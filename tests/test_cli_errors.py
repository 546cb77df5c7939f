"""Typos on the command line and in config files (issue 27 s.1 and s.4): an abbreviated option is refused by every
command, naming the option(s) it abbreviates (argparse silently took ``--trainer.max_epoch`` for
``--trainer.max_epochs``), and a misspelt option or config key (model, data, loss, trainer) is one error line with
the closest valid names, instead of the usage block."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

from lightning_dml import entry, export

ROOT = Path(__file__).resolve().parents[1]
GLYPHS = ROOT / "configs" / "glyphs.yaml"


def _error(capsys, run) -> list[str]:
    """The stderr lines of ``run()``, which must exit with status 2 (a command-line error)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*LightningCLI's args parameter.*")  # sys.argv is pytest's
        with pytest.raises(SystemExit) as done:
            run()
    assert done.value.code == 2
    captured = capsys.readouterr()
    assert "usage:" not in captured.err and "Traceback" not in captured.err
    return captured.err.strip().splitlines()


def _one_line(capsys, argv: list[str]) -> str:
    lines = _error(capsys, lambda: entry.main(argv))
    assert len(lines) == 2 and lines[1].endswith("--help` lists the options"), lines
    return lines[0]


@pytest.mark.parametrize(
    ("argv", "meant"),
    [
        (["fit", "--config", str(GLYPHS), "--trainer.max_epoch", "3"], "--trainer.max_epochs"),
        (["test", "--config", str(GLYPHS), "--model.embedding_di=16"], "--model.embedding_dim"),
        (["search", "--ind", "folder", "query.png"], "--index"),
        (["serve", "--ind", "folder"], "--index"),
        (["index", "build", "--conf", "c.yaml", "--ckpt_path", "m.ckpt", "--gallery", "g", "--out", "o"],
         "--config"),
        (["cv", "--num_fold", "3", "--config", str(GLYPHS)], "--num_folds"),
        (["cv", "--repea", "1", "--config", str(GLYPHS)], "--repeat or --repeats"),
        (["sweep", "--spac", "s.yaml", "--config", str(GLYPHS)], "--space"),
        (["report", "--predictio", "p.pt", "--out", "r"], "--predictions"),
    ],
    ids=lambda value: value[0] if isinstance(value, list) else None,
)
def test_an_abbreviated_option_is_refused_naming_the_full_option(capsys, argv, meant):
    line = _one_line(capsys, argv)
    given = next(w.split("=")[0] for w in argv if w.startswith("--") and meant.startswith(w.split("=")[0]))
    assert f"unknown option {given} (abbreviations are not accepted; did you mean {meant}?)" in line, line


def test_export_refuses_an_abbreviated_option(capsys):
    lines = _error(capsys, lambda: export.main(["--conf", "c.yaml", "--ckpt_path", "m.ckpt", "--output", "o"]))
    assert lines[0].endswith("unknown option --conf (abbreviations are not accepted; did you mean --config?)"), lines


@pytest.mark.parametrize(
    ("old", "new", "expected"),
    [
        ("  embedding_dim: 128", "  embeding_dim: 128", "unknown key 'model.embeding_dim' (did you mean "
                                                         "model.embedding_dim"),
        ("  max_epochs: 6", "  max_epoch: 6", "unknown key 'trainer.max_epoch' (abbreviations are not accepted; "
                                              "did you mean trainer.max_epochs?)"),
        ("    classes_per_batch: 16", "    classes_per_bach: 16", "unknown key 'data.init_args.classes_per_bach' "
         "for lightning_dml.data.GlyphsDataModule (did you mean classes_per_batch"),
        ("      beta: 50.0", "      betta: 50.0", "unknown key 'model.loss.init_args.betta' for "
         "lightning_dml.losses.MultiSimilarityLoss (did you mean beta?)"),
    ],
    ids=["model", "trainer", "data", "loss"],
)
def test_a_misspelt_config_file_key_is_one_line_with_the_closest_keys(tmp_path, capsys, old, new, expected):
    text = GLYPHS.read_text()
    assert old in text
    config = tmp_path / "typo.yaml"
    config.write_text(text.replace(old, new))
    line = _one_line(capsys, ["fit", "--config", str(config)])
    assert line.startswith("lightning-dml fit: error: ") and expected in line, line


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--model.embeding_dim=3", "unknown option --model.embeding_dim (did you mean --model.embedding_dim"),
        ("--data.init_args.classes_per_bach=3", "unknown key 'data.init_args.classes_per_bach' for "
         "lightning_dml.data.GlyphsDataModule (did you mean classes_per_batch"),
        ("--trainer.max_epohcs=3", "unknown option --trainer.max_epohcs (did you mean --trainer.max_epochs"),
    ],
    ids=["model", "data", "trainer"],
)
def test_a_misspelt_command_line_key_is_one_line_with_the_closest_keys(capsys, override, expected):
    line = _one_line(capsys, ["fit", "--config", str(GLYPHS), override])
    assert expected in line, line


def test_an_unknown_option_is_named_before_the_required_ones_it_left_missing(capsys):
    """argparse reports only the missing ``--index`` for ``search --indx F``: the typo is what the user needs."""
    line = _one_line(capsys, ["search", "--indx", "folder", "query.png"])
    assert line == "lightning-dml search: error: unknown option --indx (did you mean --index?)", line


def test_a_value_a_class_refuses_is_one_line_with_its_reason(capsys):
    """A constructor's ValueError (the loss's ``alpha must be > 0``), raised while jsonargparse instantiates a
    class given for a union-typed argument (``loss: nn.Module | str``), is the constructor's reason in one line,
    not jsonargparse's traceback with the union's type mismatches."""
    line = _one_line(capsys, ["fit", "--config", str(GLYPHS), "--model.loss", "lightning_dml.losses.ProxyAnchorLoss",
                              "--model.loss.init_args.alpha", "-1"])
    assert line == ("lightning-dml fit: error: the configuration was refused: ProxyAnchorLoss: alpha must be > 0, "
                    "got -1.0"), line


# ------------------------------------------------------------------------------------------ noise (issue 27 s.4)
NOISE = {
    "LeafSpec": "torch's LeafSpec deprecation, raised by Lightning's _pytree",
    "dirpath has changed": "ModelCheckpoint reading a checkpoint written into another folder",
    "torch.jit": "torch.jit deprecations of the TorchScript export",
    "tmp.pt2": "torch.export's warning about a temporary file name",
}


@pytest.mark.slow
def test_fit_predict_and_export_print_none_of_their_dependencies_noise(tmp_path, monkeypatch):
    """Each command in a fresh process, as a user runs it: stderr has none of :data:`NOISE`."""
    import subprocess
    import sys

    import yaml

    from tests import glyph_cache

    cache = tmp_path / glyph_cache.FILENAME
    glyph_cache.install(cache)
    cfg = yaml.safe_load(GLYPHS.read_text())
    cfg["trainer"].update(max_epochs=1, max_steps=3, check_val_every_n_epoch=1, enable_checkpointing=True,
                          limit_val_batches=1, limit_predict_batches=1, enable_progress_bar=False,
                          enable_model_summary=False, logger=False, callbacks=[])
    cfg["model"]["backbone"]["init_args"]["width"] = 8
    cfg["model"].update(embedding_dim=16, clustering=False)
    cfg["data"]["init_args"]["image_size"] = 16
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "OMP_NUM_THREADS": "1", glyph_cache.ENV: str(cache), "PYTHONWARNINGS": "default"}
    runner = ROOT / "tests" / "distributed" / "run_demo_ddp.py"  # lightning_dml.cli.main with the glyph cache

    def run(*args: str) -> str:
        proc = subprocess.run([sys.executable, *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stderr

    outputs = {"fit": run(str(runner), "fit", "--config", str(config), f"--trainer.default_root_dir={tmp_path / 'a'}")}
    checkpoint = max((tmp_path / "a").rglob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    outputs["predict"] = run(str(runner), "predict", "--config", str(config), "--ckpt_path", str(checkpoint),
                             f"--trainer.default_root_dir={tmp_path / 'b'}")
    outputs["export"] = run("-m", "lightning_dml.export", "--config", str(config), "--ckpt_path", str(checkpoint),
                            "--output", str(tmp_path / "export"), "--formats", "torchscript", "torch_export")
    for command, stderr in outputs.items():
        for noise, what in NOISE.items():
            assert noise not in stderr, f"{command} printed {what}:\n{stderr[-3000:]}"
