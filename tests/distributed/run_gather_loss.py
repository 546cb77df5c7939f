"""W gloo processes: every registered loss, every reduction option, under ``gather_distributed`` equals one process
holding the global batch.

Run directly (``python tests/distributed/run_gather_loss.py WORLD``); exits 0 and prints ``GATHER-OK`` on success.

Every process holds the whole global batch (a P x K batch of trained-like clustered fp64 embeddings, split into
``WORLD`` local batches of unequal sizes for ``WORLD = 3``), so it compares its own results with the single-process
reference itself:

* loss value: the mean over the processes of :func:`lightning_dml.losses.gathered_loss` equals the global loss
  (Lightning's ``sync_dist`` mean; for ``"global_batch"`` losses every process's value is the global loss);
* gradient w.r.t. each process's local embeddings, divided by ``W`` (DDP averages the parameter gradients, which
  are linear in the embedding gradients), equals the global gradient's rows of that process;
* gradient w.r.t. the loss's own parameters, all-reduced and divided by ``W`` (what DDP does), equals the global
  one.

Losses that declare ``gather_mode = None`` must be rejected by ``checks.check_gather_combination`` and by
``gathered_loss``; the per-sample proxy losses among them must equal the global batch WITHOUT gathering (each
process's mean over its own equal-sized batch, DDP's average), checked when the local batches have equal sizes.
Controls (must NOT match, or the test has no power): references gathered without autograd, and batch-wide counts
taken per process (the reductions outside ``global_reduction``).

Label sets: every variant of the losses that declare ``supports_label_sets`` again with label sets ``[B, L]`` (the
global batch's labels, a third of the items with a second label, one item with none); each process holds its block
packed to its own largest set (widths differ between processes: ``gathered_loss`` pads them). Control: the first
label alone must NOT match. Every other loss must reject label sets under ``gathered_loss`` with its message.
"""

from __future__ import annotations

import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

P, K, DIM = 6, 3, 8  # global batch: 6 classes x 3 images (18 items)
SIZES = {2: [9, 9], 3: [5, 7, 6]}
RTOL, ATOL = 1e-7, 1e-9


def _variants() -> dict[str, tuple[str, dict]]:
    """label -> (registry name, constructor arguments): every registered loss with its defaults, plus every
    reduction option and path of the losses that have them."""
    from lightning_dml.losses import LOSSES

    cases: dict[str, tuple[str, dict]] = {name: (name, {}) for name in sorted(LOSSES)}
    for reduction in ("mean_nonzero", "mean", "sum"):
        cases[f"contrastive_{reduction}"] = ("contrastive", {"reduction": reduction})
        cases[f"contrastive_{reduction}_squared_hinge"] = (
            "contrastive",
            {"reduction": reduction, "squared_hinge": True, "pos_margin": 0.3},
        )
        for mining in ("all", "batch_hard"):
            cases[f"triplet_{mining}_{reduction}"] = ("triplet", {"reduction": reduction, "mining": mining})
    for variant in ("original", "gpw", "generalized", "star"):
        cases[f"lifted_structure_{variant}"] = ("lifted_structure", {"variant": variant})
    for preset in ("pair_p", "pair_e", "triplet_p"):
        cases[f"general_pair_weighting_{preset}"] = ("general_pair_weighting", {"preset": preset})
    cases["multi_similarity_no_mining"] = ("multi_similarity", {"mining": False})
    cases["ranked_list_full_gradient"] = ("ranked_list", {"detach_gallery": False})
    cases["tuplet_margin_all"] = ("tuplet_margin", {"negatives": "all"})
    cases["tuplet_margin"] = ("tuplet_margin", {"seed": 3})  # random negatives: the same seed on every process
    cases["cross_batch_memory_triplet_sum"] = (
        "cross_batch_memory",
        {"loss": "triplet", "embedding_size": DIM, "memory_size": 20},
    )
    cases["cross_batch_memory"] = ("cross_batch_memory", {"embedding_size": DIM, "memory_size": 20})
    # nested widths (issue 31): a "references" and a "global_batch" wrapped loss (the default matryoshka: MS)
    cases["matryoshka_triplet_weighted"] = ("matryoshka", {"loss": "triplet", "widths": [2, 4, 8],
                                                           "weights": [0.5, 1, 2]})
    cases["matryoshka_lifted_structure"] = ("matryoshka", {"loss": "lifted_structure", "widths": [3, 8]})
    from lightning_dml.losses.reducers import ThresholdReducer  # pml reducers of the per-anchor terms

    for loss in ("supcon", "nca"):
        for reducer in ("sum", "avg_non_zero", "per_anchor"):
            cases[f"{loss}_reducer_{reducer}"] = (loss, {"reducer": reducer})
        cases[f"{loss}_reducer_threshold"] = (loss, {"reducer": ThresholdReducer(high=2.5)})
    # pml reducers of the contrastive pairs' and the triplets' terms
    for reducer in ("sum", "avg_non_zero", "per_anchor"):
        cases[f"contrastive_reducer_{reducer}"] = ("contrastive", {"reducer": reducer})
    cases["contrastive_reducer_threshold"] = ("contrastive", {"reducer": ThresholdReducer(low=0.05)})
    for reducer in ("sum", "mean"):
        cases[f"triplet_reducer_{reducer}"] = ("triplet", {"reducer": reducer})
    cases["triplet_batch_hard_reducer_threshold"] = (
        "triplet", {"mining": "batch_hard", "reducer": ThresholdReducer(low=0.05)}
    )
    return cases


