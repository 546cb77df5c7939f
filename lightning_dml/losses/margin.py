"""Margin loss with learnable margins (Wu et al., "Sampling Matters in Deep Embedding Learning", ICCV 2017)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_dml.losses.base import PairLoss, batch_normaliser, distance_from_similarity, similarity_matrix
from lightning_dml.losses.registry import register_loss
from lightning_dml.miners import distance_weighted_sampling, label_masks

__all__ = ["MarginLoss"]

_SAMPLING = ("distance_weighted", "all")


@register_loss("margin")
class MarginLoss(PairLoss):
    r"""Margin loss (Sampling-Matters Eqs. 4-5) on distance-weighted samples (Sec. 4, Eqs. 3-4).

    Distance: Euclidean ``D_ij = ||f_i - f_j||`` of L2-normalised embeddings. A pair ``(i, j)`` with
    ``y_ij = +1`` (same class) or ``-1`` costs

    .. math::
        \ell(i, j) = \big[\alpha + y_{ij} (D_{ij} - \beta_{c(i)})\big]_+

    (Eq. 4) with a learnable boundary ``beta`` per class of the anchor (Eq. 5's ``beta^(0) + beta^(class)``;
    the authors' code learns one ``beta`` per class, initialised to 1.2, which is the same model) and the
    regulariser ``nu * beta`` (Eq. 5). As in the authors' code (and pytorch-metric-learning), each positive pair
    ``(a, p)`` is matched with one negative ``n`` and the loss is

    .. math::
        L = \frac{\sum_{(a,p,n)} \big(\ell(a,p) + \ell(a,n) + \nu \beta_{c(a)}\big)}{\#\{\text{non-zero } \ell\}}

    ``sampling="distance_weighted"`` draws ``n`` with probability ``∝ q(D_an)^{-1}``
    (:func:`lightning_dml.miners.distance_weighted_sampling`, clip ``cutoff = 0.5``, negatives beyond
    ``nonzero_loss_cutoff = 1.4`` skipped, as the authors' code); ``sampling="all"`` uses every triplet
    (computed from per-anchor counts, ``B x N`` work, pml's ``triplets_per_anchor="all"``).

    Args:
        num_classes: number of classes (one ``beta`` each); filled in by ``DMLModule`` when left out. Labels must
            then be class indices in ``[0, num_classes)`` (``DMLModule`` maps them).
        embedding_dim: accepted for the common interface of losses with parameters (unused: the sampling reads
            the width from the embeddings).
        alpha: margin (paper 0.2).
        beta: initial ``beta`` (paper 1.2).
        nu: regularisation of ``beta`` (Eq. 5; the authors' code and pml default to 0).
        class_margins: one ``beta`` per class (default); ``False``: one shared ``beta`` (``beta^(0)`` only, no
            ``num_classes`` needed).
        learn_beta: train ``beta`` (True) or keep it fixed.
        sampling: ``"distance_weighted"`` or ``"all"``.
        cutoff, nonzero_loss_cutoff: the sampler's distance clip and range (above).
        seed: seed of the loss's own generator for the draw; None (default) uses torch's global generator
            (seeded by Lightning's ``seed_everything``).

    Under ``DMLModule(gather_distributed=True)`` the distance-weighted loss is computed on the gathered global
    batch by every process (``gather_mode = "global_batch"``): exact when every process draws the same sample,
    which a ``seed`` guarantees (torch's global generator only if its state is the same on every process).
    ``sampling="all"`` is deterministic (``gather_mode = "references"``).

    Degenerate batches: no positive pair, or no negative -> no triplet -> 0 with zero gradient (also for
    ``nu > 0``).
    """

    needs_positive_pairs = True
    has_parameters = True
    #: per-class margins (the default) need the number of classes; an instance with ``class_margins=False`` does not
    needs_num_classes = True
    #: the class default (distance-weighted sampling): every process computes the loss of the gathered global
    #: batch, so the random draw is the single-process one; ``sampling="all"`` is deterministic and runs as
    #: ``"references"`` (a sum over triplets divided by the all-reduced count of non-zero terms)
    gather_mode = "global_batch"
    label_sets_reason = (
        "its margin beta is learned per class (class_margins=True, Sampling-Matters Eq. 5: beta(class)); with "
        "class_margins=False it only asks which pairs are positive, but label sets are not implemented for it yet"
    )

    def __init__(
        self,
        num_classes: int | None = None,
        embedding_dim: int | None = None,
        alpha: float = 0.2,
        beta: float = 1.2,
        nu: float = 0.0,
        class_margins: bool = True,
        learn_beta: bool = True,
        sampling: str = "distance_weighted",
        cutoff: float = 0.5,
        nonzero_loss_cutoff: float = 1.4,
        seed: int | None = None,
    ) -> None:
        super().__init__()
        if alpha < 0 or nu < 0:
            raise ValueError(f"alpha and nu must be >= 0, got alpha={alpha}, nu={nu}")
        if sampling not in _SAMPLING:
            raise ValueError(f"sampling must be one of {_SAMPLING}, got {sampling!r}")
        if not 0 <= cutoff < nonzero_loss_cutoff:
            raise ValueError(f"need 0 <= cutoff < nonzero_loss_cutoff, got {cutoff} and {nonzero_loss_cutoff}")
        self.alpha, self.beta_init, self.nu = float(alpha), float(beta), float(nu)
        self.class_margins, self.learn_beta, self.sampling = class_margins, learn_beta, sampling
        self.cutoff, self.nonzero_loss_cutoff = float(cutoff), float(nonzero_loss_cutoff)
        self.seed = seed
        self._generator: torch.Generator | None = None
        self.gather_mode = "references" if sampling == "all" else "global_batch"
        #: per-class margins need the number of classes (DMLModule fills it in)
        self.needs_num_classes = class_margins
        self.num_classes: int | None = None
        self.embedding_dim = embedding_dim
        if learn_beta:
            self.register_parameter("beta", None)
        else:
            self.register_buffer("beta", None)
        self.register_load_state_dict_pre_hook(_create_beta_from_state_dict)
        self.complete(num_classes if class_margins else None, embedding_dim)
        if not class_margins:
            self._make_beta(1)

    def extra_repr(self) -> str:
        return (
            f"num_classes={self.num_classes}, alpha={self.alpha}, beta={self.beta_init}, nu={self.nu}, "
            f"class_margins={self.class_margins}, learn_beta={self.learn_beta}, sampling={self.sampling!r}"
        )

    # ------------------------------------------------------------------ parameters
    def _make_beta(self, size: int) -> None:
        value = torch.full((size,), self.beta_init)
        self.beta = nn.Parameter(value) if self.learn_beta else value

    def reset_parameters(self) -> None:
        """(Re-)initialise ``beta`` to its initial value (``DMLModule`` does so for each level's own copy)."""
        if self.beta is not None:
            with torch.no_grad():
                self.beta.fill_(self.beta_init)

    @property
    def is_complete(self) -> bool:
        """Whether ``beta`` exists."""
        return self.beta is not None

    def complete(self, num_classes: int | None = None, embedding_dim: int | None = None) -> MarginLoss:
        """Fill in ``num_classes`` (and record ``embedding_dim``) and create the per-class ``beta``; a size given
        twice must agree. Returns ``self``."""
        name = type(self).__name__
        if embedding_dim is not None:
            self.embedding_dim = int(embedding_dim)
        if num_classes is None or not self.class_margins:
            return self
        if isinstance(num_classes, bool) or int(num_classes) != num_classes or num_classes < 1:
            raise ValueError(f"{name}: num_classes must be an integer >= 1, got {num_classes!r}")
        if self.num_classes is not None and self.num_classes != num_classes:
            raise ValueError(
                f"{name} was configured with num_classes={self.num_classes}, but the model gives "
                f"num_classes={num_classes} (classes of the training split): leave num_classes out of the loss "
                "config, or make the two agree"
            )
        self.num_classes = int(num_classes)
        if self.beta is None:
            self._make_beta(self.num_classes)
        return self

    # ------------------------------------------------------------------ loss
    def compute(self, anchors: Tensor, labels: Tensor, gallery: Tensor | None, gallery_labels: Tensor) -> Tensor:
        name = type(self).__name__
        if self.beta is None:
            raise ValueError(
                f"{name} has no beta yet: num_classes unknown. Pass it to the constructor, call complete(...), "
                "train it with DMLModule (which fills it in), or use class_margins=False"
            )
        if self.class_margins:
            lo, hi = (int(v) for v in torch.aminmax(labels))
            if lo < 0 or hi >= self.num_classes:
                raise ValueError(
                    f"{name} takes labels that are class indices in [0, num_classes={self.num_classes}), got "
                    f"labels from {lo} to {hi}"
                )
        g = anchors if gallery is None else gallery
        dist = distance_from_similarity(similarity_matrix(anchors, g))
        beta = self.beta.to(dist.dtype)
        beta_a = beta[labels] if self.class_margins else beta.expand(labels.shape[0])
        if self.sampling == "all":
            return self._all_triplets(dist, labels, gallery_labels, beta_a)
        a, p, n = distance_weighted_sampling(
            dist, labels, gallery_labels, dim=anchors.shape[1], cutoff=self.cutoff,
            nonzero_loss_cutoff=self.nonzero_loss_cutoff, generator=self._get_generator(dist.device),
        )
        return self.triplet_loss(dist[a, p], dist[a, n], beta_a[a])

    def _get_generator(self, device: torch.device) -> torch.Generator | None:
        """The loss's own generator when ``seed`` is set (created on first use on the embeddings' device)."""
        if self.seed is None:
            return None
        if self._generator is None or self._generator.device != device:
            self._generator = torch.Generator(device=device).manual_seed(self.seed)
        return self._generator

    def triplet_loss(self, d_ap: Tensor, d_an: Tensor, beta: Tensor) -> Tensor:
        """Margin loss of given triplets from their distances and the anchors' ``beta`` (all ``[T]``)."""
        pos_l = torch.relu(d_ap - beta + self.alpha)
        neg_l = torch.relu(beta - d_an + self.alpha)
        count = (pos_l > 0).sum() + (neg_l > 0).sum()
        total = pos_l.sum() + neg_l.sum() + self.nu * beta.sum()
        return total / batch_normaliser(count, total)

    def _all_triplets(self, dist: Tensor, labels: Tensor, gallery_labels: Tensor, beta_a: Tensor) -> Tensor:
        """Every triplet ``(a, p, n)``: each positive term counts ``|Neg(a)|`` times, each negative ``|Pos(a)|``."""
        pos, neg = label_masks(labels, gallery_labels)
        n_pos, n_neg = pos.sum(dim=1).to(dist.dtype), neg.sum(dim=1).to(dist.dtype)
        pos_l = torch.where(pos, torch.relu(dist - beta_a[:, None] + self.alpha), 0.0)
        neg_l = torch.where(neg, torch.relu(beta_a[:, None] - dist + self.alpha), 0.0)
        total = (pos_l.sum(dim=1) * n_neg + neg_l.sum(dim=1) * n_pos + self.nu * beta_a * n_pos * n_neg).sum()
        count = ((pos_l > 0).sum(dim=1) * n_neg + (neg_l > 0).sum(dim=1) * n_pos).sum()
        return total / batch_normaliser(count, total)


def _create_beta_from_state_dict(module: MarginLoss, state_dict: dict, prefix: str, *args) -> None:
    """Load-state-dict pre-hook: an incomplete loss takes ``num_classes`` from the ``beta`` being loaded."""
    saved = state_dict.get(prefix + "beta")
    if module.beta is None and isinstance(saved, Tensor) and saved.ndim == 1:
        module.complete(saved.shape[0])
