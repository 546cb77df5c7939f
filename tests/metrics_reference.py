"""Slow reference implementations of the retrieval metrics, written from the definitions (SPEC 9.3).

Float64 brute force over every pair, Python sorting with the documented tie rule (score descending, then
index ascending). Used only by the metric tests.
"""

from __future__ import annotations

import torch


def brute_scores(x: torch.Tensor, metric: str = "cosine") -> torch.Tensor:
    """Float64 score matrix, one row at a time (identical rows give bit-identical scores)."""
    x64 = x.double()
    if metric == "cosine":
        f = x64 / x64.norm(dim=1, keepdim=True)
        return torch.stack([(f * f[i]).sum(dim=1) for i in range(f.shape[0])])
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