def _build(name: str, kwargs: dict):
    from lightning_dml.losses import LOSSES, build_loss

    cls = LOSSES[name]
    kwargs = dict(kwargs)
    if getattr(cls, "needs_num_classes", False):
        kwargs.setdefault("num_classes", P)
        kwargs.setdefault("embedding_dim", DIM)
    if getattr(cls, "needs_class_counts", False):  # DynamicArcFace's per-class margins
        kwargs.setdefault("class_counts", list(range(1, P + 1)))
    if name == "cross_batch_memory" and isinstance(kwargs.get("loss"), str):
        kwargs["loss"] = build_loss(kwargs["loss"], reduction="sum")
    torch.manual_seed(0)  # the same parameters on every process and in the reference
    loss = cls(**kwargs)
    # fp64 parameters (Cross-Batch Memory keeps its fp32 memory: it stores what it is given in fp32)
    return loss if name == "cross_batch_memory" else loss.double()


def _data():
    """Trained-like batch: each class a tight cluster, classes close enough that margins and mining are active."""
    g = torch.Generator().manual_seed(0)
    centres = torch.nn.functional.normalize(torch.randn(P, DIM, generator=g, dtype=torch.float64), dim=1)
    labels = torch.arange(P).repeat_interleave(K)
    x = centres[labels] + 0.35 * torch.randn(P * K, DIM, generator=g, dtype=torch.float64)
    perm = torch.randperm(P * K, generator=g)  # classes spread over the processes
    return x[perm], labels[perm]


def _label_sets(labels: torch.Tensor) -> torch.Tensor:
    """``[N, 3]`` label sets: every item its class, every third item from row 5 on also the next class, the last
    item a third label, item 4 no label; some rows with the padding first. Process 0's block (rows 0-4 at least)
    packs to width 1 or 2, the last process's to width 3."""
    index = torch.arange(labels.numel())
    second = torch.where(((index % 3 == 0) & (index >= 5)) | (index == labels.numel() - 1), (labels + 1) % P, -1)
    third = torch.where(index == labels.numel() - 1, (labels + 2) % P, -1)
    sets = torch.stack([labels, second, third], dim=1)
    sets[4] = -1
    sets[1::4] = sets[1::4].flip(1)
    return sets


def _packed(sets: torch.Tensor) -> torch.Tensor:
    """A block's sets with the labels first, cut to its largest set (at least one column)."""
    packed = sets.sort(dim=1, descending=True).values  # labels >= 0 before the -1 padding
    width = max(int((packed >= 0).sum(dim=1).max()), 1)
    return packed[:, :width]


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=RTOL, atol=ATOL)


