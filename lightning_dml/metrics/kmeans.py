"""k-means for the clustering metrics (NMI, F1) at up to Stanford-Online-Products scale.

Lloyd's algorithm (Lloyd, 1982) with a fixed iteration count and seed, so a run is reproducible:

* initialisation: k-means++ (Arthur & Vassilvitskii, 2007) when it is cheap (N k D <= 5e8), otherwise k
  distinct points drawn uniformly (what faiss does; k-means++ is sequential in k and far too slow at
  k = 11,316), both from ``torch.Generator().manual_seed(seed)``;
* assignment: ``argmax_c 2<x, c> - |c|^2`` by chunked float32 matrix products (no N x k matrix at once);
* update: float64 sums per cluster; an empty cluster is re-seeded with the points farthest from their
  centroid (largest distance first, ties by index), as scikit-learn does.

``backend="faiss"`` uses ``faiss.Kmeans`` instead, on the CPU (``"auto"`` picks faiss when it is installed, the
set is large, where its multi-threaded search pays off, and the embeddings are on the CPU); the torch k-means runs
on the device of the embeddings (CUDA included).

Scale: the set is first multiplied by one power of two that brings its largest entry into [0.5, 1), so no
squared distance overflows (or underflows) float32 at any input scale; k-means commutes with that scaling, so the
assignment is that of the set scaled down by a common factor (unchanged for embeddings of ordinary scale).
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_dml.metrics._progress import track
from lightning_dml.scaling import power_of_two_scale

__all__ = ["faiss_available", "kmeans", "torch_kmeans"]


def faiss_available() -> bool:
    """Whether the ``faiss`` package can be imported."""
    try:
        import faiss  # noqa: F401
    except ImportError:
        return False
    return True


def _scaled(x: Tensor) -> Tensor:
    """``x`` divided by the power of two near its largest entry (exact; no float32 square overflows)."""
    return x / power_of_two_scale(x) if x.numel() else x


def _assign(x: Tensor, c: Tensor, chunk: int) -> tuple[Tensor, Tensor]:
    """Nearest centroid (lowest index on ties) and squared distance for each point."""
    c_sq = (c * c).sum(dim=1)
    labels = torch.empty(x.shape[0], dtype=torch.long, device=x.device)
    dist = torch.empty(x.shape[0], device=x.device)
    for s in range(0, x.shape[0], chunk):
        xs = x[s : s + chunk]
        score = torch.addmm(c_sq.unsqueeze(0), xs, c.T, beta=-1.0, alpha=2.0)  # 2<x,c> - |c|^2
        best, idx = score.max(dim=1)
        labels[s : s + chunk] = idx
        dist[s : s + chunk] = ((xs * xs).sum(dim=1) - best).clamp_(min=0)
    return labels, dist


def _kmeans_plus_plus(x: Tensor, k: int, g: torch.Generator) -> Tensor:
    """k-means++ seeding: each next centre drawn with probability proportional to D(x)^2."""
    n = x.shape[0]
    idx = [int(torch.randint(n, (1,), generator=g))]
    d2 = ((x - x[idx[0]]) ** 2).sum(dim=1).double()
    for _ in range(1, k):
        if float(d2.sum()) > 0:
            # drawn on the host generator (the same seed gives the same centres on every device)
            nxt = int(torch.multinomial(d2.cpu(), 1, generator=g))
        else:  # every point coincides with a centre: take the first unused index
            used = torch.zeros(n, dtype=torch.bool, device=x.device)
            used[idx] = True
            nxt = int((~used).nonzero()[0])
        idx.append(nxt)
        d2 = torch.minimum(d2, ((x - x[nxt]) ** 2).sum(dim=1).double())
    return x[torch.tensor(idx, device=x.device)].clone()


def torch_kmeans(x: Tensor, k: int, *, iters: int = 20, seed: int = 0, chunk: int | None = None) -> Tensor:
    """Cluster the rows of ``x`` into ``k`` clusters; returns the ``[N]`` cluster index of each row (on x's device)."""
    x = _scaled(x.detach().to(torch.float32)).contiguous()
    n, d = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"k-means needs 1 <= k <= number of points, got k={k}, N={n}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    if chunk is None:
        chunk = max(256, min(8192, (32 * 2**20) // (4 * k)))  # about 32 MB of scores per chunk
    g = torch.Generator().manual_seed(int(seed))
    if n * k * d <= 5e8:
        c = _kmeans_plus_plus(x, k, g)
    else:
        c = x[torch.randperm(n, generator=g)[:k].to(x.device)].clone()
    labels = torch.zeros(n, dtype=torch.long, device=x.device)
    for _ in track(range(iters), f"k-means (k={k})"):
        labels, dist = _assign(x, c, chunk)
        sums = torch.zeros(k, d, dtype=torch.float64, device=x.device).index_add_(0, labels, x.double())
        counts = torch.bincount(labels, minlength=k)
        empty = (counts == 0).nonzero().squeeze(1)
        c = (sums / counts.clamp(min=1).unsqueeze(1).double()).float()
        if empty.numel():
            # re-seed empty clusters with the farthest points (stable: ties by index)
            far = torch.argsort(dist, descending=True, stable=True)[: empty.numel()]
            c[empty] = x[far]
    labels, _ = _assign(x, c, chunk)
    return labels


def _faiss_kmeans(x: Tensor, k: int, *, iters: int, seed: int) -> Tensor:
    import faiss
    import numpy as np

    # faiss computes on the host: the explicit CPU path of the clustering
    xn = np.ascontiguousarray(_scaled(x.detach().to("cpu", torch.float32)).numpy())
    km = faiss.Kmeans(xn.shape[1], k, niter=iters, seed=int(seed), verbose=False, max_points_per_centroid=10**9)
    km.train(xn)
    _, assign = km.index.search(xn, 1)
    return torch.from_numpy(assign[:, 0].astype("int64")).to(x.device)


def kmeans(x: Tensor, k: int, *, iters: int = 20, seed: int = 0, backend: str = "auto") -> Tensor:
    """k-means cluster assignment ``[N]`` (int64) of the rows of ``x``.

    Args:
        backend: ``"torch"`` (:func:`torch_kmeans`), ``"faiss"`` (``faiss.Kmeans``; must be installed) or
            ``"auto"``: faiss when installed, ``x`` is on the CPU and ``N * k`` is large (>= 1e7), torch otherwise.
    """
    if backend not in ("auto", "torch", "faiss"):
        raise ValueError(f"backend must be 'auto', 'torch' or 'faiss', got {backend!r}")
    if backend == "auto":
        large = x.shape[0] * k >= 10**7
        backend = "faiss" if x.device.type == "cpu" and large and faiss_available() else "torch"
    if backend == "faiss":
        if not faiss_available():
            raise ValueError("backend='faiss' but faiss is not installed (pip install faiss-cpu)")
        if not 1 <= k <= x.shape[0]:
            raise ValueError(f"k-means needs 1 <= k <= number of points, got k={k}, N={x.shape[0]}")
        return _faiss_kmeans(x, k, iters=iters, seed=seed)
    return torch_kmeans(x, k, iters=iters, seed=seed)
