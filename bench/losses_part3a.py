"""Forward + backward time of the issue-29 part-3a losses against pytorch-metric-learning (pml).

Usage::

    OMP_NUM_THREADS=1 python bench/losses_part3a.py                      # B = 512 and 2048, dim 512, CPU
    OMP_NUM_THREADS=1 python bench/losses_part3a.py --batch 512 --cases histogram --repeats 9 --clock thread

The protocol of ``bench/pml_table.py`` (``bench/losses.py``'s ``run_once`` and ``CLOCKS``): for every (case, batch) ours
and pml's run interleaved (ours, pml, ours, pml, ...) on the same embeddings and P x 4 labels, ``--repeats`` times
each after one warm-up, and the medians are reported with their ratio (ours / pml; < 1 means faster); the two
values are checked equal first. Cases:

* ``dynamic_soft_margin``: ours with ``histogram_update="pml"``; pml's with its histogram updated from detached
  values (pml's own differentiates through the histogram into the previous call's freed graph, so its second
  backward fails). pml enumerates every triplet through a ``B x B x B`` mask: not run at B = 2048 (8.6e9 bytes).
* ``generalized_lifted_structure``, ``intra_pair_variance``: the defaults on both sides.
* ``histogram``: 100 bins; pml takes its pairs from every triplet (the same ``B^3`` mask): not run at B = 2048.
* ``large_margin_softmax``: ``--num-classes`` classes (default 11,318, SOP's), m = 4, pml's ``W`` copied from ours.
"""

from __future__ import annotations

import os
import sys
from typing import Callable, Dict, Tuple

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from pml_table import main as run_table, time_pair  # noqa: E402  (the part-3 scripts' one protocol)

CASES = ["dynamic_soft_margin", "generalized_lifted_structure", "histogram", "intra_pair_variance",
         "large_margin_softmax"]
#: pml enumerates all triplets through a B x B x B boolean mask for these: not run above this batch
PML_MAX_BATCH = {"dynamic_soft_margin": 512, "histogram": 512}


def make_pair(case: str, num_classes: int, dim: int) -> Tuple[Callable, Callable]:
    """(ours, pml) modules computing the same loss (see the module docstring)."""
    import pytorch_metric_learning.losses as pml

    from lightning_dml.losses import build_loss

    if case == "dynamic_soft_margin":
        class DetachedHistogramDSM(pml.DynamicSoftMarginLoss):
            def update_histogram(self, data):
                return super().update_histogram(data.detach())

        return build_loss(case, histogram_update="pml"), DetachedHistogramDSM()
    if case == "generalized_lifted_structure":
        return build_loss(case), pml.GeneralizedLiftedStructureLoss(neg_margin=1.0, pos_margin=0.0)
    if case == "histogram":
        return build_loss(case, n_bins=100), pml.HistogramLoss(n_bins=100)
    if case == "intra_pair_variance":
        return build_loss(case), pml.IntraPairVarianceLoss()
    if case == "large_margin_softmax":
        ours = build_loss(case, num_classes=num_classes, embedding_dim=dim, margin=4)
        theirs = pml.LargeMarginSoftmaxLoss(num_classes, dim, margin=4)
        with torch.no_grad():
            theirs.W.copy_(ours.proxies.T)
        return ours, theirs
    raise ValueError(f"unknown case {case!r}; cases: {', '.join(CASES)}")


def make_data(case: str, batch: int, dim: int, num_classes: int, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = (torch.arange(batch) // 4)[torch.randperm(batch, generator=g)]
    if case == "large_margin_softmax":  # the P classes drawn among all num_classes
        labels = torch.randperm(num_classes, generator=g)[labels]
    return torch.randn(batch, dim, generator=g), labels


def time_case(case: str, batch: int, dim: int, repeats: int, num_classes: int, clock: str) -> Dict[str, float]:
    ours, theirs = make_pair(case, num_classes, dim)
    data, labels = make_data(case, batch, dim, num_classes)
    with_pml = batch <= PML_MAX_BATCH.get(case, batch)
    # fresh copies for the value check (the DSM histograms move during the warm-up)
    return time_pair(ours, theirs, data, labels, repeats, clock, with_pml, lambda: make_pair(case, num_classes, dim))


def main() -> None:
    run_table(__doc__.split("\n")[0], CASES, time_case)


if __name__ == "__main__":
    main()
