"""How ``gathered_loss`` wires a loss under DDP (``lightning_dml/losses/distributed.py``), in one process.

The real collectives are exercised by ``tests/distributed/test_distributed_loss.py`` (gloo, in subprocesses). Here
the world is simulated: two processes, this one of rank 1, the other's block fixed; ``all_gather_uneven`` returns
the blocks in rank order and, with ``with_grad=True`` only, keeps the other block attached to a leaf (so a test can
see that the gather is the autograd-aware one: the other process's rows receive their gradient). A spy loss records
what it is called with. The module docstring's contract:

* world size 1: ``loss(embeddings, labels)``, nothing gathered, no global reduction;
* ``"references"``: this process's rows as anchors, the OTHER processes' rows as references, inside
  ``global_reduction``;
* ``"global_batch"``: the whole gathered batch in rank order;
* label sets are padded to the widest ``L`` over the processes first; ``gather_mode=None`` raises.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import lightning_dml.losses.base as base
import lightning_dml.losses.distributed as distributed
from lightning_dml.losses.distributed import gather_from_other_ranks, gathered_loss

OWN = torch.tensor([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
OTHER = torch.tensor([[-1.0, 0.5], [0.25, -2.0]])
OWN_LABELS, OTHER_LABELS = torch.tensor([0, 1, 1]), torch.tensor([1, 2])


class Spy(nn.Module):
    def __init__(self, gather_mode: str | None) -> None:
        super().__init__()
        self.gather_mode = gather_mode
        self.calls: list[dict] = []

    def forward(self, embeddings, labels, ref_embeddings=None, ref_labels=None):
        self.calls.append(dict(embeddings=embeddings, labels=labels, ref_embeddings=ref_embeddings,
                               ref_labels=ref_labels, global_reduction=base._GLOBAL_REDUCTION.get()))
        value = (embeddings**2).sum()
        if ref_embeddings is not None:
            value = value + (ref_embeddings**3).sum()
        return value


@pytest.fixture
def world_of_two(monkeypatch):
    """This process is rank 1 of 2; returns the leaf behind the other process's block."""
    other = OTHER.clone().requires_grad_(True)
    other_sets = torch.tensor([[1, 4, 5], [2, -1, -1]])

    def all_gather_uneven(embeddings, labels, with_grad=False):
        block = other * 1.0 if with_grad else other.detach().clone()
        other_labels = OTHER_LABELS if labels.ndim == 1 else other_sets
        return [block, embeddings], [other_labels, labels]

    def all_reduce(t, op=None, **kwargs):  # the MAX of the label-set widths; what this process sends is recorded
        reduced.append(t.clone())
        t.copy_(torch.maximum(t, torch.tensor([other_sets.shape[1]])))

    reduced: list[torch.Tensor] = []
    monkeypatch.setattr(distributed, "get_world_size", lambda: 2)
    monkeypatch.setattr(distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(distributed, "all_gather_uneven", all_gather_uneven)
    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    other.reduced = reduced
    return other


def test_world_of_one_is_the_plain_loss():
    spy = Spy("references")
    z = OWN.clone().requires_grad_(True)
    value = gathered_loss(spy, z, OWN_LABELS)
    (call,) = spy.calls
    assert call["ref_embeddings"] is None and call["ref_labels"] is None and not call["global_reduction"]
    assert call["embeddings"] is z
    torch.testing.assert_close(value, (OWN**2).sum())


def test_references_are_the_other_processes_rows_inside_global_reduction(world_of_two):
    spy = Spy("references")
    z = OWN.clone().requires_grad_(True)
    value = gathered_loss(spy, z, OWN_LABELS)
    (call,) = spy.calls
    assert call["global_reduction"]
    assert call["embeddings"] is z and torch.equal(call["labels"], OWN_LABELS)
    torch.testing.assert_close(call["ref_embeddings"], OTHER)
    assert torch.equal(call["ref_labels"], OTHER_LABELS)
    value.backward()
    torch.testing.assert_close(z.grad, 2 * OWN)
    torch.testing.assert_close(world_of_two.grad, 3 * OTHER**2)  # the gather carries the gradient back
    assert not base._GLOBAL_REDUCTION.get()  # the context is left


def test_global_batch_is_the_gathered_batch_in_rank_order(world_of_two):
    spy = Spy("global_batch")
    z = OWN.clone().requires_grad_(True)
    value = gathered_loss(spy, z, OWN_LABELS)
    (call,) = spy.calls
    assert call["ref_embeddings"] is None and not call["global_reduction"]
    torch.testing.assert_close(call["embeddings"], torch.cat([OTHER, OWN]))
    assert torch.equal(call["labels"], torch.cat([OTHER_LABELS, OWN_LABELS]))
    value.backward()
    torch.testing.assert_close(z.grad, 2 * OWN)
    torch.testing.assert_close(world_of_two.grad, 2 * OTHER)


def test_gather_from_other_ranks_pads_label_sets_to_the_widest(world_of_two):
    sets = torch.tensor([[0, -1], [1, 3], [1, -1]])
    ref, ref_labels = gather_from_other_ranks(OWN, sets)
    torch.testing.assert_close(ref, OTHER)
    assert ref_labels.shape == (2, 3)
    assert [t.tolist() for t in world_of_two.reduced] == [[2]]  # this process's set width L (not its B = 3)
    spy = Spy("global_batch")
    gathered_loss(spy, OWN, sets)
    assert spy.calls[0]["labels"].shape == (5, 3)
    assert torch.equal(spy.calls[0]["labels"][2:], torch.tensor([[0, -1, -1], [1, 3, -1], [1, -1, -1]]))


def test_a_loss_without_gather_mode_is_refused(world_of_two):
    with pytest.raises(ValueError, match="gather_mode=None"):
        gathered_loss(Spy(None), OWN, OWN_LABELS)
