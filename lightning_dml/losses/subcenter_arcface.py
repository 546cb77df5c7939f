"""Sub-center ArcFace (Deng et al., "Sub-center ArcFace", ECCV 2020)."""

from __future__ import annotations

from lightning_dml.losses.arcface import ArcFaceLoss
from lightning_dml.losses.registry import register_loss

__all__ = ["SubCenterArcFaceLoss"]


@register_loss("subcenter_arcface")
class SubCenterArcFaceLoss(ArcFaceLoss):
    r"""Sub-center ArcFace (Deng et al., ECCV 2020): ``K`` sub-centres per class, the closest one counts.

    .. math::
        \theta_{i,j} = \arccos\big(\max_k \hat W_{j_k}^\top \hat x_i\big)

    then the ArcFace loss (:class:`~lightning_dml.losses.ArcFaceLoss`, ArcFace Eq. 3) on these angles: the sample
    is pulled to the nearest sub-centre of its class and pushed from the nearest sub-centre of every other class.
    Where several sub-centres of a class are equally near (identical sub-centres), the first of them is the
    nearest: the loss's gradient reaches that one only.

    Args:
        num_classes: number of classes; filled in by ``DMLModule`` when left out.
        embedding_dim: width of the embeddings; filled in by ``DMLModule`` when left out.
        sub_centers: ``K`` (paper: 3).
        scale: ``s`` (paper: 64).
        margin: angular margin ``m`` in **radians** (paper: 0.5).
        sharded, sample_rate: as :class:`~lightning_dml.losses.ArcFaceLoss` (a class's ``K`` sub-centres stay on
            one process).

    The ``num_classes * K`` sub-centres are the rows of ``proxies``, class ``c``'s in rows ``c K .. c K + K - 1``.
    pytorch-metric-learning's ``SubCenterArcFaceLoss(num_classes, embedding_size, margin=28.6, scale=64,
    sub_centers=3)`` uses the same layout transposed (``W`` = our ``proxies.T``) and a margin in **degrees**; with
    the margin converted it computes the same loss.
    """

    def __init__(
        self,
        num_classes: int | None = None,
        embedding_dim: int | None = None,
        sub_centers: int = 3,
        scale: float = 64.0,
        margin: float = 0.5,
        sharded: bool = False,
        sample_rate: float = 1.0,
    ) -> None:
        self.sub_centers = sub_centers  # read by ArcFaceLoss.__init__ (validated there as proxies_per_class)
        super().__init__(num_classes, embedding_dim, scale, margin, sharded, sample_rate)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, sub_centers={self.proxies_per_class}"
