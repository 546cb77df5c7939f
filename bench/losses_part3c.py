"""Forward + backward time of the issue-29 part-3c losses against pytorch-metric-learning (pml).

Usage::

    OMP_NUM_THREADS=1 python bench/losses_part3c.py --clock thread            # B = 512 and 2048, dim 512, CPU
    OMP_NUM_THREADS=1 python bench/losses_part3c.py --batch 512 --cases manifold --repeats 9

The protocol of ``bench/pml_table.py`` (``bench/losses.py``'s ``run_once`` and ``CLOCKS``, ours and pml's interleaved
on the same embeddings and labels, the values checked first); the cases are built here. Cases:

* ``instance``: P x 4 class labels, ``gamma = 64`` on both sides.
* ``manifold``: ``K = 50`` proxies (pml's default), item ``i``'s proxy ``label mod 50`` (pml's ``indices_tuple``);
  pml not run above B = 512 (``PML_MAX_BATCH``).
* ``dynamic_arcface``: ``--num-classes`` classes (default 11,318, SOP's) with 3 sub-centres, counts 1 to 50; pml 3's
  ``DynamicArcFaceLoss`` (Python >= 3.12, not installable) is pml 2.9's ``SubCenterArcFaceLoss`` with its margin set
  to the batch's margins, as pml 3 does.
* ``self_supervised_ntxent``, ``self_supervised_contrastive``: pml's ``SelfSupervisedLoss`` around its NT-Xent /
  contrastive loss on the batch's two halves (two views of B / 2 items); pml's NT-Xent forms a (positive pairs x
  negative pairs) mask: not run above B = 512.
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

CASES = ["instance", "manifold", "dynamic_arcface", "self_supervised_ntxent", "self_supervised_contrastive"]
#: pml's NT-Xent forms a (positive pairs x negative pairs) mask; pml's ManifoldLoss a K x B x (B + K) cosine tensor
#: and its backward (over 5 GB and minutes per call at B = 2048 on this machine): not run above B = 512
PML_MAX_BATCH = {"self_supervised_ntxent": 512, "manifold": 512}
PROXIES = 50


class _Indices(torch.nn.Module):
    """pml's ManifoldLoss with the proxy assignments (our labels) as its ``indices_tuple``."""

    def __init__(self, loss: torch.nn.Module) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss(embeddings, indices_tuple=labels)


class _Views(torch.nn.Module):
    """pml's SelfSupervisedLoss on the batch's two halves (embeddings, ref_emb)."""

    def __init__(self, loss: torch.nn.Module) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        half = embeddings.shape[0] // 2
        return self.loss(embeddings[:half], embeddings[half:])


class _DynamicMargins(torch.nn.Module):
    """pml 3's DynamicArcFaceLoss.forward on pml 2.9's loss: the margin set to the batch's per-class margins."""

    def __init__(self, loss: torch.nn.Module, margins: torch.Tensor) -> None:
        super().__init__()
        self.loss, self.margins = loss, margins

    def forward(self, embeddings: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        self.loss.margin = self.margins[labels].to(embeddings.dtype)
        return self.loss(embeddings, labels)


def counts_for(num_classes: int) -> torch.Tensor:
    return torch.arange(num_classes) % 50 + 1


def make_pair(case: str, num_classes: int, dim: int) -> Tuple[Callable, Callable]:
    """(ours, pml) modules (see the module docstring)."""
    import pytorch_metric_learning.losses as pml

    from lightning_dml.losses import build_loss

    if case == "instance":
        return build_loss(case), pml.InstanceLoss()
    if case == "manifold":
        theirs = pml.ManifoldLoss(dim, K=PROXIES)
        ours = build_loss(case, num_classes=PROXIES, embedding_dim=dim)
        with torch.no_grad():
            ours.proxies.copy_(theirs.proxies)
        return ours, _Indices(theirs)
    if case == "dynamic_arcface":
        counts = counts_for(num_classes)
        ours = build_loss(case, num_classes=num_classes, embedding_dim=dim, class_counts=counts)
        theirs = pml.SubCenterArcFaceLoss(num_classes=num_classes, embedding_size=dim, sub_centers=3)
        with torch.no_grad():
            theirs.W.copy_(ours.proxies.T)
        return ours, _DynamicMargins(theirs, 0.5 * counts.double() ** -0.25 + 0.05)
    if case.startswith("self_supervised_"):
        inner = case.split("_")[-1]
        theirs = pml.NTXentLoss(temperature=0.1) if inner == "ntxent" else pml.ContrastiveLoss(neg_margin=0.8)
        return build_loss("self_supervised", loss=build_loss(inner)), _Views(pml.SelfSupervisedLoss(theirs))
    raise ValueError(f"unknown case {case!r}; cases: {', '.join(CASES)}")


def make_data(case: str, batch: int, dim: int, num_classes: int, seed: int = 0) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    labels = (torch.arange(batch) // 4)[torch.randperm(batch, generator=g)]
    if case == "dynamic_arcface":  # the P classes drawn among all num_classes
        labels = torch.randperm(num_classes, generator=g)[labels]
    if case == "manifold":
        labels = labels % PROXIES
    if case.startswith("self_supervised_"):  # item i of the first half and item i of the second: its two views
        labels = torch.arange(batch) % (batch // 2)
    return torch.randn(batch, dim, generator=g), labels


def time_case(case: str, batch: int, dim: int, repeats: int, num_classes: int, clock: str) -> Dict[str, float]:
    ours, theirs = make_pair(case, num_classes, dim)
    data, labels = make_data(case, batch, dim, num_classes)
    with_pml = batch <= PML_MAX_BATCH.get(case, batch)
    return time_pair(ours, theirs, data, labels, repeats, clock, with_pml, lambda: (ours, theirs))


def main() -> None:
    run_table(__doc__.split("\n")[0], CASES, time_case)


if __name__ == "__main__":
    main()
