"""Slow reference implementations of the retrieval metrics, written from the definitions (SPEC 9.3).

Float64 brute force over every pair, Python sorting with the documented tie rule (score descending, then
index ascending). Used only by the metric tests.
"""

from __future__ import annotations

import torch


def brute_scores(x: torch.Tensor, metric: str = "cosine") -> torch.Tensor:
    """Float64 score matrix, one row at a time (identical rows give bit-identical scores), by the definition of
    docs/metrics.md: ``<x_q, x_g> / (|x_q| |x_g|)`` (or ``-|x_q - x_g|^2``) in float64. The cosine is divided
    by the product of the norms, not taken between normalised rows: two pairs whose cosines are mathematically
    equal (integer coordinates: ``1 / (sqrt(2) sqrt(2))`` and ``2 / (sqrt(4) sqrt(4))``) may then differ in the
    last bit exactly as the engine's exact scores do; on integer coordinates the sums are exact in any order, so
    these scores are bit-identical to the engine's."""
    x64 = x.double()
    if metric == "cosine":
        norms = (x64 * x64).sum(dim=1).sqrt()
        return torch.stack([(x64 * x64[i]).sum(dim=1) / (norms * norms[i]) for i in range(x64.shape[0])])
    return torch.stack([-((x64 - x64[i]) ** 2).sum(dim=1) for i in range(x64.shape[0])])


def brute_rankings(x, labels, metric="cosine", query_mask=None, gallery_mask=None):
    """For each query (in index order): its gallery ranking (list of indices), labels list, R."""
    n = x.shape[0]
    s = brute_scores(x, metric)
    qs = range(n) if query_mask is None else [i for i in range(n) if bool(query_mask[i])]
    gs = list(range(n)) if gallery_mask is None else [i for i in range(n) if bool(gallery_mask[i])]
    out = []
    for q in qs:
        cand = [g for g in gs if g != q]
        cand.sort(key=lambda g: (-float(s[q, g]), g))
        rel = [int(labels[g]) == int(labels[q]) for g in cand]
        out.append((q, cand, rel, sum(rel)))
    return out


def brute_metrics(x, labels, recall_at=(1, 2, 4, 8), metric="cosine", query_mask=None, gallery_mask=None):
    rk = brute_rankings(x, labels, metric, query_mask, gallery_mask)
    out = {}
    for k in recall_at:
        out[f"recall@{k}"] = sum(any(rel[:k]) for _, _, rel, _ in rk) / len(rk)
    out["precision@1"] = sum(bool(rel[:1] and rel[0]) for _, _, rel, _ in rk) / len(rk)
    rp, ap = [], []
    for _, _, rel, r in rk:
        if r == 0:
            continue
        rp.append(sum(rel[:r]) / r)
        hits, acc = 0, 0.0
        for i in range(r):
            if rel[i]:
                hits += 1
                acc += hits / (i + 1)
        ap.append(acc / r)
    out["r_precision"] = sum(rp) / len(rp) if rp else 0.0
    out["map@r"] = sum(ap) / len(ap) if ap else 0.0
    return out


# --------------------------------------------------------------------------------------------- general tasks
def _relevant(labels, q: int, g: int) -> bool:
    """Same label, or label sets (rows padded with -1) that intersect."""
    if labels.ndim == 1:
        return int(labels[q]) == int(labels[g])
    a = {int(v) for v in labels[q] if int(v) >= 0}
    b = {int(v) for v in labels[g] if int(v) >= 0}
    return bool(a & b)


def brute_task_rankings(x, labels, metric="cosine", query_mask=None, gallery_mask=None, sequence=None):
    """Per query (in index order): (query, ranked gallery list, relevance list, R, exact scores list), with the
    query itself and (with ``sequence``) the items of its sequence removed from its gallery."""
    n = x.shape[0]
    s = brute_scores(x, metric)
    qs = range(n) if query_mask is None else [i for i in range(n) if bool(query_mask[i])]
    gs = list(range(n)) if gallery_mask is None else [i for i in range(n) if bool(gallery_mask[i])]
    out = []
    for q in qs:
        cand = [
            g for g in gs
            if g != q and not (sequence is not None and int(sequence[q]) >= 0 and int(sequence[g]) == int(sequence[q]))
        ]
        cand.sort(key=lambda g: (-float(s[q, g]), g))
        rel = [_relevant(labels, q, g) for g in cand]
        out.append((q, cand, rel, sum(rel), [float(s[q, g]) for g in cand]))
    return out


