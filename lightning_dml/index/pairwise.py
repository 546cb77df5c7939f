"""The learned pairwise re-ranker at search, serve, ``index evaluate`` and ``test`` time:
``--rerank pairwise:model=DIR,top_n=N``.

A pairwise re-ranker (:mod:`lightning_dml.rerank`: STIR's ``ConcatSiamese``, Shabanov et al. 2023, or the cheap
``FeatureDistanceSiamese``) gives a logit for a (query, candidate) pair, larger = more likely the same class
(:meth:`~lightning_dml.rerank.PairwiseReranker.score`). Each query's first ``top_n`` results of the base ranking
are re-scored with it and sorted by that logit (ties: the base order); the results beyond ``top_n`` stay in the
base order below them, as STIR re-ranks the top-n only and OML's ``PairwiseReranker`` keeps the rest
(:func:`rerank_top_n`). Its inputs are those :attr:`~lightning_dml.rerank.PairwiseReranker.inputs` names:

* ``"embeddings"``: the query's embedding and the candidates' vectors, both as the index stores them
  (:func:`~lightning_dml.index.rerank.as_stored`: L2-normalised float32 for ``cosine``, raw for ``euclidean``);
* ``"images"``: the query's model input (its pixels after the index's preprocessing) and the candidates' images,
  read from the index table's paths and preprocessed the same way (the index's
  :class:`~lightning_dml.index.embed.ImageEmbedder` transform). ``test`` takes the test dataset's items instead.

Reported scores: the re-scored items carry their logit; the items beyond ``top_n`` carry their base score shifted
by one per-query constant so that the first of them is 1 below the smallest logit (their gaps, hence an adaptive
cut among them, are kept; on the re-scored results a ``--threshold`` reads as a logit: 0 is a probability of 1/2).

Syntax and order (:func:`parse_chain`): ``pairwise:model=DIR,top_n=N`` alone, or after one training-free re-ranker
joined by ``+``, e.g. ``aqe:alpha=3,n=2+pairwise:model=DIR,top_n=20``: the training-free re-ranker gives the base
ranking (its first ``max(k, top_n)`` results), then the pairwise re-ranker re-scores the first ``top_n`` of it.
The pairwise re-ranker comes last and at most once; ``DIR`` may not hold ``,`` or ``+``. In a URL (``serve``'s
``rerank`` query parameter) write ``+`` as ``%2B``.

Refused in one line (:class:`~lightning_dml.index.rerank.RerankOptionError` or the loader's
:class:`~lightning_dml.errors.UserInputError`): a missing or broken folder, ``top_n`` outside ``1..MAX_TOP_N``,
a re-ranker trained on another base checkpoint than the index's (or the tested one's) sha256, an embeddings
re-ranker of another embedding size, an images re-ranker on an index without an exported model or image files
(built from tensors) or of another input spec than the index's model, and (``index evaluate``) an images re-ranker with ``--queries`` (the evaluation is handed
the queries' embeddings, not their images: evaluate it leave-one-out, or with ``lightning-dml test``).

``index evaluate`` (:func:`pairwise_metrics`) and ``lightning-dml test --rerank``
(:class:`~lightning_dml.callbacks.pairwise_test.PairwiseRerankTest`) take the exact engine's ranked lists
(:func:`lightning_dml.metrics.functional.knn`, :func:`~lightning_dml.metrics.functional.retrieval_stats`) and
re-score their first ``top_n`` the same way (:func:`rerank_ranked`), so a flat index searched with ``lightning-dml
search`` gives the ranked ids these figures come from.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from lightning_dml.errors import MissingFileError, UserInputError
from lightning_dml.index.rerank import Reranker, RerankOptionError, SearchFn, VectorsFn, as_stored

__all__ = [
    "MAX_TOP_N",
    "PAIR_BLOCK",
    "PairwiseRerank",
    "base_sha256",
    "candidate_images",
    "check_base",
    "index_device",
    "load_pairwise_model",
    "pairwise_metrics",
    "parse_chain",
    "permuted_metrics",
    "query_inputs",
    "rerank_ranked",
    "rerank_top_n",
    "score_pairs",
    "search_index",
]

#: the largest ``top_n`` of ``--rerank pairwise`` (``serve`` caps it lower, ``server.MAX_PAIRWISE_TOP_N``)
MAX_TOP_N = 1000
#: (query, candidate) pairs handed to the re-ranker at once (a memory bound only: the re-ranker's scores do not
#: depend on its batch, :meth:`~lightning_dml.rerank.PairwiseReranker.score`)
PAIR_BLOCK = 256

InputsFn = Callable[[Tensor], Tensor]


# --------------------------------------------------------------------------------------------- functional core
def rerank_top_n(scores: Tensor, ids: Tensor, logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Base lists ``scores, ids [Q, L]`` (best first, ``-1`` / ``-inf`` padding last) with the re-ranker's
    ``logits [Q, n]`` of their first ``n <= L`` items -> ``(scores [Q, L] float64, ids [Q, L], perm [Q, n])``.

    The first ``n`` are sorted by logit, larger first, ties in the base order (a stable sort), padding last;
    ``perm[q, j]``: the base position of the new ``j``-th item. The items beyond ``n`` keep their order and their
    base scores shifted by one constant per query, so that the first of them scores 1 below the smallest logit of
    the row (module docstring). A non-finite logit of a real pair is a ``ValueError``."""
    n = logits.shape[1]
    if scores.shape != ids.shape or logits.shape[0] != ids.shape[0] or n > ids.shape[1]:
        raise ValueError(f"scores/ids [Q, L] and logits [Q, n <= L] expected, got {tuple(scores.shape)}, "
                         f"{tuple(ids.shape)}, {tuple(logits.shape)}")
    valid = ids[:, :n] >= 0
    lg = logits.detach().double().to(ids.device)
    if not bool(torch.isfinite(lg[valid]).all()):
        raise ValueError("the pairwise re-ranker gave a non-finite score (NaN or inf) for a (query, candidate) pair")
    key = torch.where(valid, lg, float("-inf"))
    perm = torch.sort(key, dim=1, descending=True, stable=True).indices
    top_ids = ids[:, :n].gather(1, perm)
    top_scores = key.gather(1, perm)
    rest_ids = ids[:, n:]
    rest = scores[:, n:].double().to(ids.device)
    if rest.shape[1]:
        low = torch.where(valid, lg, float("inf")).min(dim=1).values  # the smallest logit (inf: no item)
        first = rest[:, 0]
        ok = torch.isfinite(low) & torch.isfinite(first)
        offset = torch.where(ok, low - 1.0 - first, torch.zeros_like(first))
        rest = torch.where(rest_ids >= 0, rest + offset.unsqueeze(1), float("-inf"))
    return torch.cat([top_scores, rest], 1), torch.cat([top_ids, rest_ids], 1), perm


