"""The search cut: which of a query's top-k results are kept, so that "no match" is an answer.

Results are ``(scores [Q, k], ids [Q, k])`` best first (similarities: higher is better), ``-1`` ids padding. A cut
never reorders; it turns dropped results into padding (score ``-inf``, id ``-1``), which the search command and
the server leave out of their answers (an empty ``results`` list: no match).

* **Constant threshold** (:func:`threshold_mask`, ``--threshold T``): a result is kept when its score is at least
  ``T`` (OML's ``ConstantThresholding`` keeps distances ``< th``; here similarities ``>= T``).
* **Adaptive cut** (:func:`adaptive_mask`, ``--adaptive N``): the list is cut after the first gap between
  consecutive scores that is larger than ``N`` times the mean gap. This follows open-metric-learning's
  ``AdaptiveThresholding`` (``oml/retrieval/postprocessors/algo.py``): ``diffs = d[1:] - d[:-1]``; a gap is big
  when ``diffs > n_std * avg_gap``; the list keeps ``d[: i + 1]`` for the first big gap ``i``, or all of it when
  there is none. Where it differs: (1) OML's ``n_std`` multiplies the **mean** gap (its ``AvgOnline``), not a
  standard deviation of the gaps, and so does ``N`` here (the definition OML implements, whatever the name);
  (2) OML pools the gaps of all queries of a batch into one mean; here each query's mean is over its own gaps, so
  a query's answer does not depend on which queries it was batched with (the server batches requests); (3) the
  gaps are of similarities sorted descending (``s[i] - s[i + 1] >= 0``), OML's of distances sorted ascending.
  A single result has no gap and is kept; equal scores have mean gap 0 and no gap is larger, so all are kept.

Both cuts together: the adaptive cut runs first (on the list as searched, or re-ranked), then the threshold.
:class:`SearchCut` holds the two options; :func:`parse_threshold` / :func:`parse_adaptive` check the values for the
command line and the server's query parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from lightning_dml.errors import UserInputError

__all__ = [
    "CutOptionError",
    "SearchCut",
    "adaptive_mask",
    "apply_mask",
    "parse_adaptive",
    "parse_threshold",
    "threshold_mask",
]


class CutOptionError(UserInputError, ValueError):
    """A ``--threshold`` / ``--adaptive`` value that is not a finite number (or a negative ``--adaptive``)."""


def _check(scores: Tensor, ids: Tensor) -> None:
    if scores.ndim != 2 or scores.shape != ids.shape:
        raise ValueError(f"scores and ids must both be [Q, k], got {tuple(scores.shape)} and {tuple(ids.shape)}")


def threshold_mask(scores: Tensor, ids: Tensor, threshold: float) -> Tensor:
    """``[Q, k]`` bool: the result is a real one (id >= 0) with ``score >= threshold``."""
    _check(scores, ids)
    return (ids >= 0) & (scores >= threshold)


def adaptive_mask(scores: Tensor, ids: Tensor, n: float) -> Tensor:
    """``[Q, k]`` bool: the results before (and at) each query's first gap larger than ``n`` times the mean gap of
    its list (module docstring: open-metric-learning's ``AdaptiveThresholding``, per query).

    ``scores`` best first; padding (``ids == -1``) at the end of a row is ignored. Batched, no loop over queries.
    """
    _check(scores, ids)
    valid = ids >= 0
    k = scores.shape[1]
    if k < 2:
        return valid
    s = scores.double()
    gaps = s[:, :-1] - s[:, 1:]  # [Q, k-1]; gap i lies between results i and i+1
    gap_ok = valid[:, :-1] & valid[:, 1:]
    count = gap_ok.sum(1)
    mean = torch.where(gap_ok, gaps, torch.zeros((), dtype=s.dtype, device=s.device)).sum(1) / count.clamp_min(1)
    big = gap_ok & (gaps > n * mean.unsqueeze(1))
    has_big = big.any(1)
    first = torch.where(has_big, big.double().argmax(1), torch.full_like(count, k))  # cut after result `first`
    position = torch.arange(k, device=scores.device).unsqueeze(0)
    return valid & (position <= first.unsqueeze(1))


def apply_mask(scores: Tensor, ids: Tensor, keep: Tensor) -> tuple[Tensor, Tensor]:
    """Dropped results become padding (``-inf``, ``-1``); kept ones stay in place (a cut keeps a prefix)."""
    return (
        torch.where(keep, scores, torch.full_like(scores, float("-inf"))),
        torch.where(keep, ids, torch.full_like(ids, -1)),
    )


def _number(text: str | float, option: str) -> float:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise CutOptionError(f"{option} {text!r} is not a number") from None
    if not math.isfinite(value):
        raise CutOptionError(f"{option} {text!r} is not a finite number")
    return value


def parse_threshold(text: str | float | None) -> float | None:
    """A ``--threshold`` value (any finite similarity; ``None`` -> no threshold)."""
    return None if text is None else _number(text, "--threshold")


def parse_adaptive(text: str | float | None) -> float | None:
    """An ``--adaptive`` value N >= 0 (``None`` -> no adaptive cut)."""
    if text is None:
        return None
    value = _number(text, "--adaptive")
    if value < 0:
        raise CutOptionError(f"--adaptive {text!r} must be >= 0 (a multiple of the mean gap between scores)")
    return value


@dataclass(frozen=True)
class SearchCut:
    """The cut options of a search: ``threshold`` (similarity) and ``adaptive`` (N), each optional."""

    threshold: float | None = None
    adaptive: float | None = None

    @classmethod
    def parse(cls, threshold: str | float | None = None, adaptive: str | float | None = None) -> SearchCut:
        return cls(parse_threshold(threshold), parse_adaptive(adaptive))

    def __bool__(self) -> bool:
        return self.threshold is not None or self.adaptive is not None

    def apply(self, scores: Tensor, ids: Tensor) -> tuple[Tensor, Tensor]:
        """The cut results: adaptive first, then the threshold; dropped results become padding."""
        keep = ids >= 0
        if self.adaptive is not None:
            keep = keep & adaptive_mask(scores, ids, self.adaptive)
        if self.threshold is not None:
            keep = keep & threshold_mask(scores, ids, self.threshold)
        return apply_mask(scores, ids, keep)
