"""Shared base of the proxy and classification losses: learnable class proxies scored against the batch.

A proxy loss holds ``num_classes * proxies_per_class`` learnable vectors of width ``embedding_dim`` (Proxy-Anchor's
proxies, a normalised classifier's weight rows, SoftTriple's centres, sub-centre ArcFace's sub-centres) and is
computed from the ``B x (C K)`` cosine matrix between the L2-normalised embeddings and the L2-normalised proxies.
Its labels are class *indices* in ``[0, num_classes)``; :class:`~lightning_dml.module.DMLModule` maps the data
module's training labels to those indices and fills in ``num_classes`` / ``embedding_dim`` when a config leaves
them out (:meth:`ProxyLoss.complete`).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor, nn
from torch.autograd.function import once_differentiable

from lightning_dml.losses.base import check_inputs, label_sets_error, normalize_embeddings, upcast
from lightning_dml.losses.base import refuse_indices_tuple
from lightning_dml.scaling import power_of_two_scale

__all__ = ["ProxyLoss", "ProxySoftmaxFunction", "normalize_proxies", "proxy_softmax_loss", "unit_rows"]


def _check_size(value: int | None, name: str, owner: str, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _proxy_norms(proxies: Tensor) -> Tensor | None:
    """Row norms of the (``C K x D``, possibly large) proxy matrix when every one is finite and not tiny (one norm
    pass and one host read of the check), else ``None``: the caller takes the scale-safe path."""
    norms = torch.linalg.vector_norm(proxies, dim=1, keepdim=True)
    return norms if bool(((norms > 1e-15) & torch.isfinite(norms)).all()) else None


def normalize_proxies(proxies: Tensor) -> Tensor:
    """Unit rows of the proxies, differentiable by autograd: ``proxies / norms`` (:func:`_proxy_norms`), else the
    scale-safe :func:`normalize_embeddings`."""
    norms = _proxy_norms(proxies)
    return normalize_embeddings(proxies) if norms is None else proxies / norms


def unit_rows(proxies: Tensor) -> tuple[Tensor, Tensor]:
    """``(u, n)`` with ``u = proxies / n`` the unit rows and ``n`` the row norms, without autograd; the scale-safe
    path of :func:`~lightning_dml.scaling.l2_normalize` where a norm overflows or is tiny (a zero row gives
    ``u = 0`` and ``n = 1e-12``, as ``F.normalize``). The derivative of ``u`` is ``(g - u (g . u)) / n``."""
    norms = _proxy_norms(proxies)
    if norms is not None:
        return proxies / norms, norms
    scale = power_of_two_scale(proxies, dim=1)
    unit = proxies / scale
    norms = torch.linalg.vector_norm(unit, dim=1, keepdim=True).clamp_(min=1e-12)
    return unit.div_(norms), norms.mul_(scale)


def unit_rows_backward_(grad_unit: Tensor, unit: Tensor, norms: Tensor) -> Tensor:
    """The gradient with respect to the rows from ``grad_unit``, the one with respect to their unit rows ``u = p / n``
    (:func:`unit_rows`): ``(g - u (g . u)) / n``, computed in ``grad_unit``'s buffer (no autograd, no copy)."""
    along = torch.einsum("cd,cd->c", grad_unit, unit)
    return grad_unit.addcmul_(unit, along[:, None], value=-1.0).div_(norms)


