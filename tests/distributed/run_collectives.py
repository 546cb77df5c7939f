"""Two gloo processes: the collectives of ``lightning_dml.distributed`` against what each process holds.

Run directly (``python tests/distributed/run_collectives.py``); exits 0 and prints ``COLLECTIVES-OK`` on success.

* ``all_gather_uneven``: rank 0 holds 3 rows, rank 1 holds 1 row and then 0 rows (shape ``[0, 0]``: the trailing
  shape is taken from the other rank); every rank receives every block, in rank order, exactly;
* with ``with_grad=True`` the gradient each rank receives for its rows is the sum over ranks of the gradients of
  the gathered copies (checked against the closed form of the loss used);
* ``all_gather_with_grad`` on equal shapes, ``all_gather_object`` on a dict of tensors and strings.
"""

from __future__ import annotations

import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))

WORLD = 2


def block(rank: int, rows: int) -> torch.Tensor:
    return torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4) + 100 * rank


def worker(rank: int, port: int) -> None:
    from lightning_dml.distributed import (
        all_gather_object,
        all_gather_uneven,
        all_gather_with_grad,
        get_rank,
        get_world_size,
        is_distributed,
    )

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    assert is_distributed() and get_world_size() == WORLD and get_rank() == rank
    rows = {0: 3, 1: 1}

    # uneven rows, two tensors of different dtypes and trailing shapes
    x = block(rank, rows[rank])
    labels = torch.arange(rows[rank]) + 10 * rank
    xs, ls = all_gather_uneven(x, labels)
    assert [t.shape[0] for t in xs] == [3, 1] and [t.shape[0] for t in ls] == [3, 1]
    for r in range(WORLD):
        assert torch.equal(xs[r], block(r, rows[r])), (rank, r, xs[r])
        assert torch.equal(ls[r], torch.arange(rows[r]) + 10 * r)
        assert ls[r].dtype == torch.long

    # a rank without rows and without a known width
    empty = torch.zeros(0, 0) if rank == 1 else block(0, 2)
    (parts,) = all_gather_uneven(empty)
    assert parts[0].shape == (2, 4) and parts[1].shape == (0, 4) and torch.equal(parts[0], block(0, 2))

    # autograd: loss_r = sum_over_gathered(w_r * x) with a rank-specific weight w_r = r + 1; the gradient of
    # rank r's rows is the sum over ranks s of w_s (every rank uses every row once)
    x = block(rank, rows[rank]).requires_grad_(True)
    (xs,) = all_gather_uneven(x, with_grad=True)
    loss = (rank + 1.0) * torch.cat(xs).sum()
    loss.backward()
    expected = sum(s + 1.0 for s in range(WORLD))
    assert torch.equal(x.grad, torch.full_like(x, expected)), x.grad

    # equal shapes
    y = torch.full((2, 3), float(rank), requires_grad=True)
    ys = all_gather_with_grad(y)
    assert [float(t.detach()[0, 0]) for t in ys] == [0.0, 1.0]
    (ys[1 - rank].sum() * (rank + 2.0)).backward()  # only the other rank's copy is used here
    assert torch.equal(y.grad, torch.full_like(y, (1 - rank) + 2.0)), y.grad

    objs = all_gather_object({"rank": rank, "t": torch.arange(rank + 1), "s": "x" * rank})
    assert [o["rank"] for o in objs] == [0, 1] and [o["s"] for o in objs] == ["", "x"]
    assert torch.equal(objs[1]["t"], torch.arange(2))

    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        print("COLLECTIVES-OK", flush=True)


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(worker, args=(port,), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
