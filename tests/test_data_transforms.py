"""Input conventions end to end: the backbone's InputSpec decides colour order, value scale and mean/std."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image
from torch import nn

from lightning_dml.data import SOPDataModule, ToInputSpec
from lightning_dml.data.transforms import default_resize_size, eval_transform, train_transform
from lightning_dml.models import BNINCEPTION, TORCHVISION_IMAGENET, InputSpec, InputSpecMismatchError
from tests.fixtures_data import class_color, make_sop, write_jpeg


def _reference(rgb: np.ndarray, spec: InputSpec) -> np.ndarray:
    """The convention written out per channel: reorder, rescale, subtract mean, divide by std."""
    channels = [rgb[..., 2], rgb[..., 1], rgb[..., 0]] if spec.color == "BGR" else [rgb[..., c] for c in range(3)]
    return np.stack([(ch * spec.scale / 255.0 - m) / s for ch, m, s in zip(channels, spec.mean, spec.std)])


@pytest.mark.parametrize("spec", [TORCHVISION_IMAGENET, BNINCEPTION], ids=["torchvision", "bninception"])
def test_to_input_spec_matches_the_written_out_convention(spec):
    rgb = np.random.default_rng(0).integers(0, 256, size=(5, 7, 3)).astype(np.uint8)
    out = ToInputSpec(spec)(torch.from_numpy(rgb).permute(2, 0, 1).contiguous())
    np.testing.assert_allclose(out.numpy(), _reference(rgb.astype(np.float64), spec), rtol=1e-5, atol=1e-4)


def test_to_input_spec_rejects_wrong_channels():
    with pytest.raises(ValueError, match="3 channels"):
        ToInputSpec(InputSpec(color="L", mean=(0.5,), std=(0.5,)))(torch.zeros(3, 4, 4, dtype=torch.uint8))


def test_eval_transform_is_resize_then_centre_crop(tmp_path):
    """Shorter side to resize_size, centre crop_size: compared with PIL's own resize and crop."""
    array = np.random.default_rng(1).integers(0, 256, size=(30, 50, 3)).astype(np.uint8)
    image = Image.fromarray(array)
    out = eval_transform(TORCHVISION_IMAGENET, crop_size=20, resize_size=24)(image)
    resized = image.resize((40, 24), Image.Resampling.BILINEAR)  # 50 x 30 -> 40 x 24
    left, top = (40 - 20) // 2, (24 - 20) // 2
    expected = np.asarray(resized.crop((left, top, left + 20, top + 20)), dtype=np.float64)
    np.testing.assert_allclose(out.numpy(), _reference(expected, TORCHVISION_IMAGENET), atol=2 / 255 / 0.224)
    assert default_resize_size(224, BNINCEPTION) == 256 and default_resize_size(227, BNINCEPTION) == 256
    assert default_resize_size(112, BNINCEPTION) == 128


def test_train_transform_crops_and_flips():
    array = np.zeros((40, 40, 3), dtype=np.uint8)
    array[:, :20] = (255, 0, 0)  # left half red, right half blue
    array[:, 20:] = (0, 0, 255)
    transform = train_transform(BNINCEPTION, crop_size=16, crop_scale=(1.0, 1.0))
    torch.manual_seed(0)
    left_is_red = []
    for _ in range(40):
        out = transform(Image.fromarray(array))
        assert out.shape == (3, 16, 16)
        left_is_red.append(bool(out[2, :, 0].mean() > out[0, :, 0].mean()))  # BGR: channel 2 is red
    assert 5 < sum(left_is_red) < 35  # flipped about half of the time


@pytest.fixture(scope="module")
def flat_sop(tmp_path_factory):
    return make_sop(tmp_path_factory.mktemp("sop"), train_classes=4, test_classes=4, images_per_class=2)


