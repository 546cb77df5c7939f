"""Parameter-efficient fine-tuning of timm backbones (issue 30 s.3, lightning_dml/models/adapters.py): trainable
parameter counts per adapter against counts derived from the architecture, VPT-deep against its equation written
out, the LoRA merge of the export, adapter-only checkpoints, the refusals, and one Glyphs fit through the CLI."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import yaml
from torch import nn

# LoRA needs peft, which pulls transformers (imported by torchmetrics in every process once installed) and rich
# (Lightning's default progress bar then changes): `make test` keeps them out of the venv and runs this file again
# with them on PYTHONPATH (the Makefile's PEFT_SITE), where LIGHTNING_DML_PEFT_TESTS=1 makes peft required
if os.environ.get("LIGHTNING_DML_PEFT_TESTS") == "1":
    import peft  # noqa: F401  - required: a missing peft fails this run
else:
    pytest.importorskip("peft", reason="the LoRA tests run in make test's second pass, with peft on PYTHONPATH")

from lightning_dml.checkpoints import CheckpointMismatchError, read_checkpoint
from lightning_dml.models.adapters import AdapterError

TINY = "vit_tiny_patch16_224"
#: a 2-block ViT of width 24 (MLP 96) at 32 px: 4 patches + the class token
WIDTH, DEPTH, HEADS, SIDE = 24, 2, 2, 32
TINY_KWARGS = {"img_size": SIDE, "model_kwargs": {"depth": DEPTH, "embed_dim": WIDTH, "num_heads": HEADS}}


def _backbone(adapter: str | None = None, **kwargs):
    from lightning_dml.models import TimmBackbone

    return TimmBackbone(TINY, **{"pretrained": False, **TINY_KWARGS, "adapter": adapter, **kwargs})


def _module(backbone, **kwargs):
    from lightning_dml.module import DMLModule

    return DMLModule(backbone, loss="multi_similarity", embedding_dim=8, clustering=False, **kwargs)


@pytest.fixture(scope="module")
def weights_file(tmp_path_factory) -> Path:
    """The tiny ViT's "pretrained" weights, loaded through timm's ``weights_path`` (pretrained=True)."""
    import timm

    torch.manual_seed(3)
    model = timm.create_model(TINY, pretrained=False, num_classes=0, img_size=SIDE, depth=DEPTH, embed_dim=WIDTH,
                              num_heads=HEADS)
    path = tmp_path_factory.mktemp("weights") / "tiny.pth"
    torch.save(model.state_dict(), path)
    return path


def _images(n: int = 4, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, 3, SIDE, SIDE, generator=torch.Generator().manual_seed(seed))


def _randomise(module: nn.Module, names: tuple[str, ...] = ("lora_B", "vpt")) -> None:
    """LoRA's B starts at zero (the adapter is then the identity): give the adapter weights values."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if any(n in name for n in names):
                p.normal_(0, 0.5)


def _trainable(module: nn.Module) -> dict[str, int]:
    return {name: p.numel() for name, p in module.named_parameters() if p.requires_grad}


# ------------------------------------------------------------------------------------------------ counts
def test_trainable_parameter_counts_per_adapter():
    """Each option's trainable parameters, counted from the architecture: C = 24, MLP 4C, depth 2."""
    C, H, D = WIDTH, 4 * WIDTH, DEPTH
    linears = [(C, 3 * C), (C, C), (C, H), (H, C)]  # qkv, proj, fc1, fc2 as (in, out)
    r, tokens = 4, 3
    want = {
        "lora": D * sum(r * (i + o) for i, o in linears),  # A [r, in] + B [out, r] per adapted linear
        # BitFit: norm1, qkv, proj, norm2, fc1, fc2 biases per block, patch embedding and final norm biases
        "bias": D * (C + 3 * C + C + C + H + C) + C + C,
        "norm": D * 2 * (2 * C) + 2 * C,  # norm1, norm2 (weight + bias) per block, the final norm
        "vpt": D * tokens * C,  # VPT-deep: n prompts of width C per block
    }
    for adapter, count in want.items():
        backbone = _backbone(adapter, lora_r=r, vpt_tokens=tokens)
        trainable = _trainable(backbone)
        assert sum(trainable.values()) == count, (adapter, trainable)
        if adapter == "lora":
            assert all(".lora_A." in n or ".lora_B." in n for n in trainable)
            assert len(trainable) == 2 * len(linears) * D
        # the optimizer: the adapter's parameters and the head, with and without layer-wise lr decay
        for decay in (None, 0.75):
            module = _module(backbone, layer_decay=decay)
            grouped = [p for g in module.parameter_groups() for p in g["params"]]
            assert len({id(p) for p in grouped}) == len(grouped)
            assert {id(p) for p in grouped} == {id(p) for p in module.parameters() if p.requires_grad}
            assert sum(p.numel() for p in grouped) == count + 8 * C + 8  # + head (C -> 8, with bias)
    full = sum(p.numel() for p in _backbone().parameters())
    assert full > 10 * want["lora"]  # the point of it