class ProxySoftmaxFunction(torch.autograd.Function):
    r"""Softmax cross-entropy over the classes, from the embeddings and the raw proxies, with a closed-form backward.

    The loss shared by the normalised-softmax family (NormSoftmax, ProxyNCA / ProxyNCA++, CosFace Eq. 4, ArcFace
    Eq. 3, sub-centre ArcFace, SoftTriple's margin softmax over its relaxed similarities):

    .. math::
        L = \frac{1}{B} \sum_i \Big(\log \sum_{c} e^{s\, S'_{i,c}} - s\, f(S_{i,y_i})\Big) + R(P),
        \qquad S'_{i,c} = S_{i,c} \ (c \ne y_i), \quad S'_{i,y_i} = f(S_{i,y_i})

    with ``S`` the ``B x C`` class similarities pooled from the ``B x (C K)`` cosines ``x P^T`` between the
    (normalised) embeddings ``x`` and the unit rows ``P`` of the proxies (``K = 1``: the cosines; ``gamma=None``:
    the largest of a class's ``K``, sub-centre ArcFace; else SoftTriple's relaxed similarity
    ``sum_k softmax_k(S_{i,ck} / gamma) S_{i,ck}``), ``s`` the scale, ``f`` the target-logit function (margin;
    identity when ``None``) and ``R`` an optional term of the unit proxies (SoftTriple's centre regulariser).
    With ``exclude_target`` the target column is left out of the log-sum-exp (ProxyNCA's denominator over the
    negative proxies).

    ``dL/dS`` is ``s (p - 1_y) / B`` (``p`` the softmax; the target column times ``f'``). The forward keeps one
    ``B x C`` buffer, the cosines turned into the softmax in place; the backward turns it into ``dL/dS`` in place,
    forms ``G P`` and ``G^T x``, frees it, and projects the proxies' gradient onto the unit rows' tangent space in
    place (the normalisation's backward): at most three ``B x C K`` / ``C K x D`` buffers at a time, where autograd
    keeps the logits, the log-softmax, their gradients and the normalisation's temporaries. ``f'`` and ``dR/dP``
    are taken by autograd on the ``B`` target similarities and on the unit proxies. Differentiable once: no double
    backward, and a second backward through the same graph is an error.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx,
        x: Tensor,
        proxies: Tensor,
        labels: Tensor,
        scale: float,
        target_fn: Callable[[Tensor], Tensor] | None,
        exclude_target: bool,
        per_class: int,
        gamma: float | None,
        proxy_term: Callable[[Tensor], Tensor] | None,
    ) -> Tensor:
        batch = x.shape[0]
        rows = torch.arange(batch, device=labels.device)
        unit, norms = unit_rows(proxies)
        cos = x @ unit.T
        pool: tuple[Tensor, ...] = ()
        if per_class == 1:
            sim = cos  # not needed later: becomes the softmax in place
        elif gamma is None:  # nearest of the K sub-centres (the first on a tie); the backward routes to it
            sim, arg = _nearest_center(cos.view(batch, -1, per_class))
            pool = (arg,)
        else:  # SoftTriple's relaxed similarity; the cosines are kept, the centre weights recomputed backward
            weights = _center_weights(cos.view(batch, -1, per_class), gamma)
            sim = weights.mul_(cos.view_as(weights)).sum(dim=2)
            del weights
            pool = (cos, sim.clone())
        del cos
        target = sim[rows, labels]
        if target_fn is None:
            target_logit, slope = target, None
        else:  # f and f' on the B target similarities
            with torch.enable_grad():
                leaf = target.detach().requires_grad_(True)
                out = target_fn(leaf)
                (slope,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
            target_logit = out.detach()
        logits = sim.mul_(scale)
        fill = torch.full_like(target, -math.inf) if exclude_target else scale * target_logit
        logits.index_put_((rows, labels), fill)
        top = logits.amax(dim=1, keepdim=True)
        probs = logits.sub_(top).exp_()
        total = probs.sum(dim=1, keepdim=True)
        probs.div_(total)
        loss = (top.squeeze(1) + torch.log(total.squeeze(1)) - scale * target_logit).mean()
        if proxy_term is not None:
            loss = loss + proxy_term(unit)
        ctx.save_for_backward(x, labels)
        # the intermediates are held on ctx (not as saved tensors) so that the backward can free them as it goes
        ctx.buffers = (probs, slope, unit, norms, pool)
        ctx.scale, ctx.per_class, ctx.gamma, ctx.proxy_term = scale, per_class, gamma, proxy_term
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out: Tensor):  # type: ignore[override]
        if ctx.buffers is None:
            raise RuntimeError(
                "ProxySoftmaxFunction: a second backward through the same proxy loss (retain_graph) is not "
                "supported: the first backward frees its buffers; compute the loss again"
            )
        x, labels = ctx.saved_tensors
        grad, slope, unit, norms, pool = ctx.buffers
        ctx.buffers = None
        batch = x.shape[0]
        rows = torch.arange(batch, device=labels.device)
        with torch.autocast(device_type=x.device.type, enabled=False):
            # the softmax turns into dL/dS in place
            target_grad = grad[rows, labels] - 1.0
            grad.index_put_((rows, labels), target_grad if slope is None else target_grad * slope)
            grad.mul_(grad_out * (ctx.scale / batch))
            if ctx.per_class > 1 and ctx.gamma is None:
                (arg,) = pool
                spread = grad.new_empty(batch, grad.shape[1], ctx.per_class)
                for k in range(ctx.per_class):
                    spread[..., k].copy_(grad).masked_fill_(arg != k, 0.0)
                del arg
                grad = spread.view(batch, -1)
            elif ctx.per_class > 1:
                # dS'_c / dS_ck = q_k (1 + (S_ck - S'_c) / gamma), q the centre weights: in place on the cosines
                cos, relaxed = pool
                cos3 = cos.view(batch, -1, ctx.per_class)
                weights = _center_weights(cos3, ctx.gamma).mul_(grad[..., None])
                inv = 1.0 / ctx.gamma
                grad = cos3.mul_(inv).add_((1.0 - inv * relaxed)[..., None]).mul_(weights).view(batch, -1)
                del weights, cos, cos3
            del pool
            grad_x = grad @ unit if ctx.needs_input_grad[0] else None
            if not ctx.needs_input_grad[1]:
                return grad_x, None, None, None, None, None, None, None, None
            grad_p = grad.T @ x
            del grad
            if ctx.proxy_term is not None:
                with torch.enable_grad():
                    leaf = unit.detach().requires_grad_(True)
                    (term_grad,) = torch.autograd.grad(ctx.proxy_term(leaf), leaf)
                grad_p.add_(term_grad.mul_(grad_out))
                del term_grad
            unit_rows_backward_(grad_p, unit, norms)
        return grad_x, grad_p, None, None, None, None, None, None, None


def _nearest_center(cos: Tensor) -> tuple[Tensor, Tensor]:
    """Largest of the last dimension of ``B x C x K`` cosines and its index (the first on a tie; ``uint8`` for
    ``K <= 255``): ``K - 1`` passes over ``B x C`` slices instead of ``max(dim=2)``'s ``int64`` indices, a
    ``B x C`` buffer 8 times the size of the ``uint8`` one."""
    best = cos[..., 0].clone()
    arg = torch.zeros(best.shape, dtype=torch.uint8 if cos.shape[2] <= 255 else torch.int64, device=cos.device)
    for k in range(1, cos.shape[2]):
        arg.masked_fill_(cos[..., k] > best, k)
        torch.maximum(best, cos[..., k], out=best)
    return best, arg


def _center_weights(cos: Tensor, gamma: float) -> Tensor:
    """``softmax_k(S_{i,ck} / gamma)`` over the last dimension of ``B x C x K`` cosines, in one new buffer."""
    weights = torch.sub(cos, cos.amax(dim=2, keepdim=True)).mul_(1.0 / gamma).exp_()
    return weights.div_(weights.sum(dim=2, keepdim=True))


def proxy_softmax_loss(
    x: Tensor,
    proxies: Tensor,
    labels: Tensor,
    scale: float,
    target_fn: Callable[[Tensor], Tensor] | None = None,
    exclude_target: bool = False,
    per_class: int = 1,
    gamma: float | None = None,
    proxy_term: Callable[[Tensor], Tensor] | None = None,
) -> Tensor:
    """Mean softmax cross-entropy of ``scale`` times the class similarities of the normalised embeddings ``x`` to
    the unit rows of the raw ``proxies`` (:class:`ProxySoftmaxFunction`: target logit
    ``scale * target_fn(S_{i,y_i})``, target column left out of the denominator with ``exclude_target``,
    ``per_class`` proxies per class pooled by their maximum (``gamma=None``) or SoftTriple's softmax with
    temperature ``gamma``), plus ``proxy_term`` of the unit proxies."""
    return ProxySoftmaxFunction.apply(x, proxies, labels, scale, target_fn, exclude_target, per_class, gamma, proxy_term)


class ProxyLoss(nn.Module):
    """Base class of the losses with learnable class proxies.

    Call: ``loss(embeddings [B, D], labels [B])`` with integer class indices in ``[0, num_classes)``; returns an
    fp32 scalar, computed in fp32 with autocast disabled (fp64 inputs are computed and returned in fp64).
    Embeddings and proxies are L2-normalised (:func:`~lightning_dml.losses.base.normalize_embeddings`).

    ``num_classes`` and ``embedding_dim`` may be left out at construction; the proxies are then created by
    :meth:`complete` (``DMLModule`` calls it in ``setup("fit")`` with the data module's number of training classes
    and the head's output width), or by loading a state dict that holds them. Calling an incomplete loss is an error.

    Subclasses implement :meth:`proxy_loss` (normalised embeddings, raw proxies, labels -> scalar) and may override
    :meth:`reset_parameters` (the initialisation of their paper's code) and :attr:`proxies_per_class`.
    """

    #: proxy losses L2-normalise embeddings and proxies
    normalize: bool = True
    #: they score the batch against the proxies, never against reference embeddings
    supports_ref: bool = False
    #: they learn from single images of a class (no positive pair needed in the batch)
    needs_positive_pairs: bool = False
    #: they need ``num_classes`` (and ``embedding_dim``) to create their parameters
    needs_num_classes: bool = True
    #: they hold learnable parameters (their own optimizer group in ``DMLModule``)
    has_parameters: bool = True
    #: any P x K (or plain) batch
    required_sampler: str | None = None
    #: a per-sample loss against the proxies is exact under DDP as it is (each process's mean over its equal-sized
    #: batch; DDP averages the gradients): nothing to gather, ``gather_distributed=True`` is rejected. Losses whose
    #: terms couple samples (Proxy-Anchor) set ``"global_batch"`` (:mod:`lightning_dml.losses.distributed`).
    gather_mode: str | None = None
    #: a miner's indices_tuple is refused (losses.base.refuse_indices_tuple), with this reason
    indices_tuple_reason: str | None = "it scores each item against class proxies, not chosen pairs or triplets"
    #: label sets ([B, L]) are rejected: see ``label_sets_reason``
    supports_label_sets: bool = False
    label_sets_reason: str | None = (
        "it scores each item against the proxy of its one class (a class index per item, from the data module's "
        "train_class_ids); its paper defines it for one class per item"
    )

    #: ``sample_rate < 1`` (Partial FC's sampled negative centres) is defined for this loss
    #: (:mod:`lightning_dml.losses.partial_fc`)
    supports_sampling: bool = False

    def __init__(
        self,
        num_classes: int | None = None,
        embedding_dim: int | None = None,
        proxies_per_class: int = 1,
        *,
        sharded: bool = False,
        sample_rate: float = 1.0,
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self.num_classes = _check_size(num_classes, "num_classes", name, 2)
        self.embedding_dim = _check_size(embedding_dim, "embedding_dim", name, 1)
        self.proxies_per_class = _check_size(proxies_per_class, "proxies_per_class", name, 1)
        if not isinstance(sharded, bool):
            raise ValueError(f"{name}: sharded must be true or false, got {sharded!r}")
        if isinstance(sample_rate, bool) or not isinstance(sample_rate, (int, float)) or not 0 < sample_rate <= 1:
            raise ValueError(f"{name}: sample_rate must be a number in (0, 1], got {sample_rate!r}")
        if sample_rate < 1 and not (sharded and self.supports_sampling):
            raise ValueError(
                f"{name}: sample_rate={sample_rate} needs sharded=True"
                if self.supports_sampling
                else f"{name}: sample_rate < 1 (Partial FC's sampled negative centres) is defined for the "
                "softmax-classification losses only (normalized_softmax, cosface, arcface, subcenter_arcface)"
            )
        self.sharded, self.sample_rate = sharded, float(sample_rate)
        #: the processes the proxies are split over, and this process's classes ``[shard_start, shard_stop)``
        self.shard_world, self.shard_start, self.shard_stop = 1, 0, self.num_classes
        self.register_parameter("proxies", None)
        if hasattr(self, "register_load_state_dict_pre_hook"):  # public since torch 2.x
            self.register_load_state_dict_pre_hook(_create_proxies_from_state_dict)
        else:  # older torch: the same hook through the long-standing registration method
            self._register_load_state_dict_pre_hook(_create_proxies_from_state_dict, with_module=True)
        if sharded:  # the state dict holds all classes' proxies, whatever the number of processes
            self.register_state_dict_post_hook(_gather_sharded_proxies)
        self.complete()

    # ------------------------------------------------------------------ sizes and parameters
    @property
    def is_complete(self) -> bool:
        """Whether the proxies exist (``num_classes`` and ``embedding_dim`` are known)."""
        return self.proxies is not None

    def complete(self, num_classes: int | None = None, embedding_dim: int | None = None) -> ProxyLoss:
        """Fill in the sizes left out at construction and create the proxies once both are known.

        A size given both here and before must agree (``ValueError`` naming both values). Returns ``self``.
        """
        name = type(self).__name__
        for attr, value in (("num_classes", num_classes), ("embedding_dim", embedding_dim)):
            value = _check_size(value, attr, name, 2 if attr == "num_classes" else 1)
            current = getattr(self, attr)
            if value is not None and current is not None and value != current:
                raise ValueError(
                    f"{name} was configured with {attr}={current}, but the model gives {attr}={value} "
                    f"({'classes of the training split' if attr == 'num_classes' else 'width of the embedding'}): "
                    f"leave {attr} out of the loss config, or make the two agree"
                )
            if value is not None:
                setattr(self, attr, value)
        if self.proxies is None and self.num_classes is not None and self.embedding_dim is not None:
            self._place_shard()
            rows = (self.shard_stop - self.shard_start) * self.proxies_per_class
            self.proxies = nn.Parameter(torch.empty(rows, self.embedding_dim))
            self.reset_parameters()
        return self

    def _place_shard(self) -> None:
        """This process's classes: all of them, or with ``sharded`` its block of the current process group
        (:func:`~lightning_dml.losses.partial_fc.shard_range`)."""
        from lightning_dml.distributed import get_rank, get_world_size
        from lightning_dml.losses.partial_fc import shard_range

        world = get_world_size() if self.sharded else 1
        try:
            start, stop = shard_range(self.num_classes, world, get_rank() if world > 1 else 0)
        except ValueError as err:
            raise ValueError(f"{type(self).__name__}: {err}") from None
        self.shard_world, self.shard_start, self.shard_stop = world, start, stop

    def split(self) -> ProxyLoss:
        """With ``sharded``, a loss whose proxies were created for one process (before the process group existed)
        keeps this process's rows of them. Returns ``self``."""
        from lightning_dml.distributed import get_world_size

        if self.sharded and self.proxies is not None and self.shard_world == 1 and get_world_size() > 1:
            self._place_shard()
            k = self.proxies_per_class
            self.proxies.data = self.proxies.data[self.shard_start * k : self.shard_stop * k].clone()
        return self

    def softmax_loss(
        self,
        x: Tensor,
        proxies: Tensor,
        labels: Tensor,
        scale: float,
        target_fn: Callable[[Tensor], Tensor] | None = None,
        exclude_target: bool = False,
        per_class: int = 1,
    ) -> Tensor:
        """:func:`proxy_softmax_loss`, or with ``sharded`` over several processes (or ``sample_rate < 1``) its
        Partial FC form :func:`~lightning_dml.losses.partial_fc.sharded_softmax_loss` (same arguments)."""
        if self.shard_world == 1 and self.sample_rate == 1.0:
            return proxy_softmax_loss(x, proxies, labels, scale, target_fn, exclude_target, per_class)
        from lightning_dml.losses.partial_fc import sharded_softmax_loss

        return sharded_softmax_loss(
            x, labels, proxies, self.shard_start, scale, target_fn, exclude_target, per_class, self.sample_rate
        )

    def reset_parameters(self) -> None:
        """(Re-)initialise the proxies: standard normal unless the loss's paper code says otherwise."""
        if self.proxies is not None:
            nn.init.normal_(self.proxies)

    def extra_repr(self) -> str:
        text = f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}"
        if self.sharded:
            text += f", sharded=True, sample_rate={self.sample_rate}"
        return text

    # ------------------------------------------------------------------ call
    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
        indices_tuple: tuple[Tensor, ...] | None = None,
    ) -> Tensor:
        refuse_indices_tuple(self, indices_tuple, ref_embeddings)  # a miner's tuple: the one-line refusal
        name = type(self).__name__
        if ref_embeddings is not None or ref_labels is not None:
            raise ValueError(
                f"{name} scores the batch against its class proxies and takes no ref_embeddings / ref_labels "
                "(its per-sample terms need no other process's batch: train it with gather_distributed=False)"
            )
        if self.proxies is None:
            missing = [a for a in ("num_classes", "embedding_dim") if getattr(self, a) is None]
            raise ValueError(
                f"{name} has no proxies yet: {' and '.join(missing)} unknown. Pass them to the constructor, call "
                f"complete(...), or train it with DMLModule, which fills them in from the data module and the head"
            )
        if isinstance(labels, Tensor) and labels.ndim == 2:
            raise label_sets_error(self, tuple(labels.shape))
        if self.sharded:
            from lightning_dml.distributed import get_world_size

            if get_world_size() != self.shard_world:
                raise ValueError(
                    f"{name}'s proxies are split over {self.shard_world} process(es), but {get_world_size()} run "
                    "now: create the loss (or complete() it) after the process group, or load_state_dict to "
                    "split them again"
                )
        self.check_batch(embeddings, labels)
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            x = normalize_embeddings(embeddings)
            loss = self.proxy_loss(x, self.proxies.to(x.dtype), labels)
        return upcast(loss)

    def check_batch(self, embeddings: Tensor, labels: Tensor, name: str | None = None) -> None:
        """One line for a batch the proxies cannot score (``name``: the loss as the message names it): not a
        finite ``[B, D]`` batch with ``[B]`` labels, a width other than ``embedding_dim``, or a label outside
        ``[0, num_classes)``."""
        check_inputs(embeddings, labels, where=name)  # the input checks' own messages when no name is given
        name = name or type(self).__name__
        if embeddings.shape[1] != self.embedding_dim:
            raise ValueError(
                f"{name} was built for embedding_dim={self.embedding_dim}, but the embeddings have width "
                f"{embeddings.shape[1]}"
            )
        lo, hi = (int(v) for v in torch.aminmax(labels))
        if lo < 0 or hi >= self.num_classes:
            raise ValueError(
                f"{name} takes labels that are class indices in [0, num_classes={self.num_classes}), got labels "
                f"from {lo} to {hi}"
            )

    def proxy_loss(self, x: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        """Scalar loss from the normalised embeddings ``x [B, D]`` and the raw proxies
        ``[num_classes * proxies_per_class, D]`` (row ``c K + k``: proxy ``k`` of class ``c``; in ``x``'s dtype),
        which the loss L2-normalises itself (:func:`proxy_softmax_loss` does it with a fused backward). The cosines
        are not clamped to ``[-1, 1]``: no loss here needs it (ArcFace bounds its own sin), and it would cost two
        passes over the ``B x (C K)`` matrix."""
        raise NotImplementedError


def _create_proxies_from_state_dict(module: ProxyLoss, state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook: an incomplete loss takes its sizes from the proxies being loaded; a sharded loss
    takes its rows of the saved matrix of all classes (split over the processes running now)."""
    saved = state_dict.get(prefix + "proxies")
    if module.proxies is None and isinstance(saved, Tensor) and saved.ndim == 2:
        rows, width = saved.shape
        if rows % module.proxies_per_class == 0:
            module.complete(rows // module.proxies_per_class, width)
            module.proxies.data = module.proxies.data.to(device=saved.device, dtype=saved.dtype)
    k = module.proxies_per_class
    if module.sharded and isinstance(saved, Tensor) and saved.ndim == 2 and saved.shape[0] == module.num_classes * k:
        module._place_shard()
        state_dict[prefix + "proxies"] = saved[module.shard_start * k : module.shard_stop * k]
        rows = (module.shard_stop - module.shard_start) * k
        if module.proxies is not None and module.proxies.shape[0] != rows:  # created under another world size
            module.proxies.data = module.proxies.data.new_empty(rows, module.proxies.shape[1])


def _gather_sharded_proxies(module: ProxyLoss, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """State-dict post-hook of a sharded loss: the proxies of all classes, gathered from the processes in rank
    order (a collective: every process calls ``state_dict()``), so that a checkpoint loads at any world size."""
    key = prefix + "proxies"
    if module.shard_world > 1 and key in state_dict:
        from lightning_dml.distributed import all_gather_uneven

        (parts,) = all_gather_uneven(state_dict[key].detach())
        state_dict[key] = torch.cat(parts)
