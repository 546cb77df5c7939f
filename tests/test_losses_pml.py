"""Our losses against pytorch-metric-learning (pml) where the definitions coincide (values and gradients).

Convention notes (documented differences):
* pml's ``ContrastiveLoss`` / ``TripletMarginLoss`` use ``AvgNonZeroReducer`` (mean over pairs / triplets with a
  non-zero term; for contrastive the positive and negative means are added) = our ``reduction="mean_nonzero"``;
  their default distance ``LpDistance`` (normalised, non-squared) = our ``D``; ``LpDistance(power=2)`` = ``squared``.
* pml's ``LiftedStructureLoss`` is the original lifted loss (one log over both negative sets, squared hinge, / 2,
  averaged over ordered positive pairs) = our ``variant="original"``; ``GeneralizedLiftedStructureLoss`` = ours
  ``variant="generalized"``.
* pml's ``NPairsLoss`` L2-normalises by default (``DotProductSimilarity(normalize_embeddings=True)``); the paper
  (and ours) uses raw inner products, so the test passes an unnormalised ``DotProductSimilarity``; pml has no L2
  regulariser (our ``l2_reg=0``).
* pml's ``TupletMarginLoss(margin, scale)`` takes the slack in degrees and uses all negatives of the anchor
  = ours with ``slack=radians(margin)``, ``negatives="all"``; the variance term is pml's ``IntraPairVarianceLoss``
  (gradient through the mean, ``detach_mean=False``), weighted by 0.5.
* pml's ``TripletMarginLoss`` with ``BatchHardMiner`` = our ``mining="batch_hard"``.
"""

import math

import pytest
import torch

from lightning_dml.losses import ContrastiveLoss, LiftedStructureLoss, NPairLoss, TripletLoss, TupletMarginLoss

pml_losses = pytest.importorskip("pytorch_metric_learning.losses")
pml_miners = pytest.importorskip("pytorch_metric_learning.miners")
pml_distances = pytest.importorskip("pytorch_metric_learning.distances")


def _batch(seed, b, k, d=16):
    g = torch.Generator().manual_seed(seed)
    y = (torch.arange(b) // k)[torch.randperm(b, generator=g)]
    return torch.randn(b, d, generator=g), y


def _compare(ours, theirs, z, y, rtol=1e-5):
    z1 = z.clone().requires_grad_(True)
    z2 = z.clone().requires_grad_(True)
    expected = theirs(z2, y)
    (g_ref,) = torch.autograd.grad(expected, z2)
    value = ours(z1, y)
    (g,) = torch.autograd.grad(value, z1)
    torch.testing.assert_close(value, expected, rtol=rtol, atol=1e-6)
    torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6)


SEEDS = [(0, 24, 4), (1, 40, 5), (2, 30, 3)]


@pytest.mark.parametrize("seed,b,k", SEEDS)
@pytest.mark.parametrize("squared", [False, True])
def test_contrastive(seed, b, k, squared):
    z, y = _batch(seed, b, k)
    dist = pml_distances.LpDistance(power=2) if squared else pml_distances.LpDistance()
    theirs = pml_losses.ContrastiveLoss(pos_margin=0.0, neg_margin=1.0 if squared else 0.8, distance=dist)
    _compare(ContrastiveLoss(neg_margin=1.0 if squared else 0.8, squared=squared), theirs, z, y)


@pytest.mark.parametrize("seed,b,k", SEEDS)
def test_triplet_all(seed, b, k):
    z, y = _batch(seed, b, k)
    _compare(TripletLoss(margin=0.1), pml_losses.TripletMarginLoss(margin=0.1), z, y)


@pytest.mark.parametrize("seed,b,k", SEEDS)
def test_triplet_batch_hard(seed, b, k):
    z, y = _batch(seed, b, k)
    loss, miner = pml_losses.TripletMarginLoss(margin=0.2), pml_miners.BatchHardMiner()
    _compare(TripletLoss(margin=0.2, mining="batch_hard"), lambda e, t: loss(e, t, miner(e, t)), z, y)


@pytest.mark.parametrize("seed,b,k", SEEDS)
def test_lifted_structure_original(seed, b, k):
    z, y = _batch(seed, b, k)
    _compare(LiftedStructureLoss(margin=1.0), pml_losses.LiftedStructureLoss(neg_margin=1.0, pos_margin=0.0), z, y)


@pytest.mark.parametrize("seed,b,k", SEEDS)
def test_generalized_lifted_structure(seed, b, k):
    z, y = _batch(seed, b, k)
    theirs = pml_losses.GeneralizedLiftedStructureLoss(neg_margin=1.0, pos_margin=0.0)
    _compare(LiftedStructureLoss(margin=1.0, variant="generalized"), theirs, z, y)


@pytest.mark.parametrize("seed,b,k", [(0, 16, 2), (1, 30, 3), (2, 24, 2)])
def test_npair_mc(seed, b, k):
    z, y = _batch(seed, b, k)
    theirs = pml_losses.NPairsLoss(distance=pml_distances.DotProductSimilarity(normalize_embeddings=False))
    _compare(NPairLoss(l2_reg=0.0), theirs, z, y)


@pytest.mark.parametrize("seed,b,k", SEEDS)
def test_tuplet_margin_with_intra_pair_variance(seed, b, k):
    z, y = _batch(seed, b, k)
    tml = pml_losses.TupletMarginLoss(margin=math.degrees(0.1), scale=64.0)
    ipv = pml_losses.IntraPairVarianceLoss(pos_eps=0.01, neg_eps=0.01)
    _compare(TupletMarginLoss(negatives="all"), lambda e, t: tml(e, t) + 0.5 * ipv(e, t), z, y)
