"""Backbones and embedding heads: shapes, pooling, multi-level outputs, weights from the local caches.

References are built independently: torchvision / pretrainedmodels models with the same weights, read out with
forward hooks, and torch's own adaptive pooling.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from lightning_dml.models import (
    BACKBONES,
    BNINCEPTION,
    TORCHVISION_IMAGENET,
    BNInception,
    GlobalPool,
    GoogLeNet,
    MultiLevelEmbedding,
    ResNet50,
    ResNet101,
    SmallConvNet,
    build_backbone,
)
from lightning_dml.models.backbones import BNINCEPTION_URL

PRETRAINABLE = {"bninception": BNInception, "googlenet": GoogLeNet, "resnet50": ResNet50, "resnet101": ResNet101}
WEIGHT_FILES = {
    "bninception": "bn_inception-52deb4733.pth",
    "googlenet": "googlenet-1378be20.pth",
    "resnet50": "resnet50-0676ba61.pth",
    "resnet101": "resnet101-63fe2227.pth",
}


@pytest.fixture
def empty_torch_home(tmp_path, monkeypatch):
    """A TORCH_HOME with no cached weights (and torch.hub not pointed elsewhere)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setattr(torch.hub, "_hub_dir", None, raising=False)
    return tmp_path


# ----------------------------------------------------------------------------------------- pooling
@pytest.mark.parametrize("mode", ["avg", "max", "avgmax"])
def test_global_pool_matches_adaptive_pooling(mode):
    x = torch.randn(3, 5, 7, 6)
    avg = F.adaptive_avg_pool2d(x, 1).flatten(1)
    mx = F.adaptive_max_pool2d(x, 1).flatten(1)
    expected = {"avg": avg, "max": mx, "avgmax": avg + mx}[mode]
    torch.testing.assert_close(GlobalPool(mode)(x), expected)


def test_global_pool_rejects_unknown_mode():
    with pytest.raises(ValueError, match="pooling must be"):
        GlobalPool("gem")


# ----------------------------------------------------------------------------------------- registry
def test_registry_names_and_classes():
    assert set(BACKBONES) == {"bninception", "googlenet", "resnet50", "resnet101", "small_convnet"}
    assert isinstance(build_backbone("small_convnet", width=4), SmallConvNet)
    assert isinstance(build_backbone("resnet50", pretrained=False), ResNet50)


def test_unknown_backbone_name_lists_valid_names():
    with pytest.raises(ValueError) as err:
        build_backbone("vgg16")
    for name in BACKBONES:
        assert name in str(err.value)
    assert "vgg16" in str(err.value)


# ----------------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("name", sorted(BACKBONES))
@pytest.mark.parametrize("pooling", ["avg", "avgmax"])
def test_backbone_shapes_levels_and_pooling(name, pooling):
    kwargs = {"width": 8} if name == "small_convnet" else {"pretrained": False}
    backbone = build_backbone(name, pooling=pooling, **kwargs).eval()
    x = torch.randn(2, backbone.input_spec.channels, 64, 64)
    with torch.no_grad():
        maps = backbone.forward_maps(x)
        levels = backbone.forward_levels(x)
        out = backbone(x)
    assert len(maps) == len(levels) == len(backbone.level_features) == len(backbone.level_names) == 3
    for m, lv, width in zip(maps, levels, backbone.level_features):
        assert m.shape[:2] == (2, width) and lv.shape == (2, width)
        torch.testing.assert_close(lv, GlobalPool(pooling)(m))
    assert out.shape == (2, backbone.out_features)
    assert backbone.level_features[-1] == backbone.out_features
    torch.testing.assert_close(out, levels[-1])


def test_input_specs():
    assert BNInception(pretrained=False).input_spec == BNINCEPTION
    for cls in (ResNet50, ResNet101, GoogLeNet):
        assert cls(pretrained=False).input_spec == TORCHVISION_IMAGENET
    assert SmallConvNet(in_channels=1).input_spec.color == "L"
    assert SmallConvNet(in_channels=3).input_spec.color == "RGB"


def test_models_package_does_not_import_the_data_package():
    """A backbone declares its input convention (lightning_dml.models.input_spec); the data package reads it, never
    the other way round. A fresh interpreter importing lightning_dml.models loads no lightning_dml.data module."""
    import subprocess
    import sys

    code = (
        "import sys, lightning_dml.models, lightning_dml.models.input_spec; "
        "print(sorted(m for m in sys.modules if m.startswith('lightning_dml.data')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    assert out.stdout.strip() == "[]", out.stdout
    # the data package re-exports the same objects for existing imports
    from lightning_dml import data, models

    assert data.InputSpec is models.InputSpec and data.BNINCEPTION is models.BNINCEPTION


# ----------------------------------------------------------------------------------------- weights
@pytest.mark.parametrize("name", sorted(PRETRAINABLE))
def test_pretrained_without_cached_weights_names_the_file(name, empty_torch_home):
    with pytest.raises(FileNotFoundError) as err:
        PRETRAINABLE[name](pretrained=True)
    message = str(err.value)
    assert WEIGHT_FILES[name] in message
    assert str(empty_torch_home / "hub" / "checkpoints") in message
    assert "weights_path" in message and "pretrained: false" in message


def test_missing_explicit_weights_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="nowhere.pth"):
        ResNet50(pretrained=True, weights_path=str(tmp_path / "nowhere.pth"))


