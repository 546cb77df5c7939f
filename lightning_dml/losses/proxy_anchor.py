"""Proxy-Anchor loss (Kim et al., "Proxy Anchor Loss for Deep Metric Learning", CVPR 2020, Eq. 4)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_dml.losses.proxies import ProxyLoss, normalize_proxies
from lightning_dml.losses.registry import register_loss

__all__ = ["ProxyAnchorLoss"]


@register_loss("proxy_anchor")
class ProxyAnchorLoss(ProxyLoss):
    r"""Proxy-Anchor loss (Kim et al., CVPR 2020, Eq. 4): each proxy is an anchor for the whole batch.

    .. math::
        \ell(X) = \frac{1}{|P^+|} \sum_{p \in P^+} \log\Big(1 + \sum_{x \in X_p^+} e^{-\alpha (s(x, p) - \delta)}\Big)
                + \frac{1}{|P|} \sum_{p \in P} \log\Big(1 + \sum_{x \in X_p^-} e^{\alpha (s(x, p) + \delta)}\Big)

    with ``s`` the cosine similarity, ``P`` all proxies, ``P^+`` the proxies of the classes present in the batch,
    ``X_p^+`` / ``X_p^-`` the embeddings of the batch of (not of) the proxy's class. Because every proxy pools its
    whole batch in one log-sum-exp, the gradient of an embedding depends on the other embeddings (the paper's
    data-to-data relations).

    Args:
        num_classes: number of classes (proxies); filled in by ``DMLModule`` when left out.
        embedding_dim: width of the embeddings (and proxies); filled in by ``DMLModule`` when left out.
        alpha: scale ``alpha`` (paper: 32).
        delta: margin ``delta`` (paper: 0.1).
        sharded: split the proxies over the DDP processes, each scoring the gathered batch against its own and the
            two sums over proxies added across processes (:mod:`lightning_dml.losses.partial_fc`; exact); on one
            process the plain loss.

    Proxies are initialised as in the paper's code (``kaiming_normal_``, ``mode="fan_out"``); the paper trains them
    with a 100x learning rate (``DMLModule(loss_lr_multiplier=100)``).

    pytorch-metric-learning's ``ProxyAnchorLoss(num_classes, embedding_size, margin=0.1, alpha=32)`` computes the
    same equation (its ``margin`` is ``delta``, its ``embedding_size`` our ``embedding_dim``).

    Degenerate batches: a proxy without positives (negatives) in the batch adds 0 to the first (second) sum; the
    value is always finite.
    """

    #: every proxy pools the whole batch: under DDP with gather_distributed each process computes the loss of the
    #: gathered global batch (exact; :mod:`lightning_dml.losses.distributed`)
    gather_mode = "global_batch"
    label_sets_reason = (
        "its paper's per-proxy positive sets X_p+ could hold an item under several proxies, but this implementation "
        "(like every proxy loss here) takes one class index per item (one proxy per class of train_class_ids)"
    )

    def __init__(
        self,
        num_classes: int | None = None,
        embedding_dim: int | None = None,
        alpha: float = 32.0,
        delta: float = 0.1,
        sharded: bool = False,
    ) -> None:
        if alpha <= 0:
            raise ValueError(f"ProxyAnchorLoss: alpha must be > 0, got {alpha}")
        self.alpha, self.delta = float(alpha), float(delta)
        super().__init__(num_classes, embedding_dim, sharded=sharded)

    def reset_parameters(self) -> None:
        if self.proxies is not None:
            nn.init.kaiming_normal_(self.proxies, mode="fan_out")

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, alpha={self.alpha}, delta={self.delta}"

    def proxy_loss(self, x: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        if self.shard_world > 1:  # sharded: the gathered batch against this process's proxies, sums reduced
            from lightning_dml.losses.partial_fc import gather_batch, global_value

            x, labels = gather_batch(x, labels)
        rows = torch.arange(labels.shape[0], device=labels.device)
        cols = labels - self.shard_start
        on = (cols >= 0) & (cols < proxies.shape[0])
        pos_sum, neg_sum = self.proxy_sums(x @ normalize_proxies(proxies).T, rows[on], cols[on])
        seen = torch.zeros(self.num_classes, dtype=torch.bool, device=x.device)
        num_with_pos = seen.index_fill_(0, labels, True).sum()  # |P+|: the classes of the (global) batch
        local = pos_sum / num_with_pos + neg_sum / self.num_classes
        return local if self.shard_world == 1 else global_value(local)

    def proxy_sums(self, cos: Tensor, rows: Tensor, cols: Tensor) -> tuple[Tensor, Tensor]:
        """The sums over the proxies (columns of ``cos``, the batch's cosines to them) of Eq. 4's positive and
        negative terms; ``(rows, cols)``: the (embedding, own proxy) pairs among them."""
        num = cos.shape[1]
        # positive term: only the (embedding, own proxy) pairs, summed per proxy with a per-proxy max shift
        # (clamped at 0, so exp(-shift) <= 1): log(1 + sum e^v) = shift + log(e^-shift + sum e^(v - shift))
        v = -self.alpha * (cos[rows, cols] - self.delta)
        shift = cos.new_zeros(num).scatter_reduce(0, cols, v.detach(), "amax", include_self=True)
        total = cos.new_zeros(num).index_put((cols,), torch.exp(v - shift[cols]), accumulate=True)
        pos_term = shift + torch.log(torch.exp(-shift) + total)  # exactly 0 for a proxy without positives
        # negative term: every (embedding, other proxy) pair; the positives are filled with the lowest finite
        # value (exp -> 0, zero gradient, and a column without negatives gives softplus(-huge) = 0)
        neg = (self.alpha * (cos + self.delta)).index_put((rows, cols), cos.new_tensor(torch.finfo(cos.dtype).min))
        neg_term = F.softplus(torch.logsumexp(neg, dim=0))  # log(1 + sum_{X_p^-} e^...)
        return pos_term.sum(), neg_term.sum()
