"""Pairwise re-ranking models: a logit for "the query and the candidate show the same class".

* :class:`PairwiseReranker`: the base class. ``forward(x1, x2) -> [B]`` logits of ``B`` pairs (training);
  :meth:`PairwiseReranker.score` re-scores each query's candidates, ``[Q, ...] x [Q, n, ...] -> [Q, n]``, in
  blocks of pairs (batched, no Python loop over pairs; the block size changes no result but the last bits of a
  matrix product over another number of rows), in float32 even inside an autocast region. ``inputs`` says what a pair is made of: ``"images"`` (preprocessed pixel tensors, as
  the index's :class:`~lightning_dml.models.input_spec.InputSpec` gives them) or ``"embeddings"`` (the base model's
  embeddings as the index stores them).
* :class:`ConcatSiamese`: STIR (Shabanov, Tarasov, Nikolenko, *STIR: Siamese Transformer for Image Retrieval
  Postprocessing*, arXiv:2304.13393, 2023): the query and the candidate image are concatenated into one image and
  one ViT looks at both at once (its attention compares the two images patch by patch), then an MLP head gives one
  number. Where the paper leaves details open, this follows open-metric-learning's ``ConcatSiamese``
  (``oml/models/meta/siamese.py``):

  - the two ``[C, S, S]`` images are stacked along the **height** (OML: ``torch.concat([x1, x2], dim=2)``), a
    ``[C, 2S, S]`` image; in a ViT's raster order of patches this is the query's patch tokens followed by the
    candidate's (a concatenation along the token axis), each with the position embedding of its place in the
    ``2S x S`` grid. The backbone is a timm ViT built with ``dynamic_img_size=True``, so the ``S x S`` position
    embedding of the pretrained weights is resampled to the ``2S/16 x S/16`` grid in each forward (as OML's DINO
    ViT interpolates its position encoding);
  - the head is OML's: ``Linear -> Sigmoid -> Dropout(0.5)`` per hidden width, then a ``Linear`` to one output
    without bias, on the backbone's pooled feature (the class token);
  - OML (and the paper) output the probability of a *negative* pair; here the output is the logit of a *positive*
    pair (larger = more likely the same class), the same model with the sign of the logit flipped, so that a
    re-ranker's score orders like a similarity.

* :class:`FeatureDistanceSiamese`: OML's ``LinearTrivialDistanceSiamese``, the cheap variant that never looks at
  pixels: a square linear map ``P`` (no bias, identity at initialisation) of both embeddings, then their Euclidean
  distance. OML returns the distance; here the logit is ``b - exp(s) * ||P x1 - P x2||_2`` with a learnable scale
  ``s`` (0 at initialisation) and bias ``b`` (0), so that the binary loss is well posed; at initialisation its order
  is the base model's Euclidean order (the cosine order for L2-normalised embeddings).

**Residual re-rankers** (``residual=True``, either class). STIR's and OML's rule replaces the base score of a
re-scored candidate by the pair model's output (OML's ``PairwiseReranker.process`` sorts the top-n by the new
distances alone and only rescales them to stay above the rest), so a pair model weaker than the base embedding
reorders a good list for the worse. A residual re-ranker keeps the base score and learns a correction of it:

    ``logit = exp(a) * base + c + r(x1, x2)``

where ``base`` is the score the base ranking gave the pair (the index's or the exact engine's: cosine similarity, or
minus the squared Euclidean distance), ``a`` and ``c`` are learned scalars (``a = log 10``, ``c = 0`` at
initialisation) and ``r`` the pair model, built so that ``r = 0`` before training: ConcatSiamese's last head layer
starts at zero, FeatureDistanceSiamese's residual is ``g ||P x1 - P x2||_2`` with ``g = 0`` at initialisation. An
untrained residual re-ranker is therefore a positive affine map of the base score, which (in float arithmetic too:
rounding is monotone) never reverses two candidates, so its re-ranking (ties kept in the base order) IS the base
ranking. The combination is this library's (a late fusion of the two scores, the zero-initialised last layer as in
ReZero-style residual blocks), not the paper's; :mod:`lightning_dml.rerank.module` can keep the untrained state when
training does not improve a validation split.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, ClassVar, Literal

import torch
from torch import Tensor, nn

from lightning_dml.errors import UserInputError

__all__ = ["ConcatSiamese", "FeatureDistanceSiamese", "PairwiseReranker", "RerankerInputError", "RERANKER_KINDS"]


class RerankerInputError(UserInputError, ValueError):
    """Query and candidate tensors that do not fit a re-ranker (shapes, width, image size)."""


class PairwiseReranker(nn.Module):
    """Base class of the pairwise re-rankers: ``forward(x1, x2)`` gives ``[B]`` logits of ``B`` pairs, larger = more
    likely the same class.

    Subclasses set ``kind`` (the name in ``reranker.json``), ``inputs`` (``"images"`` or ``"embeddings"``),
    ``default_block`` (pairs per block of :meth:`score`) and return the constructor's arguments from
    :meth:`options` (the model is rebuilt from them by :func:`~lightning_dml.rerank.io.load_reranker`).
    """

    kind: ClassVar[str] = ""
    inputs: ClassVar[Literal["images", "embeddings"]] = "embeddings"
    default_block: ClassVar[int] = 4096
    #: the scale ``exp(a)`` of the base score in a residual re-ranker before training (module docstring)
    BASE_SCALE: ClassVar[float] = 10.0
    #: a residual re-ranker (module docstring): its logit needs the base score of each pair
    residual: bool = False

    def init_residual(self, residual: bool) -> None:
        """Set :attr:`residual`; for a residual re-ranker add the learned scale ``a`` and bias ``c`` of the base score
        (parameters ``base_log_scale``, ``base_bias``: a non-residual re-ranker's weights are unchanged)."""
        self.residual = bool(residual)
        if self.residual:
            self.base_log_scale = nn.Parameter(torch.tensor(math.log(self.BASE_SCALE)))
            self.base_bias = nn.Parameter(torch.zeros(()))

    def pair_logits(self, x1: Tensor, x2: Tensor, base: Tensor | None = None) -> Tensor:
        """The logits ``[B]`` of ``B`` pairs: ``forward(x1, x2)``, plus ``exp(a) * base + c`` for a residual re-ranker
        (``base [B]``: the pairs' base scores; required then, ignored otherwise)."""
        own = self(x1, x2)
        if not self.residual:
            return own
        if base is None:
            raise RerankerInputError(f"the residual {self.kind} re-ranker needs the base scores of the pairs it scores")
        return (self.base_log_scale.exp() * base.to(own.dtype) + self.base_bias) + own

    def options(self) -> dict[str, Any]:
        """The constructor's arguments as plain JSON data (what ``reranker.json`` records)."""
        raise NotImplementedError

    def check_item(self, shape: Sequence[int], what: str) -> None:
        """Raise :class:`RerankerInputError` when one item of shape ``shape`` cannot be scored (``what`` names it)."""

    def score(self, query: Tensor, candidates: Tensor, *, base: Tensor | None = None, block: int | None = None
              ) -> Tensor:
        """Logits of each query against each of its candidates: ``query [Q, ...]``, ``candidates [Q, n, ...]`` ->
        ``[Q, n]`` float32 on the candidates' device (:meth:`pair_logits`; ``base [Q, n]``: the base scores of the
        pairs, which a residual re-ranker needs).

        Pairs are formed by indexing (no copy of the query per candidate) and scored ``block`` pairs at a time
        (default :attr:`default_block`); each pair's logit depends on that pair only, so the block size changes no
        result but the last bits of a matrix product over another number of rows (the ``Linear`` layers; ~1e-7
        of a logit on the CPU). The model is used in the mode it is in:
        :func:`~lightning_dml.rerank.io.load_reranker` returns it in eval mode (no dropout).
        Runs without gradient, in float32, with autocast switched off (a bfloat16 logit would tie near candidates).
        """
        if query.ndim < 1 or candidates.ndim != query.ndim + 1:
            raise RerankerInputError(
                f"re-ranker scores need query [Q, ...] and candidates [Q, n, ...] with one more dimension; got "
                f"query {tuple(query.shape)} and candidates {tuple(candidates.shape)}")
        if candidates.shape[0] != query.shape[0] or candidates.shape[2:] != query.shape[1:]:
            raise RerankerInputError(
                f"re-ranker candidates {tuple(candidates.shape)} do not fit query {tuple(query.shape)} (need "
                f"[Q, n, ...] with the query's Q and item shape)")
        self.check_item(query.shape[1:], "query")
        q, n = int(candidates.shape[0]), int(candidates.shape[1])
        flat_base = None
        if self.residual:
            if base is None or tuple(base.shape) != (q, n):
                raise RerankerInputError(
                    f"the residual {self.kind} re-ranker needs the base scores [Q, n] = {(q, n)} of the pairs; got "
                    f"{None if base is None else tuple(base.shape)}")
            flat_base = base.reshape(q * n).to(candidates.device, torch.float32)
        block = int(block or self.default_block)
        if block < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        out = torch.empty(q * n, dtype=torch.float32, device=candidates.device)
        flat = candidates.reshape(q * n, *candidates.shape[2:])
        query = query.to(candidates.device)
        with torch.no_grad(), torch.autocast(device_type=candidates.device.type, enabled=False):
            for start in range(0, q * n, block):
                stop = min(q * n, start + block)
                rows = torch.arange(start, stop, device=candidates.device) // max(n, 1)
                pair_base = None if flat_base is None else flat_base[start:stop]
                out[start:stop] = self.pair_logits(query[rows].float(), flat[start:stop].float(), pair_base).float()
        return out.view(q, n)


class FeatureDistanceSiamese(PairwiseReranker):
    """OML's ``LinearTrivialDistanceSiamese`` as a logit (module docstring): ``b - exp(s) ||P x1 - P x2||_2``.

    Residual (``residual=True``, module docstring): ``exp(a) base + c + g ||P x1 - P x2||_2``, ``g = 0`` at
    initialisation (no ``b``, ``s``: ``a``, ``c`` take their place).

    Args:
        dim: width of the base model's embeddings.
        identity_init: start ``P`` at the identity (OML's ``identity_init``): the base order before training.
        residual: keep the base score and learn a correction (module docstring).
    """

    kind = "feature_distance_siamese"
    inputs = "embeddings"
    default_block = 65536

    def __init__(self, dim: int, identity_init: bool = True, residual: bool = False) -> None:
        super().__init__()
        if int(dim) < 1:
            raise ValueError(f"dim must be >= 1, got {dim}")
        self.dim = int(dim)
        self.identity_init = bool(identity_init)
        self.proj = nn.Linear(self.dim, self.dim, bias=False)
        if self.identity_init:
            with torch.no_grad():
                self.proj.weight.copy_(torch.eye(self.dim))
        self.init_residual(residual)
        if self.residual:
            self.gate = nn.Parameter(torch.zeros(()))
        else:
            self.log_scale = nn.Parameter(torch.zeros(()))
            self.bias = nn.Parameter(torch.zeros(()))

    def options(self) -> dict[str, Any]:
        return {"dim": self.dim, "identity_init": self.identity_init, "residual": self.residual}

    def check_item(self, shape: Sequence[int], what: str) -> None:
        if tuple(shape) != (self.dim,):
            raise RerankerInputError(
                f"the {self.kind} re-ranker takes embeddings of width {self.dim}; the {what} has shape "
                f"{tuple(shape)} (an index of another model?)")

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        distance = torch.linalg.vector_norm(self.proj(x1) - self.proj(x2), dim=-1)
        if self.residual:
            return self.gate * distance
        return self.bias - self.log_scale.exp() * distance


class ConcatSiamese(PairwiseReranker):
    """STIR's siamese transformer (module docstring): ``[C, S, S]`` query and candidate stacked into ``[C, 2S, S]``,
    a timm ViT, an MLP head to one logit.

    Args:
        model_name: a timm ViT (``vit_small_patch16_224.dino`` as in the paper's ViT-S/16; ``vit_tiny_patch16_224``
            for tests), built through :class:`~lightning_dml.models.timm_backbone.TimmBackbone` (its offline and
            weights-file handling) with ``dynamic_img_size=True``.
        img_size: side ``S`` of each of the two images (the index's crop size).
        pretrained: load the tag's pretrained weights (``False`` when a saved re-ranker is loaded: its own weights
            replace them).
        weights_path: a local weights file for the backbone (see ``TimmBackbone``).
        hidden: widths of the head's hidden layers (OML's ``mlp_hidden_dims``).
        dropout: dropout after each hidden layer of the head (OML: 0.5).
        model_kwargs: further ``timm.create_model`` arguments (``{depth: 4, patch_size: 4}`` for small images,
            ``{in_chans: 1}`` for grey images such as Glyphs'; timm adapts pretrained weights to them).
        residual: keep the base score and learn a correction (module docstring): the head's last layer starts at zero.
    """

    kind = "concat_siamese"
    inputs = "images"
    default_block = 32

    def __init__(self, model_name: str = "vit_small_patch16_224.dino", img_size: int = 224, pretrained: bool = True,
                 weights_path: str | None = None, hidden: Sequence[int] = (384,), dropout: float = 0.5,
                 model_kwargs: dict[str, Any] | None = None, residual: bool = False) -> None:
        super().__init__()
        from lightning_dml.models.timm_backbone import TimmBackbone

        if not 0.0 <= float(dropout) < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.model_name, self.img_size = str(model_name), int(img_size)
        self.hidden, self.dropout = tuple(int(h) for h in hidden), float(dropout)
        self.model_kwargs = dict(model_kwargs or {})
        self.backbone = TimmBackbone(self.model_name, pretrained=pretrained, weights_path=weights_path,
                                     img_size=self.img_size, model_kwargs={**self.model_kwargs,
                                                                           "dynamic_img_size": True})
        #: the backbone's own preprocessing (timm's); a trained re-ranker's folder records the base model's instead
        self.input_spec = self.backbone.input_spec
        self.in_chans = int(self.model_kwargs.get("in_chans", 3))
        layers: list[nn.Module] = []
        width = self.backbone.out_features
        for h in self.hidden:
            layers += [nn.Linear(width, h), nn.Sigmoid(), nn.Dropout(self.dropout)]
            width = h
        layers.append(nn.Linear(width, 1, bias=False))
        self.head = nn.Sequential(*layers)
        self.init_residual(residual)
        if self.residual:
            nn.init.zeros_(layers[-1].weight)  # r(x1, x2) = 0 before training: the base ranking

    def options(self) -> dict[str, Any]:
        return {"model_name": self.model_name, "img_size": self.img_size, "hidden": list(self.hidden),
                "dropout": self.dropout, "model_kwargs": self.model_kwargs, "residual": self.residual}

    def check_item(self, shape: Sequence[int], what: str) -> None:
        want = (self.in_chans, self.img_size, self.img_size)
        if tuple(shape) != want:
            raise RerankerInputError(
                f"the {self.kind} re-ranker takes images of shape {want} (channels, height, width); the {what} "
                f"has shape {tuple(shape)} (another crop size than the re-ranker was trained on?)")

    @staticmethod
    def concat(x1: Tensor, x2: Tensor) -> Tensor:
        """``[B, C, S, S]`` x2 -> ``[B, C, 2S, S]``: the query above the candidate (OML's ``dim=2``)."""
        return torch.cat([x1, x2], dim=-2)

    def forward(self, x1: Tensor, x2: Tensor) -> Tensor:
        return self.head(self.backbone(self.concat(x1, x2))).squeeze(-1)


#: the re-ranker classes by their ``kind`` (the name ``reranker.json`` records)
RERANKER_KINDS: dict[str, type[PairwiseReranker]] = {
    FeatureDistanceSiamese.kind: FeatureDistanceSiamese,
    ConcatSiamese.kind: ConcatSiamese,
}
