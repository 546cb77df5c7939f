"""Cross-batch memory: score each batch against the embeddings of earlier batches (beyond the five papers)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from lightning_dml.losses.base import PairLoss, check_inputs, label_sets_error, refuse_indices_tuple
from lightning_dml.losses.registry import build_loss, register_loss

__all__ = ["CrossBatchMemory"]


@register_loss("cross_batch_memory")
class CrossBatchMemory(nn.Module):
    """Wrap a pair loss and keep the last ``memory_size`` embeddings and labels of earlier batches.

    Each call scores the batch against itself plus the memory through the loss's ``ref_embeddings`` path
    (the memory is detached: earlier batches are constants), then, in training mode, enqueues the batch
    (detached, first-in first-out). This is the MS authors' follow-up idea (Wang et al., "Cross-Batch Memory for
    Embedding Learning", CVPR 2020); it is not in the five papers.

    Args:
        loss: the wrapped loss, a :class:`PairLoss` instance or a registry name built with its defaults.
        embedding_size: ``D`` of the embeddings; ``None`` (default): the width of the model's embedding, filled in by
            ``DMLModule`` when fit starts (through :meth:`complete`), or taken from the first batch when the loss is
            used on its own.
        memory_size: number of remembered embeddings ``M``.
        start_after: number of training calls before the memory is used (a warm-up; the XBM paper starts after the
            embedding has stabilised). Until then the loss sees the batch only; the memory is filled regardless.

    Raw embeddings are stored (the wrapped loss normalises them), in fp32. Memory items are used only once
    written (the buffer is not zero-padded into the loss). Extra ``ref_embeddings`` given at call time (DDP) are
    scored too, appended before the memory.
    """

    # anatomy (see PairLoss): under DDP with gather_distributed every process computes the loss of the gathered
    # global batch and enqueues that batch, so each process's memory equals the single-process memory
    normalize = True
    supports_ref = True
    needs_positive_pairs = True
    has_parameters = False
    needs_num_classes = False
    needs_embedding_dim = True
    required_sampler = None
    gather_mode = "global_batch"
    supports_label_sets = False
    label_sets_reason = "its memory queue stores one class id per item"

    def __init__(
        self,
        loss: PairLoss | str = "contrastive",
        embedding_size: int | None = None,
        memory_size: int = 1024,
        start_after: int = 0,
    ) -> None:
        super().__init__()
        if isinstance(loss, str):
            loss = build_loss(loss)
        if not isinstance(loss, PairLoss) or not loss.supports_ref:
            raise ValueError(f"CrossBatchMemory needs a pair loss that accepts ref_embeddings, got {type(loss).__name__}")
        if (embedding_size is not None and embedding_size < 1) or memory_size < 1 or start_after < 0:
            raise ValueError(
                f"need embedding_size >= 1, memory_size >= 1, start_after >= 0; got {embedding_size}, {memory_size}, "
                f"{start_after}"
            )
        self.loss = loss
        self.embedding_size, self.memory_size, self.start_after = embedding_size, memory_size, start_after
        self.register_buffer("memory_embeddings", torch.zeros(memory_size, embedding_size or 0))
        self.register_buffer("memory_labels", torch.zeros(memory_size, dtype=torch.long))
        self.register_buffer("num_filled", torch.zeros((), dtype=torch.long))
        self.register_buffer("write_pointer", torch.zeros((), dtype=torch.long))
        self.register_buffer("num_calls", torch.zeros((), dtype=torch.long))

    def extra_repr(self) -> str:
        return f"embedding_size={self.embedding_size}, memory_size={self.memory_size}, start_after={self.start_after}"

    @property
    def is_complete(self) -> bool:
        """Whether the memory's width is known."""
        return self.embedding_size is not None

    def complete(self, num_classes: int | None = None, embedding_dim: int | None = None) -> CrossBatchMemory:
        """Size the memory for ``embedding_dim`` when ``embedding_size`` was left out (``num_classes`` is unused).

        A width given both here and at construction must agree (``ValueError`` naming both). Returns ``self``.
        """
        if embedding_dim is None:
            return self
        if self.embedding_size is not None:
            if int(embedding_dim) != self.embedding_size:
                raise ValueError(
                    f"CrossBatchMemory was configured with embedding_size={self.embedding_size}, but the model gives "
                    f"embedding_dim={int(embedding_dim)} (width of the embedding): leave embedding_size out or make "
                    "the two agree"
                )
            return self
        self.embedding_size = int(embedding_dim)
        self.memory_embeddings = self.memory_embeddings.new_zeros(self.memory_size, self.embedding_size)
        return self

    def reset(self) -> None:
        """Empty the memory."""
        self.num_filled.zero_()
        self.write_pointer.zero_()
        self.num_calls.zero_()

    @torch.no_grad()
    def enqueue(self, embeddings: Tensor, labels: Tensor) -> None:
        """Write a batch into the ring buffer (the newest ``memory_size`` rows win)."""
        emb, lab = embeddings.detach().float()[-self.memory_size :], labels.detach()[-self.memory_size :]
        n = emb.shape[0]
        idx = (self.write_pointer + torch.arange(n, device=emb.device)) % self.memory_size
        self.memory_embeddings[idx] = emb.to(self.memory_embeddings.device)
        self.memory_labels[idx] = lab.to(self.memory_labels.device).long()
        self.write_pointer.copy_((self.write_pointer + n) % self.memory_size)
        self.num_filled.copy_(torch.clamp(self.num_filled + n, max=self.memory_size))

    def forward(
        self,
        embeddings: Tensor,
        labels: Tensor,
        ref_embeddings: Tensor | None = None,
        ref_labels: Tensor | None = None,
        indices_tuple: tuple[Tensor, ...] | None = None,
    ) -> Tensor:
        refuse_indices_tuple(self, indices_tuple, ref_embeddings)  # a miner's tuple: the one-line refusal
        if any(isinstance(t, Tensor) and t.ndim == 2 for t in (labels, ref_labels)):
            raise label_sets_error(self, tuple(labels.shape))
        check_inputs(embeddings, labels, ref_embeddings, ref_labels, where=type(self).__name__)
        if self.embedding_size is None:
            self.complete(embedding_dim=embeddings.shape[1])
        if embeddings.shape[1] != self.embedding_size:
            raise ValueError(f"embeddings have dim {embeddings.shape[1]}, the memory was built for {self.embedding_size}")
        n = int(self.num_filled)
        use_memory = n > 0 and int(self.num_calls) >= self.start_after
        refs, ref_labs = [], []
        if ref_embeddings is not None:
            refs.append(ref_embeddings)
            ref_labs.append(ref_labels)
        if use_memory:
            refs.append(self.memory_embeddings[:n].to(embeddings.dtype))
            ref_labs.append(self.memory_labels[:n].to(labels.dtype))
        if refs:
            value = self.loss(embeddings, labels, ref_embeddings=torch.cat(refs), ref_labels=torch.cat(ref_labs))
        else:
            value = self.loss(embeddings, labels)
        if self.training:
            self.enqueue(embeddings, labels)
            self.num_calls += 1
        return value
