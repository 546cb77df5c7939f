"""W gloo processes: the proxy losses with ``sharded=True`` (Partial FC) equal the unsharded loss of the global batch
in one process (fp64: values, the embeddings' gradients and each shard's gradient), checkpoints load at any world
size, ``sample_rate < 1`` is the softmax over the sampled classes of all processes, and an SGD step with the backbone
in ``DistributedDataParallel`` and the sharded loss outside it equals one process's step on the global batch.

Run directly: ``python tests/distributed/run_sharded_losses.py WORLD CHECKPOINT save|load``; exits 0 and prints
``SHARDED-OK world=W``. ``save`` writes (rank 0) the state dict of a sharded ArcFace after one SGD step on its
shards and the loss value it then gives; ``load`` loads that file split over W processes and checks the value.
The batch (11 rows, split unevenly) has 7 classes: not divisible by 2 or 3.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.distributed.run_gather_loss import finish_worker, spawn_workers  # noqa: E402

N, C, D = 11, 7, 5
SIZES = {1: [11], 2: [6, 5], 3: [4, 4, 3]}
CASES = {
    "normalized_softmax": {},
    "cosface": {},
    "arcface": {},
    "subcenter_arcface": {},
    "proxy_nca": {},
    "proxy_nca_plus": {"exclude_positive": False, "temperature": 0.25},
    "proxy_anchor": {},
}


def data() -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch: fp64 embeddings, labels with every class but one (class 6 only as a negative)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, D, generator=g, dtype=torch.float64)
    y = torch.tensor([0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 0])
    return x, y


def proxies(loss: torch.nn.Module, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(C * loss.proxies_per_class, D, generator=g, dtype=torch.float64)


def build(name: str, kwargs: dict, sharded: bool) -> torch.nn.Module:
    from lightning_dml.losses import LOSSES

    base = "proxy_nca" if name == "proxy_nca_plus" else name
    return LOSSES[base](num_classes=C, embedding_dim=D, sharded=sharded, **kwargs).double()


def value_and_grads(loss: torch.nn.Module, x: torch.Tensor, y: torch.Tensor):
    x = x.clone().requires_grad_(True)
    value = loss(x, y)
    value.backward()
    return value.detach(), x.grad, loss.proxies.grad


def close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-12) -> bool:
    return a.shape == b.shape and bool((a - b).abs().max() <= tol * max(1.0, float(b.abs().max())))


def _worker(rank: int, world: int, store: str, checkpoint: str, phase: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from lightning_dml.losses import partial_fc

    x, y = data()
    start = sum(SIZES[world][:rank])
    local = slice(start, start + SIZES[world][rank])
    failures, lines = [], []
    for name, kwargs in CASES.items():
        plain = build(name, kwargs, False)
        full = proxies(plain)
        plain.load_state_dict({"proxies": full})
        want, want_x, want_p = value_and_grads(plain, x, y)
        sharded = build(name, kwargs, True)
        sharded.load_state_dict({"proxies": full})  # each process takes its rows
        k = sharded.proxies_per_class
        rows = slice(sharded.shard_start * k, sharded.shard_stop * k)
        got, got_x, got_p = value_and_grads(sharded, x[local], y[local])
        checks = {
            "value": close(got, want),
            "embedding grad / W": close(got_x / world, want_x[local]),
            "shard grad": close(got_p, want_p[rows]),
            "state dict": torch.equal(sharded.state_dict()["proxies"], full),
            "shard rows": sharded.proxies.shape[0] == (sharded.shard_stop - sharded.shard_start) * k,
        }
        failures += [f"{name}: {what}" for what, ok in checks.items() if not ok]
        lines.append(f"{name}: loss {float(want):.6f} classes [{sharded.shard_start}, {sharded.shard_stop})")

    # sampling: the softmax over the union of every process's sampled classes (reference: the plain loss with
    # those classes' weights only, labels renumbered), each process keeping its positives and int(r C_r) classes
    kept_here: list[torch.Tensor] = []
    sample = partial_fc.sample_classes

    def recording(positive, num_local, rate):
        kept_here.append(sample(positive, num_local, rate))
        return kept_here[-1]

    partial_fc.sample_classes = recording
    torch.manual_seed(100 + rank)
    ys = y % 3  # classes 0-2 only: the processes holding other classes draw negatives
    for name in ("arcface", "subcenter_arcface"):
        kept_here.clear()
        sampled = build(name, {"sample_rate": 0.5}, True)
        full = proxies(sampled)
        sampled.load_state_dict({"proxies": full})
        got, got_x, got_p = value_and_grads(sampled, x[local], ys[local])
        kept = torch.cat(partial_fc.all_gather_uneven(kept_here[0] + sampled.shard_start)[0])
        k = sampled.proxies_per_class
        positives = set(ys.tolist()) & set(range(sampled.shard_start, sampled.shard_stop))
        here = set((kept_here[0] + sampled.shard_start).tolist())
        wanted = max(len(positives), int(0.5 * (sampled.shard_stop - sampled.shard_start)))
        if not positives <= here or len(here) != wanted:
            failures.append(f"{name} sampled: kept {sorted(here)}, positives {sorted(positives)}, wanted {wanted}")
        sub = build(name, {}, False)
        sub.num_classes = len(kept)
        sub_rows = (kept[:, None] * k + torch.arange(k)).reshape(-1)
        sub.proxies = torch.nn.Parameter(full[sub_rows].clone())
        relabel = torch.searchsorted(kept, ys)
        want, want_x, want_p = value_and_grads(sub, x, relabel)
        mine = (kept_here[0][:, None] * k + torch.arange(k)).reshape(-1)
        offset = sum(int(n) for n in partial_fc.all_gather_uneven(torch.tensor([len(mine)]))[0][:rank])
        grad_rows = torch.zeros_like(got_p)
        grad_rows[mine] = want_p[offset : offset + len(mine)]
        if not (close(got, want) and close(got_x / world, want_x[local]) and close(got_p, grad_rows)):
            failures.append(f"{name} sampled: differs from the plain loss over the sampled classes")
        lines.append(f"{name} sample_rate=0.5: {len(kept)} of {C} classes")
    partial_fc.sample_classes = sample

    # a training step as Partial FC's code takes it: the backbone in DistributedDataParallel, the sharded loss
    # outside it (its shard in the optimizer only); equals one process's step on the global batch
    from torch.nn.parallel import DistributedDataParallel

    inputs = torch.randn(N, 4, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    steps = {}
    for distributed in (False, True):
        torch.manual_seed(4)
        backbone = torch.nn.Linear(4, D).double()
        loss = build("arcface", {}, distributed)
        loss.load_state_dict({"proxies": proxies(loss)})
        model = DistributedDataParallel(backbone) if distributed else backbone
        opt = torch.optim.SGD(list(model.parameters()) + list(loss.parameters()), lr=0.1)
        rows_in = local if distributed else slice(None)
        loss(model(inputs[rows_in]), y[rows_in]).backward()
        opt.step()
        steps[distributed] = [backbone.weight.detach(), backbone.bias.detach(), loss.state_dict()["proxies"]]
    if not all(close(a, b) for a, b in zip(steps[True], steps[False])):
        failures.append("a DDP step (backbone in DDP, sharded loss outside) differs from one process's step")
    lines.append("DDP step with the sharded loss outside DistributedDataParallel: equal to one process's step")

    # checkpoints: a sharded ArcFace's state dict holds all classes; saved under one world size, loaded under another;
    # DMLModule's checkpoint hooks (add_sharded_state / take_sharded_state) do the same with the centres' momentum
    loss = build("arcface", {}, True)
    if phase == "save":
        torch.manual_seed(7 + rank)  # shards initialised differently on each process: only the checkpoint has them
        loss.reset_parameters()
        opt = torch.optim.SGD([{"params": [loss.proxies], "name": "loss"}], lr=0.5, momentum=0.9)
        loss(x[local], y[local]).backward()
        opt.step()
        value = loss(x[local], y[local]).detach()
        state = loss.state_dict()
        ckpt = {"state_dict": {}, "optimizer_states": [opt.state_dict()]}
        partial_fc.add_sharded_state(loss, ckpt)
        momentum = ckpt["optimizer_states"][0]["state"][0]["momentum_buffer"]
        if momentum.shape[0] != C or opt.state[loss.proxies]["momentum_buffer"].shape != loss.proxies.shape:
            failures.append("add_sharded_state: the saved momentum is not all classes', or the live one changed")
        if not torch.equal(ckpt["state_dict"]["loss.proxies"], state["proxies"]):
            failures.append("add_sharded_state: the saved centres are not the loss's state dict")
        if rank == 0:
            torch.save({"state_dict": state, "value": value, "module_checkpoint": ckpt}, checkpoint)
    else:
        saved = torch.load(checkpoint, weights_only=True)
        loss.load_state_dict(saved["state_dict"])
        value = loss(x[local], y[local]).detach()
        if not close(value, saved["value"]):
            failures.append(f"resume: loss {float(value)!r} under {world}, saved {float(saved['value'])!r}")
        lines.append(f"resumed at world {world}: loss {float(value):.6f}")
        other = build("arcface", {}, True)
        ckpt = saved["module_checkpoint"]
        full_momentum = ckpt["optimizer_states"][0]["state"][0]["momentum_buffer"].clone()
        partial_fc.take_sharded_state(other, ckpt)
        opt = torch.optim.SGD([{"params": [other.proxies], "name": "loss"}], lr=0.5, momentum=0.9)
        opt.load_state_dict(ckpt["optimizer_states"][0])
        rows = slice(other.shard_start, other.shard_stop)
        if not (torch.equal(other.proxies.detach(), saved["state_dict"]["proxies"][rows])
                and torch.equal(opt.state[other.proxies]["momentum_buffer"], full_momentum[rows])
                and "loss.proxies" not in ckpt["state_dict"]):
            failures.append("take_sharded_state: this process's rows of the centres or of their momentum differ")

    finish_worker(rank, lines, failures, f"SHARDED-OK world={world}")


def main() -> int:
    world, checkpoint, phase = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    return spawn_workers(_worker, world, checkpoint, phase)


if __name__ == "__main__":
    sys.exit(main())
