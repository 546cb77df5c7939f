"""Class centres (proxies) split over the DDP processes: Partial FC (An et al., "Partial FC: Training 10 Million
Identities on a Single Machine", ICCVW 2021; "Killing Two Birds with One Stone: Efficient and Robust Training of
Face Recognition CNNs by Partial FC", CVPR 2022), the functional core of the proxy losses' ``sharded=True``.

Split rule (insightface's ``partial_fc_v2.py``): with ``C`` classes and ``W`` processes, process ``r`` holds the
``C // W + (r < C % W)`` consecutive classes from ``r (C // W) + min(r, C % W)`` (:func:`shard_range`), each with
its ``K`` proxy rows (sub-centres) in the loss's row layout; ``C >= W`` is required.

Every process gathers the embeddings and labels of all processes (autograd-aware, in rank order: the global batch
``X`` of ``N`` rows) and scores them against its own shard only. Partial FC's softmax is the margin softmax of the
full classifier with its logits ``W_j^T x`` computed block-wise per process (insightface's ``DistCrossEntropyFunc``):
the cross-entropy over *all* classes, its normaliser reduced across the processes (the row maxima with an
all-reduce MAX, the sums of ``exp(logit - max)`` with an all-reduce SUM), the margin ``f`` applied to the positive
logit on the process that holds the positive class. Every process returns the global-batch loss's value.

Gradients: each process back-propagates only the part of the loss that depends on its shard (the surrogate of
:func:`sharded_softmax_loss`, :func:`global_value`), so its shard receives exactly the global loss's gradient; the
gathered embeddings' gradients are summed over the processes by the all-gather's backward (each process's rows get
the global loss's gradient) and multiplied by ``W`` (:func:`gather_batch`), because DDP averages the backbone's
gradients over the ``W`` processes (the factor of insightface's ``AllGatherFunc`` backward). Outside a distributed
run (``W = 1``) all of this is the plain computation.

Sampling (``sample_rate < 1``; Partial FC's positive-plus-randomly-negative sampling, both papers, arXiv 2203.15565;
insightface's ``PartialFC_V2.sample``): each step, each process keeps the centres of every class of the global batch
that it holds (the positives) and fills up to ``int(sample_rate * C_r)`` centres with negatives drawn uniformly
without replacement from its other classes (all positives are kept when they alone exceed that number); the
softmax is then taken over the sampled centres of all processes only, without re-weighting (the papers' estimator:
the centres outside the sample are neither in the normaliser nor updated this step). The draw uses the default
random generator of the shard's device, independently on each process.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_dml.distributed import all_gather_uneven, get_world_size

__all__ = [
    "add_sharded_state",
    "check_sharded_fit",
    "cosine_to_proxies",
    "gather_batch",
    "global_value",
    "sample_classes",
    "scale_grad",
    "shard_range",
    "sharded_softmax_loss",
    "take_sharded_state",
]


def shard_range(num_classes: int, world: int, rank: int) -> tuple[int, int]:
    """``[start, stop)`` of the classes process ``rank`` of ``world`` holds (the module docstring's split rule)."""
    if num_classes < world:
        raise ValueError(f"sharded proxies need num_classes >= the number of processes, got {num_classes} < {world}")
    base, extra = divmod(num_classes, world)
    start = base * rank + min(rank, extra)
    return start, start + base + int(rank < extra)


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, factor: float) -> Tensor:  # type: ignore[override]
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        return grad * ctx.factor, None


def scale_grad(x: Tensor, factor: float) -> Tensor:
    """``x`` unchanged, its gradient multiplied by ``factor`` (identity when ``factor == 1``)."""
    return x if factor == 1 else _ScaleGrad.apply(x, factor)


def gather_batch(x: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """The global batch (every process's rows in rank order; sizes may differ), autograd-aware: the gradient of
    each process's own rows is ``W`` times the sum over processes of the gradients computed for them (module
    docstring: undoes DDP's average). ``(x, labels)`` outside a distributed run."""
    world = get_world_size()
    if world == 1:
        return x, labels
    emb_parts, label_parts = all_gather_uneven(scale_grad(x, float(world)), labels, with_grad=True)
    return torch.cat(emb_parts), torch.cat(label_parts)


def global_value(local: Tensor) -> Tensor:
    """``sum over processes of local`` as the value, with the gradient of this process's ``local`` only: the
    processes' local terms depend on disjoint shards, so each shard gets the gradient of the sum."""
    if get_world_size() == 1:
        return local
    total = local.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM)
    return local + (total - local.detach())