def test_released_backbone_keeps_the_adapters_weights_frozen():
    """``freeze_backbone_epochs``: releasing the backbone gives back the adapter's trainable set, not all weights."""
    module = _module(_backbone("lora", lora_r=2), freeze_backbone_epochs=1)
    before = _trainable(module.backbone)
    module.set_backbone_frozen(True)
    assert not _trainable(module.backbone)
    module.set_backbone_frozen(False)
    assert _trainable(module.backbone) == before


# ------------------------------------------------------------------------------------------------ VPT
def test_vpt_deep_is_the_papers_equation():
    """Jia et al. 2022 Sec. 3.2: [x_i, _, E_i] = L_i([x_{i-1}, P_{i-1}, E_{i-1}]), written out with the blocks of a
    plain copy of the same weights (3 blocks, average pooling over the patch tokens, so prompt outputs left in the
    sequence would show); forward and the three levels of forward_levels (each block's output through the final
    norm) against it."""
    three = {"pooling": "avg", "model_kwargs": {"depth": 3, "embed_dim": WIDTH, "num_heads": HEADS}}
    prompted = _backbone("vpt", vpt_tokens=3, **three).eval()
    _randomise(prompted)
    plain = _backbone(**three).eval()
    plain.load_state_dict({k: v for k, v in prompted.state_dict().items() if not k.startswith("vpt.")})
    images = _images()
    model = plain.model
    with torch.no_grad():
        patches = model.patch_embed(images)
        x = torch.cat([model.cls_token.expand(len(images), -1, -1), patches], dim=1) + model.pos_embed
        want = []
        for i, block in enumerate(model.blocks):
            prompts = prompted.vpt.prompts[i].expand(len(images), -1, -1)
            out = block(torch.cat([x[:, :1], prompts, x[:, 1:]], dim=1))
            x = torch.cat([out[:, :1], out[:, 1 + prompts.shape[1]:]], dim=1)  # the prompts' outputs dropped
            want.append(model.norm(x)[:, 1:].mean(dim=1))
        torch.testing.assert_close(prompted(images), want[-1], rtol=1e-5, atol=1e-6)
        for got, expected in zip(prompted.forward_levels(images), want, strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
        assert not torch.allclose(plain(images), want[-1], atol=1e-3)  # the prompts change the features


# ------------------------------------------------------------------------------------------------ export
@pytest.mark.parametrize("adapter", ["lora", "vpt"])
def test_export_of_an_adapter_model(adapter, tmp_path):
    """LoRA is merged (W0 + alpha/r B A): the safe export holds plain linears, needs no peft, and embeds as the
    unmerged module within 1e-5 (float32 rounding of the merge); VPT keeps its prompts and is exact."""
    from lightning_dml.export import export_embedding_model, load_safe_embedding_model

    module = _module(_backbone(adapter, lora_r=4, lora_alpha=8.0)).eval()
    _randomise(module)
    images = _images()
    with torch.no_grad():
        want = module(images)
    paths = export_embedding_model(module, tmp_path, images, ["safetensors"])
    loaded = load_safe_embedding_model(paths["safetensors"])
    keys = list(loaded.state_dict())
    with torch.no_grad():
        got = loaded(images)
    if adapter == "lora":
        assert not [k for k in keys if "lora" in k or "base_layer" in k]
        assert type(loaded.backbone.model.blocks[0].attn.qkv) is nn.Linear
        assert loaded.backbone.init_args["adapter"] is None
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(got, _module(_backbone()).eval().head(loaded.backbone(images)), atol=1e-3)
        assert any(".lora_A." in k for k in module.state_dict())  # the module itself keeps its adapter
    else:
        assert "backbone.vpt.prompts" in keys
        torch.testing.assert_close(got, want, rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------ checkpoints
def test_adapter_only_checkpoint_round_trip(weights_file, tmp_path):
    """The checkpoint holds the adapter and the head alone; loaded into a freshly built model (pretrained weights
    from the file, a new random adapter) it gives the saved model's embeddings exactly; built on other frozen
    weights it is refused in one message."""
    from lightning_dml.module import DMLModule

    def build(pretrained: bool = True) -> DMLModule:
        return _module(_backbone("lora", lora_r=4, pretrained=pretrained, weights_path=str(weights_file)
                                 if pretrained else None))

    saved = build().eval()
    _randomise(saved)
    checkpoint = {"state_dict": saved.state_dict(), "pytorch-lightning_version": "2.6.0"}
    saved.on_save_checkpoint(checkpoint)
    backbone_keys = [k for k in checkpoint["state_dict"] if k.startswith("backbone.")]
    assert backbone_keys and all(".lora_A." in k or ".lora_B." in k for k in backbone_keys)
    assert sum(checkpoint["state_dict"][k].numel() for k in backbone_keys) == sum(_trainable(saved.backbone).values())
    torch.save(checkpoint, tmp_path / "adapter.ckpt")
    full = tmp_path / "full.ckpt"
    torch.save({"state_dict": saved.state_dict()}, full)
    assert (tmp_path / "adapter.ckpt").stat().st_size < full.stat().st_size / 3

    loaded = build().eval()
    state = read_checkpoint(tmp_path / "adapter.ckpt", what="--ckpt_path")
    loaded.on_load_checkpoint(state)
    loaded.load_state_dict(state["state_dict"])
    images = _images()
    with torch.no_grad():
        torch.testing.assert_close(loaded(images), saved(images), rtol=0, atol=0)

    other = build(pretrained=False)  # random frozen weights: not what the adapter was trained on
    with pytest.raises(CheckpointMismatchError, match="trained on other frozen weights of vit_tiny_patch16_224"):
        other.on_load_checkpoint(read_checkpoint(tmp_path / "adapter.ckpt", what="--ckpt_path"))


# ------------------------------------------------------------------------------------------------ refusals
def test_adapters_a_backbone_cannot_take_are_refused_naming_it():
    from lightning_dml.models import TimmBackbone

    with pytest.raises(AdapterError, match=r"'vpt' .*needs a timm VisionTransformer.*backbone resnet10t \(ResNet\)"):
        TimmBackbone("resnet10t", pretrained=False, adapter="vpt")
    with pytest.raises(AdapterError, match=r"'lora' needs nn.Linear layers named attn.qkv.*backbone resnet10t"):
        TimmBackbone("resnet10t", pretrained=False, adapter="lora")
    with pytest.raises(AdapterError, match=r"named blocks.9.attn.qkv .*has none"):
        _backbone("lora", lora_targets=["blocks.9.attn.qkv"])
    with pytest.raises(AdapterError, match="unknown adapter 'prefix'; adapters: lora, bias, norm, vpt"):
        _backbone("prefix")
    with pytest.raises(AdapterError, match="lora_r >= 1"):
        _backbone("lora", lora_r=0)
    with pytest.raises(AdapterError, match="vpt_tokens must be >= 1"):
        _backbone("vpt", vpt_tokens=0)
    norm = TimmBackbone("resnet10t", pretrained=False, adapter="norm")  # a CNN's BatchNorm layers: allowed
    assert all(isinstance(norm.get_submodule(n.rsplit(".", 1)[0]), nn.BatchNorm2d) for n in _trainable(norm))


# ------------------------------------------------------------------------------------------------ CLI
def test_glyphs_fit_with_lora_through_the_cli_then_export(weights_file, tmp_path, monkeypatch):
    """``lightning-dml fit`` with ``adapter: lora`` on a tiny ViT (Glyphs, 32 px RGB, 4 steps, layer-wise lr decay):
    only LoRA and the head change, the checkpoint holds them alone, ``python -m lightning_dml.export`` of it (LoRA
    merged) embeds exactly as ``load_run_model``'s module (merged too: what ``index build`` embeds with), and
    within 1e-5 of the fit's unmerged model."""
    from lightning_dml.cli import build_cli
    from lightning_dml.export import load_embedding_model
    from lightning_dml.export import main as export_main
    from lightning_dml.run_model import load_run_model

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dml"])
    config = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "max_steps": 4, "limit_val_batches": 0, "logger": False,
                    "enable_progress_bar": False, "enable_model_summary": False,
                    "default_root_dir": str(tmp_path / "run")},
        "model": {
            "backbone": {"class_path": "lightning_dml.models.TimmBackbone", "init_args": {
                "model_name": TINY, "pretrained": True, "weights_path": str(weights_file), "img_size": SIDE,
                "model_kwargs": {"depth": DEPTH, "embed_dim": WIDTH, "num_heads": HEADS},
                "adapter": "lora", "lora_r": 4, "lora_alpha": 8.0}},
            "loss": "multi_similarity", "embedding_dim": 8, "clustering": False, "layer_decay": 0.75,
            "optimizer": {"class_path": "torch.optim.Adam", "init_args": {"lr": 0.01}},
        },
        "data": {"class_path": "lightning_dml.data.GlyphsDataModule", "init_args": {
            "image_size": SIDE, "classes_per_batch": 4, "samples_per_class": 2, "num_workers": 0}},
        "validate_at_end": False,
    }
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(config))
    base = torch.load(weights_file, weights_only=True)
    cli = build_cli(["fit", "--config", str(path)])
    model, trainer = cli.model, cli.trainer
    assert trainer.global_step == 4
    frozen = {n.replace(".base_layer", ""): p for n, p in model.backbone.model.named_parameters()
              if not p.requires_grad}
    assert sorted(frozen) == sorted(base)
    assert all(torch.equal(p, base[n]) for n, p in frozen.items())  # the frozen weights are the file's, unchanged
    assert any(p.abs().sum() > 0 for n, p in model.named_parameters() if "lora_B" in n)  # LoRA trained
    optimized = {id(p) for g in trainer.optimizers[0].param_groups for p in g["params"]}
    assert optimized == {id(p) for p in model.parameters() if p.requires_grad}
    assert sorted({g.get("lr_scale") for g in trainer.optimizers[0].param_groups} - {None}) == \
        pytest.approx([0.75, 1.0])  # LoRA of block 0 (layer 1 of 0..2) and block 1; the stem (0.75**2) has none

    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    saved = read_checkpoint(checkpoint, what="last.ckpt")
    backbone_keys = [k for k in saved["state_dict"] if k.startswith("backbone.")]
    assert backbone_keys and all(".lora_A." in k or ".lora_B." in k for k in backbone_keys)
    assert saved["lightning_dml"]["adapter"]["adapter"] == "lora"

    from lightning_dml.models import TimmBackbone
    from lightning_dml.module import DMLModule

    # Lightning's own loading (on_load_checkpoint, then a strict load_state_dict): on the file's frozen weights
    backbone = TimmBackbone(**config["model"]["backbone"]["init_args"])
    restored = DMLModule.load_from_checkpoint(checkpoint, backbone=backbone, loss="multi_similarity",
                                              weights_only=True).eval()
    probe = _images(3)
    with torch.no_grad():
        torch.testing.assert_close(restored(probe), model.eval()(probe), rtol=0, atol=0)

    export_main(["--config", str(path), "--ckpt_path", str(checkpoint), "--output", str(tmp_path / "out")])
    exported = load_embedding_model(tmp_path / "out")
    reloaded, datamodule, _ = load_run_model(path, checkpoint)
    datamodule.setup("test")
    images = next(iter(datamodule.test_dataloader()))[0][:6]
    with torch.no_grad():
        want = reloaded(images)
        torch.testing.assert_close(exported(images), want, rtol=0, atol=0)  # both merged: what an index embeds
        torch.testing.assert_close(model.eval()(images), want, rtol=1e-5, atol=1e-5)  # the fit's unmerged model
    assert not any("lora" in name for name in reloaded.state_dict())