def _hook_outputs(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    store: dict[str, torch.Tensor] = {}
    modules = dict(model.named_modules())
    for n in names:
        modules[n].register_forward_hook(lambda m, i, o, n=n: store.__setitem__(n, o))
    return store


def test_resnet50_loads_torchvision_cache_and_matches_torchvision(empty_torch_home):
    reference = torchvision.models.resnet50(weights=None).eval()
    cache = empty_torch_home / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(reference.state_dict(), cache / WEIGHT_FILES["resnet50"])
    ours = ResNet50(pretrained=True).eval()
    store = _hook_outputs(reference, ["layer2", "layer3", "avgpool"])
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        reference(x)
        levels = ours.forward_levels(x)
        out = ours(x)
    torch.testing.assert_close(out, store["avgpool"].flatten(1))
    torch.testing.assert_close(levels[0], store["layer2"].mean(dim=(2, 3)))
    torch.testing.assert_close(levels[1], store["layer3"].mean(dim=(2, 3)))


def test_googlenet_weights_path_matches_torchvision_pretrained_convention(tmp_path):
    reference = torchvision.models.GoogLeNet(aux_logits=True, transform_input=True, init_weights=True)
    path = tmp_path / "googlenet.pth"
    torch.save(reference.state_dict(), path)
    reference.eval()
    reference.fc = nn.Identity()  # eval forward: pooled inception-5b features, dropout off
    store = _hook_outputs(reference, ["inception3b", "inception4e"])
    ours = GoogLeNet(pretrained=True, weights_path=str(path)).eval()
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        expected = reference(x)
        levels = ours.forward_levels(x)
    torch.testing.assert_close(levels[2], expected)
    torch.testing.assert_close(levels[0], store["inception3b"].mean(dim=(2, 3)))
    torch.testing.assert_close(levels[1], store["inception4e"].mean(dim=(2, 3)))


@pytest.mark.parametrize("bn_as_row", [False, True])
def test_bninception_loads_cache_and_its_levels_match_pretrainedmodels(empty_torch_home, bn_as_row):
    from pretrainedmodels.models.bninception import BNInception as Reference

    reference = Reference(num_classes=1000).eval()
    state = reference.state_dict()
    if bn_as_row:  # other ports of the Caffe model store BN vectors as [1, C]
        state = {k: v.unsqueeze(0) if "_bn." in k and v.ndim == 1 else v for k, v in state.items()}
    cache = empty_torch_home / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    torch.save(state, cache / os.path.basename(BNINCEPTION_URL))
    ours = BNInception(pretrained=True).eval()
    # the concatenated inception-3c / 4e outputs, rebuilt from their branches
    parts = {
        "3c": ["inception_3c_relu_3x3", "inception_3c_relu_double_3x3_2", "inception_3c_pool"],
        "4e": ["inception_4e_relu_3x3", "inception_4e_relu_double_3x3_2", "inception_4e_pool"],
    }
    store = _hook_outputs(reference, parts["3c"] + parts["4e"])
    x = torch.randn(2, 3, 224, 224) * 50
    with torch.no_grad():
        top = reference.features(x)
        expected_3c = torch.cat([store[n] for n in parts["3c"]], 1)
        expected_4e = torch.cat([store[n] for n in parts["4e"]], 1)
        # pretrainedmodels' own classifier input: AvgPool2d(7) of the 7x7 inception-5b map
        expected_top = reference.global_pool(top).flatten(1)
        levels = ours.forward_levels(x)
        out = ours(x)
    assert expected_3c.shape[1] == 576 and expected_4e.shape[1] == 1056
    torch.testing.assert_close(levels[0], expected_3c.mean(dim=(2, 3)))
    torch.testing.assert_close(levels[1], expected_4e.mean(dim=(2, 3)))
    torch.testing.assert_close(levels[2], expected_top)
    torch.testing.assert_close(out, expected_top)


def test_bninception_hooks_do_not_keep_tensors():
    backbone = BNInception(pretrained=False).eval()
    with torch.no_grad():
        backbone(torch.randn(1, 3, 64, 64))
        backbone.forward_levels(torch.randn(1, 3, 64, 64))
    assert backbone._captured is None


# ----------------------------------------------------------------------------------------- heads
@pytest.mark.parametrize("normalize_levels", [False, True])
def test_multi_level_embedding_concatenates_per_level_linear_maps(normalize_levels):
    head = MultiLevelEmbedding((6, 10, 4), embedding_dim=5, normalize_levels=normalize_levels)
    feats = [torch.randn(3, c) for c in (6, 10, 4)]
    levels = head.forward_levels(feats)
    expected = [f @ h.fc.weight.T + h.fc.bias for f, h in zip(feats, head.levels)]
    if normalize_levels:
        expected = [e / e.norm(dim=1, keepdim=True) for e in expected]
    for got, want in zip(levels, expected):
        torch.testing.assert_close(got, want)
    fused = head(feats)
    assert fused.shape == (3, 15) and head.embedding_dim == 15
    torch.testing.assert_close(fused, torch.cat(expected, 1))


def test_multi_level_embedding_checks_level_count():
    head = MultiLevelEmbedding((6, 10), embedding_dim=5)
    with pytest.raises(ValueError, match="expected 2 levels"):
        head([torch.randn(2, 6)])
