"""Forward + backward time of the issue-29 part-3b losses against pytorch-metric-learning (pml).

Usage::

    OMP_NUM_THREADS=1 python bench/losses_part3b.py --clock thread            # B = 512 and 2048, dim 512, CPU
    OMP_NUM_THREADS=1 python bench/losses_part3b.py --batch 512 --cases pnp --repeats 9

The protocol of ``bench/pml_table.py`` (``bench/losses.py``'s ``run_once`` and ``CLOCKS``): for every (case, batch) ours
and pml's run interleaved (ours, pml, ours, pml, ...) on the same embeddings and labels (P x 4), ``--repeats``
times each after one warm-up, and the medians are reported with their ratio (ours / pml; < 1 means faster); the
two values are checked equal first. Cases:

* ``p2sgrad``, ``sphereface``: ``--num-classes`` classes (default 11,318, SOP's), pml's weight copied from ours.
* ``pnp`` (variant ``Dq``): pml forms ``B x B x B`` tensors: not run above B = 512.
* ``snr_contrastive``: pml forms the ``B x B x D`` pairwise differences: not run above B = 512.
* ``threshold_consistent_margin``: the defaults on both sides; pml gathers both embeddings of every pair
  (``B^2 x D`` twice): not run above B = 512.
* ``vicreg``: the batch's two halves are the two views (ours: each label twice; pml: ``ref_emb``).
* ``multi_supcon``: against pml 2.9's ``SupConLoss`` (the same loss for one label per item; pml 3's
  ``MultiSupConLoss`` needs Python >= 3.12).
* ``decoupled_contrastive``: against pml 2.9's ``NTXentLoss``, the nearest loss pml 2.9 has (DCL is NT-Xent without
  the positive in the denominator; pml 3's ``DecoupledContrastiveLoss`` cannot be installed): a time reference
  only, the values differ by definition (not checked, reported as nan); pml's NT-Xent forms a (positive pairs x
  negative pairs) matrix (26 GB at B = 2048): not run above B = 512.
* ``selectively_contrastive_triplet``: against pml 2.9's ``TripletMarginLoss`` on the triplets of its
  ``BatchEasyHardMiner`` (easiest positive, hardest negative: the same one triplet per anchor; pml 3's
  ``SelectivelyContrastiveTripletLoss`` cannot be installed): a time reference only, the values differ.
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

CASES = ["p2sgrad", "pnp", "snr_contrastive", "sphereface", "threshold_consistent_margin", "vicreg",
         "multi_supcon", "decoupled_contrastive", "selectively_contrastive_triplet"]
#: pml materialises B x B x B (PNP), B x B x D (SNR) or (pairs x D, TCM: 17 GB at B = 2048) tensors: not run above
#: this batch
PML_MAX_BATCH = {"pnp": 512, "snr_contrastive": 512, "threshold_consistent_margin": 512, "decoupled_contrastive": 512}
#: cases whose pml counterpart is not the same loss (time reference only)
NOT_EQUAL = {"decoupled_contrastive", "selectively_contrastive_triplet"}
CLASSIFICATION = {"p2sgrad", "sphereface"}


class _TwoViews(torch.nn.Module):
    """pml's VICReg called on the batch's two halves as (embeddings, ref_emb)."""

    def __init__(self, loss: torch.nn.Module) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        half = embeddings.shape[0] // 2
        return self.loss(embeddings[:half], ref_emb=embeddings[half:])


def make_pair(case: str, num_classes: int, dim: int) -> Tuple[Callable, Callable]:
    """(ours, pml) modules (see the module docstring)."""
    import pytorch_metric_learning.losses as pml

    from lightning_dml.losses import build_loss

    if case == "p2sgrad":
        ours = build_loss(case, num_classes=num_classes, embedding_dim=dim)
        theirs = pml.P2SGradLoss(dim, num_classes)
        with torch.no_grad():
            theirs.weight.copy_(ours.proxies.T)
        return ours, theirs
    if case == "sphereface":
        ours = build_loss(case, num_classes=num_classes, embedding_dim=dim, margin=4)
        theirs = pml.SphereFaceLoss(num_classes, dim, margin=4)
        with torch.no_grad():
            theirs.W.copy_(ours.proxies.T)
        return ours, theirs
    if case == "pnp":
        return build_loss(case, variant="Dq"), pml.PNPLoss(variant="Dq")
    if case == "snr_contrastive":
        return build_loss(case), pml.SignalToNoiseRatioContrastiveLoss()
    if case == "threshold_consistent_margin":
        return build_loss(case), pml.ThresholdConsistentMarginLoss()
    if case == "vicreg":
        return build_loss(case), _TwoViews(pml.VICRegLoss())
    if case == "multi_supcon":
        return build_loss(case, temperature=0.1), pml.SupConLoss(temperature=0.1)
    if case == "decoupled_contrastive":
        return build_loss(case, temperature=0.1), pml.NTXentLoss(temperature=0.1)
    if case == "selectively_contrastive_triplet":
        from pytorch_metric_learning.miners import BatchEasyHardMiner

        miner, triplet = BatchEasyHardMiner(), pml.TripletMarginLoss(margin=0.1)
        return build_loss(case), lambda e, t: triplet(e, t, miner(e, t))
    raise ValueError(f"unknown case {case!r}; cases: {', '.join(CASES)}")


def make_data(case: str, batch: int, dim: int, num_classes: int, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = (torch.arange(batch) // 4)[torch.randperm(batch, generator=g)]
    if case in CLASSIFICATION:  # the P classes drawn among all num_classes
        labels = torch.randperm(num_classes, generator=g)[labels]
    if case == "vicreg":  # item i of the first half and item i of the second are one item's two views
        labels = torch.arange(batch) % (batch // 2)
    return torch.randn(batch, dim, generator=g), labels


def time_case(case: str, batch: int, dim: int, repeats: int, num_classes: int, clock: str) -> Dict[str, float]:
    ours, theirs = make_pair(case, num_classes, dim)
    data, labels = make_data(case, batch, dim, num_classes)
    with_pml = batch <= PML_MAX_BATCH.get(case, batch)
    value_pair = None if case in NOT_EQUAL else (lambda: (ours, theirs))
    return time_pair(ours, theirs, data, labels, repeats, clock, with_pml, value_pair)


def main() -> None:
    run_table(__doc__.split("\n")[0], CASES, time_case)


if __name__ == "__main__":
    main()
