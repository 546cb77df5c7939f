"""Two gloo processes: the gathered pair loss and DDP-averaged gradients equal one process with the global batch.

Run directly (``python tests/distributed/run_gather_loss.py``); exits 0 and prints ``GATHER-OK`` on success.
Derivation: with equal local batch sizes B and world size W, the global loss over W*B anchors is the average over
ranks of each rank's local-anchor loss (every loss checked here reduces by 1/B over its anchors). The all-gather
backward sums the gradient contributions of all ranks to each rank's rows, so rank r's parameter gradient is
d(sum_r L_r)/d(theta) through its own rows, and DDP's average over W ranks gives d(L_global)/d(theta).
"""

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

WORLD, LOCAL_B, DIM_IN, DIM = 2, 12, 10, 6


class _TripletPerAnchor(torch.nn.Module):
    """Batch-hard triplet loss summed over anchors / local B (a per-anchor reduction)."""

    def __init__(self):
        super().__init__()
        from lightning_dml.losses import TripletLoss

        self.inner, self.closed_form = TripletLoss(mining="batch_hard", margin=0.5, reduction="sum"), True

    def forward(self, emb, labels, ref_embeddings=None, ref_labels=None):
        self.inner.closed_form = self.closed_form
        return self.inner(emb, labels, ref_embeddings=ref_embeddings, ref_labels=ref_labels) / emb.shape[0]


def _losses():
    from lightning_dml.losses import GeneralPairWeightingLoss, MultiSimilarityLoss, RankedListLoss

    return {
        "multi_similarity": MultiSimilarityLoss(),
        "multi_similarity_autograd": MultiSimilarityLoss(),
        "ranked_list": RankedListLoss(),
        "ranked_list_full_gradient": RankedListLoss(detach_gallery=False),
        "gpw_pair_e": GeneralPairWeightingLoss("pair_e"),
        "triplet_batch_hard_sum_over_b": _TripletPerAnchor(),
    }


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(WORLD * LOCAL_B, DIM_IN, generator=g, dtype=torch.float64)
    y = torch.randint(0, 4, (WORLD * LOCAL_B,), generator=g)
    model = torch.nn.Linear(DIM_IN, DIM).double()
    with torch.no_grad():  # every parameter from the seeded generator (the default init uses the global RNG)
        model.weight.copy_(torch.randn(DIM, DIM_IN, generator=g, dtype=torch.float64))
        model.bias.copy_(torch.randn(DIM, generator=g, dtype=torch.float64))
    return x, y, model


def _worker(rank, store_path, out_path):
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    from torch.nn.parallel import DistributedDataParallel as DDP

    from lightning_dml.losses import gather_from_other_ranks

    x, y, model = _data()
    ddp = DDP(model)
    local = slice(rank * LOCAL_B, (rank + 1) * LOCAL_B)
    results = {}
    for name, loss in _losses().items():
        loss.closed_form = not name.endswith("autograd")
        ddp.zero_grad()
        emb = ddp(x[local])
        ref, ref_labels = gather_from_other_ranks(emb, y[local])
        assert ref.shape == ((WORLD - 1) * LOCAL_B, DIM), ref.shape
        value = loss(emb, y[local], ref_embeddings=ref, ref_labels=ref_labels)
        value.backward()
        mean_value = value.detach().clone()
        dist.all_reduce(mean_value)
        results[name] = (float(mean_value) / WORLD, model.weight.grad.clone(), model.bias.grad.clone())
    # negative control: a gather without autograd (detached refs) must NOT reproduce the global gradient
    ddp.zero_grad()
    emb = ddp(x[local])
    ref, ref_labels = gather_from_other_ranks(emb, y[local])
    _losses()["multi_similarity"](emb, y[local], ref_embeddings=ref.detach(), ref_labels=ref_labels).backward()
    results["control_detached"] = model.weight.grad.clone()
    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


def main() -> int:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.pt")
        mp.spawn(_worker, args=(os.path.join(tmp, "store"), out), nprocs=WORLD, join=True)
        results = torch.load(out)
    x, y, model = _data()
    failures = []
    for name, loss in _losses().items():
        loss.closed_form = not name.endswith("autograd")
        model.zero_grad()
        value = loss(model(x), y)
        value.backward()
        got_value, got_w, got_b = results[name]
        ok = (
            abs(got_value - float(value.detach())) <= 1e-9 * max(1.0, abs(float(value.detach())))
            and torch.allclose(got_w, model.weight.grad, rtol=1e-7, atol=1e-10)
            and torch.allclose(got_b, model.bias.grad, rtol=1e-7, atol=1e-10)
        )
        print(f"{name}: ddp loss {got_value:.12f} single {float(value.detach()):.12f} "
              f"max|dW| {float((got_w - model.weight.grad).abs().max()):.3e} {'ok' if ok else 'MISMATCH'}")
        if not ok:
            failures.append(name)
    model.zero_grad()
    _losses()["multi_similarity"](model(x), y).backward()
    if torch.allclose(results["control_detached"], model.weight.grad, rtol=1e-7, atol=1e-10):
        failures.append("control_detached (a detached gather should not match: the test has no power)")
    else:
        print("control: detached gather differs from the global gradient, as it must")
    if failures:
        print("FAILED:", failures)
        return 1
    print("GATHER-OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
