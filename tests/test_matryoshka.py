"""MatryoshkaLoss (Kusupati et al., NeurIPS 2022, Eq. 1): the weighted sum over the nested widths of the wrapped loss
on the cut embedding, against the reference losses written from their papers (tests/reference_losses.py), in fp64,
values and gradients. Under DDP: tests/distributed/run_gather_loss.py (the ``matryoshka*`` variants)."""

from __future__ import annotations

import pytest
import torch

from lightning_dml.losses import LOSSES, MatryoshkaLoss, build_loss
from tests import reference_losses as ref

WIDTHS, WEIGHTS = [2, 5, 8], [0.5, 1.0, 2.0]


def _batch(classes: int = 4, per_class: int = 3, dim: int = 8):
    """Clustered fp64 embeddings with norms far from 1 (so that normalising or not matters) and ties of labels."""
    g = torch.Generator().manual_seed(0)
    centres = torch.randn(classes, dim, generator=g, dtype=torch.float64)
    y = torch.arange(classes).repeat_interleave(per_class)
    x = 3.0 * (centres[y] + 0.6 * torch.randn(classes * per_class, dim, generator=g, dtype=torch.float64))
    return x, y


def _value_and_grad(fn, x):
    x = x.clone().requires_grad_(True)
    value = fn(x)
    (grad,) = torch.autograd.grad(value, x)
    return value.detach(), grad


def _check(loss, reference, x, *args):
    got, got_grad = _value_and_grad(lambda z: loss(z, *args), x)
    want, want_grad = _value_and_grad(
        lambda z: sum(c * reference(z[:, :d]) for d, c in zip(WIDTHS, WEIGHTS)), x
    )
    assert torch.allclose(got, want, rtol=1e-10, atol=1e-12), (float(got), float(want))
    assert torch.allclose(got_grad, want_grad, rtol=1e-9, atol=1e-12)
    assert float(got_grad.abs().max()) > 0


def test_weighted_sum_over_widths_equals_reference_losses_fp64():
    x, y = _batch()
    # a normalising loss: each cut L2-normalised (the reference normalises every row of the cut)
    loss = MatryoshkaLoss("triplet", widths=WIDTHS, weights=WEIGHTS)
    _check(loss, lambda z: ref.triplet(z, y), x, y)
    # N-pair does not normalise: the raw cuts (a wrapper normalising the full vector first would differ here)
    xn, yn = _batch(classes=5, per_class=2)
    _check(MatryoshkaLoss(build_loss("npair"), widths=WIDTHS, weights=WEIGHTS), lambda z: ref.npair(z, yn), xn, yn)


def test_label_sets_where_the_wrapped_loss_takes_them():
    x, y = _batch()
    sets = torch.stack([y, torch.where(torch.arange(y.numel()) % 4 == 0, (y + 1) % 4, -1)], dim=1)
    sets[5] = torch.tensor([-1, -1])  # an item without a label
    rows = [{int(v) for v in r if v >= 0} for r in sets]
    same = [[bool(a & b) for b in rows] for a in rows]
    loss = MatryoshkaLoss("contrastive", widths=WIDTHS, weights=WEIGHTS)
    _check(loss, lambda z: ref.contrastive(z, sets, same=same), x, sets)
    assert loss.supports_label_sets
    with pytest.raises(ValueError, match="NPairLoss cannot train on label sets"):
        MatryoshkaLoss("npair", widths=[2, 8])(x, sets)


def test_anatomy_follows_the_wrapped_loss_and_default_widths():
    npair = MatryoshkaLoss("npair")
    assert (npair.normalize, npair.required_sampler, npair.supports_ref) == (False, "npair", False)
    assert MatryoshkaLoss("lifted_structure").gather_mode == "global_batch"
    assert MatryoshkaLoss().gather_mode == "references" and LOSSES["matryoshka"] is MatryoshkaLoss
    assert MatryoshkaLoss().widths_for(64) == [8, 16, 32, 64]
    x, y = _batch()
    default = MatryoshkaLoss("contrastive")
    assert torch.allclose(default(x, y), sum(build_loss("contrastive")(x[:, :d], y) for d in (1, 2, 4, 8)))


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"loss": "cross_batch_memory"}, "cannot wrap CrossBatchMemory: it is neither a pair loss"),
        ({"loss": "matryoshka"}, "cannot wrap itself"),
        ({"widths": [4, 4]}, "strictly increasing"),
        ({"widths": [0, 4]}, "integer >= 1"),
        ({"widths": [2, 4], "weights": [1.0]}, "one value per width"),
        ({"widths": [2, 4], "weights": [1.0, -1.0]}, "finite, >= 0"),
    ],
)
def test_bad_options_one_line(kwargs, needle):
    with pytest.raises(ValueError, match=needle) as err:
        MatryoshkaLoss(**kwargs)
    assert "\n" not in str(err.value)


