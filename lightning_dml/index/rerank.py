"""Training-free re-ranking of search results: k-reciprocal re-ranking, alpha-query expansion, database-side
augmentation.

Each method is written from its paper's equations as batched tensor code (no Python loop over queries; queries
are processed in blocks of at most ``QUERY_BLOCK`` queries and ``BLOCK_ELEMENTS`` elements per intermediate
tensor, which never changes a result but the last bits of a matrix product) on the device of its inputs. Every
option has a documented range (:data:`RERANK_LIMITS`), and ``candidates`` and ``n`` are clamped to the gallery
size, so that memory follows the gallery and the block, not an option's value:

* **k-reciprocal re-ranking** (Zhong, Zheng, Cao, Li, *Re-ranking Person Re-identification with k-reciprocal
  Encoding*, CVPR 2017): :func:`k_reciprocal_distance` on distance matrices, :func:`k_reciprocal_rerank` on
  vectors. Final distance ``d* = (1 - lambda) d_J + lambda d`` (Eq. 12), defaults ``k1=20, k2=6, lambda=0.3``.
* **alpha-query expansion (alpha-QE)** and **database-side augmentation (DBA)** (Radenovic, Tolias, Chum,
  *Fine-tuning CNN Image Retrieval with No Human Annotation*, TPAMI 2019): a vector is replaced by
  the L2-normalised weighted sum of itself and its top ``n`` neighbours, weights ``sim^alpha``
  (:func:`alpha_weighted_average`, :func:`alpha_query_expansion`, :func:`database_side_augmentation`).

**The candidate set (k-reciprocal, DBA).** The papers re-rank against the whole gallery: Zhong et al.'s neighbour
sets ``N(g_i, k)`` of every gallery item range over the whole gallery plus the probe (an N x N distance matrix),
and DBA replaces every database vector. Here each query is re-ranked within its own universe ``U = {p} ∪ C``,
``C`` its top ``candidates`` results of the index: the neighbour sets, reciprocity tests, vectors ``V`` and the
Jaccard sums all range over ``U`` (a ``[Q, K+1, K+1]`` computation instead of ``[N, N]``), and DBA augments only the
candidates. Items outside ``C`` are never returned (``C`` holds ``max(candidates, k)`` results). With
``candidates`` at least the gallery size the result is the paper's full-gallery formulation
(``tests/test_rerank.py`` checks it against a loop reference written from the equations). Each query's universe
holds that query only, never the other queries of a batch (the authors' code pools all probes with the gallery),
so a query's answer does not depend on what it was batched with (the server batches requests).

Conventions of :func:`k_reciprocal_distance` where the paper leaves a choice, following the authors' code
(``re_ranking.py`` of github.com/zhunzhong07/person-re-ranking) unless said otherwise:

* ``d`` is the squared Euclidean distance (the Mahalanobis distance of Eq. 1 with M = I) of the vectors as the
  index compares them: L2-normalised for the ``cosine`` metric (``d = 2 - 2 cos``), raw for ``euclidean``. The authors'
  code also divides each row by its maximum; that is not done here (it would make ``d`` depend on the candidate
  set's size). One normalisation path (:func:`as_stored`): a raw query is first L2-normalised in its own dtype,
  as the index normalises the vectors it stores (``F.normalize`` of float32 embeddings), and the stored candidate
  vectors are taken as they are; then both are normalised again in float64. A query that is itself in the gallery
  is thus bit for bit its stored copy (distance exactly 0), not a vector ~1e-8 away.
* ``N(x, k)`` (Eq. 2) holds the ``k + 1`` nearest items of ``x`` in ``U`` **including x itself** (the code's
  ``initial_rank[i, :k1 + 1]``), so ``x ∈ R*(x, k)``. Order: ``x`` itself first, then distance, ties by position
  in ``U`` (the probe first, then gallery ids ascending) -- the library's tie rule. ``x`` is put first explicitly:
  among identical copies (distance 0) the position rule alone would leave a copy out of its own set when more
  than ``k`` copies come before it (the authors' ``argsort`` has the same gap). Copies beyond the first ``k``
  (by position) are still outside each other's sets, so with more than ``k1`` identical copies of the probe in
  ``U`` the later copies score below the first ones (the definition, not a rounding effect).
* ``R(x, k) = {y ∈ N(x, k) : x ∈ N(y, k)}`` (Eq. 3). Expansion (Eq. 4): ``R*(x, k) = R(x, k) ∪ R(q, k/2)``
  for every ``q ∈ R(x, k)`` with ``|R(x, k) ∩ R(q, k/2)| >= 2/3 |R(q, k/2)|`` (the paper's ``>=``; the code
  has ``>``), ``k/2`` rounded half to even as the code's ``np.around``.
* ``V_{x,y} = exp(-d(x, y))`` for ``y ∈ R*(x, k1)``, else 0 (Eq. 9, the Gaussian kernel in place of the binary
  indicator of Eq. 7), as in the paper (the code also divides each row by its sum).
* Local query expansion (Eq. 11): ``V_x <- mean of V_y over the k2 nearest items y of x, x included`` (the code's
  ``initial_rank[i, :k2]``; ``k2 = 1`` switches it off).
* Jaccard distance (Eq. 5) by the sparse min/max form (Eqs. 8, 10):
  ``d_J(p, g) = 1 - sum_j min(V_{p,j}, V_{g,j}) / sum_j max(V_{p,j}, V_{g,j})``, ``j`` over ``U``.

Scores: a re-ranked list is ordered by ``d*`` ascending (ties: smaller id first) and reported as a similarity that
equals the original score at ``lambda = 1``: ``1 - d*/2`` for ``cosine``, ``-d*`` for ``euclidean`` (the index's
score for ``euclidean`` being the negated squared distance). alpha-QE and DBA report the cosine similarity of the
expanded / augmented vectors; both need the ``cosine`` metric (the papers' L2-normalised descriptors).

``--rerank`` option of ``lightning-dml search``, ``serve`` and ``index evaluate``: :func:`parse_rerank`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from lightning_dml.errors import UserInputError

__all__ = [
    "AlphaQueryExpansion",
    "DatabaseSideAugmentation",
    "KReciprocal",
    "RERANKERS",
    "Reranker",
    "RerankOptionError",
    "alpha_query_expansion",
    "alpha_weighted_average",
    "as_stored",
    "database_side_augmentation",
    "k_reciprocal_distance",
    "k_reciprocal_rerank",
    "parse_rerank",
    "RERANK_LIMITS",
    "ranked_list_metrics",
    "rerank_metrics",
    "rerank_search",
    "squared_distances",
]

#: queries processed at once by the batched re-rankers (a memory bound only: results never depend on it)
QUERY_BLOCK = 256
#: at most this many elements per intermediate tensor of a block of queries (k-reciprocal: ``[B, M, M]`` universes,
#: ~100 MiB at the peak for one query of 1000 candidates; the gathered ``[B, K, D]`` vectors; DBA: ``[R, n, D]``
#: neighbours): fewer queries per block for large options (at least one; results do not depend on it, except in
#: the last bits of a matrix product over another number of rows)
BLOCK_ELEMENTS = 1 << 20

SearchFn = Callable[[Tensor, int], tuple[Tensor, Tensor]]
VectorsFn = Callable[[Tensor], Tensor]


class RerankOptionError(UserInputError, ValueError):
    """A ``--rerank`` option that cannot be parsed or does not fit the index (unknown method, key or value)."""


# --------------------------------------------------------------------------------------------- functional core
def squared_distances(x: Tensor, y: Tensor | None = None) -> Tensor:
    """Squared Euclidean distances ``||x_i - y_j||^2`` in float64, ``[..., A, D] x [..., B, D] -> [..., A, B]``,
    clamped at 0. With ``y=None`` (``x`` against itself) the result is exactly symmetric with a zero diagonal."""
    xd = x.double()
    yd = xd if y is None else y.double()
    g = xd @ yd.transpose(-1, -2)
    d = (xd * xd).sum(-1).unsqueeze(-1) + (yd * yd).sum(-1).unsqueeze(-2) - 2.0 * g
    d = d.clamp_min(0.0)
    if y is None:
        d = 0.5 * (d + d.transpose(-1, -2))
        d.diagonal(dim1=-2, dim2=-1).zero_()
    return d


def as_stored(x: Tensor, metric: str) -> Tensor:
    """Raw query vectors in the form an index stores its vectors: L2-normalised in their own dtype for ``cosine``
    (what :meth:`~lightning_dml.index.EmbeddingIndex.search` and the stored gallery get: ``F.normalize`` of float32
    embeddings), unchanged for ``euclidean``. A query equal to a gallery item's embedding becomes bit for bit
    its stored vector (module docstring: one normalisation path)."""
    return F.normalize(x, dim=-1) if metric == "cosine" else x


def _block(per_query: int) -> int:
    """Queries per block so that a block holds at most :data:`BLOCK_ELEMENTS` elements (at least 1, at most
    :data:`QUERY_BLOCK`)."""
    return max(1, min(QUERY_BLOCK, BLOCK_ELEMENTS // max(1, int(per_query))))


def _pad_columns(scores: Tensor, ids: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """``scores``/``ids`` padded with ``-inf`` / ``-1`` to ``k`` columns."""
    missing = int(k) - ids.shape[1]
    if missing <= 0:
        return scores, ids
    return (torch.cat([scores, scores.new_full((scores.shape[0], missing), float("-inf"))], 1),
            torch.cat([ids, ids.new_full((ids.shape[0], missing), -1)], 1))


def _nearest_mask(order: Tensor, count: int, pair_valid: Tensor) -> Tensor:
    """``m[b, i, j]``: ``j`` is among the ``count`` first items of row ``i`` of ``order`` (and the pair is valid)."""
    count = min(count, order.shape[-1])
    m = torch.zeros(order.shape, dtype=torch.bool, device=order.device)
    m.scatter_(-1, order[..., :count], True)
    return m & pair_valid


def k_reciprocal_distance(
    dist: Tensor, valid: Tensor | None = None, *, k1: int = 20, k2: int = 6, lambda_: float = 0.3
) -> Tensor:
    """The final distance ``d*`` of k-reciprocal re-ranking (Zhong et al., CVPR 2017) of the probe against the
    other items of its universe: ``d`` (Eq. 1), ``N`` (Eq. 2), ``R`` (Eq. 3), ``R*`` (Eq. 4), ``V`` (Eq. 9), the
    Jaccard distance (Eq. 10), local query expansion (Eq. 11), ``d*`` (Eq. 12).

    Args:
        dist: ``[B, M, M]`` distances over each row's universe ``U`` (item 0: the probe; items 1..M-1: gallery items
            in increasing id order, which is the tie rule); symmetric, zero diagonal (:func:`squared_distances`).
        valid: ``[B, M]`` bool, False for padding items (a universe smaller than M); item 0 must be valid.
        k1, k2, lambda_: the paper's k (R and R*), k2 (local query expansion) and lambda (Eq. 12).

    Returns:
        ``[B, M-1]`` float64 ``d*(p, g) = (1 - lambda) d_J(p, g) + lambda d(p, g)``; ``inf`` at padding items.
        A padded universe gives the same values as the unpadded one (every set ignores padding items).
    """
    if dist.ndim != 3 or dist.shape[-1] != dist.shape[-2]:
        raise ValueError(f"dist must be [B, M, M], got {tuple(dist.shape)}")
    b, m, _ = dist.shape
    dist = dist.double()
    if valid is None:
        valid = torch.ones(b, m, dtype=torch.bool, device=dist.device)
    pair_valid = valid.unsqueeze(-1) & valid.unsqueeze(-2)
    masked = dist.masked_fill(~pair_valid, float("inf"))
    # ranks: the item itself first (also among identical copies), then distance, ties by position in U (stable)
    masked.diagonal(dim1=-2, dim2=-1).fill_(float("-inf"))
    order = torch.sort(masked, dim=-1, stable=True).indices
    # Eqs. 2, 3: N(x, k1) (k1 + 1 items with x), R(x, k1) = mutual membership
    near = _nearest_mask(order, k1 + 1, pair_valid)
    recip = near & near.transpose(-1, -2)
    # Eq. 4: R*(x, k1) = R(x, k1) ∪ R(q, k1/2) for q ∈ R(x, k1) with |R(x,k1) ∩ R(q,k1/2)| >= 2/3 |R(q,k1/2)|
    half = int(round(k1 / 2))
    near_h = _nearest_mask(order, half + 1, pair_valid)
    recip_h = (near_h & near_h.transpose(-1, -2)).double()
    overlap = recip.double() @ recip_h.transpose(-1, -2)  # [b, x, q] = |R(x) ∩ R(q, k/2)| (exact integer counts)
    size_h = recip_h.sum(-1)  # [b, q]
    expand = recip & (3.0 * overlap >= 2.0 * size_h.unsqueeze(-2))
    r_star = recip | ((expand.double() @ recip_h) > 0)
    # Eq. 9: V_{x,y} = exp(-d(x, y)) on R*(x, k1)
    v = torch.where(r_star, torch.exp(-dist.masked_fill(~pair_valid, 0.0)), torch.zeros((), dtype=torch.float64,
                                                                                         device=dist.device))
    # Eq. 11: local query expansion over the k2 nearest items (the item itself included)
    if k2 > 1:
        w = _nearest_mask(order, k2, pair_valid).double()
        w = w / w.sum(-1, keepdim=True).clamp_min(1.0)
        v = w @ v
    # Eq. 10: Jaccard distance of the probe (row 0) to every other item, sparse min/max form
    vp, vg = v[:, :1, :], v[:, 1:, :]
    num = torch.minimum(vp, vg).sum(-1)
    den = torch.maximum(vp, vg).sum(-1)
    d_j = torch.where(den > 0, 1.0 - num / den.clamp_min(torch.finfo(torch.float64).tiny), 1.0)
    # Eq. 12
    d_star = (1.0 - lambda_) * d_j + lambda_ * dist[:, 0, 1:]
    return d_star.masked_fill(~valid[:, 1:], float("inf"))


def _sort_by_id(ids: Tensor, *others: Tensor) -> tuple[Tensor, ...]:
    """Sorts each row by id ascending (``-1`` padding last); ``others`` ([Q, K] or [Q, K, D]) follow."""
    big = torch.iinfo(torch.int64).max
    key = torch.where(ids < 0, torch.full_like(ids, big), ids)
    perm = torch.sort(key, dim=1, stable=True).indices
    out = [ids.gather(1, perm)]
    for t in others:
        p = perm if t.ndim == 2 else perm.unsqueeze(-1).expand_as(t)
        out.append(t.gather(1, p))
    return tuple(out)


def _distance_to_score(d: Tensor, metric: str) -> Tensor:
    return 1.0 - d / 2.0 if metric == "cosine" else -d


def _check_metric(metric: str) -> None:
    if metric not in ("cosine", "euclidean"):
        raise ValueError(f"metric must be 'cosine' or 'euclidean', got {metric!r}")


def k_reciprocal_rerank(
    queries: Tensor,
    candidates: Tensor,
    candidate_ids: Tensor,
    *,
    k: int | None = None,
    k1: int = 20,
    k2: int = 6,
    lambda_: float = 0.3,
    metric: str = "cosine",
) -> tuple[Tensor, Tensor]:
    """k-reciprocal re-ranking of each query's candidate set (module docstring: the candidate-set universe).

    Args:
        queries: ``[Q, D]`` query vectors (raw: normalised here for ``cosine``, :func:`as_stored` first).
        candidates: ``[Q, K, D]`` the gallery vectors of each query's candidates, as the index stores them.
        candidate_ids: ``[Q, K]`` int64 gallery ids, ``-1`` for padding (fewer than K candidates).
        k: results kept per query (default K).

    Returns:
        ``(scores [Q, k] float64, ids [Q, k] int64)`` ordered by ``d*`` then id; scores as in the module docstring;
        padding ``-inf`` / ``-1``.
    """
    _check_metric(metric)
    if queries.ndim != 2 or candidates.ndim != 3 or candidates.shape[:2] != candidate_ids.shape:
        raise ValueError(
            f"queries [Q, D], candidates [Q, K, D] and candidate_ids [Q, K] expected, got {tuple(queries.shape)}, "
            f"{tuple(candidates.shape)}, {tuple(candidate_ids.shape)}"
        )
    nq, kc = candidate_ids.shape
    k = kc if k is None else min(int(k), kc)
    out_s = torch.full((nq, k), float("-inf"), dtype=torch.float64, device=queries.device)
    out_i = torch.full((nq, k), -1, dtype=torch.int64, device=queries.device)
    block = _block((kc + 1) ** 2)
    for start in range(0, nq, block):
        sl = slice(start, start + block)
        q, c = as_stored(queries[sl], metric).double(), candidates[sl].double()
        if metric == "cosine":
            q, c = F.normalize(q, dim=-1), F.normalize(c, dim=-1)
        ids, c = _sort_by_id(candidate_ids[sl], c)
        universe = torch.cat([q.unsqueeze(1), c], dim=1)
        valid = torch.cat([torch.ones_like(ids[:, :1], dtype=torch.bool), ids >= 0], dim=1)
        d_star = k_reciprocal_distance(squared_distances(universe), valid, k1=k1, k2=k2, lambda_=lambda_)
        order = torch.sort(d_star, dim=1, stable=True).indices[:, :k]  # ties: smaller id (ids are sorted)
        top_d, top_i = d_star.gather(1, order), ids.gather(1, order)
        out_s[sl] = torch.where(top_i >= 0, _distance_to_score(top_d, metric), float("-inf"))
        out_i[sl] = top_i
    return out_s, out_i


def alpha_weighted_average(
    vectors: Tensor, neighbours: Tensor, similarities: Tensor, *, alpha: float, valid: Tensor | None = None
) -> Tensor:
    """``normalize(x + sum_i w_i x_i)``, ``w_i = max(s_i, 0)^alpha`` (Radenovic et al., TPAMI 2019: alpha-QE and
    DBA; the vector itself has weight ``(x^T x)^alpha = 1``). Negative similarities weigh 0 (so that a non-integer
    ``alpha`` is defined; the top neighbours of a query are the positive ones in practice).

    Args:
        vectors: ``[Q, D]``; neighbours: ``[Q, n, D]``; similarities: ``[Q, n]`` cosine similarities of each
            vector to its neighbours; valid: ``[Q, n]`` bool (False: padding, weight 0).

    Returns:
        ``[Q, D]`` L2-normalised (all inputs are L2-normalised first).
    """
    x = F.normalize(vectors.double(), dim=-1)
    nb = F.normalize(neighbours.double(), dim=-1)
    w = similarities.double().clamp_min(0.0) ** float(alpha)
    if valid is not None:
        w = torch.where(valid, w, torch.zeros((), dtype=w.dtype, device=w.device))
    return F.normalize(x + (w.unsqueeze(-1) * nb).sum(1), dim=-1)


def alpha_query_expansion(
    queries: Tensor, neighbours: Tensor, similarities: Tensor, *, alpha: float = 3.0, valid: Tensor | None = None
) -> Tensor:
    """alpha-QE (Radenovic et al., TPAMI 2019): the query replaced by the L2-normalised weighted sum of itself and
    its top ``n`` database vectors (``neighbours [Q, n, D]``), weights ``(q^T d_i)^alpha``; search again with it."""
    return alpha_weighted_average(queries, neighbours, similarities, alpha=alpha, valid=valid)


def database_side_augmentation(
    vectors: Tensor, neighbours: Tensor, similarities: Tensor, *, alpha: float = 3.0, valid: Tensor | None = None
) -> Tensor:
    """DBA (Radenovic et al., TPAMI 2019): each database vector replaced by the L2-normalised weighted sum of itself
    and its top ``n`` database neighbours (itself excluded from ``neighbours``), weights ``(x^T d_i)^alpha``."""
    return alpha_weighted_average(vectors, neighbours, similarities, alpha=alpha, valid=valid)


# --------------------------------------------------------------------------------------------- re-rankers
def _clamp(count: int, limit: int | None) -> int:
    """``count`` at most ``limit`` (a gallery size; ``None``: no limit), at least 1."""
    return max(1, int(count) if limit is None else min(int(count), int(limit)))


def _gather_vectors(vectors_fn: VectorsFn, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Vectors of ``ids [Q, K]`` (``-1`` -> zeros) as ``[Q, K, D]`` and the validity mask."""
    valid = ids >= 0
    flat = vectors_fn(ids.clamp_min(0).reshape(-1))
    vec = flat.reshape(*ids.shape, flat.shape[-1])
    return vec * valid.unsqueeze(-1).to(vec.dtype), valid