def brute_task_metrics(x, labels, recall_at=(1, 2, 4, 8), metric="cosine", query_mask=None, gallery_mask=None,
                       sequence=None, category=None, precision_at=(), ndcg_at=(), fmrs=()):
    """Every metric of docs/metrics.md from the definitions, in float64 and Python loops (``fmrs``: floats or
    decimal strings; a string's figures are keyed by the string as given)."""
    import math
    from fractions import Fraction

    rk = brute_task_rankings(x, labels, metric, query_mask, gallery_mask, sequence)

    def figures(rows):
        out = {}
        for k in recall_at:
            out[f"recall@{k}"] = sum(any(rel[:k]) for _, _, rel, _, _ in rows) / len(rows) if rows else 0.0
        out["precision@1"] = out.get("recall@1", sum(bool(rel[:1] and rel[0]) for _, _, rel, _, _ in rows) / max(len(rows), 1))
        for k in precision_at:
            out[f"precision@{k}"] = sum(sum(rel[:k]) / k for _, _, rel, _, _ in rows) / len(rows) if rows else 0.0
        out["mrr"] = sum((1 / (rel.index(True) + 1)) if any(rel) else 0.0 for _, _, rel, _, _ in rows) / max(len(rows), 1)
        with_r = [row for row in rows if row[3] > 0]
        rp, apr, ap = [], [], []
        ndcg = {k: [] for k in ndcg_at}
        for _, _, rel, r, _ in with_r:
            rp.append(sum(rel[:r]) / r)
            hits, acc = 0, 0.0
            for i in range(r):
                if rel[i]:
                    hits += 1
                    acc += hits / (i + 1)
            apr.append(acc / r)
            hits, acc = 0, 0.0
            for i, is_rel in enumerate(rel):
                if is_rel:
                    hits += 1
                    acc += hits / (i + 1)
            ap.append(acc / r)
            for k in ndcg_at:
                dcg = sum(1 / math.log2(i + 2) for i in range(min(k, len(rel))) if rel[i])
                idcg = sum(1 / math.log2(i + 2) for i in range(min(k, r)))
                ndcg[k].append(dcg / idcg)
        out["r_precision"] = sum(rp) / len(rp) if rp else 0.0
        out["map@r"] = sum(apr) / len(apr) if apr else 0.0
        out["map"] = sum(ap) / len(ap) if ap else 0.0
        for k in ndcg_at:
            out[f"ndcg@{k}"] = sum(ndcg[k]) / len(ndcg[k]) if ndcg[k] else 0.0
        return out

    out = figures(rk)
    if category is not None:
        for c in sorted({int(category[q]) for q, *_ in rk}):
            if c < 0:
                continue
            for key, value in figures([row for row in rk if int(category[row[0]]) == c]).items():
                out[f"category/{c}/{key}"] = value
    if fmrs:
        pos = sorted(sc for _, _, rel, _, scores in rk for is_rel, sc in zip(rel, scores) if is_rel)
        neg = sorted((sc for _, _, rel, _, scores in rk for is_rel, sc in zip(rel, scores) if not is_rel), reverse=True)
        for f in fmrs:
            # F exactly as the decimal number written (a float: its shortest repr), floor in integers
            rate = Fraction(f) if isinstance(f, str) else Fraction(repr(float(f)))
            m = (rate.numerator * len(neg)) // rate.denominator
            theta = neg[m] if m < len(neg) else -math.inf
            key = f if isinstance(f, str) else f"{f:g}"
            out[f"fnmr@fmr={key}"] = sum(p <= theta for p in pos) / len(pos) if pos else 0.0
            out[f"threshold@fmr={key}"] = theta
            out[f"_fmr@fmr={key}"] = sum(v > theta for v in neg) / len(neg) if neg else 0.0
    return out