def _reference(name, kwargs, x, y, calls):
    loss = _build(name, kwargs)
    xg = x.clone().requires_grad_(True)
    if calls > 1:  # memory filled with the earlier global batch
        loss.train()
        torch.manual_seed(7)
        loss(xg.detach(), y)
    torch.manual_seed(7)
    value = loss(xg, y)
    value.backward()
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in loss.parameters()]
    return float(value.detach()), xg.grad, grads


def _distributed(name, kwargs, x_local, y_local, world, calls, gathered=True):
    from lightning_dml.losses import gathered_loss

    loss = _build(name, kwargs)
    emb = x_local.clone().requires_grad_(True)
    if calls > 1:
        loss.train()
        torch.manual_seed(7)
        with torch.no_grad():
            gathered_loss(loss, emb.detach(), y_local)
    torch.manual_seed(7)
    value = gathered_loss(loss, emb, y_local) if gathered else loss(emb, y_local)
    value.backward()
    mean = value.detach().clone()
    dist.all_reduce(mean)
    grads = []
    for p in loss.parameters():
        g = p.grad.clone() if p.grad is not None else torch.zeros_like(p)
        dist.all_reduce(g)
        grads.append(g / world)
    return float(mean) / world, emb.grad / world, grads


def _worker(rank: int, world: int, store_path: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world)
    torch.set_num_threads(1)
    from lightning_dml.checks import check_gather_combination
    from lightning_dml.losses import PairLoss, gather_from_other_ranks, gathered_loss

    x, y = _data()
    sizes = SIZES[world]
    start = sum(sizes[:rank])
    local = slice(start, start + sizes[rank])
    equal_sizes = len(set(sizes)) == 1
    failures, lines = [], []
    for label, (name, kwargs) in _variants().items():
        calls = 2 if name == "cross_batch_memory" else 1
        probe = _build(name, kwargs)
        mode = probe.gather_mode
        if mode is None:
            try:
                check_gather_combination(probe, True)
                failures.append(f"{label}: gather_mode=None but check_gather_combination accepted it")
            except ValueError as err:
                if type(probe).__name__ not in str(err) or "gather_distributed" not in str(err):
                    failures.append(f"{label}: rejection message does not name loss and option: {err}")
            try:
                gathered_loss(probe, x[local].clone(), y[local])
                failures.append(f"{label}: gathered_loss accepted a loss with gather_mode=None")
            except ValueError:
                pass
            if not isinstance(probe, PairLoss) and not probe.needs_positive_pairs and equal_sizes:
                # per-sample proxy loss: exact under DDP with no gathering at all
                want = _reference(name, kwargs, x, y, calls)
                got = _distributed(name, kwargs, x[local], y[local], world, calls, gathered=False)
                _compare(f"{label} (no gather)", got, want, local, failures, lines)
            continue
        check_gather_combination(probe, True)
        want = _reference(name, kwargs, x, y, calls)
        got = _distributed(name, kwargs, x[local], y[local], world, calls)
        _compare(f"{label} [{mode}]", got, want, local, failures, lines)

    # label sets: every variant of the losses that take them; the other losses reject them
    from lightning_dml.losses import LOSSES

    sets = _label_sets(y)
    local_sets = _packed(sets[local])
    for label, (name, kwargs) in _variants().items():
        probe = _build(name, kwargs)
        if not getattr(LOSSES[name], "supports_label_sets", False):
            try:
                gathered_loss(probe, x[local].clone(), local_sets)
                failures.append(f"{label}: accepted label sets under gathered_loss")
            except ValueError as err:  # gather_mode=None losses: that message comes first (DMLModule checks both)
                needle = "cannot train on label sets" if probe.gather_mode else "gather_distributed"
                if type(probe).__name__ not in str(err) or needle not in str(err):
                    failures.append(f"{label}: label-set rejection message: {err}")
            continue
        want = _reference(name, kwargs, x, sets, 1)
        got = _distributed(name, kwargs, x[local], local_sets, world, 1)
        _compare(f"{label} [{probe.gather_mode}, label sets width {local_sets.shape[1]}]", got, want, local, failures, lines)
    first_only = _distributed("triplet", {}, x[local], sets[local].amax(dim=1), world, 1)[1]
    same = torch.tensor(float(_close(first_only, _reference("triplet", {}, x, sets, 1)[1][local])))
    dist.all_reduce(same)
    if float(same) == world:
        failures.append("control label sets: one label per item matches the label-set gradient (no power)")

    # controls: these must differ from the global batch (otherwise the comparisons above could not fail)
    from lightning_dml.losses import ContrastiveLoss

    xl = x[local].clone().requires_grad_(True)
    ref, ref_labels = gather_from_other_ranks(xl, y[local])
    ContrastiveLoss(reduction="mean")(xl, y[local], ref.detach(), ref_labels).backward()
    detached = xl.grad / world
    xl = x[local].clone().requires_grad_(True)
    ref, ref_labels = gather_from_other_ranks(xl, y[local])
    ContrastiveLoss()(xl, y[local], ref, ref_labels).backward()  # per-process counts, no W scale
    local_counts = xl.grad / world
    for control, grad, kwargs in (("detached references", detached, {"reduction": "mean"}),
                                  ("per-process counts", local_counts, {})):
        want = _reference("contrastive", kwargs, x, y, 1)[1][local]
        same = torch.tensor(float(_close(grad, want)))
        dist.all_reduce(same)
        if float(same) == world:
            failures.append(f"control {control}: matches the global gradient (the test has no power)")
    finish_worker(rank, lines, failures, f"GATHER-OK world={world} cases={len(lines)}",
                  verbose=bool(os.environ.get("GATHER_VERBOSE")))


