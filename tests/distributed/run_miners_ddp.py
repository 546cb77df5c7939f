"""W gloo processes: a loss on a miner's tuples under ``gather_distributed`` (:class:`lightning_dml.miners.MinedLoss`
through :func:`lightning_dml.losses.gathered_loss`) equals one process holding the global batch - the miner sees the
global batch. Per-anchor miners run in the loss's ``"references"`` mode (each process mines its own anchors against
the gathered batch), batch-wide and random ones (HDC, uniform histogram, distance weighted, seeded) in
``"global_batch"`` mode.

Run directly (``python tests/distributed/run_miners_ddp.py WORLD``); exits 0 and prints ``MINERS-OK`` on success.
Every process holds the whole global batch (trained-like clustered fp64 embeddings) and compares with the
single-process reference itself: the mean of the processes' values, and each process's embedding gradient divided
by ``W`` against the global gradient's rows; once more with label sets. Control (must NOT match): each process mining
its own batch alone.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.distributed.run_gather_loss import finish_worker, spawn_workers  # noqa: E402

P, K, DIM = 6, 3, 8
SIZES = {2: [9, 9], 3: [5, 7, 6]}


def _cases():
    from lightning_dml.losses import CircleLoss, ContrastiveLoss, MultiSimilarityLoss, TripletLoss
    from lightning_dml.miners import (
        AngularMiner, BatchEasyHardMiner, BatchHardMiner, DistanceWeightedMiner, HDCMiner, MultiSimilarityMiner,
        PairMarginMiner, TripletMarginMiner, UniformHistogramMiner,
    )

    return {
        "triplet+batch_hard": (lambda: TripletLoss(margin=0.2), lambda: BatchHardMiner()),
        "contrastive+batch_easy_hard": (lambda: ContrastiveLoss(), lambda: BatchEasyHardMiner("easy", "hard")),
        "triplet+triplet_margin_semihard": (
            lambda: TripletLoss(margin=0.2), lambda: TripletMarginMiner(0.3, "semihard")
        ),
        "contrastive+pair_margin": (lambda: ContrastiveLoss(neg_margin=0.8), lambda: PairMarginMiner(0.4, 0.7)),
        "ms+multi_similarity": (lambda: MultiSimilarityLoss(mining=False), lambda: MultiSimilarityMiner()),
        "circle+angular": (lambda: CircleLoss(m=0.4, gamma=80), lambda: AngularMiner(30)),
        "contrastive+hdc": (lambda: ContrastiveLoss(), lambda: HDCMiner(0.4)),
        "ms+uniform_histogram": (lambda: MultiSimilarityLoss(mining=False),
                                 lambda: UniformHistogramMiner(5, 3, 3, seed=2)),
        "triplet+distance_weighted": (lambda: TripletLoss(margin=0.2), lambda: DistanceWeightedMiner(seed=4)),
    }


def _data():
    g = torch.Generator().manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(P, DIM, generator=g, dtype=torch.float64), dim=1)
    labels = torch.arange(P).repeat_interleave(K)
    x = centres[labels] + 0.35 * torch.randn(P * K, DIM, generator=g, dtype=torch.float64)
    perm = torch.randperm(P * K, generator=g)
    return x[perm], labels[perm]


def _worker(rank: int, world: int, store_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from lightning_dml.losses import gathered_loss
    from lightning_dml.miners import MinedLoss

    x, y = _data()
    start = sum(SIZES[world][:rank])
    local = slice(start, start + SIZES[world][rank])
    failures, lines = [], []
    for label, (make_loss, make_miner) in _cases().items():
        xg = x.clone().requires_grad_(True)
        want = MinedLoss(make_loss(), make_miner())(xg, y)
        want.backward()
        mined = MinedLoss(make_loss(), make_miner())
        emb = x[local].clone().requires_grad_(True)
        value = gathered_loss(mined, emb, y[local])
        value.backward()
        mean = value.detach().clone()
        dist.all_reduce(mean)
        mean /= world
        grad = emb.grad / world
        ok = torch.allclose(mean, want.detach(), rtol=1e-9, atol=1e-12) and torch.allclose(
            grad, xg.grad[local], rtol=1e-7, atol=1e-10
        )
        err = float((grad - xg.grad[local]).abs().max())
        lines.append(
            f"{label} [{mined.gather_mode}]: {float(mean):.10f} vs {float(want.detach()):.10f}, max|d grad| {err:.1e}"
        )
        if not ok or float(xg.grad.abs().max()) == 0.0:
            failures.append(lines[-1])
        # control: the miner on this process's batch alone (no gather) must not match
        emb = x[local].clone().requires_grad_(True)
        MinedLoss(make_loss(), make_miner())(emb, y[local]).backward()
        same = torch.tensor(float(torch.allclose(emb.grad / world, xg.grad[local], rtol=1e-7, atol=1e-10)))
        dist.all_reduce(same)
        if float(same) == world:
            failures.append(f"control {label}: the local batch alone matches (no power)")
    # label sets (a pair positive when the sets intersect), each process's block packed to its own width
    from tests.distributed.run_gather_loss import _label_sets, _packed

    from lightning_dml.losses import ContrastiveLoss
    from lightning_dml.miners import PairMarginMiner

    sets = _label_sets(y)
    xg = x.clone().requires_grad_(True)
    want = MinedLoss(ContrastiveLoss(), PairMarginMiner(0.4, 0.7))(xg, sets)
    want.backward()
    emb = x[local].clone().requires_grad_(True)
    value = gathered_loss(MinedLoss(ContrastiveLoss(), PairMarginMiner(0.4, 0.7)), emb, _packed(sets[local]))
    value.backward()
    mean = value.detach().clone()
    dist.all_reduce(mean)
    ok = torch.allclose(mean / world, want.detach(), rtol=1e-9, atol=1e-12) and torch.allclose(
        emb.grad / world, xg.grad[local], rtol=1e-7, atol=1e-10
    )
    lines.append(f"contrastive+pair_margin, label sets: {float(mean / world):.10f} vs {float(want.detach()):.10f}")
    if not ok:
        failures.append(lines[-1])
    finish_worker(rank, lines, failures, f"MINERS-OK world={world} cases={len(lines)}")


def main() -> int:
    return spawn_workers(_worker, int(sys.argv[1]) if len(sys.argv) > 1 else 2)


if __name__ == "__main__":
    sys.exit(main())
