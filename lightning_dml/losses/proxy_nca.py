"""ProxyNCA loss (Movshovitz-Attias et al., ICCV 2017) with the ProxyNCA++ temperature (Teh et al., ECCV 2020)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_dml.losses.proxies import ProxyLoss
from lightning_dml.losses.registry import register_loss

__all__ = ["ProxyNCALoss"]


@register_loss("proxy_nca")
class ProxyNCALoss(ProxyLoss):
    r"""ProxyNCA (Movshovitz-Attias et al., "No Fuss Distance Metric Learning using Proxies", ICCV 2017, the
    proxy-NCA loss) with ProxyNCA++'s temperature (Teh et al., "ProxyNCA++", ECCV 2020, the temperature-scaled loss).

    With ``d(x, p) = ||x - p||^2`` between the L2-normalised embedding and proxies and temperature ``T``:

    .. math::
        L = -\frac{1}{B} \sum_i \log \frac{\exp(-d(x_i, p_{y_i}) / T)}{\sum_{z \in Z_i} \exp(-d(x_i, p_z) / T)}

    ``Z_i`` is the set of *negative* proxies (ProxyNCA's NCA form, ``exclude_positive=True``, the default) or all
    proxies including the positive one (ProxyNCA++, ``exclude_positive=False``: a proper softmax, the loss is
    >= 0). ProxyNCA++ settings: ``exclude_positive=False`` and a low temperature (e.g. ``temperature=1/9``); its
    "fast-moving proxies" are the proxies' learning rate, ``DMLModule(loss_lr_multiplier=...)``.

    Args:
        num_classes: number of classes; filled in by ``DMLModule`` when left out.
        embedding_dim: width of the embeddings; filled in by ``DMLModule`` when left out.
        temperature: ``T`` (ProxyNCA: 1; ProxyNCA++ uses a low temperature, e.g. 1/9).
        exclude_positive: leave the positive proxy out of the denominator (ProxyNCA's equation). The loss is then
            unbounded below (``d_pos - logsumexp(-d_neg)``), as in the paper.
        sharded: split the proxies over the DDP processes, each scoring the gathered batch against its own
            (:mod:`lightning_dml.losses.partial_fc`; exact); on one process the plain loss.

    Proxies are initialised as in the ProxyNCA / ProxyNCA++ code: standard normal / 8.

    pytorch-metric-learning's ``ProxyNCALoss(num_classes, embedding_size, softmax_scale=1)`` is the softmax over
    *all* proxies (= ours with ``exclude_positive=False, temperature=1/softmax_scale``); it also drops the rows
    whose positive probability underflows to 0 (a ``-log 0``), where ours gives the finite large value.
    """

    def __init__(
        self,
        num_classes: int | None = None,
        embedding_dim: int | None = None,
        temperature: float = 1.0,
        exclude_positive: bool = True,
        sharded: bool = False,
    ) -> None:
        if temperature <= 0:
            raise ValueError(f"ProxyNCALoss: temperature must be > 0, got {temperature}")
        self.temperature = float(temperature)
        self.exclude_positive = bool(exclude_positive)
        super().__init__(num_classes, embedding_dim, sharded=sharded)

    def reset_parameters(self) -> None:
        if self.proxies is not None:
            with torch.no_grad():
                nn.init.normal_(self.proxies).div_(8.0)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, temperature={self.temperature}, exclude_positive={self.exclude_positive}"
        )

    def proxy_loss(self, x: Tensor, proxies: Tensor, labels: Tensor) -> Tensor:
        # -d(x, p) / T = (2 cos - 2) / T: the constant -2 / T shifts every logit of a row alike and cancels
        return self.softmax_loss(x, proxies, labels, 2.0 / self.temperature, exclude_target=self.exclude_positive)