def finish_worker(rank: int, lines: list[str], failures: list[str], ok_line: str, verbose: bool = False) -> None:
    """The end of every script's worker: rank 0's ``lines`` (every rank's with ``verbose``), each process's
    failures, ``ok_line`` on rank 0 when no process failed (what the pytest side looks for), exit status 1 else."""
    if rank == 0 or verbose:
        for line in lines:
            print(f"rank {rank}: {line}", flush=True)
    bad = torch.tensor(float(len(failures)))
    dist.all_reduce(bad)
    for f in failures:
        print(f"rank {rank}: FAIL {f}", flush=True)
    dist.barrier()
    if rank == 0 and float(bad) == 0:
        print(ok_line, flush=True)
    dist.destroy_process_group()
    if float(bad) > 0:
        sys.exit(1)


def spawn_workers(worker, world: int, *args) -> int:
    """``worker(rank, world, store_path, *args)`` in ``world`` processes; 1 when one of them failed."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            mp.spawn(worker, args=(world, os.path.join(tmp, "store"), *args), nprocs=world, join=True)
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as err:
            print(err)
            return 1
    return 0


def _compare(label, got, want, local, failures, lines):
    value, grad, params = got
    ref_value, ref_grad, ref_params = want
    ok_value = abs(value - ref_value) <= 1e-8 * max(1.0, abs(ref_value))
    ok_grad = _close(grad, ref_grad[local])
    ok_params = len(params) == len(ref_params) and all(_close(a, b) for a, b in zip(params, ref_params))
    err = float((grad - ref_grad[local]).abs().max()) if grad.shape == ref_grad[local].shape else float("nan")
    scale = float(ref_grad.abs().max())
    lines.append(f"{label}: loss {value:.10f} vs {ref_value:.10f}, max|d grad| {err:.2e} (max|grad| {scale:.2e})")
    if not (ok_value and ok_grad and ok_params):
        failures.append(f"{label}: value ok={ok_value} embedding grad ok={ok_grad} parameter grads ok={ok_params}; "
                        f"{lines[-1]}")
    if scale == 0.0 and "control" not in label:
        lines[-1] += " (zero gradient)"


def main() -> int:
    return spawn_workers(_worker, int(sys.argv[1]) if len(sys.argv) > 1 else 2)


if __name__ == "__main__":
    sys.exit(main())
