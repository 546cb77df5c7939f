"""The embedding model exported alone (safetensors + architecture record, state dict, TorchScript, torch.export) and
reloaded (the program formats without Lightning; they load only when trusted, tests/test_safe_loads.py)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from lightning_dml.export import (
    FORMATS,
    INPUT_SPEC,
    SAFETENSORS,
    STATE_DICT,
    TORCH_EXPORT,
    TORCHSCRIPT,
    EmbeddingModel,
    export_checkpoint,
    export_embedding_model,
    load_embedding_model,
)
from lightning_dml.models import LinearEmbedding, SmallConvNet
from lightning_dml.module import DMLModule
from tests import glyph_cache


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A small DMLModule after a few optimizer steps (so BatchNorm statistics and weights are not the defaults),
    exported to every format."""
    torch.manual_seed(0)
    module = DMLModule(SmallConvNet(in_channels=1, width=4), embedding_dim=8, head_norm="batch", clustering=False)
    optimizer = torch.optim.Adam(module.parameters(), lr=1e-2)
    labels = torch.arange(16) % 4
    for _ in range(3):
        loss = module.loss(module(torch.randn(16, 1, 16, 16)), labels)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    module.eval()
    out = tmp_path_factory.mktemp("export")
    torch_formats = [f for f in FORMATS if f != "onnx"]  # onnx (the onnx extra): tests/test_onnx.py
    paths = export_embedding_model(module, out, torch.randn(3, 1, 16, 16), formats=torch_formats)
    return module, out, paths


def test_every_format_is_written_and_nothing_else(trained, tmp_path):
    module, out, paths = trained
    assert set(paths) == {"safetensors", "state_dict", "torchscript", "torch_export"}
    assert sorted(p.name for p in out.iterdir()) == sorted([SAFETENSORS, STATE_DICT, TORCHSCRIPT, TORCH_EXPORT])
    # by default only the formats that load without running code
    default = export_embedding_model(module, tmp_path, torch.randn(2, 1, 16, 16))
    assert set(default) == {"safetensors", "state_dict"}


