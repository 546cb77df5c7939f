"""``predict --output PATH`` (issue 27 s.1): the places it refuses, each in one line naming ``--output``
(:func:`lightning_dml.callbacks.predictions.check_output_path`); the CLI's run is in ``tests/test_runs.py``. And
``index build``'s gallery embeddings (a temporary predictions file) print no "predict: wrote ... no checkpoint"
line for a model whose weights it loaded."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_dml.callbacks.predictions import check_output_path
from lightning_dml.errors import UserInputError

GLYPHS = str(Path(__file__).resolve().parents[1] / "configs" / "glyphs.yaml")


def test_output_places_that_are_refused(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert check_output_path("a/b/p.pt") == tmp_path / "a" / "b" / "p.pt"  # missing folders: created at write
    assert not (tmp_path / "a").exists()  # ... not by the check
    (tmp_path / "folder").mkdir()
    (tmp_path / "file.txt").write_text("x")
    refused = [
        ("folder", "is a folder"),
        ("new/", "is a folder"),
        ("", "is a folder"),
        ("file.txt/p.pt", f"{tmp_path / 'file.txt'} is a file, not a folder"),
        ("file.txt/deeper/p.pt", f"{tmp_path / 'file.txt'} is a file, not a folder"),
        ("/proc/p.pt", "cannot write into /proc"),  # refused to root as well (the check writes a probe file)
    ]
    for path, message in refused:
        with pytest.raises(UserInputError, match="^--output ") as error:
            check_output_path(path)
        assert message in str(error.value) and "\n" not in str(error.value), (path, str(error.value))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file.txt", "folder"]  # no probe file left


def test_index_embeddings_print_no_predict_line(tmp_path: Path, capsys):
    """On main ``index build`` printed "lightning-dml predict: wrote /tmp/.../gallery.pt: ...; no checkpoint
    (initial weights)" for the temporary file of its gallery embeddings, after loading the checkpoint's weights."""
    from PIL import Image

    from lightning_dml.index.embed import predict_embeddings
    from lightning_dml.models import SmallConvNet
    from lightning_dml.models.input_spec import InputSpec
    from lightning_dml.module import DMLModule

    paths = []
    for i in range(3):
        paths.append(tmp_path / f"{i}.png")
        Image.new("L", (12, 12), color=40 * i).save(paths[-1])
    module = DMLModule(SmallConvNet(in_channels=1, width=4), embedding_dim=8, clustering=False).eval()
    spec = InputSpec(color="L", mean=(0.5,), std=(0.5,), crop_size=12, resize_size=12)
    embeddings = predict_embeddings(module, paths, spec, {"crop_size": 12, "resize_size": 12, "mode": "L"},
                                    accelerator="cpu", progress=False)
    assert embeddings.shape == (3, 8) and torch.isfinite(embeddings).all()
    out = capsys.readouterr().out
    assert "lightning-dml predict: wrote" not in out and "no checkpoint" not in out, out


@pytest.mark.parametrize("command", ["fit", "test", "validate"])
def test_output_is_refused_outside_predict_and_null_is_accepted(command, tmp_path: Path):
    """Every parser takes ``--output`` (a config dumped from the main parser, as sweep's best.yaml, holds
    ``output: null`` and must load in ``fit``), but a value outside ``predict`` is an error, not silently ignored."""
    from lightning_dml.cli import build_cli

    with pytest.raises(UserInputError, match=f"--output is an option of predict; {command} writes"):
        build_cli([command, "--config", GLYPHS, "--output", str(tmp_path / "p.pt"), "--trainer.logger", "false"])
    config = tmp_path / "c.yaml"
    config.write_text("output: null\ntrainer:\n  logger: false\n")
    with pytest.raises(SystemExit) as exit_info:
        build_cli([command, "--config", GLYPHS, "--config", str(config), "--print_config"])
    assert exit_info.value.code == 0