class Reranker:
    """A re-ranking method: :meth:`search` wraps an index's search; :meth:`neighbour_lists` gives the exact ranked
    lists for evaluation (on the library's exact engine, :func:`lightning_dml.metrics.functional.knn`)."""

    name: str = ""

    def candidates_for(self, k: int) -> int:
        return k

    def check_metric(self, metric: str) -> None:
        _check_metric(metric)

    def search(
        self, search_fn: SearchFn, vectors_fn: VectorsFn, queries: Tensor, k: int, metric: str = "cosine",
        gallery_size: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Re-ranked ``(scores [Q, k], ids [Q, k])`` (``-1`` padding) from ``search_fn(queries, k)`` (the index's
        search: similarity scores, best first) and ``vectors_fn(ids [N]) -> [N, D]`` (the gallery vectors).

        ``gallery_size`` (the number of items ``search_fn`` searches): ``candidates`` and ``n`` are clamped to it
        (the index cannot return more; the results are those of the unclamped options, only the padding that
        would cost memory and time is not made)."""
        raise NotImplementedError

    def spec(self) -> str:
        """The ``--rerank`` text that parses back to this re-ranker."""
        names = [f.name for f in fields(self)]  # type: ignore[arg-type]
        opts = ",".join(f"{_KEY_OF.get(name, name)}={getattr(self, name)}" for name in names)
        return f"{self.name}:{opts}"


def _in_blocks(
    queries: Tensor, per_query: int, k: int, run: Callable[[Tensor], tuple[Tensor, Tensor]]
) -> tuple[Tensor, Tensor]:
    """``run`` on blocks of queries of at most :data:`BLOCK_ELEMENTS` / ``per_query`` rows (results never depend on
    the block: each query is re-ranked on its own), concatenated and padded to ``k`` columns."""
    out_s, out_i = [], []
    block = _block(per_query)
    for start in range(0, queries.shape[0], block):
        s, i = run(queries[start : start + block])
        s, i = _pad_columns(s, i, k)
        out_s.append(s)
        out_i.append(i)
    return torch.cat(out_s), torch.cat(out_i)


@dataclass(frozen=True)
class KReciprocal(Reranker):
    """k-reciprocal re-ranking (Zhong et al., CVPR 2017) of the top ``candidates`` results of each query."""

    k1: int = 20
    k2: int = 6
    lambda_: float = 0.3
    candidates: int = 100
    name = "kreciprocal"

    def candidates_for(self, k: int) -> int:
        return max(int(k), self.candidates)

    def search(
        self, search_fn: SearchFn, vectors_fn: VectorsFn, queries: Tensor, k: int, metric: str = "cosine",
        gallery_size: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        self.check_metric(metric)
        kc = _clamp(self.candidates_for(k), gallery_size)

        def run(q: Tensor) -> tuple[Tensor, Tensor]:
            _, ids = search_fn(q, kc)
            vec, _ = _gather_vectors(vectors_fn, ids)
            return k_reciprocal_rerank(q, vec.to(q.device), ids.to(q.device), k=k, k1=self.k1, k2=self.k2,
                                       lambda_=self.lambda_, metric=metric)

        return _in_blocks(queries, max((kc + 1) ** 2, kc * queries.shape[-1]), k, run)


@dataclass(frozen=True)
class AlphaQueryExpansion(Reranker):
    """alpha-QE (Radenovic et al., TPAMI 2019): search with the query expanded by its top ``n`` results."""

    alpha: float = 3.0
    n: int = 2
    name = "aqe"

    def check_metric(self, metric: str) -> None:
        _check_metric(metric)
        if metric != "cosine":
            raise RerankOptionError(f"--rerank {self.name} needs the cosine metric (normalised vectors), the index's "
                                    f"metric is {metric!r}")

    def search(
        self, search_fn: SearchFn, vectors_fn: VectorsFn, queries: Tensor, k: int, metric: str = "cosine",
        gallery_size: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        self.check_metric(metric)
        n = _clamp(self.n, gallery_size)

        def run(q: Tensor) -> tuple[Tensor, Tensor]:
            sims, ids = search_fn(q, n)
            vec, valid = _gather_vectors(vectors_fn, ids)
            expanded = alpha_query_expansion(as_stored(q, metric), vec.to(q.device), sims.to(q.device),
                                             alpha=self.alpha, valid=valid.to(q.device))
            return search_fn(expanded.to(q.dtype), k)

        return _in_blocks(queries, max(n, k) * queries.shape[-1], k, run)


@dataclass(frozen=True)
class DatabaseSideAugmentation(Reranker):
    """DBA (Radenovic et al., TPAMI 2019) on each query's top ``candidates``: each candidate is augmented by its own
    top ``n`` gallery neighbours (from the index, itself excluded) and the candidates are re-scored against the
    query (the candidate-set approximation of augmenting the whole database, module docstring)."""

    alpha: float = 3.0
    n: int = 2
    candidates: int = 100
    name = "dba"

    check_metric = AlphaQueryExpansion.check_metric

    def candidates_for(self, k: int) -> int:
        return max(int(k), self.candidates)

    def search(
        self, search_fn: SearchFn, vectors_fn: VectorsFn, queries: Tensor, k: int, metric: str = "cosine",
        gallery_size: int | None = None,
    ) -> tuple[Tensor, Tensor]:
        self.check_metric(metric)
        n = _clamp(self.n, None if gallery_size is None else gallery_size - 1)
        kc = _clamp(self.candidates_for(k), gallery_size)

        def run(q: Tensor) -> tuple[Tensor, Tensor]:
            _, ids = search_fn(q, kc)
            vec, _ = _gather_vectors(vectors_fn, ids)
            nq = ids.shape[0]
            flat_ids, flat_vec = ids.reshape(-1), vec.reshape(nq * kc, -1)
            rows = _block((n + 1) * max(1, flat_vec.shape[-1]))  # candidates augmented at once
            aug = torch.cat([self._augment(search_fn, vectors_fn, flat_vec[r : r + rows], flat_ids[r : r + rows], n)
                             for r in range(0, nq * kc, rows)]).to(q.device).reshape(nq, kc, -1)
            scores = (aug @ F.normalize(as_stored(q, "cosine").double(), dim=-1).unsqueeze(-1)).squeeze(-1)
            ids = ids.to(q.device)
            ids, scores = _sort_by_id(ids, torch.where(ids >= 0, scores, float("-inf")))
            order = torch.sort(-scores, dim=1, stable=True).indices[:, :k]  # ties: smaller id (ids are sorted)
            return scores.gather(1, order), ids.gather(1, order)

        return _in_blocks(queries, kc * queries.shape[-1], k, run)

    def _augment(self, search_fn: SearchFn, vectors_fn: VectorsFn, vec: Tensor, ids: Tensor, n: int) -> Tensor:
        """The augmented vectors ``[R, D]`` (float64) of gallery vectors ``vec [R, D]`` with ids ``ids [R]``
        (``-1``: padding): each by its ``n`` nearest gallery items besides itself, in the index's order."""
        nb_s, nb_i = search_fn(vec, n + 1)
        nb_s, nb_i = nb_s.to(vec.device), nb_i.to(vec.device)
        not_self = nb_i != ids.to(nb_i.device).unsqueeze(1)
        # keep the first n that are not the item itself (stable: the index's order)
        keep_rank = torch.cumsum(not_self.long(), dim=1)
        keep = not_self & (keep_rank <= n) & (nb_i >= 0)
        pos = torch.sort((~keep).long(), dim=1, stable=True).indices[:, :n]
        sel_i, sel_s, sel_ok = nb_i.gather(1, pos), nb_s.gather(1, pos), keep.gather(1, pos)
        nb_vec, _ = _gather_vectors(vectors_fn, torch.where(sel_ok, sel_i, -1))
        return database_side_augmentation(vec, nb_vec.to(vec.device), sel_s, alpha=self.alpha, valid=sel_ok)


#: ``--rerank`` method name -> class (timm-style registry)
RERANKERS: dict[str, type[Reranker]] = {
    "kreciprocal": KReciprocal,
    "aqe": AlphaQueryExpansion,
    "dba": DatabaseSideAugmentation,
}
#: field name -> option key where they differ (``lambda`` is a Python keyword)
_KEY_OF = {"lambda_": "lambda"}
_FIELD_OF = {v: k for k, v in _KEY_OF.items()}
#: the documented range of each ``--rerank`` option (field name -> inclusive bounds), for every command. Work and
#: memory grow with ``candidates`` (k-reciprocal: ``(candidates + 1)^2`` per query, in blocks of queries of at most
#: :data:`BLOCK_ELEMENTS`; DBA: one search per candidate) and ``n``, never past the gallery size
#: (:meth:`Reranker.search` clamps both to it); ``k1`` and ``k2`` past the universe mean the whole universe.
RERANK_LIMITS: dict[str, tuple[float, float]] = {
    "k1": (1, 1000), "k2": (1, 1000), "lambda_": (0.0, 1.0), "candidates": (1, 10_000),
    "alpha": (0.0, 100.0), "n": (1, 1000),
}


def parse_rerank(text: str | None) -> Reranker | None:
    """Parses a ``--rerank`` option: ``METHOD`` or ``METHOD:KEY=VALUE,...``; ``None``, ``""`` or ``"none"`` -> None.

    Methods and keys (defaults): ``kreciprocal`` (``k1=20, k2=6, lambda=0.3, candidates=100``), ``aqe``
    (``alpha=3, n=2``), ``dba`` (``alpha=3, n=2, candidates=100``). E.g. ``kreciprocal:k1=20,k2=6,lambda=0.3``,
    ``aqe:alpha=3,n=2``. Values outside :data:`RERANK_LIMITS` (``k1, k2, n`` in 1..1000, ``candidates`` in
    1..10000, ``lambda`` in [0, 1], ``alpha`` in [0, 100]) and anything else raise :class:`RerankOptionError`
    naming the method, key or value. The learned re-ranker, ``pairwise:model=DIR,top_n=N``, alone or after one of
    these joined by ``+``: :func:`lightning_dml.index.pairwise.parse_chain`.
    """
    if text is None:
        return None
    spec = str(text).strip()
    if spec in ("", "none"):
        return None
    if "+" in spec or spec.partition(":")[0].strip().lower() == "pairwise":  # the learned re-ranker, last
        from lightning_dml.index.pairwise import parse_chain

        return parse_chain(spec, parse_rerank)
    name, _, rest = spec.partition(":")
    name = name.strip().lower()
    if name not in RERANKERS:
        raise RerankOptionError(f"--rerank {spec!r}: unknown method {name!r}; expected one of {', '.join(RERANKERS)}")
    cls = RERANKERS[name]
    types = {f.name: f.type for f in fields(cls)}  # type: ignore[arg-type]
    defaults = cls()
    allowed = [_KEY_OF.get(f, f) for f in types]
    values: dict[str, Any] = {}
    for item in [p for p in rest.split(",") if p.strip()] if rest.strip() else []:
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        field = _FIELD_OF.get(key, key)
        if not eq or not raw:
            raise RerankOptionError(f"--rerank {spec!r}: {item.strip()!r} is not KEY=VALUE")
        if field not in types or key != _KEY_OF.get(field, field):
            raise RerankOptionError(
                f"--rerank {spec!r}: unknown key {key!r} for {name}; expected {', '.join(allowed)}"
            )
        if field in values:
            raise RerankOptionError(f"--rerank {spec!r}: key {key!r} given twice")
        is_int = isinstance(getattr(defaults, field), int)
        try:
            value: float = int(raw) if is_int else float(raw)
        except ValueError:
            kind = "an integer" if is_int else "a number"
            raise RerankOptionError(f"--rerank {spec!r}: {key}={raw!r} is not {kind}") from None
        lo, hi = RERANK_LIMITS[field]
        if not (math.isfinite(value) and lo <= value <= hi):
            raise RerankOptionError(f"--rerank {spec!r}: {key}={raw} outside [{lo:g}, {hi:g}]")
        values[field] = value
    return cls(**values)


def rerank_search(index: Any, queries: Tensor, k: int, reranker: Reranker | None = None) -> tuple[Tensor, Tensor]:
    """``index.search(queries, k)`` (an :class:`~lightning_dml.index.EmbeddingIndex`), re-ranked by ``reranker``
    (``None``: the plain search) with the index's stored vectors (``index.vectors``) and metric."""
    if reranker is None:
        return index.search(queries, k)
    return reranker.search(index.search, index.vectors, queries, k, index.metric, gallery_size=len(index))


# --------------------------------------------------------------------------------------------- evaluation
def ranked_list_metrics(
    ranked: Tensor, query_labels: Tensor, gallery_labels: Tensor, num_relevant: Tensor, recall_at: Sequence[int]
) -> dict[str, float]:
    """Recall@K and MAP@R of ranked lists ``[Q, L]`` (gallery positions, ``-1`` padding), with the library's metric
    definitions (:func:`lightning_dml.metrics.functional.recall_at_k`, ``map_at_r``); ``L`` must cover every
    query's R (``num_relevant``)."""
    from lightning_dml.metrics import functional as MF

    safe = ranked.clamp_min(0)
    relevance = (gallery_labels[safe] == query_labels.unsqueeze(1)) & (ranked >= 0)
    hit = relevance.any(dim=1)
    first = torch.where(hit, relevance.double().argmax(dim=1), torch.full_like(hit, -1, dtype=torch.int64))
    out = {f"recall@{int(k)}": MF.recall_at_k(first, int(k)) for k in recall_at}
    out["map@r"] = MF.map_at_r(relevance, num_relevant)
    return out


def rerank_metrics(
    reranker: Reranker | None,
    gallery: Tensor,
    gallery_labels: Tensor,
    queries: Tensor | None = None,
    query_labels: Tensor | None = None,
    *,
    recall_at: Sequence[int] = (1, 2, 4, 8),
    metric: str = "cosine",
) -> dict[str, float]:
    """Recall@K and MAP@R of exact search followed by ``reranker`` (``None``: exact search alone), the neighbour
    lists coming from the library's exact engine (:func:`lightning_dml.metrics.functional.knn`, its tie rule).

    Without ``queries``: the gallery all-vs-all, each item a query against the others (leave-one-out, as the
    metrics' all-vs-all mode). Lists are as long as the largest R (and ``max(recall_at)``); past a re-ranker's
    candidate set they continue in the exact order, so MAP@R is that of the whole re-ranked list. DBA augments the
    whole gallery here (the papers' formulation), with each item's ``n`` exact neighbours.
    """
    from lightning_dml.metrics import functional as MF

    _check_metric(metric)
    if gallery_labels.ndim != 1:
        raise ValueError(
            f"rerank_metrics needs one label per item ([N]), got labels of shape {tuple(gallery_labels.shape)}"
        )
    loo = queries is None
    qv, ql = (gallery, gallery_labels) if loo else (queries, query_labels)
    if ql is None:
        raise ValueError("query_labels are needed with queries")
    if reranker is not None:
        reranker.check_metric(metric)
    gl = gallery_labels.to(qv.device)
    ql = ql.to(qv.device)
    r = (ql.unsqueeze(1) == gl.unsqueeze(0)).sum(1) - (1 if loo else 0)
    n_rank = gallery.shape[0] - (1 if loo else 0)
    length = max(int(r.max()) if r.numel() else 1, max(recall_at), 1)
    if reranker is not None:
        length = max(length, reranker.candidates_for(length))
    length = min(length, n_rank)

    def exact(x: Tensor, k: int) -> tuple[Tensor, Tensor]:
        # the queries against the gallery (leave-one-out: the gallery against itself, each item left out)
        return MF.knn(x, None if loo else gallery, k=min(k, n_rank), metric=metric)

    def exact_excluding_self(x: Tensor, k: int, db: Tensor) -> tuple[Tensor, Tensor]:
        # x[i] is query i (leave-one-out): search x against db, drop position i
        s, i = MF.knn(x, db, k=min(k + 1, db.shape[0]), metric=metric)
        own = i == torch.arange(x.shape[0], device=i.device).unsqueeze(1)
        pos = torch.sort(own.long(), dim=1, stable=True).indices[:, :k]
        return s.gather(1, pos), i.gather(1, pos)

    if reranker is None:
        _, ranked = exact(qv, length)
    elif isinstance(reranker, KReciprocal):
        _, ranked = exact(qv, length)
        kc = min(reranker.candidates_for(1), ranked.shape[1])
        stored = as_stored(gallery, metric)  # the candidates as an index stores them: one normalisation path
        block = _block(kc * gallery.shape[-1])
        heads = []
        for start in range(0, qv.shape[0], block):  # candidate vectors of one block at a time
            ids = ranked[start : start + block, :kc]
            heads.append(k_reciprocal_rerank(
                qv[start : start + block], stored[ids.clamp_min(0)], ids, k1=reranker.k1, k2=reranker.k2,
                lambda_=reranker.lambda_, metric=metric,
            )[1])
        ranked = torch.cat([torch.cat(heads), ranked[:, kc:]], dim=1)
    elif isinstance(reranker, AlphaQueryExpansion):
        s, i = exact(qv, reranker.n)
        valid = i >= 0
        expanded = alpha_query_expansion(qv, gallery[i.clamp_min(0)], s, alpha=reranker.alpha, valid=valid)
        if loo:
            _, ranked = exact_excluding_self(expanded.to(gallery.dtype), length, gallery)
        else:
            _, ranked = MF.knn(expanded.to(gallery.dtype), gallery, k=length, metric=metric)
    elif isinstance(reranker, DatabaseSideAugmentation):
        s, i = MF.knn(gallery, None, k=min(reranker.n, gallery.shape[0] - 1), metric=metric)
        augmented = database_side_augmentation(
            gallery, gallery[i.clamp_min(0)], s, alpha=reranker.alpha, valid=i >= 0
        ).to(gallery.dtype)
        if loo:
            _, ranked = exact_excluding_self(gallery, length, augmented)
        else:
            _, ranked = MF.knn(qv, augmented, k=length, metric=metric)
    else:
        raise TypeError(f"unknown re-ranker {type(reranker).__name__}")
    return ranked_list_metrics(ranked, ql, gl, r, recall_at)