def test_cli_refuses_vpt_on_a_cnn_in_one_line(tmp_path, monkeypatch, capsys):
    from lightning_dml.cli import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["lightning-dml"])
    args = ["fit", "--model.backbone", "lightning_dml.models.TimmBackbone",
            "--model.backbone.init_args.model_name", "resnet10t", "--model.backbone.init_args.pretrained", "false",
            "--model.backbone.init_args.adapter", "vpt", "--data", "lightning_dml.data.GlyphsDataModule",
            "--trainer.logger", "false"]
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "lightning-dml: error: adapter 'vpt' (visual prompt tuning) needs a timm VisionTransformer" in err
    assert "backbone resnet10t (ResNet) is not one" in err and "Traceback" not in err


# ------------------------------------------------------------------------------------------------ configs
@pytest.mark.parametrize("dataset", ["cub200", "cars196", "sop", "inshop"])
def test_lora_config_is_the_vit_recipe_with_lora(dataset):
    """configs/<benchmark>/vits16_dino_lora.yaml: the ViT-S/16 DINO triplet recipe, with LoRA and lr 1e-4 only."""
    root = Path(__file__).resolve().parents[1] / "configs" / dataset
    lora = yaml.safe_load((root / "vits16_dino_lora.yaml").read_text())
    recipe = yaml.safe_load((root / "vit_small_dino_triplet.yaml").read_text())
    added = {"adapter": "lora", "lora_r": 8, "lora_alpha": 8.0, "lora_dropout": 0.0,
             "lora_targets": ["attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"]}
    recipe["model"]["backbone"]["init_args"].update(added)
    recipe["model"]["optimizer"]["init_args"]["lr"] = 1e-4
    assert lora == recipe