def test_width_beyond_the_embedding_refused_at_call():
    x, y = _batch()
    with pytest.raises(ValueError, match=r"width 16 exceeds the embedding width D = 8"):
        MatryoshkaLoss(widths=[4, 16])(x, y)
    with pytest.raises(ValueError, match="ref_embeddings have dim 4"):
        MatryoshkaLoss(widths=[2, 4])(x, y, x[:, :4], y)


#: the config snippet of docs/losses/matryoshka.md with a proxy inner loss (each width its own proxies)
PROXY_YAML = """
model:
  loss:
    class_path: lightning_dml.losses.MatryoshkaLoss
    init_args:
      loss:
        class_path: lightning_dml.losses.ProxyAnchorLoss
        init_args:
          alpha: 16.0
      widths: [4, 8, 16]
      weights: [1, 1, 2]
  loss_lr_multiplier: 100.0
  metric_widths: [4, 8]
"""


def test_cli_fit_trains_matryoshka_and_validates_every_width(tmp_path, monkeypatch, capsys):
    """The one CLI fit of the package: MatryoshkaLoss over Proxy-Anchor from a yaml snippet (class path and
    init_args, the inner loss a class path too): one proxy matrix per width, created at fit start with the data
    module's classes, all trained in the optimizer's ``"loss"`` group at ``loss_lr_multiplier``; a checkpoint loads
    back into a fresh module (``loss_sizes``); ``metric_widths``: the logged ``val/w<d>/...`` metrics and the
    printed table's width columns. The parameter-free inner loss from the command line: parsed only."""
    import warnings

    from lightning_dml.checkpoints import read_checkpoint
    from lightning_dml.cli import build_cli
    from lightning_dml.losses import ProxyAnchorLoss
    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule
    from tests.test_cli import FAST, GLYPHS

    monkeypatch.chdir(tmp_path)
    (tmp_path / "loss.yaml").write_text(PROXY_YAML)
    args = ["fit", "--config", str(GLYPHS), *FAST, "--config", "loss.yaml", "--trainer.callbacks=[]",
            "--trainer.limit_train_batches=2", "--trainer.limit_val_batches=2", "--trainer.num_sanity_val_steps=0",
            "--trainer.logger=false"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cli = build_cli(args)
        parsed = build_cli(["--config", str(GLYPHS), *FAST, "--model.loss", "lightning_dml.losses.MatryoshkaLoss",
                            "--model.loss.init_args.loss", "contrastive", "--model.loss.init_args.widths", "[4, 8]"],
                           run=False).model.loss
    assert isinstance(parsed, MatryoshkaLoss) and type(parsed.loss).__name__ == "ContrastiveLoss"
    loss = cli.model.loss
    assert isinstance(loss, MatryoshkaLoss) and (loss.widths, loss.weights) == ([4, 8, 16], [1.0, 1.0, 2.0])
    assert cli.trainer.global_step == 2 and loss.num_classes == cli.datamodule.train_class_ids.numel()
    proxies = [f.proxies for f in loss.losses]
    assert [tuple(p.shape) for p in proxies] == [(loss.num_classes, d) for d in (4, 8, 16)]
    optimizer = cli.trainer.optimizers[0]
    (group,) = [g for g in optimizer.param_groups if g.get("name") == "loss"]
    backbone_lr = [g["lr"] for g in optimizer.param_groups if g.get("name") == "backbone"][0]
    assert [id(p) for p in group["params"]] == [id(p) for p in proxies] and group["lr"] == 100.0 * backbone_lr
    assert all(float(optimizer.state[p]["exp_avg"].abs().max()) > 0 for p in proxies)  # every width trained
    cli.trainer.save_checkpoint(tmp_path / "m.ckpt")
    ckpt = read_checkpoint(tmp_path / "m.ckpt")
    fresh = DMLModule(SmallConvNet(in_channels=1, width=8), embedding_dim=16, loss_sizes=ckpt["hyper_parameters"][
        "loss_sizes"], loss=MatryoshkaLoss(ProxyAnchorLoss(alpha=16.0), widths=[4, 8, 16], weights=[1, 1, 2]))
    fresh.load_state_dict(ckpt["state_dict"])
    for mine, saved in zip(fresh.loss.losses, loss.losses):
        assert torch.equal(mine.proxies, saved.proxies)
    logged = cli.trainer.callback_metrics
    assert {"val/recall@1", "val/w4/recall@1", "val/w8/map@r"} <= set(logged)
    header = [line for line in capsys.readouterr().out.splitlines() if line.split() == ["full", "w4", "w8"]]
    assert header, "the validation table has no width columns"