@pytest.mark.parametrize("spec", [TORCHVISION_IMAGENET, BNINCEPTION], ids=["rgb", "bgr"])
def test_data_module_delivers_the_spec(flat_sop, spec):
    dm = SOPDataModule(flat_sop, 2, 2, num_workers=0, image_size=16, input_spec=spec, eval_batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.setup()
    images, labels, _ = next(iter(dm.test_dataloader()))
    for image, label in zip(images, labels):
        rgb = np.broadcast_to(np.array(class_color(int(label)), dtype=np.float64), (16, 16, 3))
        tolerance = 4 * spec.scale / 255.0 / min(spec.std)  # JPEG: a few grey levels
        np.testing.assert_allclose(image.numpy(), _reference(rgb, spec), atol=tolerance)


class RecordingBGRBackbone(nn.Module):
    """A tiny backbone declaring the BN-Inception convention; records the first batch it receives."""

    input_spec = BNINCEPTION
    out_features = 3
    received: list[torch.Tensor] = []

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        RecordingBGRBackbone.received.append(x.detach().clone())
        return x.mean(dim=(2, 3)) * self.scale


def _sop_with_one_colour(tmp_path, red: tuple[int, int, int]) -> None:
    top = tmp_path / "Stanford_Online_Products"
    lines = ["image_id class_id super_class_id path"]
    for c in range(1, 5):
        for k in range(2):
            write_jpeg(top / f"chair_final/{c}_{k}.JPG", red, (24, 24))
            lines.append(f"{len(lines)} {c} 1 chair_final/{c}_{k}.JPG")
    (top / "Ebay_train.txt").write_text("\n".join(lines[:5]) + "\n")
    (top / "Ebay_test.txt").write_text("\n".join(lines[:1] + lines[5:]) + "\n")


def _bgr_cli_args(tmp_path) -> list[str]:
    return [
        "--trainer.logger=false",
        "--trainer.enable_checkpointing=false",
        "--trainer.max_steps=1",
        "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false",
        f"--trainer.default_root_dir={tmp_path}",
        "--model.backbone=tests.test_data_transforms.RecordingBGRBackbone",
        "--model.embedding_dim=4",
        "--model.loss=contrastive",
        "--data=lightning_dml.data.SOPDataModule",
        f"--data.init_args.root={tmp_path}",
        "--data.init_args.classes_per_batch=2",
        "--data.init_args.samples_per_class=2",
        "--data.init_args.num_workers=0",
        "--data.init_args.image_size=16",
    ]


#: the BN-Inception convention written out in a config, and a hand-set one that disagrees with it
_BGR_IN_CONFIG = '{"color": "BGR", "scale": 255.0, "mean": [104.0, 117.0, 128.0], "std": [1.0, 1.0, 1.0]}'
_RGB_IN_CONFIG = '{"color": "RGB"}'


@pytest.mark.parametrize("given", [None, _BGR_IN_CONFIG], ids=["input_spec-unset", "input_spec-agrees"])
def test_bgr_backbone_receives_bgr_0_255_through_the_cli(tmp_path, given):
    """The config names only the backbone (or also its convention): the data module produces BGR 0-255 input."""
    from lightning_dml.cli import build_cli

    red = (200, 30, 10)
    _sop_with_one_colour(tmp_path, red)
    args = _bgr_cli_args(tmp_path) + ([] if given is None else [f"--data.init_args.input_spec={given}"])
    RecordingBGRBackbone.received.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = build_cli(args, run=False)
        assert cli.datamodule.input_spec == (None if given is None else BNINCEPTION)
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert cli.datamodule.input_spec == BNINCEPTION  # read from the backbone at set-up
    batch = RecordingBGRBackbone.received[0]
    assert batch.shape == (4, 3, 16, 16)
    expected = torch.tensor([red[2] - 104.0, red[1] - 117.0, red[0] - 128.0])  # B, G, R on the 0-255 scale
    assert torch.allclose(batch.mean(dim=(0, 2, 3)), expected, atol=4.0), batch.mean(dim=(0, 2, 3))


def test_input_spec_set_in_the_config_that_disagrees_with_the_backbone_is_an_error(tmp_path, capsys):
    """A hand-set input_spec is never silently replaced by the backbone's: one message naming both, no traceback."""
    from lightning_dml.cli import build_cli, main

    _sop_with_one_colour(tmp_path, (200, 30, 10))
    args = _bgr_cli_args(tmp_path) + [f"--data.init_args.input_spec={_RGB_IN_CONFIG}"]
    RecordingBGRBackbone.received.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = build_cli(args, run=False)
        assert cli.datamodule.input_spec == TORCHVISION_IMAGENET  # kept as given
        with pytest.raises(InputSpecMismatchError):  # a ValueError
            cli.trainer.fit(cli.model, datamodule=cli.datamodule)
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_:
            main(["fit", *args])
    assert exit_.value.code == 1
    message = capsys.readouterr().err
    assert "lightning-dml: error: SOPDataModule: input_spec InputSpec(color='RGB', scale=1.0" in message
    assert "disagrees with RecordingBGRBackbone's input_spec InputSpec(color='BGR', scale=255.0" in message
    assert "Traceback" not in message
    assert RecordingBGRBackbone.received == []  # no step ran on wrongly converted images


def test_python_fit_reads_the_backbone_spec_and_rebuilds_datasets_set_up_without_it(flat_sop):
    """No CLI: a data module set up alone uses the default (RGB, [0, 1]); fitting it with a BGR backbone adopts
    the backbone's convention and rebuilds the datasets, so no image reaches the network in the wrong one."""
    import pytorch_lightning as pl

    from lightning_dml.module import DMLModule

    dm = SOPDataModule(flat_sop, 2, 2, num_workers=0, image_size=16, eval_batch_size=8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dm.setup()
        assert dm.input_spec is None and dm.spec == TORCHVISION_IMAGENET
        image, label, _ = dm.test_dataset[0]
        rgb = np.broadcast_to(np.array(class_color(int(label)), dtype=np.float64), (16, 16, 3))
        np.testing.assert_allclose(image.numpy(), _reference(rgb, TORCHVISION_IMAGENET), atol=4 / 255 / 0.224)
        RecordingBGRBackbone.received.clear()
        model = DMLModule(RecordingBGRBackbone(), loss="contrastive", embedding_dim=4, clustering=False)
        trainer = pl.Trainer(
            max_steps=1, limit_val_batches=0, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, datamodule=dm)
    assert dm.input_spec == BNINCEPTION
    image, label, _ = dm.test_dataset[0]
    rgb = np.broadcast_to(np.array(class_color(int(label)), dtype=np.float64), (16, 16, 3))
    np.testing.assert_allclose(image.numpy(), _reference(rgb, BNINCEPTION), atol=4.0)
    # the training batch is on the 0-255 scale minus the Caffe means (ImageNet-standardised values stay within 3)
    assert RecordingBGRBackbone.received[0].abs().max() > 10
