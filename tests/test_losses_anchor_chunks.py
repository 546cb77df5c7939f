"""``anchor_chunk_size``: the pair losses scored one block of anchors at a time (lightning_dml/losses/chunking.py)
give the unchunked value and gradients.

* fp64: every supporting loss and option, both code paths (closed form / autograd), random and trained-like
  clustered batches, blocks of 7 anchors (uneven last block; blocks of 1 for MS and SupCon), with and without
  reference items: value and
  gradients (embeddings and references) within ``1e-12`` relative (measured: below ``2e-15``);
* label sets, with reference items of another width;
* fp32: within ``5e-6`` relative of the unchunked fp32 loss at ``B = 256`` (measured: at most ``6.5e-7`` at
  ``B = 512``; the blocks only change the order of the row and batch sums);
* the graph kept for the backward is the gallery, not the ``B x N`` matrices (saved-tensor hooks);
* controls: per-block normalisers (a naive chunking) do NOT give the loss, so the comparisons can fail;
* lifted structure ``original`` / ``gpw``: every item's ``a_j`` and ``dL/da_j`` first (a control drops the chain-rule
  term and must fail);
* tuplet margin (``negatives="all"``): its variance means are batch-wide with a gradient, computed over all blocks
  first; the chunked loss does not equal the loss with the means detached (the chain-rule term is tested);
* bad values and losses whose terms couple anchors are rejected with a message naming the loss;
* under DDP (2 gloo processes, ``gather_distributed``'s reference path): tests/distributed/run_anchor_chunks_ddp.py.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lightning_dml.losses import LOSSES
from tests.test_losses_trained_like import trained_like_batch

VARIANTS = [
    ("multi_similarity", {}),
    ("multi_similarity", {"mining": False}),
    ("multi_similarity", {"weighting": False}),
    ("multi_similarity", {"plus_one": False, "on_empty": "skip"}),
    ("contrastive", {}),
    ("contrastive", {"reduction": "mean", "pos_margin": 0.3}),
    ("contrastive", {"reduction": "sum", "squared": True, "squared_hinge": True}),
    ("triplet", {}),
    ("triplet", {"mining": "batch_hard"}),
    ("triplet", {"reduction": "mean", "squared": True}),
    ("triplet", {"reduction": "sum"}),
    ("supcon", {}),
    ("ntxent", {}),
    ("circle", {}),
    ("nca", {}),
    ("nca", {"objective": "expected"}),
    ("smooth_ap", {"temperature": 0.1}),
    ("fastap", {}),
    ("lifted_structure", {"variant": "generalized"}),
    ("lifted_structure", {"variant": "star"}),
    ("tuplet_margin", {"negatives": "all"}),
    ("tuplet_margin", {"negatives": "all", "scale": 8.0, "variance_weight": 20.0}),
    ("tuplet_margin", {"negatives": "all", "scale": 8.0, "variance_weight": 20.0, "detach_mean": True}),
]
IDS = [f"{name}-{kw}" for name, kw in VARIANTS]
B, M, DIM = 24, 7, 16


def _batch(kind: str, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    if kind == "clustered":  # trained-like: tight classes, negatives at the margins (mining and hinges active)
        return trained_like_batch(seed, 0.8, 0.55, classes=6, per_class=4, dim=DIM)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, DIM, generator=g, dtype=torch.float64), torch.randint(0, 6, (B,), generator=g)


def _loss_and_grads(name, kwargs, chunk, closed_form, x, y, ref=None, ref_y=None):
    loss = LOSSES[name](**kwargs, anchor_chunk_size=chunk)
    loss.closed_form = closed_form
    inputs = [x.clone().requires_grad_(True)] + ([ref.clone().requires_grad_(True)] if ref is not None else [])
    value = loss(inputs[0], y, inputs[1] if ref is not None else None, ref_y)
    return value.detach(), torch.autograd.grad(value, inputs)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))


def _assert_equal(got, want, tol):
    (v1, g1), (v0, g0) = got, want
    assert abs(float(v1 - v0)) <= tol * max(abs(float(v0)), 1e-300), (float(v1), float(v0))
    assert float(v0) != 0.0  # the batches activate every loss
    for a, b in zip(g1, g0):
        assert float(b.abs().max()) > 0 and _rel(a, b) <= tol, _rel(a, b)


@pytest.mark.parametrize("closed_form", [True, False], ids=["closed_form", "autograd"])
@pytest.mark.parametrize("kind", ["random", "clustered"])
@pytest.mark.parametrize("name, kwargs", VARIANTS, ids=IDS)
def test_chunked_equals_unchunked_fp64(name, kwargs, kind, closed_form):
    if name == "tuplet_margin" and not closed_form:
        pytest.skip("tuplet margin has one (autograd) path: the closed_form case runs it")
    x, y = _batch(kind)
    xr, yr = _batch(kind, seed=1)
    ref, ref_y = xr[:M], yr[:M]
    want = _loss_and_grads(name, kwargs, None, closed_form, x, y)
    want_ref = _loss_and_grads(name, kwargs, None, closed_form, x, y, ref, ref_y)
    for chunk in (1, 7) if name in ("multi_similarity", "supcon") else (7,):
        _assert_equal(_loss_and_grads(name, kwargs, chunk, closed_form, x, y), want, 1e-12)
        _assert_equal(_loss_and_grads(name, kwargs, chunk, closed_form, x, y, ref, ref_y), want_ref, 1e-12)


@pytest.mark.parametrize("name, kwargs", [v for v in VARIANTS if LOSSES[v[0]].supports_label_sets],
                         ids=[i for i, v in zip(IDS, VARIANTS) if LOSSES[v[0]].supports_label_sets])
def test_chunked_equals_unchunked_with_label_sets(name, kwargs):
    x, y = _batch("clustered")
    index = torch.arange(B)
    sets = torch.stack([y, torch.where(index % 3 == 0, (y + 1) % 6, -1)], dim=1)
    sets[4] = -1  # an item without labels
    sets[1::4] = sets[1::4].flip(1)  # padding first
    xr, yr = _batch("clustered", seed=1)
    ref, ref_sets = xr[:M], torch.stack([yr[:M], (yr[:M] + 2) % 6, torch.full((M,), -1)], dim=1)  # width 3
    for closed_form in (True, False):
        want = _loss_and_grads(name, kwargs, None, closed_form, x, sets, ref, ref_sets)
        _assert_equal(_loss_and_grads(name, kwargs, 5, closed_form, x, sets, ref, ref_sets), want, 1e-12)


@pytest.mark.parametrize("name, kwargs", [VARIANTS[i] for i in (0, 4, 7, 11, 16, 21)],
                         ids=[IDS[i] for i in (0, 4, 7, 11, 16, 21)])
def test_chunked_fp32_within_stated_bound(name, kwargs):
    g = torch.Generator().manual_seed(3)
    y = torch.arange(256) % 32
    centres = torch.nn.functional.normalize(torch.randn(32, 32, generator=g), dim=1)
    x = centres[y] + 0.3 * torch.randn(256, 32, generator=g)
    want = _loss_and_grads(name, kwargs, None, True, x, y)
    got = _loss_and_grads(name, kwargs, 32, True, x, y)
    assert got[0].dtype == torch.float32
    _assert_equal(got, want, 5e-6)


def test_tuplet_margin_chunks_carry_the_gradient_through_the_batch_means():
    """Tuplet margin's variance means ``mu`` (TML Eqs. 15-16) are batch-wide with a gradient: the chunked loss
    equals the unchunked one (above) and NOT the loss with ``mu`` detached, so the chain-rule term through ``mu``
    that each block adds is what the comparison checks; blocks of 1 and an uneven last block."""
    x, y = _batch("clustered")
    kw = {"negatives": "all", "scale": 8.0, "variance_weight": 20.0}
    want = _loss_and_grads("tuplet_margin", kw, None, True, x, y)
    detached = _loss_and_grads("tuplet_margin", {**kw, "detach_mean": True}, None, True, x, y)
    assert _rel(detached[1][0], want[1][0]) > 1e-3  # the gradient through mu matters in this batch
    for chunk in (1, 5):
        _assert_equal(_loss_and_grads("tuplet_margin", kw, chunk, True, x, y), want, 1e-12)


@pytest.mark.parametrize("variant", ["original", "gpw"])
def test_lifted_structure_pair_variants_chunked_equal_unchunked(variant):
    """Lifted structure ``original`` / ``gpw`` (no reference items): pair ``(i, j)`` holds ``a_j`` of item ``j``'s
    negatives; chunked, every ``a`` and ``dL/da`` come first and each block adds the chain-rule term through its own
    rows' ``a``. fp64 to 1e-12 (blocks of 1 and 7, random and clustered batches, label sets), fp32 within 5e-6
    (measured at most 2.7e-7); the same blocks with ``a`` treated as a constant (no chain-rule term) do NOT give
    the gradient."""
    for kind in ("random", "clustered"):
        x, y = _batch(kind)
        want = _loss_and_grads("lifted_structure", {"variant": variant}, None, True, x, y)
        for chunk in (1, 7):
            _assert_equal(_loss_and_grads("lifted_structure", {"variant": variant}, chunk, True, x, y), want, 1e-12)
    loss = LOSSES["lifted_structure"](variant=variant, anchor_chunk_size=7)
    item_terms = loss._item_terms
    loss._item_terms = lambda *args: (*item_terms(*args)[:2], torch.zeros(B, dtype=x.dtype))  # control: no dL/da
    xg = x.clone().requires_grad_(True)
    loss(xg, y).backward()
    assert _rel(xg.grad, want[1][0]) > 1e-3
    index = torch.arange(B)
    sets = torch.stack([y, torch.where(index % 3 == 0, (y + 1) % 6, -1)], dim=1)
    sets[4] = -1
    sets[1::4] = sets[1::4].flip(1)
    want = _loss_and_grads("lifted_structure", {"variant": variant}, None, True, x, sets)
    _assert_equal(_loss_and_grads("lifted_structure", {"variant": variant}, 5, True, x, sets), want, 1e-12)
    g = torch.Generator().manual_seed(3)  # fp32 at B = 256: within the bound of the other losses (5e-6)
    y = torch.arange(256) % 32
    centres = torch.nn.functional.normalize(torch.randn(32, 32, generator=g), dim=1)
    x = centres[y] + 0.3 * torch.randn(256, 32, generator=g)
    want = _loss_and_grads("lifted_structure", {"variant": variant}, None, True, x, y)
    _assert_equal(_loss_and_grads("lifted_structure", {"variant": variant}, 32, True, x, y), want, 5e-6)


def test_graph_keeps_the_gallery_not_the_pair_matrices():
    """Saved for the backward while the loss's graph exists: the unchunked MS loss holds ``B x N`` weights, the
    chunked one only its input gallery (each block is recomputed in the backward)."""
    x, y = torch.randn(64, 8, dtype=torch.float64), torch.arange(64) % 8

    def saved_numel(chunk):
        sizes = []

        def pack(t):
            sizes.append(t.numel())
            return t

        xg = x.clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            value = LOSSES["multi_similarity"](anchor_chunk_size=chunk)(xg, y)
        value.backward()
        assert xg.grad is not None and float(xg.grad.abs().max()) > 0
        return max(sizes)

    assert saved_numel(None) >= 64 * 64
    assert saved_numel(8) <= 64 * 8  # the normalised embeddings [B, D]


def test_no_grad_and_bfloat16_inputs():
    x, y = _batch("clustered")
    loss, chunked = LOSSES["supcon"](), LOSSES["supcon"](anchor_chunk_size=5)
    with torch.no_grad():
        assert torch.allclose(chunked(x, y), loss(x, y), rtol=1e-12, atol=0)
    xb = x.to(torch.bfloat16)
    want = _loss_and_grads("supcon", {}, None, True, xb, y)
    got = _loss_and_grads("supcon", {}, 5, True, xb, y)
    assert got[1][0].dtype == torch.bfloat16
    assert abs(float(got[0] - want[0])) <= 1e-6 * abs(float(want[0]))
    assert _rel(got[1][0].double(), want[1][0].double()) <= 1e-2  # one bf16 rounding of each gradient entry


def test_per_block_normalisers_do_not_give_the_loss():
    """Control: each block's loss with its own normalisers, summed or averaged, is not the loss (so the
    comparisons above, which pass only with the global normalisers, have power)."""
    x, y = _batch("clustered")
    for name in ("multi_similarity", "contrastive", "supcon", "triplet"):
        want = float(LOSSES[name]()(x, y))
        loss = LOSSES[name]()
        blocks = []
        for s in range(0, B, 7):
            order = torch.cat([torch.arange(s, min(s + 7, B)), torch.arange(0, s), torch.arange(min(s + 7, B), B)])
            rest = order[min(s + 7, B) - s:]
            blocks.append(float(loss(x[s:s + 7], y[s:s + 7], x[rest], y[rest])))
        assert abs(sum(blocks) / len(blocks) - want) > 1e-6 * abs(want), name
        assert abs(sum(blocks) - want) > 1e-6 * abs(want), name


@pytest.mark.parametrize("value", [0, -3, 2.5, True, "8"])
def test_bad_chunk_size_rejected(value):
    with pytest.raises(ValueError, match=r"MultiSimilarityLoss: anchor_chunk_size must be an integer >= 1"):
        LOSSES["multi_similarity"](anchor_chunk_size=value)


def test_losses_whose_terms_couple_anchors_reject_chunks():
    for name in ("tuplet_margin", "npair", "ranked_list"):
        loss = LOSSES[name]()
        with pytest.raises(ValueError, match=f"{type(loss).__name__}.*does not take anchor_chunk_size"):
            loss.set_anchor_chunk_size(8)
        loss.set_anchor_chunk_size(None)  # turning it off is always fine
    # tuplet margin's random negatives are drawn over the whole batch: only negatives="all" is chunked
    with pytest.raises(ValueError, match=r"negatives='random_per_class'.*use negatives='all'"):
        LOSSES["tuplet_margin"](anchor_chunk_size=8)


def test_batch_within_one_block_is_the_plain_call():
    x, y = _batch("random")
    want = _loss_and_grads("contrastive", {}, None, True, x, y)
    _assert_equal(_loss_and_grads("contrastive", {}, B, True, x, y), want, 0.0)


@pytest.mark.skipif(sys.platform == "win32", reason="gloo")
def test_chunked_losses_under_ddp_gather_equal_single_process():
    from tests.distributed.test_distributed_callbacks import _env

    script = Path(__file__).resolve().parent / "distributed" / "run_anchor_chunks_ddp.py"
    proc = subprocess.run([sys.executable, str(script), "2"], capture_output=True, text=True, timeout=300, env=_env())
    assert proc.returncode == 0, proc.stdout[-8000:] + proc.stderr[-5000:]
    assert "CHUNKS-DDP-OK world=2" in proc.stdout


def test_dml_module_fit_with_chunked_loss_ends_with_the_same_weights():
    """Three SGD steps of ``DMLModule`` with SupCon chunked in blocks of 4 (batches of 12) end with the weights of
    the unchunked run, within fp32 rounding (the per-step gradients differ by the order of sums only)."""
    from functools import partial

    import pytorch_lightning as pl

    from lightning_dml.losses import SupConLoss
    from lightning_dml.models import SmallConvNet
    from lightning_dml.module import DMLModule
    from tests.random_images import RandomImages

    def flat(model):
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    weights = []
    for chunk in (None, 4):
        torch.manual_seed(0)
        dm = RandomImages(classes_per_batch=4, samples_per_class=3, eval_batch_size=8, train_classes=6, test_classes=4)
        model = DMLModule(SmallConvNet(in_channels=1, width=4), loss=SupConLoss(anchor_chunk_size=chunk),
                          embedding_dim=8, optimizer=partial(torch.optim.SGD, lr=0.1))
        start = flat(model)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                             enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
        trainer.fit(model, datamodule=dm)
        weights.append(flat(model))
    moved = float((weights[0] - start).abs().max())
    assert moved > 1e-3  # the runs trained
    print(f"moved {moved:.3e}, chunked - unchunked {float((weights[1] - weights[0]).abs().max()):.3e}")
    assert float((weights[1] - weights[0]).abs().max()) <= 1e-5 * moved
