"""Matryoshka Representation Learning: one embedding whose leading ``d`` dimensions are an embedding of their own.

Kusupati et al., "Matryoshka Representation Learning", NeurIPS 2022, Eq. (1):
``min (1/N) sum_i sum_{m in M} c_m L(W^(m) F(x_i; theta)_{1:m}; y_i)`` over nested widths ``M = {d_1 < ... <= D}``
with relative importances ``c_m`` (1 each in the paper's experiments). Here ``L`` is any registered pair loss
(:class:`~lightning_dml.losses.base.PairLoss`) applied to the cut embedding ``z[:, :m]``; sentence-transformers'
``MatryoshkaLoss`` does the same for its text losses.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from lightning_dml.input_checks import check_embeddings
from lightning_dml.losses.base import PairLoss
from lightning_dml.losses.registry import build_loss, register_loss
from lightning_dml.widths import check_width_fits, check_widths

__all__ = ["MatryoshkaLoss", "default_widths"]


def default_widths(dim: int) -> list[int]:
    """The widths used when none are given: ``D/8, D/4, D/2, D`` (integer halvings of ``D``, those ``>= 1``)."""
    return sorted({dim >> s for s in (3, 2, 1, 0) if dim >> s >= 1})


@register_loss("matryoshka")
class MatryoshkaLoss(nn.Module):
    r"""A pair loss applied to the leading ``d_1 < d_2 < ... <= D`` dimensions of the embedding, weighted and summed
    (Kusupati et al., NeurIPS 2022, Eq. (1)): ``sum_m c_m loss(z[:, :d_m], labels)``.

    Each cut is handed to the wrapped loss as raw embeddings, so it is L2-normalised exactly where the wrapped loss
    normalises (its own ``normalize``; N-pair does not). Reference embeddings (cross-batch memory, DDP's gathered
    rows) are cut the same way, and a miner's ``indices_tuple`` is passed to every width (it was mined on the full
    embedding: ``DMLModule`` runs the miner once).

    Args:
        loss: the wrapped loss, a :class:`~lightning_dml.losses.base.PairLoss` or a registry name built with its
            defaults. Losses with parameters (proxies, class weights: ArcFace, Proxy-Anchor, ...) are refused: the
            paper gives each width its own classifier ``W^(m)``, which this wrapper does not build.
        widths: the nested widths ``d_1 < ... <= D``; ``None``: ``D/8, D/4, D/2, D`` of the embedding it is given.
        weights: ``c_m``, one non-negative number per width (default 1 each, as the paper).

    Under ``DMLModule(gather_distributed=True)`` it runs as the wrapped loss declares (``gather_mode``): with
    ``"references"`` every width's batch-wide counts are all-reduced by the wrapped loss itself, so the sum equals
    the single-process global-batch loss. Label sets, reference embeddings, miners and ``anchor_chunk_size`` are
    supported exactly where the wrapped loss supports them.
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
        loss: PairLoss | str = "multi_similarity",
        widths: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
    ) -> None:
        super().__init__()
        where = "MatryoshkaLoss"
        if isinstance(loss, str):
            if loss == "matryoshka":
                raise ValueError(f"{where} cannot wrap itself: name the loss to apply at every width")
            loss = build_loss(loss)
        if not isinstance(loss, nn.Module):
            raise ValueError(
                f"{where} wraps a pair loss (a PairLoss of lightning_dml.losses), got {type(loss).__name__}"
            )
        if getattr(loss, "has_parameters", False) or getattr(loss, "needs_num_classes", False) or any(
            True for _ in loss.parameters()
        ):
            raise ValueError(
                f"{where} cannot wrap {type(loss).__name__}: its parameters (proxies, class weights) have one width, "
                "and one loss per width (the paper's W^(m)) is not implemented; wrap a pair loss without parameters"
            )
        if not isinstance(loss, PairLoss):
            raise ValueError(
                f"{where} wraps a pair loss (a PairLoss of lightning_dml.losses), got {type(loss).__name__}"
            )
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
        self.loss = loss
        for name in (
            "normalize", "supports_ref", "needs_positive_pairs", "required_sampler", "gather_mode",
            "supports_label_sets", "label_sets_reason", "supports_anchor_chunks", "supports_indices_tuple",
            "indices_tuple_reason",
        ):
            setattr(self, name, getattr(loss, name, getattr(PairLoss, name)))

    def extra_repr(self) -> str:
        return f"widths={self.widths}, weights={self.weights}"

    def set_anchor_chunk_size(self, value: int | None) -> None:
        """The wrapped loss's ``anchor_chunk_size`` (every width is scored in chunks of anchors)."""
        self.loss.set_anchor_chunk_size(value)

    def widths_for(self, dim: int) -> list[int]:
        """The widths used for embeddings of width ``dim``; ``ValueError`` when one exceeds it."""
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
        """``sum_m c_m loss(embeddings[:, :d_m], labels, ref_embeddings[:, :d_m], ref_labels, indices_tuple)``."""
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
        total: Tensor | None = None
        for width, weight in zip(widths, weights):
            ref = None if ref_embeddings is None else ref_embeddings[:, :width]
            value = self.loss(embeddings[:, :width], labels, ref, ref_labels, indices_tuple=indices_tuple)
            term = value * weight
            total = term if total is None else total + term
        assert total is not None
        return total