def score_pairs(model: Any, query_inputs: Tensor | Callable[[slice], Tensor], candidate_fn: InputsFn,
                ids: Tensor, base: Tensor | None = None) -> Tensor:
    """The re-ranker's logits ``[Q, n]`` of each query (``query_inputs [Q, ...]``, or a function of a slice of the
    queries giving theirs) with its candidates ``ids
    [Q, n]`` (``-1``: padding, logit ``-inf``), whose inputs ``candidate_fn(ids [B, n]) -> [B, n, ...]`` gives; in
    blocks of at most :data:`PAIR_BLOCK` pairs (whole queries; at least one), without gradients. ``base [Q, n]``:
    the base ranking's scores of these pairs, handed to a residual re-ranker (``model.residual``; required then)."""
    residual = bool(getattr(model, "residual", False))
    if residual and (base is None or tuple(base.shape) != tuple(ids.shape)):
        raise ValueError(f"a residual pairwise re-ranker needs the base scores {tuple(ids.shape)} of its pairs")
    q, n = ids.shape
    out = torch.full((q, n), float("-inf"), dtype=torch.float32, device=ids.device)
    if q == 0 or n == 0:
        return out
    block = max(1, PAIR_BLOCK // n)
    with torch.no_grad():
        for start in range(0, q, block):
            sl = slice(start, start + block)
            block_ids = ids[sl]
            candidates = candidate_fn(block_ids)
            q_in = query_inputs(sl) if callable(query_inputs) else query_inputs[sl]
            if residual:  # padding's -inf base scores: any finite value, its logit is masked below
                block_base = torch.where(block_ids >= 0, base[sl].to(ids.device).double(), 0.0)
                logits = model.score(q_in, candidates, base=block_base)
            else:
                logits = model.score(q_in, candidates)
            if tuple(logits.shape) != tuple(block_ids.shape):
                raise ValueError(f"the pairwise re-ranker returned scores of shape {tuple(logits.shape)} for "
                                 f"{tuple(block_ids.shape)} pairs")
            out[sl] = torch.where(block_ids >= 0, logits.detach().float().to(ids.device), float("-inf"))
    return out


def rerank_ranked(model: Any, ranked: Tensor, query_inputs: Tensor | Callable[[slice], Tensor], candidate_fn: InputsFn, top_n: int,
                  scores: Tensor | None = None) -> Tensor:
    """The permutation ``perm [Q, n]`` (``n = min(top_n, L)``) that the re-ranker gives the first ``n`` of ranked
    lists ``ranked [Q, L]`` (gallery positions or ids, ``-1`` padding): apply it to the lists and to anything per
    position (relevance flags) with ``x[:, :n].gather(1, perm)`` (what :func:`rerank_top_n` does to a search).
    ``scores [Q, L]``: the lists' base scores (a residual re-ranker needs them)."""
    n = min(int(top_n), ranked.shape[1])
    logits = score_pairs(model, query_inputs, candidate_fn, ranked[:, :n],
                         None if scores is None else scores[:, :n])
    _, _, perm = rerank_top_n(torch.zeros(ranked.shape, dtype=torch.float64, device=ranked.device), ranked, logits)
    return perm


def permuted_metrics(perm: Tensor, relevance: Tensor, num_relevant: Tensor, first_positive_rank: Tensor,
                     recall_at: Sequence[int]) -> dict[str, float]:
    """Recall@K and MAP@R after re-ordering the first ``n`` positions of ranked lists by ``perm [Q, n]``
    (:func:`rerank_ranked`), with the library's definitions (:func:`lightning_dml.metrics.functional.recall_at_k`,
    ``map_at_r``). ``relevance [Q, L]`` (``L >= n``, covering every query's R), ``num_relevant`` R and
    ``first_positive_rank`` (exact engine's, ``-1``: none) are the base lists'; a first relevant item beyond the
    first ``n`` keeps its rank (the first ``n`` are only re-ordered)."""
    from lightning_dml.metrics import functional as MF

    n = perm.shape[1]
    head = relevance[:, :n].gather(1, perm)
    rel = torch.cat([head, relevance[:, n:]], 1)
    in_head = head.any(dim=1)
    first = torch.where(in_head, head.double().argmax(dim=1), first_positive_rank.long())
    out = {f"recall@{int(k)}": MF.recall_at_k(first, int(k)) for k in recall_at}
    out["map@r"] = MF.map_at_r(rel, num_relevant)
    return out


# --------------------------------------------------------------------------------------------- the option
@dataclass(frozen=True)
class PairwiseRerank(Reranker):
    """``pairwise:model=DIR,top_n=N``, optionally after a training-free re-ranker ``first`` (module docstring)."""

    model: str = ""
    top_n: int = 10
    first: Reranker | None = None
    name = "pairwise"

    def candidates_for(self, k: int) -> int:
        inner = max(int(k), self.top_n)
        return inner if self.first is None else self.first.candidates_for(inner)

    def check_metric(self, metric: str) -> None:
        Reranker.check_metric(self, metric)
        if self.first is not None:
            self.first.check_metric(metric)

    def spec(self) -> str:
        own = f"pairwise:model={self.model},top_n={self.top_n}"
        return own if self.first is None else f"{self.first.spec()}+{own}"

    def load(self, device: str | torch.device = "cpu") -> Any:
        """The re-ranker of :attr:`model` (:func:`load_pairwise_model`, cached)."""
        return load_pairwise_model(self.model, device)

    def check_index(self, index: Any, *, queries_are_images: bool = True) -> Any:
        """Loads the re-ranker and refuses, in one line, one that cannot re-rank ``index``'s results (module
        docstring); returns the loaded model."""
        model = self.load(index_device(index))
        check_base(model, index.manifest.checkpoint_sha256, f"the index {index.folder or ''}".rstrip(), self.model)
        if model.inputs == "embeddings":
            dim = _embedding_dim(model)
            if dim is not None and int(dim) != int(index.dim):
                raise RerankOptionError(f"--rerank pairwise: model={self.model} compares embeddings of size {dim}, "
                                        f"the index holds size {index.dim}")
        elif model.inputs == "images":
            if not index.manifest.model or index.folder is None:
                raise RerankOptionError(f"--rerank pairwise: model={self.model} compares images, and the index "
                                        f"{index.folder or '(in memory)'} has no exported model or image files (built "
                                        "from tensors)")
            from lightning_dml.models.input_spec import InputSpec

            theirs = getattr(model, "input_spec", None)
            spec = index.manifest.input_spec or {}
            mine = InputSpec(**{k: tuple(v) if isinstance(v, list) else v for k, v in spec.items()})
            if theirs is not None and theirs != mine:
                raise RerankOptionError(f"--rerank pairwise: model={self.model} takes images preprocessed as {theirs}, "
                                        f"the index's model as {mine}: the candidates' pixels would not be its input")
            if not queries_are_images:
                raise RerankOptionError(f"--rerank pairwise: model={self.model} compares images, and index evaluate "
                                        "--queries hands over the queries' embeddings, not their images: evaluate it "
                                        "leave-one-out (no --queries) or with lightning-dml test --rerank")
        else:
            raise RerankOptionError(f"--rerank pairwise: model={self.model} has inputs {model.inputs!r}; expected "
                                    "'images' or 'embeddings'")
        return model

    def search(
        self, search_fn: SearchFn, vectors_fn: VectorsFn, queries: Tensor, k: int, metric: str = "cosine",
        gallery_size: int | None = None, *, model: Any = None, query_inputs: Tensor | None = None,
        candidate_fn: InputsFn | None = None,
    ) -> tuple[Tensor, Tensor]:
        """The base search (``first`` or ``search_fn``) of ``max(k, top_n)`` results, its first ``top_n``
        re-scored by ``model`` (:meth:`load` when None). An embeddings re-ranker takes ``as_stored(queries)`` and
        the stored vectors; an images one ``query_inputs [Q, C, H, W]`` and ``candidate_fn(ids) -> [B, n, C, H,
        W]`` (:func:`candidate_images`)."""
        self.check_metric(metric)
        model = self.load(queries.device) if model is None else model
        length = max(int(k), self.top_n)
        if gallery_size is not None:
            length = max(1, min(length, int(gallery_size)))
        if self.first is None:
            scores, ids = search_fn(queries, length)
        else:
            scores, ids = self.first.search(search_fn, vectors_fn, queries, length, metric, gallery_size)
        ids = ids.to(queries.device)
        if model.inputs == "embeddings":
            q_in = as_stored(queries.detach().float(), metric)

            def stored(block_ids: Tensor) -> Tensor:
                flat = vectors_fn(block_ids.clamp_min(0).reshape(-1)).to(q_in.device)
                return flat.reshape(*block_ids.shape, flat.shape[-1])

            fn: InputsFn = stored
        else:
            if query_inputs is None or candidate_fn is None:
                raise RerankOptionError(f"--rerank pairwise: model={self.model} compares images: the query images "
                                        "are needed (search images, not embeddings)")
            q_in, fn = query_inputs, candidate_fn
        n = min(self.top_n, ids.shape[1])
        if getattr(model, "residual", False) and self.first is not None:
            raise RerankOptionError(f"--rerank {self.spec()}: the re-ranker model={self.model} is residual (it adds "
                                    "to the base model's scores): it re-ranks the base search alone, not after "
                                    f"{self.first.name}, whose scores it was not trained on")
        logits = score_pairs(model, q_in, fn, ids[:, :n], scores[:, :n])
        scores, ids, _ = rerank_top_n(scores, ids, logits)
        return scores[:, :k], ids[:, :k]


def index_device(index: Any) -> torch.device:
    """Where the re-ranker of ``index`` runs: where the index's model does (``search --device cpu|cuda|auto``: a GPU
    when the index was loaded for one and torch sees one, as :attr:`~lightning_dml.index.EmbeddingIndex.embedder`)."""
    device = str(getattr(index, "device", "cpu"))
    return torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")


def _embedding_dim(model: Any) -> int | None:
    """The base embedding width the re-ranker takes (its record's ``embedding_dim``), or None."""
    value = getattr(model, "embedding_dim", None)
    return None if value is None else int(value)


def base_sha256(model: Any) -> str | None:
    """The sha256 of the base checkpoint the re-ranker was trained on (as :func:`lightning_dml.rerank.
    save_reranker` recorded it; :func:`~lightning_dml.rerank.load_reranker` sets it on the model)."""
    value = getattr(model, "base_checkpoint_sha256", None)
    return str(value) if value else None


def check_base(model: Any, sha256: str | None, what: str, folder: str) -> None:
    """:class:`~lightning_dml.index.rerank.RerankOptionError` unless the re-ranker's base checkpoint is ``sha256``
    (``what``'s: the index's or the tested checkpoint's); neither may be unknown."""
    mine = base_sha256(model)
    if mine is None:
        raise RerankOptionError(f"--rerank pairwise: model={folder} records no base checkpoint sha256: it cannot be "
                                f"checked against {what}'s")
    if sha256 is None:
        raise RerankOptionError(f"--rerank pairwise: {what} records no checkpoint sha256 (built from tensors or "
                                f"tested without --ckpt_path): the re-ranker model={folder} cannot be checked against "
                                "its base model")
    if mine != sha256:
        raise RerankOptionError(f"--rerank pairwise: model={folder} was trained on the base checkpoint sha256 "
                                f"{mine}, {what} comes from checkpoint sha256 {sha256}: a re-ranker of another base "
                                "model")


_MODELS: dict[tuple, Any] = {}


def load_pairwise_model(folder: str, device: str | torch.device = "cpu") -> Any:
    """:func:`lightning_dml.rerank.load_reranker` of ``folder`` in eval mode on ``device``, kept for the next call
    with the same folder content (its ``reranker.json`` stat) and device; a missing folder is a
    :class:`~lightning_dml.errors.MissingFileError` naming it."""
    path = Path(folder)
    if not path.is_dir():
        raise MissingFileError(f"--rerank pairwise: model={folder}: no such folder (a re-ranker folder written by "
                               "lightning_dml.rerank.save_reranker)")
    try:
        st = os.stat(path / "reranker.json")
        stamp: tuple = (st.st_size, st.st_mtime_ns)
    except OSError:
        stamp = ()
    device = torch.device(device)
    key = (os.path.realpath(path), stamp, str(device))
    model = _MODELS.get(key)
    if model is None:
        from lightning_dml.rerank import load_reranker

        model = load_reranker(str(path), device=str(device)).eval()
        _MODELS.clear()  # one re-ranker at a time (a server serves one)
        _MODELS[key] = model
    return model


def parse_chain(spec: str, parse_one: Callable[[str], Reranker | None]) -> PairwiseRerank:
    """``[TRAINING_FREE+]pairwise:model=DIR,top_n=N`` -> :class:`PairwiseRerank` (module docstring: syntax and
    order); ``parse_one`` parses the training-free part (:func:`~lightning_dml.index.rerank.parse_rerank`)."""
    parts = [p.strip() for p in spec.split("+")]
    if len(parts) > 2 or any(not p for p in parts):
        raise RerankOptionError(f"--rerank {spec!r}: expected pairwise:model=DIR,top_n=N or one training-free "
                                "re-ranker and then it, joined by + (e.g. aqe:alpha=3,n=2+pairwise:model=DIR,top_n=20)")
    *before, last = parts
    if last.partition(":")[0].strip().lower() != "pairwise":
        raise RerankOptionError(f"--rerank {spec!r}: + joins a training-free re-ranker and then pairwise:...; "
                                f"{last!r} is not pairwise")
    first = None
    if before:
        if before[0].partition(":")[0].strip().lower() == "pairwise":
            raise RerankOptionError(f"--rerank {spec!r}: pairwise may be given once, last")
        first = parse_one(before[0])
    values: dict[str, Any] = {}
    rest = last.partition(":")[2]
    for item in [p for p in rest.split(",") if p.strip()]:
        key, eq, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not eq or not raw:
            raise RerankOptionError(f"--rerank {spec!r}: {item.strip()!r} is not KEY=VALUE")
        if key not in ("model", "top_n"):
            raise RerankOptionError(f"--rerank {spec!r}: unknown key {key!r} for pairwise; expected model, top_n")
        if key in values:
            raise RerankOptionError(f"--rerank {spec!r}: key {key!r} given twice")
        if key == "top_n":
            try:
                value = int(raw)
            except ValueError:
                raise RerankOptionError(f"--rerank {spec!r}: top_n={raw!r} is not an integer") from None
            if not 1 <= value <= MAX_TOP_N:
                raise RerankOptionError(f"--rerank {spec!r}: top_n={raw} outside [1, {MAX_TOP_N}]")
            values[key] = value
        else:
            values[key] = raw
    if "model" not in values:
        raise RerankOptionError(f"--rerank {spec!r}: pairwise needs model=DIR (a re-ranker folder)")
    return PairwiseRerank(model=values["model"], top_n=values.get("top_n", 10), first=first)


# --------------------------------------------------------------------------------------------- images
def candidate_images(index: Any) -> InputsFn:
    """``ids [B, n] -> [B, n, C, H, W]``: the index items' image files (the table's paths) read and preprocessed as
    the index's model takes them (its :class:`~lightning_dml.index.embed.ImageEmbedder`'s mode and transform);
    padding ``-1`` -> zeros. An unreadable file is a :class:`~lightning_dml.errors.UserInputError` naming it."""
    from lightning_dml.data.image_list import load_image

    embedder = index.embedder

    def one(path: str) -> Tensor:
        try:
            return embedder.transform(load_image(Path(path), embedder.mode))
        except FileNotFoundError:
            raise UserInputError(f"index {index.folder}: the gallery image {path} does not exist (the pairwise "
                                 "re-ranker reads the candidates' images)") from None
        except Exception as error:  # noqa: BLE001 - any decoder failure names the file
            detail = " ".join(f"{type(error).__name__}: {error}".split())
            raise UserInputError(f"index {index.folder}: the gallery image {path} cannot be read ({detail})") from None

    def fn(ids: Tensor) -> Tensor:
        rows = index.table.rows_of(ids.clamp_min(0).reshape(-1).cpu().numpy())
        pixels = [one(index.table.paths[int(r)]) for r in rows.tolist()]
        out = torch.stack(pixels).reshape(*ids.shape, *pixels[0].shape)
        out = out * (ids >= 0).reshape(*ids.shape, *([1] * pixels[0].ndim)).to(out.dtype).cpu()
        return out.to(embedder.device)

    return fn


def query_inputs(index: Any, rerank: str | None, images: Sequence[Any]) -> Tensor | None:
    """The model inputs ``[Q, C, H, W]`` of query images (paths or PIL images), preprocessed as the index's model
    takes them, when ``rerank`` (a ``--rerank`` text) is a pairwise re-ranker of images; else None (no work)."""
    from lightning_dml.index.rerank import parse_rerank

    reranker = parse_rerank(rerank)
    if not isinstance(reranker, PairwiseRerank) or reranker.load(index_device(index)).inputs != "images":
        return None
    from lightning_dml.data.image_list import load_image

    embedder = index.embedder
    pixels = []
    for image in images:
        if isinstance(image, (str, os.PathLike)):
            try:
                image = load_image(Path(image), embedder.mode)
            except FileNotFoundError:
                raise UserInputError(f"query image {image} does not exist") from None
            except Exception as error:  # noqa: BLE001 - any decoder failure names the file
                detail = " ".join(f"{type(error).__name__}: {error}".split())
                raise UserInputError(f"query image {image} cannot be read as an image ({detail})") from None
        elif image.mode != embedder.mode:
            image = image.convert(embedder.mode)
        pixels.append(embedder.transform(image))
    return torch.stack(pixels).to(embedder.device)


def search_index(index: Any, reranker: PairwiseRerank, queries: Tensor, k: int,
                 query_inputs: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``index``'s results of raw query embeddings ``queries [Q, D]`` re-ranked by ``reranker`` (with
    ``query_inputs``, the queries' model inputs, for an images re-ranker): what ``search`` and ``serve`` call."""
    model = reranker.check_index(index)
    fn = candidate_images(index) if model.inputs == "images" else None
    if query_inputs is not None and model.inputs == "images":
        query_inputs = query_inputs.to(index.embedder.device)
    return reranker.search(index.search, index.vectors, queries, k, index.metric, gallery_size=len(index),
                           model=model, query_inputs=query_inputs, candidate_fn=fn)


# --------------------------------------------------------------------------------------------- evaluation
def pairwise_metrics(
    reranker: PairwiseRerank, index: Any, queries: Tensor | None = None, query_labels: Tensor | None = None,
    gallery_labels: Tensor | None = None, *, recall_at: Sequence[int] = (1, 2, 4, 8),
) -> dict[str, float]:
    """Recall@K and MAP@R of ``index evaluate``'s exact ranked lists (:func:`lightning_dml.metrics.functional.knn`
    on the stored vectors; without ``queries`` every gallery item against the others) re-ranked by ``reranker``
    (its first ``top_n`` re-scored, :func:`rerank_ranked`; a training-free ``first`` is refused here).
    ``gallery_labels`` / ``query_labels``: class ids. ``queries``: raw embeddings of the index's model."""
    from lightning_dml.metrics import functional as MF

    if reranker.first is not None:
        raise RerankOptionError(f"--rerank {reranker.spec()}: index evaluate re-ranks the exact lists with pairwise "
                                "alone (a training-free re-ranker before it is for search and serve)")
    loo = queries is None
    model = reranker.check_index(index, queries_are_images=loo)
    metric = index.metric
    gallery = index.embeddings
    gl = gallery_labels
    qv = gallery if loo else as_stored(queries.detach().float().cpu(), metric)
    ql = gl if loo else query_labels
    n_rank = len(index) - (1 if loo else 0)
    r = (ql.unsqueeze(1) == gl.unsqueeze(0)).sum(1) - (1 if loo else 0)
    length = min(max(int(r.max()) if r.numel() else 1, max(recall_at), reranker.top_n, 1), n_rank)
    base, ranked = MF.knn(qv, None if loo else gallery, k=length, metric=metric)
    device = next(iter(model.parameters()), torch.empty(0)).device
    if model.inputs == "embeddings":
        q_in = qv.to(device)

        def fn(pos: Tensor) -> Tensor:
            return gallery[pos.clamp_min(0).cpu()].to(device)
    else:
        ids = torch.as_tensor(index.table.ids, dtype=torch.long)
        images = candidate_images(index)

        def q_in(sl: slice) -> Tensor:  # leave-one-out: the queries are the gallery items, read block by block
            return images(ids[sl].unsqueeze(1)).squeeze(1)

        def fn(pos: Tensor) -> Tensor:
            return images(torch.where(pos >= 0, ids[pos.clamp_min(0).cpu()], -1))
    perm = rerank_ranked(model, ranked.to(device), q_in, fn, reranker.top_n, base.to(device)).cpu()
    relevance = (ranked >= 0) & (gl[ranked.clamp_min(0)] == ql.unsqueeze(1))
    hit = relevance.any(dim=1)
    # the base first relevant rank within the list (-1: none; the list covers R, so none means R = 0)
    first = torch.where(hit, relevance.double().argmax(dim=1), torch.full_like(hit, -1, dtype=torch.int64))
    return permuted_metrics(perm, relevance, r, first, recall_at)

