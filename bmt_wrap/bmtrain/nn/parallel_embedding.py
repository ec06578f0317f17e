"""BMTrain's ``VPEmbedding``: an embedding whose vocabulary is split over the TP group, used for the token
lookup and, tied, for the output projection to vocabulary-split logits."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ...explicit.module import DistributedModule
from ...job.distributed import parallel_layout
from ...job.tp_inputs import tp_digests
from ...runtime import tp_ops
from .tp_parameter import split_size, tp_parameter


class VPEmbedding(DistributedModule):
    """``VPEmbedding(vocab_size, embedding_size, dtype=torch.half, init_mean=0.0, init_std=1)`` as in BMTrain;
    the weight's rows (the vocabulary) are split over the TP group.

    ``forward(x)`` looks up this rank's tokens ``x`` in the whole table. Its gradient is right whether TP
    peers hold the same tokens or each its own part of the sequence (BMTrain's example): the table's
    gradient is summed over the TP group in the second case only (BMTrain keeps each rank's own slice in
    both, so rows of other ranks' vocabulary lose the gradient of this rank's tokens). Telling the cases
    apart costs one all-reduce of one integer per TP rank. ``forward(x, projection=True)`` takes this
    rank's part of the sequence (dim 1 of ``(batch, seq, dim)``; dim 0 of ``(rows, dim)``), gathers the
    sequence and returns logits for this rank's part of the vocabulary, for
    ``bmt.loss.FusedCrossEntropy(parallel=True)``.
    """

    def __init__(self, vocab_size: int, embedding_size: int, dtype: torch.dtype = torch.half,
                 init_mean: float = 0.0, init_std: float = 1) -> None:
        super().__init__()
        self.dim_model = embedding_size
        self.vocab_size_per_partition = split_size(vocab_size, "VPEmbedding vocab_size")
        self.start_index = parallel_layout().tp_rank * self.vocab_size_per_partition
        self.end_index = self.start_index + self.vocab_size_per_partition
        init = functools.partial(torch.nn.init.normal_, mean=init_mean, std=init_std)
        self.weight = tp_parameter((vocab_size, embedding_size), 0, init, dtype)

    def forward(self, x: torch.Tensor, projection: bool = False) -> torch.Tensor:
        """Embeddings of the token ids ``x``, or (``projection``) vocabulary-split logits of hidden states."""
        comm = parallel_layout().tp
        if projection:
            dim = 1 if x.dim() >= 3 else 0
            # Every rank uses the whole sequence with its own vocabulary rows: gradients summed, then split.
            return F.linear(tp_ops.gather_sum_grads(x, comm, dim=dim), self.weight)
        same_tokens = len(set(tp_digests([x]))) == 1
        gather = tp_ops.gather_from_tp if same_tokens else tp_ops.gather_sum_grads
        return F.embedding(x, gather(self.weight, comm, dim=0))
