"""MatryoshkaLoss with per-width proxies under DDP (2 gloo processes on CPU): equal to one process holding the global
batch, values, embedding gradients and every width's proxy gradients (all-reduced and averaged, as DDP does).

* Proxy-Anchor per width and tied (MRL-E): ``gather_mode = "global_batch"`` through ``gathered_loss``;
* ArcFace per width: a per-sample loss, exact without gathering (each process's mean over its equal-sized batch).

Reuses tests/distributed/run_gather_loss.py's batch, comparison and process helpers. This file is both the pytest
test and the script it runs (``python tests/test_matryoshka_ddp.py`` prints ``MATRYOSHKA-DDP-OK``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORLD = 2
WIDTHS = [3, 8]


def _case(name: str):
    """A fresh fp64 wrapper with the same parameters on every process (seeded)."""
    from lightning_dml.losses import MatryoshkaLoss, build_loss
    from tests.distributed.run_gather_loss import DIM, P

    torch.manual_seed(0)
    if name == "proxy_anchor_tied":
        loss = MatryoshkaLoss(build_loss("proxy_anchor", num_classes=P), widths=WIDTHS, weights=[2.0, 1.0], tied=True)
    else:
        loss = MatryoshkaLoss(build_loss(name, num_classes=P), widths=WIDTHS, weights=[2.0, 1.0])
    return loss.complete(embedding_dim=DIM).double()


def _run(name: str, x: torch.Tensor, y: torch.Tensor, gather: bool, world: int):
    from lightning_dml.losses import gathered_loss

    loss = _case(name)
    emb = x.clone().requires_grad_(True)
    value = gathered_loss(loss, emb, y) if gather else loss(emb, y)
    value.backward()
    grads = [p.grad.clone() for p in loss.parameters()]
    value = value.detach().clone()
    if world > 1:
        dist.all_reduce(value)
        for g in grads:
            dist.all_reduce(g)
    return float(value) / world, emb.grad / world, [g / world for g in grads]


def _worker(rank: int, world: int, store_path: str) -> None:
    from tests.distributed.run_gather_loss import SIZES, _compare, _data, finish_worker

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    x, y = _data()
    start = sum(SIZES[world][:rank])
    local = slice(start, start + SIZES[world][rank])
    failures: list[str] = []
    lines: list[str] = []
    for name, gather in (("proxy_anchor", True), ("proxy_anchor_tied", True), ("arcface", False)):
        probe = _case(name)
        assert probe.gather_mode == ("global_batch" if gather else None), (name, probe.gather_mode)
        want = _run(name, x, y, False, 1)  # one process holding the global batch
        got = _run(name, x[local], y[local], gather, world)
        _compare(f"matryoshka {name} [{probe.gather_mode}]", got, want, local, failures, lines)
        if not all(float(g.abs().max()) > 0 for g in want[2]):
            failures.append(f"{name}: a width's proxies got no gradient (the comparison has no power)")
    # control: Proxy-Anchor's per-proxy sums over the local batch alone must NOT match (the test has power)
    control = _run("proxy_anchor", x[local], y[local], False, world)
    same = torch.tensor(float(torch.allclose(control[1], _run("proxy_anchor", x, y, False, 1)[1][local])))
    dist.all_reduce(same)
    if float(same) == world:
        failures.append("control: Proxy-Anchor without gathering matches the global batch")
    finish_worker(rank, lines, failures, f"MATRYOSHKA-DDP-OK world={world} cases={len(lines)}")


@pytest.mark.skipif(sys.platform == "win32", reason="gloo")
def test_per_width_proxies_under_ddp_equal_one_process_with_the_global_batch():
    from tests.distributed.test_distributed_callbacks import _env

    proc = subprocess.run([sys.executable, str(Path(__file__).resolve())], capture_output=True, text=True,
                          timeout=300, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-5000:] + proc.stderr[-5000:]
    assert f"MATRYOSHKA-DDP-OK world={WORLD} cases=3" in proc.stdout


if __name__ == "__main__":
    from tests.distributed.run_gather_loss import spawn_workers

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(spawn_workers(_worker, WORLD))
