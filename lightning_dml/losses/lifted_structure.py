"""Lifted structure losses: the original (Song et al.), the GPW form (GPW Eq. 14), the generalised per-anchor form
(MS Eq. 6 / Hermans et al.) and LiftedStruct* (MS Eq. 16)."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.losses.base import PairLoss, batch_normaliser, check_inputs, distance_from_similarity, masked_lse
from lightning_dml.losses.base import normalize_embeddings, refuse_indices_tuple, similarity_matrix, upcast
from lightning_dml.losses.chunking import anchor_blocks, anchor_chunked_loss
from lightning_dml.losses.registry import register_loss
from lightning_dml.miners import label_masks

__all__ = ["LiftedStructureLoss"]

_VARIANTS = ("original", "gpw", "generalized", "star")


@register_loss("lifted_structure")
class LiftedStructureLoss(PairLoss):
    r"""Lifted structure loss, one of four variants.

    * ``"original"`` (Song et al. 2016, quoted in SPEC 2.2/4.1): with ``a_i = log sum_{k in Neg(i)} e^{m - D_ik}``,
      ``J_ij = log(e^{a_i} + e^{a_j}) + D_ij`` and ``L = 1/(2|P|) sum_{(i,j) in P} [J_ij]_+^2`` over the ordered
      positive pairs ``P`` (the union of both negative sets inside one log, squared hinge).
    * ``"gpw"`` (GPW Eq. 14): ``[D_ij + a_i + a_j]_+`` (two separate logs, no square), averaged over the ordered
      positive pairs (GPW writes a sum; the mean keeps the scale independent of the batch size).
    * ``"generalized"`` (MS Eq. 6 in distance form, Hermans et al.):
      ``L = 1/B sum_i [log sum_{Pos(i)} e^{D_ij} + log sum_{Neg(i)} e^{m - D_ik}]_+``.
    * ``"star"`` (LiftedStruct*, MS Eq. 16, cosine similarity, no hinge, no "+1"):
      ``L = 1/B sum_i {(1/alpha) log sum_{Pos(i)} e^{-alpha S_ik} + (1/beta) log sum_{Neg(i)} e^{beta S_ik}}``.

    Distance: Euclidean ``D`` of L2-normalised embeddings (``"star"``: cosine ``S``).

    Args:
        margin: ``m`` of the first three variants (original paper 1.0).
        variant: one of ``"original"``, ``"gpw"``, ``"generalized"``, ``"star"``.
        alpha, beta: scales of ``"star"`` (MS Table 2: 2 and 50).
        anchor_chunk_size: as in the other pair losses (:mod:`lightning_dml.losses.chunking`). ``"original"`` and
            ``"gpw"`` couple the rows of both items of a pair through ``a_j``: a chunked call first computes every
            item's ``a`` and ``G_j = dL/da_j`` block by block without a graph; each block then scores its pairs
            with ``a`` fixed and adds ``sum_i G_i (a_i - a_i.detach())`` over its own rows (value 0), whose gradient
            is the chain-rule term through ``a``: the unchunked value and gradients, at two more loss passes.

    ``"original"`` and ``"gpw"`` need the negatives of the positive item ``j`` too, so they cannot score against
    reference items (ValueError); ``"generalized"`` and ``"star"`` can.

    Degenerate batches: no positive pair -> 0. An anchor without negatives has ``a_i = -inf`` (its log-sum is
    empty): in ``"original"`` the pair keeps ``a_j``, and a pair with neither anchor having negatives gives 0; in
    ``"gpw"`` and ``"generalized"`` such a term is 0; in ``"star"`` an empty set contributes 0.
    """

    #: label sets ([B, L], positive = the sets intersect): the loss only asks which pairs are positive
    supports_label_sets = True

    def __init__(
        self,
        margin: float = 1.0,
        variant: str = "original",
        alpha: float = 2.0,
        beta: float = 50.0,
        anchor_chunk_size: int | None = None,
    ) -> None:
        super().__init__()
        if variant not in _VARIANTS:
            raise ValueError(f"variant must be one of {_VARIANTS}, got {variant!r}")
        if not alpha > 0 or not beta > 0:
            raise ValueError(f"alpha and beta must be > 0, got alpha={alpha}, beta={beta}")
        self.margin, self.variant, self.alpha, self.beta = float(margin), variant, float(alpha), float(beta)
        self.supports_ref = variant in ("generalized", "star")
        # original / gpw couple anchor i's and j's negative sets in one pair term: the global batch is gathered
        self.gather_mode = "references" if self.supports_ref else "global_batch"
        self.supports_anchor_chunks = True  # original / gpw: their per-item a_j computed over all blocks first
        self.set_anchor_chunk_size(anchor_chunk_size)

    def extra_repr(self) -> str:
        return f"margin={self.margin}, variant={self.variant!r}, alpha={self.alpha}, beta={self.beta}"

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
        indices_tuple: tuple[Tensor, ...] | None = None,
    ) -> Tensor:
        refuse_indices_tuple(self, indices_tuple, ref_embeddings)  # a miner's tuple: the one-line refusal
        chunk = self.anchor_chunk_size
        if self.supports_ref or chunk is None or embeddings.shape[0] <= chunk or ref_embeddings is not None:
            return super().forward(embeddings, labels, ref_embeddings, ref_labels)
        check_inputs(embeddings, labels, where=type(self).__name__, label_sets=True)
        with torch.autocast(device_type=embeddings.device.type, enabled=False):
            x = normalize_embeddings(embeddings)
            a, has_neg, grad_a = self._item_terms(x, labels, chunk)
            # each block's gallery comes reordered: the items' indices travel with their labels
            index = torch.arange(x.shape[0], device=x.device)
            keyed = torch.cat([index[:, None], labels.reshape(x.shape[0], -1)], dim=1)

            def block(anchors: Tensor, keys: Tensor, gallery: Tensor, gallery_keys: Tensor) -> Tensor:
                return self._pair_block(anchors, keys, gallery, gallery_keys, a, has_neg, grad_a, labels.ndim)

            loss = anchor_chunked_loss(block, x, keyed, None, keyed, chunk, [], batch_normaliser)
        return upcast(loss)

    def _pair_terms(self, sim: Tensor, pos: Tensor, ai: Tensor, aj: Tensor, hi: Tensor, hj: Tensor) -> Tensor:
        """Sum of the ``"original"`` / ``"gpw"`` pair terms of ``sim`` given the items' ``a`` and ``has_neg``."""
        dist = distance_from_similarity(sim)
        if self.variant == "gpw":
            ok = pos & hi & hj
            return torch.relu(torch.where(ok, dist + ai + aj, 0.0)).sum()
        both = torch.logaddexp(torch.where(hi, ai, -1e30), torch.where(hj, aj, -1e30))
        hinge = torch.relu(torch.where(pos & (hi | hj), both + dist, 0.0))
        return (hinge * hinge).sum() / 2

    def _rows(self, anchors: Tensor, gallery: Tensor, labels: Tensor, gallery_labels: Tensor):
        """Similarities, masks and ``a_i`` (``-inf`` without negatives) of the anchors' rows."""
        sim = similarity_matrix(anchors, gallery)
        pos, neg = label_masks(labels, gallery_labels)
        has_neg = neg.any(1)
        a = torch.where(has_neg, masked_lse(self.margin - distance_from_similarity(sim), neg), 0.0)
        return sim, pos, a, has_neg

    def _item_terms(self, x: Tensor, labels: Tensor, chunk: int) -> tuple[Tensor, Tensor, Tensor]:
        """Every item's ``a`` and ``has_neg`` and ``G = dL/da`` (no graph), one block of rows at a time."""
        spans = anchor_blocks(x.shape[0], x.shape[0], chunk, x.device)
        with torch.no_grad():
            rows = [self._rows(x[s:e], x[order], labels[s:e], labels[order])[2:] for s, e, order in spans]
            a, has_neg = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        count = torch.zeros((), dtype=torch.long, device=x.device)
        grad_a = torch.zeros_like(a)
        with torch.enable_grad():
            for s, e, order in spans:
                leaf = a.detach().requires_grad_(True)
                with torch.no_grad():
                    sim, pos, _, _ = self._rows(x[s:e], x[order], labels[s:e], labels[order])
                count += pos.sum()
                terms = self._pair_terms(sim, pos, leaf[s:e, None], leaf[order][None, :], has_neg[s:e, None],
                                         has_neg[order][None, :])
                if terms.requires_grad:
                    grad_a += torch.autograd.grad(terms, leaf)[0]
        return a, has_neg, grad_a / count.clamp(min=1).to(a.dtype)

    def _pair_block(self, anchors: Tensor, keys: Tensor, gallery: Tensor, gallery_keys: Tensor, a: Tensor,
                    has_neg: Tensor, grad_a: Tensor, label_ndim: int) -> Tensor:
        """One block of a chunked ``"original"`` / ``"gpw"`` call: its pairs with every ``a`` fixed, plus the
        chain-rule term through its own rows' ``a``."""
        i, j = keys[:, 0], gallery_keys[:, 0]
        labels, gallery_labels = keys[:, 1:], gallery_keys[:, 1:]
        if label_ndim == 1:
            labels, gallery_labels = labels[:, 0], gallery_labels[:, 0]
        sim, pos, a_rows, _ = self._rows(anchors, gallery, labels, gallery_labels)
        terms = self._pair_terms(sim, pos, a[i][:, None], a[j][None, :], has_neg[i][:, None], has_neg[j][None, :])
        return terms / batch_normaliser(pos.sum(), sim) + (grad_a[i] * (a_rows - a_rows.detach())).sum()

    def pair_loss(self, sim: Tensor, pos: Tensor, neg: Tensor) -> Tensor:
        B = sim.shape[0]
        if self.variant == "star":
            lp = masked_lse(-self.alpha * sim, pos) / self.alpha
            ln = masked_lse(self.beta * sim, neg) / self.beta
            per_anchor = torch.where(pos.any(1), lp, 0.0) + torch.where(neg.any(1), ln, 0.0)
            return per_anchor.sum() / batch_normaliser(B, sim)
        dist = distance_from_similarity(sim)
        neg_lse = masked_lse(self.margin - dist, neg)  # a_i, -inf when Neg(i) is empty
        has_neg = neg.any(1)
        if self.variant == "generalized":
            pos_lse = masked_lse(dist, pos)
            ok = pos.any(1) & has_neg
            per_anchor = torch.relu(torch.where(ok, pos_lse, 0.0) + torch.where(ok, neg_lse, 0.0))
            return per_anchor.sum() / batch_normaliser(B, sim)
        # original / gpw: gallery = batch (no references), pairs (i, j) of the B x B matrix
        a = torch.where(has_neg, neg_lse, 0.0)
        ai, aj = a[:, None].expand(B, B), a[None, :].expand(B, B)
        hi, hj = has_neg[:, None].expand(B, B), has_neg[None, :].expand(B, B)
        if self.variant == "gpw":
            ok = pos & hi & hj
            hinge = torch.relu(torch.where(ok, dist + ai + aj, 0.0))
            return hinge.sum() / pos.sum().clamp(min=1)
        both = torch.logaddexp(torch.where(hi, ai, -1e30), torch.where(hj, aj, -1e30))
        ok = pos & (hi | hj)
        hinge = torch.relu(torch.where(ok, both + dist, 0.0))
        return (hinge * hinge).sum() / (2 * pos.sum().clamp(min=1))
