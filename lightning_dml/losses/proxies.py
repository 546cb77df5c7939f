"""Shared base of the proxy and classification losses: learnable class proxies scored against the batch.

A proxy loss holds ``num_classes * proxies_per_class`` learnable vectors of width ``embedding_dim`` (Proxy-Anchor's
proxies, a normalised classifier's weight rows, SoftTriple's centres, sub-centre ArcFace's sub-centres) and is
computed from the ``B x (C K)`` cosine matrix between the L2-normalised embeddings and the L2-normalised proxies.
Its labels are class *indices* in ``[0, num_classes)``; :class:`~lightning_dml.module.DMLModule` maps the data
module's training labels to those indices and fills in ``num_classes`` / ``embedding_dim`` when a config leaves
them out (:meth:`ProxyLoss.complete`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dml.losses.base import check_inputs, normalize_embeddings, upcast

__all__ = ["ProxyLoss", "margin_cross_entropy"]


def _check_size(value: int | None, name: str, owner: str, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or int(value) != value or value < minimum:
        raise ValueError(f"{owner}: {name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _normalize_proxies(proxies: Tensor) -> Tensor:
    """Unit rows of the (``C K x D``, possibly large) proxy matrix: one norm pass when every row norm is finite
    and not tiny (one host read of the check), else the scale-safe :func:`normalize_embeddings`."""
    norms = torch.linalg.vector_norm(proxies, dim=1, keepdim=True)
    if bool(((norms > 1e-15) & torch.isfinite(norms)).all()):
        return proxies / norms
    return normalize_embeddings(proxies)


def margin_cross_entropy(logits: Tensor, labels: Tensor, target_logits: Tensor, scale: float) -> Tensor:
    """Mean cross-entropy of ``scale * logits`` with each row's target logit replaced by ``target_logits``.

    The form shared by the normalised-softmax family (CosFace Eq. 4, ArcFace Eq. 3): ``logits`` are the ``B x C``
    cosines, ``target_logits`` the ``B`` margin-modified target cosines.
    """
    rows = torch.arange(labels.shape[0], device=labels.device)
    logits = logits.index_put((rows, labels), target_logits)
    return F.cross_entropy(scale * logits, labels)


class ProxyLoss(nn.Module):
    """Base class of the losses with learnable class proxies.

    Call: ``loss(embeddings [B, D], labels [B])`` with integer class indices in ``[0, num_classes)``; returns an
    fp32 scalar, computed in fp32 with autocast disabled (fp64 inputs are computed and returned in fp64).
    Embeddings and proxies are L2-normalised (:func:`~lightning_dml.losses.base.normalize_embeddings`).

    ``num_classes`` and ``embedding_dim`` may be left out at construction; the proxies are then created by
    :meth:`complete` (``DMLModule`` calls it in ``setup("fit")`` with the data module's number of training classes
    and the head's output width), or by loading a state dict that holds them. Calling an incomplete loss is an error.

    Subclasses implement :meth:`proxy_loss` (cosine matrix, labels -> scalar) and may override
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

    def __init__(
        self, num_classes: int | None = None, embedding_dim: int | None = None, proxies_per_class: int = 1
    ) -> None:
        super().__init__()
        name = type(self).__name__
        self.num_classes = _check_size(num_classes, "num_classes", name, 2)
        self.embedding_dim = _check_size(embedding_dim, "embedding_dim", name, 1)
        self.proxies_per_class = _check_size(proxies_per_class, "proxies_per_class", name, 1)
        self.register_parameter("proxies", None)
        if hasattr(self, "register_load_state_dict_pre_hook"):  # public since torch 2.x
            self.register_load_state_dict_pre_hook(_create_proxies_from_state_dict)
        else:  # older torch: the same hook through the long-standing registration method
            self._register_load_state_dict_pre_hook(_create_proxies_from_state_dict, with_module=True)
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
            rows = self.num_classes * self.proxies_per_class
            self.proxies = nn.Parameter(torch.empty(rows, self.embedding_dim))
            self.reset_parameters()
        return self

    def reset_parameters(self) -> None:
        """(Re-)initialise the proxies: standard normal unless the loss's paper code says otherwise."""
        if self.proxies is not None:
            nn.init.normal_(self.proxies)

    def extra_repr(self) -> str:
        return f"num_classes={self.num_classes}, embedding_dim={self.embedding_dim}"

    # ------------------------------------------------------------------ call
    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
    ) -> Tensor:
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
        check_inputs(embeddings, labels)
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
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            x = normalize_embeddings(embeddings)
            proxies = _normalize_proxies(self.proxies.to(x.dtype))
            # the cosines are not clamped to [-1, 1]: no loss here needs it (ArcFace bounds its own sin), and it
            # would cost two passes over the B x (C K) matrix
            loss = self.proxy_loss(x @ proxies.T, labels, proxies)
        return upcast(loss)

    def proxy_loss(self, cos: Tensor, labels: Tensor, proxies: Tensor) -> Tensor:
        """Scalar loss from the ``B x (num_classes * proxies_per_class)`` cosines (column ``c K + k``: proxy ``k`` of
        class ``c``) and the normalised proxies."""
        raise NotImplementedError


def _create_proxies_from_state_dict(module: ProxyLoss, state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook: an incomplete loss takes its sizes from the proxies being loaded."""
    saved = state_dict.get(prefix + "proxies")
    if module.proxies is None and isinstance(saved, Tensor) and saved.ndim == 2:
        rows, width = saved.shape
        if rows % module.proxies_per_class == 0:
            module.complete(rows // module.proxies_per_class, width)
            module.proxies.data = module.proxies.data.to(device=saved.device, dtype=saved.dtype)
