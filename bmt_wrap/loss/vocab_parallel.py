"""Cross-entropy over logits whose classes (the vocabulary) are split over the tensor-parallel group.

Each TP rank holds ``(N, V/T)`` logits, the whole target, and computes the whole loss with three
all-reduces of one value per row (max, target logit + sum of exponentials); backward needs none: each
rank's gradient is its own columns of ``softmax - one_hot``, as in Megatron's and BMTrain's.
"""

from __future__ import annotations

from typing import Any

import torch

from ..runtime.comm import Communicator


class _VocabParallelRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,  # type: ignore[override]
                comm: Communicator) -> torch.Tensor:
        x = logits.float()
        rows, width = x.shape
        start = comm.rank * width
        valid = target != ignore_index
        inside = valid & (target >= start) & (target < start + width)
        local = torch.where(inside, target - start, 0)
        top = x.max(dim=1).values
        if comm.world_size > 1:
            comm.all_reduce(top, "max", label="vocab-parallel max")
        picked = x.gather(1, local[:, None]).squeeze(1) * inside
        sums = torch.stack([picked, torch.exp(x - top[:, None]).sum(dim=1)])  # (2, N): one all-reduce
        if comm.world_size > 1:
            flat = sums.reshape(-1)
            comm.all_reduce(flat, "sum", label="vocab-parallel sums")
            sums = flat.view(2, rows)
        lse = top + torch.log(sums[1])
        ctx.save_for_backward(logits, local, inside, valid, lse)
        return torch.where(valid, lse - sums[0], 0.0)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, local, inside, valid, lse = ctx.saved_tensors
        probs = torch.exp(logits.float() - lse[:, None])
        probs[torch.arange(probs.shape[0]), local] -= inside.float()
        scale = torch.where(valid, grad.float(), 0.0)
        return (probs * scale[:, None]).to(logits.dtype), None, None, None


def vocab_parallel_rows(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                        comm: Communicator) -> torch.Tensor:
    """Per-row fp32 losses (0 where the target is ``ignore_index``) of vocabulary-split ``logits``."""
    return _VocabParallelRows.apply(logits, target, ignore_index, comm)