class _CosineToProxies(torch.autograd.Function):
    """``x @ unit(proxies).T`` with the closed-form backward of
    :class:`~lightning_dml.losses.proxies.ProxySoftmaxFunction`: the proxies' gradient ``G^T x`` is projected onto
    the unit rows' tangent space in place, ``(g - u (g . u)) / n``, so the step holds the unit rows and one
    gradient-sized buffer of the shard (autograd's normalisation backward holds several)."""

    @staticmethod
    def forward(ctx, x: Tensor, proxies: Tensor) -> Tensor:  # type: ignore[override]
        from lightning_dml.losses.proxies import unit_rows

        unit, norms = unit_rows(proxies)
        ctx.save_for_backward(x, unit, norms)
        return x @ unit.T

    @staticmethod
    def backward(ctx, grad: Tensor):  # type: ignore[override]
        x, unit, norms = ctx.saved_tensors
        grad_x = grad @ unit if ctx.needs_input_grad[0] else None
        grad_p = None
        if ctx.needs_input_grad[1]:
            from lightning_dml.losses.proxies import unit_rows_backward_  # proxies imports this module

            grad_p = unit_rows_backward_(grad.T @ x, unit, norms)
        return grad_x, grad_p


def cosine_to_proxies(x: Tensor, proxies: Tensor) -> Tensor:
    """The ``N x R`` cosines of the normalised embeddings ``x`` to the unit rows of the raw ``proxies``
    (differentiable in both; see :class:`_CosineToProxies`)."""
    return _CosineToProxies.apply(x, proxies)


def sample_classes(positive: Tensor, num_local: int, sample_rate: float) -> Tensor:
    """Sorted local class indices kept this step: every ``positive`` one (local indices of the batch's classes held
    here, may repeat) plus uniformly drawn others up to ``int(sample_rate * num_local)`` in all (module docstring;
    insightface's ``partial_fc_v2.PartialFC_V2.sample``)."""
    wanted = int(sample_rate * num_local)
    keep = torch.zeros(num_local, dtype=torch.bool, device=positive.device)
    keep[positive] = True
    count = int(keep.sum())
    if wanted > count:
        score = torch.rand(num_local, device=positive.device).masked_fill_(keep, 2.0)
        keep[score.topk(wanted).indices] = True
    return keep.nonzero().squeeze(1)


def sharded_softmax_loss(
    x: Tensor,
    labels: Tensor,
    shard: Tensor,
    start: int,
    scale: float,
    target_fn: Callable[[Tensor], Tensor] | None = None,
    exclude_target: bool = False,
    per_class: int = 1,
    sample_rate: float = 1.0,
) -> Tensor:
    r"""The mean softmax cross-entropy of :func:`~lightning_dml.losses.proxies.proxy_softmax_loss` over the global
    batch, with this process holding the proxy rows ``shard`` of the classes ``[start, start + len(shard) / K)``.

    .. math::
        L = \frac{1}{N} \sum_i \Big(m_i + \log \sum_r \sum_{c \in S_r} e^{\ell_{i,c} - m_i} - s f(S_{i,y_i})\Big),
        \qquad m_i = \max_r \max_{c \in S_r} \ell_{i,c}

    with ``S_r`` the (sampled) classes of process ``r``, ``\ell_{i,c} = s S_{i,c}`` (``s f(S_{i,y_i})`` in the
    target column, left out with ``exclude_target``), ``S`` the class similarities (nearest of the ``K``
    sub-centres). Each process differentiates its own part: ``sum_c e^{\ell - m} / T_i`` (``T_i`` the reduced
    sum, constant) has the softmax as gradient, and the target term is on the process holding ``y_i``.

    ``x``: this process's normalised embeddings; ``labels``: global class indices; ``shard``: raw proxy rows.
    """
    big_x, big_y = gather_batch(x, labels)
    n = big_x.shape[0]
    num_local = shard.shape[0] // per_class
    local = big_y - start
    on = (local >= 0) & (local < num_local)
    rows = on.nonzero().squeeze(1)
    cols = local[rows]
    if sample_rate < 1.0:
        kept = sample_classes(cols, num_local, sample_rate)
        cols = torch.searchsorted(kept, cols)
        proxy_rows = (kept[:, None] * per_class + torch.arange(per_class, device=kept.device)).reshape(-1)
        shard = shard[proxy_rows]
    cos = cosine_to_proxies(big_x, shard)
    sim = cos if per_class == 1 else cos.view(n, -1, per_class).max(dim=2).values
    target = sim[rows, cols]
    target_logit = scale * (target if target_fn is None else target_fn(target))
    fill = torch.full_like(target_logit, -math.inf) if exclude_target else target_logit
    logits = (scale * sim).index_put((rows, cols), fill)
    del cos, sim  # free the cosines early (autograd keeps only what the backward needs)
    if logits.shape[1] > 0:
        top = logits.detach().amax(dim=1)
    else:  # a process whose sample is empty (sample_rate * C_r < 1 and no positive here)
        top = logits.new_full((n,), -math.inf)
    if get_world_size() > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
    shifted = torch.exp(logits - top[:, None])
    del logits
    part = shifted.sum(dim=1)
    total = part.detach().clone()
    if get_world_size() > 1:
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
    targets = target_logit.new_zeros(n).index_put((rows,), target_logit)
    local_part = ((part / total).sum() - targets.sum()) / n
    full_targets = targets.detach().clone()
    if get_world_size() > 1:
        dist.all_reduce(full_targets, op=dist.ReduceOp.SUM)
    value = (top + torch.log(total) - full_targets).mean()
    return local_part + (value - local_part).detach()