@pytest.mark.slow
def test_reloaded_without_lightning_gives_the_module_embeddings(trained, tmp_path):
    """A fresh interpreter in which importing Lightning or lightning_dml fails loads both program formats."""
    module, out, _ = trained
    images = torch.randn(5, 1, 16, 16)  # another batch size than the export example
    torch.save(images, tmp_path / "images.pt")
    script = textwrap.dedent(
        f"""
        import sys
        for name in ("pytorch_lightning", "lightning", "lightning_fabric", "lightning_dml"):
            sys.modules[name] = None  # any import of them raises ImportError
        import torch
        images = torch.load({str(tmp_path / "images.pt")!r})
        scripted = torch.jit.load({str(out / TORCHSCRIPT)!r})
        exported = torch.export.load({str(out / TORCH_EXPORT)!r}).module()
        torch.save({{"torchscript": scripted(images), "torch_export": exported(images)}}, {str(tmp_path / "out.pt")!r})
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    embeddings = torch.load(tmp_path / "out.pt")
    with torch.no_grad():
        expected = module(images)
    for name in ("torchscript", "torch_export"):
        assert embeddings[name].shape == (5, 8)
        torch.testing.assert_close(embeddings[name], expected, rtol=1e-5, atol=1e-6, msg=name)


def test_state_dict_reloads_into_plain_modules(trained):
    module, out, _ = trained
    payload = torch.load(out / STATE_DICT, weights_only=True)
    assert payload["embedding_dim"] == 8 and payload["input_shape"] == [1, 16, 16]
    model = EmbeddingModel(SmallConvNet(in_channels=1, width=4), LinearEmbedding(module.backbone.out_features, 8, "batch"))
    model.load_state_dict(payload["state_dict"])
    model.eval()
    images = torch.randn(4, 1, 16, 16)
    with torch.no_grad():
        torch.testing.assert_close(model(images), module(images))


def test_load_embedding_model_by_file_name(trained):
    module, out, _ = trained
    images = torch.randn(2, 1, 16, 16)
    with torch.no_grad():
        expected = module(images)
        assert torch.equal(load_embedding_model(out / SAFETENSORS)(images), expected)
        for name in (TORCHSCRIPT, TORCH_EXPORT):
            loaded = load_embedding_model(out / name, trust_code=True)
            torch.testing.assert_close(loaded(images), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="weights only"):
        load_embedding_model(out / STATE_DICT)
    with pytest.raises(FileNotFoundError, match="no exported model"):
        load_embedding_model(out / "missing.pt")


def test_bad_export_requests_write_nothing(trained, tmp_path):
    module, _, _ = trained
    with pytest.raises(ValueError, match="unknown export format.*tflite.*valid formats: safetensors, state_dict"):
        export_embedding_model(module, tmp_path / "a", torch.randn(2, 1, 16, 16), formats=["tflite"])
    with pytest.raises(ValueError, match=r"example_input must be an image batch \[B, C, H, W\], got \(1, 16, 16\)"):
        export_embedding_model(module, tmp_path / "b", torch.randn(1, 16, 16))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.slow
def test_export_a_checkpoint_from_its_config(tmp_path, tmp_path_factory):
    """The command-line path: a config as `lightning-dml` saves it plus a Lightning checkpoint."""
    glyph_cache.install(tmp_path_factory.getbasetemp() / glyph_cache.FILENAME)
    config = {
        "seed_everything": 0,
        "ckpt_path": None,
        "model": {
            "backbone": {"class_path": "lightning_dml.models.SmallConvNet", "init_args": {"width": 4}},
            "embedding_dim": 8,
            "clustering": False,
        },
        "data": {"class_path": "lightning_dml.data.GlyphsDataModule", "init_args": {"image_size": 16}},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    torch.manual_seed(1)
    module = DMLModule(SmallConvNet(width=4), embedding_dim=8, clustering=False)
    torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": "2.6.0"}, tmp_path / "last.ckpt")
    paths = export_checkpoint(tmp_path / "config.yaml", tmp_path / "last.ckpt", tmp_path / "out",
                              ["safetensors", "torchscript"])
    assert list(paths) == ["safetensors", "torchscript", "input_spec"]
    module.eval()
    images = torch.randn(3, 1, 16, 16)
    with torch.no_grad():
        assert torch.equal(load_embedding_model(paths["safetensors"])(images), module(images))
        loaded = load_embedding_model(paths["torchscript"], trust_code=True)
        torch.testing.assert_close(loaded(images), module(images))


def test_export_feeds_the_backbone_its_input_convention(tmp_path):
    """No trainer sets the data module up during export: it still reads the backbone's input convention, so a
    grey-input backbone gets grey example images from an RGB dataset (not torchvision's 3-channel default)."""
    from tests.fixtures_data import make_sop

    top = make_sop(tmp_path / "sop", train_classes=4, test_classes=4, images_per_class=2)
    config = {
        "model": {
            "backbone": {"class_path": "lightning_dml.models.SmallConvNet", "init_args": {"in_channels": 1, "width": 4}},
            "embedding_dim": 8,
            "clustering": False,
        },
        "data": {
            "class_path": "lightning_dml.data.SOPDataModule",
            "init_args": {"root": str(top), "num_workers": 0, "image_size": 16, "classes_per_batch": 2},
        },
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    torch.save({"state_dict": DMLModule(SmallConvNet(in_channels=1, width=4), embedding_dim=8).state_dict(),
                "pytorch-lightning_version": "2.6.0"}, tmp_path / "last.ckpt")
    with pytest.warns(UserWarning, match="differs from the copy the papers use"):
        paths = export_checkpoint(tmp_path / "config.yaml", tmp_path / "last.ckpt", tmp_path / "out", ["state_dict"])
    assert torch.load(paths["state_dict"], weights_only=True)["input_shape"] == [1, 16, 16]


def saved_config(command: str, config: dict, tmp_path: Path, capsys) -> Path:
    """The config ``lightning-dml <command>`` saves for ``config`` (LightningCLI's ``--print_config`` prints the
    dump its SaveConfigCallback writes: every option of the command, ``ckpt_path`` and ``weights_only`` included)."""
    from lightning_dml.cli import build_cli

    (tmp_path / "given.yaml").write_text(yaml.safe_dump(config))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        build_cli([command, "--config", str(tmp_path / "given.yaml"), "--print_config"])
    assert exit_info.value.code in (0, None)
    path = tmp_path / f"config_{command}.yaml"
    path.write_text(capsys.readouterr().out)
    return path


@pytest.mark.parametrize("command", ["fit", "test"])
def test_export_and_index_accept_the_config_a_command_saves(command, tmp_path, tmp_path_factory, capsys):
    """Issue 27 s.2: the config.yaml `fit` saves (and a `test`'s config_test.yaml) holds the command's own options
    (`ckpt_path`, `weights_only`, `verbose`); `python -m lightning_dml.export --config` and `index build --config`
    stopped on them with "Option 'weights_only' is not accepted"."""
    from lightning_dml.index.embed import load_checkpoint_model

    glyph_cache.install(tmp_path_factory.getbasetemp() / glyph_cache.FILENAME)
    config = {
        "model": {
            "backbone": {"class_path": "lightning_dml.models.SmallConvNet", "init_args": {"width": 4}},
            "embedding_dim": 8,
            "clustering": False,
        },
        "data": {"class_path": "lightning_dml.data.GlyphsDataModule", "init_args": {"image_size": 16}},
    }
    path = saved_config(command, config, tmp_path, capsys)
    assert "weights_only" in yaml.safe_load(path.read_text())  # what made both commands fail
    torch.manual_seed(2)
    module = DMLModule(SmallConvNet(width=4), embedding_dim=8, clustering=False).eval()
    torch.save({"state_dict": module.state_dict(), "pytorch-lightning_version": "2.6.0"}, tmp_path / "last.ckpt")
    paths = export_checkpoint(path, tmp_path / "last.ckpt", tmp_path / "out", ["safetensors"])
    preprocess = json.loads(paths["input_spec"].read_text())  # the data module's evaluation sizes, not the backbone's
    assert (preprocess["crop_size"], preprocess["resize_size"], preprocess["input_shape"]) == (16, 16, [1, 16, 16])
    images = torch.randn(3, 1, 16, 16)
    with torch.no_grad():
        assert torch.equal(load_embedding_model(paths["safetensors"])(images), module(images))
        loaded, _, _ = load_checkpoint_model(path, tmp_path / "last.ckpt")  # what `index build --config` reads
        assert torch.equal(loaded(images), module(images))


def plain_pytorch_lines() -> str:
    """The python block of docs/models.md that embeds one image from an export folder in plain PyTorch."""
    text = (Path(__file__).parents[1] / "docs" / "models.md").read_text()
    blocks = [b for b in re.findall(r"^```python\n(.*?)^```", text, re.M | re.S) if "input_spec.json" in b]
    assert len(blocks) == 1, "docs/models.md: one python block reading input_spec.json"
    return blocks[0]


def run_plain_pytorch_lines(folder: Path, image, tmp_path: Path, monkeypatch) -> torch.Tensor:
    work = tmp_path / "user"
    work.mkdir()
    (work / "exported").symlink_to(folder)
    image.save(work / "query.png")
    monkeypatch.chdir(work)
    namespace: dict = {}
    exec(compile(plain_pytorch_lines(), "docs/models.md", "exec"), namespace)  # noqa: S102 - the repository's docs
    return namespace["embedding"]


@pytest.mark.parametrize("kind", ["grey", "bgr255"])
def test_export_folder_carries_its_preprocessing_and_the_documented_lines_use_it(kind, trained, tmp_path,
                                                                                 monkeypatch):
    """Issue 27 s.2: input_spec.json beside the weights, load_embedding_model takes the folder, and the ten lines
    of docs/models.md give the embedding the library's own evaluation transform gives (search's ImageEmbedder)."""
    import dataclasses

    from PIL import Image

    from lightning_dml.index.embed import ImageEmbedder
    from lightning_dml.models.input_spec import InputSpec

    if kind == "grey":  # the backbone's declared spec, cropped to 16
        module = trained[0]
        spec = module.backbone.input_spec
        crop, resize = 16, 16
        folder = tmp_path / "grey"
        export_embedding_model(module, folder, torch.randn(2, 1, 16, 16), ["safetensors"],
                               (spec, {"crop_size": crop, "resize_size": resize, "mode": "L"}))
    else:  # a Caffe-style convention: BGR, pixels in [0, 255]
        torch.manual_seed(3)
        module = DMLModule(SmallConvNet(in_channels=3, width=4), embedding_dim=8, clustering=False).eval()
        spec = InputSpec(color="BGR", scale=255.0, mean=(104.0, 117.0, 128.0), std=(58.0, 57.0, 57.0), crop_size=16,
                         resize_size=20, interpolation="bicubic")
        crop, resize = 16, 20
        folder = tmp_path / "bgr"
        export_embedding_model(module, folder, torch.randn(2, 3, 16, 16), ["safetensors"],
                               (spec, {"crop_size": crop, "resize_size": resize, "mode": "RGB"}))
    record = json.loads((folder / INPUT_SPEC).read_text())
    assert record["input_spec"] == json.loads(json.dumps(dataclasses.asdict(spec)))
    assert (record["crop_size"], record["resize_size"], record["normalized"]) == (crop, resize, False)
    pixels = torch.randint(0, 256, (30, 41, 3), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    image = Image.fromarray(pixels.numpy(), "RGB")
    documented = run_plain_pytorch_lines(folder, image, tmp_path, monkeypatch)
    library = ImageEmbedder(folder / SAFETENSORS, spec, {"crop_size": crop, "resize_size": resize,
                                                         "mode": record["mode"]})([image])
    assert documented.shape == (1, 8)
    torch.testing.assert_close(documented, torch.nn.functional.normalize(library, dim=1), rtol=0, atol=1e-6)
    with torch.no_grad():
        assert torch.equal(load_embedding_model(folder)(torch.ones(1, spec.channels, crop, crop)),
                           load_embedding_model(folder / SAFETENSORS)(torch.ones(1, spec.channels, crop, crop)))


def test_load_embedding_model_names_what_an_export_folder_lacks(tmp_path):
    (tmp_path / STATE_DICT).write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=f"export folder .* has no {SAFETENSORS} .*it holds {STATE_DICT}"):
        load_embedding_model(tmp_path)
