"""W gloo processes: the losses with ``anchor_chunk_size`` under ``gather_distributed`` equal one unchunked process
holding the global batch (values and gradients, labels and label sets).

Run directly (``python tests/distributed/run_anchor_chunks_ddp.py WORLD``); exits 0 and prints ``CHUNKS-DDP-OK``.
Reuses run_gather_loss.py's batch, reference and comparison: the reference is the unchunked loss of the global
batch in one process, the distributed run chunks each process's anchors (blocks of 4: several blocks, an
uneven last one) and scores them against the gathered references, its batch-wide counts captured over the blocks
and all-reduced once per normaliser. Control: a chunked run whose counts are NOT all-reduced (the loss called
outside ``global_reduction``) must differ.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from tests.distributed.run_gather_loss import SIZES, _close, _compare, _data, _distributed  # noqa: E402
from tests.distributed.run_gather_loss import _label_sets, _packed, _reference  # noqa: E402
from tests.distributed.run_gather_loss import finish_worker, spawn_workers  # noqa: E402

VARIANTS = {
    "multi_similarity": ("multi_similarity", {}),
    "contrastive_mean": ("contrastive", {"reduction": "mean"}),
    "contrastive_mean_nonzero": ("contrastive", {}),
    "triplet": ("triplet", {}),
    "triplet_batch_hard_sum": ("triplet", {"mining": "batch_hard", "reduction": "sum"}),
    "supcon": ("supcon", {}),
    "ntxent": ("ntxent", {}),
    "circle": ("circle", {}),
    "nca": ("nca", {}),
    "smooth_ap": ("smooth_ap", {"temperature": 0.1}),
    "fastap": ("fastap", {}),
    "lifted_structure_generalized": ("lifted_structure", {"variant": "generalized"}),
    "tuplet_margin_all": ("tuplet_margin", {"negatives": "all", "scale": 8.0, "variance_weight": 20.0}),
    "lifted_structure_original": ("lifted_structure", {"variant": "original"}),
    "lifted_structure_gpw": ("lifted_structure", {"variant": "gpw"}),
}


def _worker(rank: int, world: int, store_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from lightning_dml.losses import LOSSES, gather_from_other_ranks

    x, y = _data()
    sizes = SIZES[world]
    start = sum(sizes[:rank])
    local = slice(start, start + sizes[rank])
    sets = _label_sets(y)
    failures, lines = [], []
    for label, (name, kwargs) in VARIANTS.items():
        for chunk in (4,):
            chunked = {**kwargs, "anchor_chunk_size": chunk}
            want = _reference(name, kwargs, x, y, 1)
            got = _distributed(name, chunked, x[local], y[local], world, 1)
            _compare(f"{label} chunk={chunk}", got, want, local, failures, lines)
            if LOSSES[name].supports_label_sets:
                want = _reference(name, kwargs, x, sets, 1)
                got = _distributed(name, chunked, x[local], _packed(sets[local]), world, 1)
                _compare(f"{label} chunk={chunk} label sets", got, want, local, failures, lines)
    # control: counts of this process only (no global_reduction) must not match
    xl = x[local].clone().requires_grad_(True)
    ref, ref_labels = gather_from_other_ranks(xl, y[local])
    LOSSES["contrastive"](anchor_chunk_size=2)(xl, y[local], ref, ref_labels).backward()
    same = torch.tensor(float(_close(xl.grad / world, _reference("contrastive", {}, x, y, 1)[1][local])))
    dist.all_reduce(same)
    if float(same) == world:
        failures.append("control per-process counts: matches the global gradient (the test has no power)")
    finish_worker(rank, lines, failures, f"CHUNKS-DDP-OK world={world} cases={len(lines)}")


def main() -> int:
    return spawn_workers(_worker, int(sys.argv[1]) if len(sys.argv) > 1 else 2)


if __name__ == "__main__":
    sys.exit(main())