def check_sharded_fit(module: object, world_size: int) -> None:
    """``ValueError`` naming the option when ``DMLModule`` (``module``) cannot train its sharded loss under DDP
    (``world_size > 1``): with per-level losses, ``gather_distributed`` (the loss gathers the batch itself),
    ``embedding_chunk_size`` or a regularizer of the loss's weights (a term of the local shard only). On one
    process ``sharded=True`` is the plain loss and every option passes."""
    loss = getattr(module, "loss", None)
    if world_size <= 1 or not getattr(loss, "sharded", False):
        return
    targets = getattr(getattr(module, "regularization", None), "targets", None) or []
    clashes = [
        (getattr(module, "level_losses", None) is not None, 'fusion="per_level" (one loss per level)'),
        (bool(getattr(module, "gather_distributed", False)), "gather_distributed=True (the sharded loss gathers the "
         "batch itself)"),
        (getattr(module, "embedding_chunk_size", None) is not None, "embedding_chunk_size"),
        ("loss_weights" in targets, "a regularizer with target loss_weights (it would see this process's shard only)"),
    ]
    for clash, option in clashes:
        if clash:
            raise ValueError(
                f"{type(loss).__name__}(sharded=True) under DDP ({world_size} processes) cannot be combined with "
                f"{option}: set sharded: false, or leave the option out"
            )


def _loss_param_indices(optimizer_state: dict) -> list[int]:
    """Indices, in an optimizer's ``state_dict``, of the parameters of its group named ``"loss"``
    (``DMLModule.parameter_groups``)."""
    return [i for g in optimizer_state.get("param_groups", []) if g.get("name") == "loss" for i in g["params"]]


def add_sharded_state(loss: object, checkpoint: dict, prefix: str = "loss.") -> None:
    """``on_save_checkpoint`` of a module whose sharded loss is held outside DDP: the centres of all classes
    (``loss.state_dict``) and, in each optimizer state's ``"loss"`` group, every tensor shaped like the shard
    (momentum, Adam's moments) gathered over the processes, so the checkpoint is the unsharded one. A collective:
    every process calls it (Lightning dumps the checkpoint on every process, rank 0 writes it)."""
    checkpoint.setdefault("state_dict", {}).update(loss.state_dict(prefix=prefix))
    for optimizer_state in checkpoint.get("optimizer_states", []):
        states = optimizer_state.get("state", {})
        for index in _loss_param_indices(optimizer_state):
            # a new dict: an optimizer's state_dict() shares its per-parameter dicts with the live optimizer
            state = dict(states.get(index, {}))
            for key in sorted(state):
                value = state[key]
                if isinstance(value, Tensor) and value.shape == loss.proxies.shape:
                    state[key] = torch.cat(all_gather_uneven(value.detach())[0])
            if index in states:
                states[index] = state


def take_sharded_state(loss: object, checkpoint: dict, prefix: str = "loss.") -> None:
    """``on_load_checkpoint`` counterpart of :func:`add_sharded_state`: the loss loads its rows of the centres (their
    keys leave the checkpoint's state dict) and each optimizer state's ``"loss"`` group keeps this process's rows of
    the tensors that hold all classes, whatever the number of processes that saved it."""
    state_dict = checkpoint.get("state_dict", {})
    own = {key[len(prefix):]: state_dict.pop(key) for key in list(state_dict) if key.startswith(prefix)}
    if own:
        loss.load_state_dict(own)
    k = loss.proxies_per_class
    lo, hi, full = loss.shard_start * k, loss.shard_stop * k, loss.num_classes * k
    for optimizer_state in checkpoint.get("optimizer_states", []):
        states = optimizer_state.get("state", {})
        for index in _loss_param_indices(optimizer_state):
            if index in states:
                states[index] = {
                    key: value[lo:hi].clone()
                    if isinstance(value, Tensor) and value.ndim == 2 and value.shape[0] == full
                    else value
                    for key, value in states[index].items()
                }
