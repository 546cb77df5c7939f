"""Self-supervised wrapper: a pair loss on several augmented views of each item, the other views its positives
(pytorch-metric-learning's ``SelfSupervisedLoss``; SimCLR's setting, Chen et al., ICML 2020, Sec. 2.1)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_dml.losses.base import PairLoss, label_sets_error, refuse_indices_tuple
from lightning_dml.losses.registry import build_loss, register_loss

__all__ = ["SelfSupervisedLoss", "view_labels"]


def view_labels(items: int, views: int, device: torch.device | None = None) -> Tensor:
    """Item ids of ``views`` blocks of ``items`` views each, view-major: ``[0 .. n-1, 0 .. n-1, ...]``."""
    return torch.arange(items, device=device).repeat(views)


@register_loss("self_supervised")
class SelfSupervisedLoss(nn.Module):
    r"""A pair loss trained on ``V >= 2`` augmented views of every item: an item's other views are its positives,
    every view of another item a negative (pml's ``SelfSupervisedLoss``; SimCLR's two views, Sec. 2.1).

    Called as every loss, ``loss(embeddings, labels)``, where the labels are **item ids**: the ``V`` views of an
    item share its id. The data modules' ``views: V`` option yields such batches (the items of a training batch,
    each ``V`` times with its own random augmentation, labelled by the item's index in the training split; the
    class labels are not used). Every id must occur exactly ``V`` times (``views``, or the count of the first id
    when ``views`` is left out), else one ``ValueError`` names the counts: a P x K batch of class labels with
    ``K != V`` is caught, one with ``K = V`` is not (the two cannot be told apart from the labels), so train with the
    data module's ``views``. The value is then ``loss(embeddings, labels)`` of the wrapped loss.

    pml's ``SelfSupervisedLoss(inner)(emb, ref_emb)`` (``symmetric=True``, its default) is
    ``inner(cat([emb, ref_emb]), cat([arange(n), arange(n)]))``: :meth:`forward_views` ``(emb, ref_emb, ...)`` here,
    for any number of views. pml's ``symmetric=False`` (only the first view as anchors) is not implemented.

    Args:
        loss: the wrapped pair loss, a :class:`~lightning_dml.losses.base.PairLoss` or a registry name built with
            its defaults (``"ntxent"``, SimCLR's loss, by default).
        views: ``V``, or ``None`` to read it from the batch.

    DDP: with ``gather_distributed`` every process computes the loss of the gathered global batch
    (``gather_mode = "global_batch"``: the views of an item stay on one process); a wrapped loss that cannot gather
    makes the wrapper refuse it too. Label sets and reference embeddings are rejected. Degenerate batches are the
    wrapped loss's (identical views: its value at zero distance of the positives).
    """

    normalize = True
    supports_ref = False
    needs_positive_pairs = True
    has_parameters = False
    needs_num_classes = False
    needs_embedding_dim = False
    required_sampler = None
    #: the wrapped loss's own choice decides per instance (``None`` when it cannot gather)
    gather_mode: str | None = "global_batch"
    supports_label_sets = False
    label_sets_reason = "its labels are item ids, one per item (the views of an item share it)"
    indices_tuple_reason = "its pairs are the views of each item, set by the view labels"

    def __init__(self, loss: PairLoss | str = "ntxent", views: int | None = None) -> None:
        super().__init__()
        if isinstance(loss, str):
            loss = build_loss(loss)
        if not isinstance(loss, PairLoss):
            raise ValueError(f"SelfSupervisedLoss wraps a pair loss (a PairLoss), got {type(loss).__name__}")
        if views is not None and (isinstance(views, bool) or int(views) != views or views < 2):
            raise ValueError(f"SelfSupervisedLoss: views must be an integer >= 2, got {views!r}")
        self.loss = loss
        self.views = None if views is None else int(views)
        self.gather_mode = "global_batch" if loss.gather_mode is not None else None

    def extra_repr(self) -> str:
        return f"views={self.views}"

    def check_views(self, labels: Tensor) -> int:
        """``V``: every item id in ``labels`` must occur exactly ``V >= 2`` times; ``ValueError`` otherwise."""
        _, counts = torch.unique(labels, return_counts=True)
        low, high = (int(v) for v in torch.aminmax(counts))
        want = self.views if self.views is not None else high
        if low != want or high != want or want < 2:
            raise ValueError(
                f"SelfSupervisedLoss: every item id must occur exactly {want if want >= 2 else 'V >= 2'} times (the "
                f"item's views), got {labels.numel()} labels with counts from {low} to {high}. Train with the data "
                "module's views option (--data.init_args.views 2), whose batches are labelled by item"
            )
        return want

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
        indices_tuple: tuple[Tensor, ...] | None = None,
    ) -> Tensor:
        refuse_indices_tuple(self, indices_tuple, ref_embeddings)  # a miner's tuple: the one-line refusal
        if any(isinstance(t, Tensor) and t.ndim == 2 for t in (labels, ref_labels)):
            raise label_sets_error(self, tuple(labels.shape))
        if ref_embeddings is not None or ref_labels is not None:
            raise ValueError(
                "SelfSupervisedLoss takes no ref_embeddings / ref_labels: give every view in the batch (forward_views)"
            )
        if isinstance(labels, Tensor) and labels.ndim == 1 and labels.numel() and not labels.is_floating_point():
            self.check_views(labels)
        return self.loss(embeddings, labels)  # the wrapped loss validates shapes, dtypes and values

    def forward_views(self, *views: Tensor) -> Tensor:
        """pml's call: ``V >= 2`` tensors ``[n, D]``, view ``v`` of item ``i`` in row ``i`` of the ``v``-th."""
        if len(views) < 2 or len({tuple(v.shape) for v in views}) != 1:
            raise ValueError(
                f"SelfSupervisedLoss.forward_views needs at least two views of the same shape, got shapes "
                f"{[tuple(v.shape) for v in views]}"
            )
        return self(torch.cat(views), view_labels(views[0].shape[0], len(views), views[0].device))
