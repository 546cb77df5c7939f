"""Matryoshka Representation Learning: one embedding whose leading ``d`` dimensions are an embedding of their own.

Kusupati et al., "Matryoshka Representation Learning", NeurIPS 2022, Eq. (1):
``min (1/N) sum_i sum_{m in M} c_m L(W^(m) F(x_i; theta)_{1:m}; y_i)`` over nested widths ``M = {d_1 < ... <= D}``
with relative importances ``c_m`` (1 each in the paper's experiments). Here ``L`` is any registered loss applied to
the cut embedding ``z[:, :m]``: a pair loss without parameters is one loss shared by every width (sentence-
transformers' ``MatryoshkaLoss`` does the same for its text losses); a loss with parameters (proxies, class
weights, per-class margins) gets one copy per width, its own ``W^(m)`` of width ``m`` (Eq. 1), or with ``tied=True``
one proxy matrix of width ``D`` whose leading ``m`` columns are ``W^(m)`` (the paper's weight-tied MRL-E, Sec. 3).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_dml.input_checks import check_embeddings
from lightning_dml.losses.base import PairLoss, label_sets_error, normalize_embeddings
from lightning_dml.losses.base import refuse_indices_tuple, upcast
from lightning_dml.losses.proxies import ProxyLoss
from lightning_dml.losses.registry import build_loss, register_loss
from lightning_dml.widths import check_width_fits, check_widths

__all__ = ["MatryoshkaLoss", "default_widths"]

#: the anatomy a MatryoshkaLoss copies from its wrapped loss, per instance (see PairLoss)
_ANATOMY = (
    "normalize", "supports_ref", "needs_positive_pairs", "required_sampler", "gather_mode", "supports_label_sets",
    "label_sets_reason", "supports_anchor_chunks", "supports_indices_tuple", "indices_tuple_reason",
)


def default_widths(dim: int) -> list[int]:
    """The widths used when none are given: ``D/8, D/4, D/2, D`` (integer halvings of ``D``, those ``>= 1``)."""
    return sorted({dim >> s for s in (3, 2, 1, 0) if dim >> s >= 1})


def _has_parameters(loss: nn.Module) -> bool:
    """Whether ``loss`` holds (or will hold once its sizes are known) learnable parameters."""
    return bool(
        getattr(loss, "has_parameters", False) or getattr(loss, "needs_num_classes", False)
        or any(True for _ in loss.parameters())
    )


@register_loss("matryoshka")
class MatryoshkaLoss(nn.Module):
    r"""A loss applied to the leading ``d_1 < d_2 < ... <= D`` dimensions of the embedding, weighted and summed
    (Kusupati et al., NeurIPS 2022, Eq. (1)): ``sum_m c_m loss_m(z[:, :d_m], labels)``.

    Each cut is handed to the wrapped loss as raw embeddings, so it is L2-normalised exactly where the wrapped loss
    normalises (its own ``normalize``; N-pair does not). Reference embeddings (``ref_embeddings``, DDP's gathered
    rows) are cut the same way, and a miner's ``indices_tuple`` is passed to every width (it was mined on the full
    embedding: ``DMLModule`` runs the miner once).

    Losses with parameters (proxies and class weights: Proxy-Anchor, ProxyNCA, ArcFace, CosFace, SoftTriple,
    NormSoftmax, ...; HIER's proxies; the margin loss's per-class ``beta``): ``loss_m`` is a copy of the wrapped loss
    per width, built with ``embedding_dim = d_m`` (the paper's classifier ``W^(m)`` per width), each with its own
    parameters, registered as ``losses.<i>`` (in the state dict, moved with the module, in ``DMLModule``'s
    ``"loss"`` optimizer group with ``loss_lr_multiplier`` as the wrapped loss alone). The copies are made when the
    widths and ``num_classes`` are known: at construction, or by :meth:`complete` (``DMLModule`` calls it at fit
    start with the data module's classes and the head's width, as for the wrapped loss alone), or by loading a
    state dict that holds them. Parameter-free losses are one shared loss (``loss``).

    Args:
        loss: the wrapped loss (a loss module of lightning_dml.losses) or a registry name built with its defaults.
            A loss with parameters is given without ``embedding_dim`` (every width gets its own); ``num_classes``
            may be given (else filled in by ``DMLModule``).
        widths: the nested widths ``d_1 < ... <= D``; ``None``: ``D/8, D/4, D/2, D`` of the embedding it is given.
        weights: ``c_m``, one non-negative number per width (default 1 each, as the paper).
        tied: MRL-E (Kusupati et al., Sec. 3): one copy of a proxy loss of width ``D`` whose proxies' leading
            ``d_m`` columns are the proxies at width ``d_m`` (each cut L2-normalised where the loss normalises its
            proxies). For the proxy losses (subclasses of :class:`~lightning_dml.losses.proxies.ProxyLoss`) only.

    Under ``DMLModule(gather_distributed=True)`` it runs as the wrapped loss declares (``gather_mode``): with
    ``"references"`` every width's batch-wide counts are all-reduced by the wrapped loss itself, so the sum equals
    the single-process global-batch loss; with ``"global_batch"`` (Proxy-Anchor) every width sees the gathered batch;
    the per-sample proxy losses (``None``) are exact under DDP without gathering. Label sets, reference embeddings,
    miners and ``anchor_chunk_size`` are supported exactly where the wrapped loss supports them. Not supported:
    Partial FC's ``sharded`` proxies (refused), Cross-Batch Memory (refused inside it, and it refuses a
    MatryoshkaLoss).
    """

    # anatomy (see PairLoss): the class values are those of the default wrapped loss (multi-similarity); every
    # instance copies its wrapped loss's (set in __init__)
    normalize = True
    supports_ref = True
    needs_positive_pairs = True
    has_parameters = False
    needs_num_classes = False
    needs_embedding_dim = False
    required_sampler: str | None = None
    gather_mode: str | None = "references"
    supports_label_sets = True
    label_sets_reason: str | None = None
    supports_anchor_chunks = True
    supports_indices_tuple = True
    indices_tuple_reason: str | None = None

    def __init__(
        self,
        loss: nn.Module | str = "multi_similarity",
        widths: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
        tied: bool = False,
    ) -> None:
        super().__init__()
        where = "MatryoshkaLoss"
        if isinstance(loss, str):
            if loss == "matryoshka":
                raise ValueError(f"{where} cannot wrap itself: name the loss to apply at every width")
            loss = build_loss(loss)
        if not isinstance(loss, nn.Module) or isinstance(loss, MatryoshkaLoss):
            raise ValueError(f"{where} wraps a loss of lightning_dml.losses (not itself), got {type(loss).__name__}")
        if not isinstance(tied, bool):
            raise ValueError(f"{where}: tied must be true or false, got {tied!r}")
        self.widths = None if widths is None else check_widths(widths, where)
        if weights is not None:
            weights = [float(c) for c in weights]
            if self.widths is None or len(weights) != len(self.widths):
                raise ValueError(
                    f"{where}: weights need one value per width, got {len(weights)} weights for widths {self.widths}"
                )
            if any(not (c >= 0.0 and c < float("inf")) for c in weights) or not any(c > 0 for c in weights):
                raise ValueError(f"{where}: weights must be finite, >= 0 and not all 0, got {weights}")
        self.weights = weights
        self.tied = tied
        self.per_width = _has_parameters(loss)
        #: the full embedding width ``D`` (known from the embeddings, or from :meth:`complete`)
        self.embedding_dim: int | None = None
        self.losses: nn.ModuleList | None = None
        if self.per_width:
            self._check_wrapped_with_parameters(loss)
            self.__dict__["template"] = loss  # copied per width; not a submodule (its parameters never train)
            self.has_parameters = True
            self.needs_num_classes = bool(getattr(loss, "needs_num_classes", False))
            # the width alone is needed to make the copies when no num_classes is (the margin loss without
            # per-class margins); DMLModule then records it as ``embedding_size``
            self.needs_embedding_dim = not self.needs_num_classes
            if getattr(loss, "needs_class_counts", False):  # DynamicArcFace's margins: DMLModule sets the counts
                self.needs_class_counts = True
            self.loss = loss if tied else None
            if not tied and self.widths is not None:
                self._make_copies(self.widths)
            if tied and getattr(loss, "embedding_dim", None) is not None:
                self.embedding_dim = int(loss.embedding_dim)
            self.complete(getattr(loss, "num_classes", None))
            self.register_load_state_dict_pre_hook(_copies_from_state_dict)
        else:
            if tied:
                raise ValueError(
                    f"{where}: tied=True (MRL-E) ties proxies across widths; {type(loss).__name__} has none"
                )
            if not isinstance(loss, PairLoss):
                raise ValueError(
                    f"{where} cannot wrap {type(loss).__name__}: it is neither a pair loss (a PairLoss of "
                    "lightning_dml.losses) nor a loss with parameters"
                )
            self.loss = loss
        for name in _ANATOMY:
            setattr(self, name, getattr(loss, name, getattr(PairLoss, name)))

    def _check_wrapped_with_parameters(self, loss: nn.Module) -> None:
        """A loss with parameters can be wrapped when it has the sizes interface (``complete``) and is not
        sharded; ``tied`` needs a proxy loss. ``ValueError`` (one line) otherwise."""
        where, name = "MatryoshkaLoss", type(loss).__name__
        if not callable(getattr(loss, "complete", None)):
            raise ValueError(
                f"{where} cannot wrap {name}: its parameters have no complete(num_classes, embedding_dim) to build "
                "one copy per width"
            )
        if getattr(loss, "sharded", False):
            raise ValueError(
                f"{where} cannot wrap {name}(sharded=True): Partial FC's proxies split over the processes are not "
                "built per width; give sharded=False"
            )
        if self.tied and not isinstance(loss, ProxyLoss):
            raise ValueError(
                f"{where}: tied=True (MRL-E: one proxy matrix, its leading columns per width) needs a proxy loss, "
                f"{name} holds no proxy matrix"
            )
        if not self.tied and getattr(loss, "embedding_dim", None) is not None:
            raise ValueError(
                f"{where}: give {name} without embedding_dim (got {loss.embedding_dim}): every width d gets its own "
                "copy with embedding_dim = d (or set tied=True for one proxy matrix of the full width)"
            )

    def _make_copies(self, widths: list[int]) -> None:
        """One copy of the wrapped loss per width, each with ``embedding_dim = d`` (its parameters are created by
        ``complete`` once ``num_classes`` is known too)."""
        template = self.__dict__["template"]
        copies = []
        for width in widths:
            loss = copy.deepcopy(template)
            loss.complete(embedding_dim=width)
            copies.append(loss)
        self.losses = nn.ModuleList(copies)

    # ------------------------------------------------------------------ sizes (DMLModule's interface)
    def _first(self) -> nn.Module | None:
        """The shared or tied loss, else the first width's copy, else the wrapped loss as given."""
        if self.loss is not None:
            return self.loss
        return self.losses[0] if self.losses else self.__dict__.get("template")

    @property
    def num_classes(self) -> int | None:
        """The number of classes of the wrapped loss (per width, the same)."""
        return getattr(self._first(), "num_classes", None)

    @property
    def embedding_size(self) -> int | None:
        """``embedding_dim`` (the name ``DMLModule`` records for losses that need the width alone)."""
        return self.embedding_dim

    @property
    def class_counts(self) -> Tensor | None:
        """The wrapped loss's ``class_counts`` (DynamicArcFace's per-class margins)."""
        return getattr(self._first(), "class_counts", None)

    @property
    def is_complete(self) -> bool:
        """Whether every width's parameters exist."""
        if not self.per_width:
            return True
        if self.tied:
            return bool(self.loss.is_complete)
        return self.losses is not None and all(bool(getattr(f, "is_complete", True)) for f in self.losses)

    def complete(self, num_classes: int | None = None, embedding_dim: int | None = None) -> MatryoshkaLoss:
        """Fill in the sizes: ``num_classes`` for every width's copy, the full width ``D`` (which gives the default
        widths and must hold the largest one). A size given twice must agree. Returns ``self``."""
        where = "MatryoshkaLoss"
        if embedding_dim is not None:
            embedding_dim = int(embedding_dim)
            if self.embedding_dim is not None and self.embedding_dim != embedding_dim:
                raise ValueError(
                    f"{where} was built for embedding width D = {self.embedding_dim}, but the model gives "
                    f"{embedding_dim}"
                )
            if self.widths is not None:
                check_width_fits(self.widths[-1], embedding_dim, where)
            self.embedding_dim = embedding_dim
        if not self.per_width:
            return self
        if self.tied:
            self.loss.complete(num_classes=num_classes, embedding_dim=self.embedding_dim)
            if self.widths is not None and self.loss.embedding_dim is not None:
                check_width_fits(self.widths[-1], self.loss.embedding_dim, where)
            return self
        if self.losses is None and self.embedding_dim is not None:
            self._make_copies(default_widths(self.embedding_dim))
        if self.losses is not None and num_classes is not None:
            widths = self.widths or default_widths(self.embedding_dim)
            for loss, width in zip(self.losses, widths):
                loss.complete(num_classes=num_classes, embedding_dim=width)
        return self

    def set_class_counts(self, counts: Sequence[int] | Tensor) -> MatryoshkaLoss:
        """The wrapped loss's ``set_class_counts`` for every width (DynamicArcFace's margins)."""
        for loss in self.trained_copies():
            loss.set_class_counts(counts)
        return self

    def reset_parameters(self) -> None:
        """(Re-)initialise every width's parameters (``DMLModule`` does so for each level's copy)."""
        for loss in self.trained_copies():
            if hasattr(loss, "reset_parameters"):
                loss.reset_parameters()

    def trained_copies(self) -> list[nn.Module]:
        """The loss modules that hold this loss's parameters: one per width, the tied one, or the shared one."""
        if self.losses is not None:
            return list(self.losses)
        return [] if self.loss is None else [self.loss]

    def extra_repr(self) -> str:
        tied = ", tied=True" if self.tied else ""
        return f"widths={self.widths}, weights={self.weights}{tied}"

    def set_anchor_chunk_size(self, value: int | None) -> None:
        """The wrapped loss's ``anchor_chunk_size`` (every width is scored in chunks of anchors)."""
        if self.loss is None or self.tied or not hasattr(self.loss, "set_anchor_chunk_size"):
            raise ValueError(
                f"MatryoshkaLoss({type(self.__dict__.get('template', self.loss)).__name__}) does not take "
                "anchor_chunk_size: its wrapped loss scores the batch against its parameters"
            )
        self.loss.set_anchor_chunk_size(value)

    def widths_for(self, dim: int) -> list[int]:
        """The widths used for embeddings of width ``dim``; ``ValueError`` when one exceeds it, or when the
        per-width losses were built for another embedding width."""
        if self.per_width and self.embedding_dim is not None and dim != self.embedding_dim and self.widths is None:
            raise ValueError(
                f"MatryoshkaLoss: its per-width losses were built for embedding width D = {self.embedding_dim} "
                f"(widths {default_widths(self.embedding_dim)}), the embeddings have width {dim}"
            )
        widths = default_widths(dim) if self.widths is None else self.widths
        check_width_fits(widths[-1], dim, "MatryoshkaLoss")
        return widths

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
        indices_tuple: tuple[Tensor, ...] | None = None,
    ) -> Tensor:
        """``sum_m c_m loss_m(embeddings[:, :d_m], labels, ref_embeddings[:, :d_m], ref_labels, indices_tuple)``."""
        if isinstance(ref_embeddings, (tuple, list)):  # pml's order: (embeddings, labels, indices_tuple, ref_emb, ...)
            indices_tuple, ref_embeddings, ref_labels = ref_embeddings, ref_labels, indices_tuple  # type: ignore
        check_embeddings(embeddings, "embeddings", where="MatryoshkaLoss")
        widths = self.widths_for(embeddings.shape[1])
        ref_dim = ref_embeddings.shape[1] if isinstance(ref_embeddings, Tensor) and ref_embeddings.ndim == 2 else None
        if ref_dim is not None and ref_dim != embeddings.shape[1]:
            raise ValueError(
                f"MatryoshkaLoss: ref_embeddings have dim {ref_embeddings.shape[1]} but embeddings have dim "
                f"{embeddings.shape[1]}"
            )
        weights = self.weights or [1.0] * len(widths)
        if self.tied:
            return self._tied(embeddings, labels, ref_embeddings, ref_labels, indices_tuple, widths, weights)
        if self.per_width and not self.is_complete:
            raise ValueError(self._incomplete_message())
        losses = list(self.losses) if self.per_width else [self.loss] * len(widths)
        total: Tensor | None = None
        for width, weight, loss in zip(widths, weights, losses):
            ref = None if ref_embeddings is None else ref_embeddings[:, :width]
            value = loss(embeddings[:, :width], labels, ref, ref_labels, indices_tuple=indices_tuple)
            term = value * weight
            total = term if total is None else total + term
        assert total is not None
        return total

    def _incomplete_message(self) -> str:
        name = type(self.__dict__["template"]).__name__
        missing = "num_classes" if self.losses is not None else "num_classes and the embedding width"
        return (
            f"MatryoshkaLoss({name}) has no per-width {name} yet: {missing} unknown. Give num_classes to the wrapped "
            "loss and widths, call complete(num_classes, embedding_dim), or train it with DMLModule, which fills "
            "them in"
        )

    def _tied(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None,
        ref_labels: Tensor | None,
        indices_tuple: tuple[Tensor, ...] | None,
        widths: list[int],
        weights: list[float],
    ) -> Tensor:
        """MRL-E: the proxy loss at width ``d`` with the leading ``d`` columns of its one proxy matrix (the checks
        of :meth:`ProxyLoss.forward`, then its ``proxy_loss`` on each cut)."""
        loss = self.loss
        name = f"MatryoshkaLoss({type(loss).__name__}, tied=True)"
        refuse_indices_tuple(loss, indices_tuple, ref_embeddings)
        if ref_embeddings is not None or ref_labels is not None:
            raise ValueError(f"{name} scores the batch against its class proxies and takes no ref_embeddings")
        if not loss.is_complete:
            raise ValueError(self._incomplete_message())
        if isinstance(labels, Tensor) and labels.ndim == 2:
            raise label_sets_error(loss, tuple(labels.shape))
        loss.check_batch(embeddings, labels, name)
        total: Tensor | None = None
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            for width, weight in zip(widths, weights):
                x = normalize_embeddings(embeddings[:, :width])
                term = loss.proxy_loss(x, loss.proxies[:, :width].to(x.dtype), labels) * weight
                total = term if total is None else total + term
        assert total is not None
        return upcast(total)


def _copies_from_state_dict(module: MatryoshkaLoss, state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook: a wrapper whose per-width copies do not exist yet makes them for the widths of the
    state dict (its own ``widths``, else those of the saved parameters' last width ``D``); each copy then takes its
    sizes from its saved parameters (their own pre-hooks)."""
    if module.tied or module.losses is not None:
        return
    keys = [k[len(prefix):].split(".") for k in state_dict if k.startswith(prefix + "losses.")]
    count = len({k[1] for k in keys if len(k) > 2})
    if count == 0:
        return
    widths = module.widths
    if widths is None:
        last = state_dict.get(f"{prefix}losses.{count - 1}.proxies")
        if isinstance(last, Tensor) and last.ndim == 2 and len(default_widths(last.shape[1])) == count:
            module.embedding_dim = int(last.shape[1])
            widths = default_widths(module.embedding_dim)
    if widths is not None and len(widths) == count:
        module._make_copies(widths)
