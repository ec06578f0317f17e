"""Cross-entropy over logits whose classes (the vocabulary) are split over the tensor-parallel group.

Each TP rank holds ``(N, V/T)`` logits, the whole target, and computes the whole loss with two all-reduces
per call: each row's max, then (target logit, sum of exponentials, and under label smoothing the row's sum)
together; backward needs none: each rank's gradient is its own columns of ``softmax - one_hot`` (smoothed),
as in Megatron's and BMTrain's. ``rows_forward``/``rows_backward`` serve the fused head too
(``linear_cross_entropy`` under tensor parallelism, one chunk of rows at a time).
"""

from __future__ import annotations

from typing import Any

import torch

from ..runtime.comm import Communicator


class ParallelRows:
    """One call's per-row state between forward and backward: log-sum-exp and the target's local column."""

    def __init__(self, lse: torch.Tensor, local: torch.Tensor, inside: torch.Tensor) -> None:
        self.lse, self.local, self.inside = lse, local, inside


def rows_forward(x: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float, comm: Communicator
                 ) -> tuple[torch.Tensor, ParallelRows]:
    """Per-row fp32 losses (0 where the target is ``ignore_index``) of this rank's fp32 columns ``x``."""
    rows, width = x.shape
    start = comm.rank * width
    valid = target != ignore_index
    inside = valid & (target >= start) & (target < start + width)
    local = torch.where(inside, target - start, 0)
    top = x.max(dim=1).values
    if comm.world_size > 1:
        comm.all_reduce(top, "max", label="vocab-parallel max")
    parts = [x.gather(1, local[:, None]).squeeze(1) * inside, torch.exp(x - top[:, None]).sum(dim=1)]
    if smoothing > 0:
        parts.append(x.sum(dim=1))
    sums = torch.stack(parts)  # one all-reduce for every per-row sum
    if comm.world_size > 1:
        flat = sums.reshape(-1)
        comm.all_reduce(flat, "sum", label="vocab-parallel sums")
        sums = flat.view(len(parts), rows)
    lse = top + torch.log(sums[1])
    loss = (1.0 - smoothing) * (lse - sums[0])
    if smoothing > 0:
        loss = loss + smoothing * (lse - sums[2] / (width * comm.world_size))
    return torch.where(valid, loss, 0.0), ParallelRows(lse, local, inside)


def rows_backward(x: torch.Tensor, state: ParallelRows, row_scale: torch.Tensor, smoothing: float,
                  world_size: int) -> torch.Tensor:
    """d(sum of row_scale * row loss)/d x, fp32 (``row_scale`` is 0 on ignored rows)."""
    probs = torch.exp(x - state.lse[:, None])
    if smoothing > 0:
        probs.sub_(smoothing / (x.shape[1] * world_size))
    probs[torch.arange(probs.shape[0]), state.local] -= (1.0 - smoothing) * state.inside.float()
    return probs.mul_(row_scale[:, None])


class _VocabParallelRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, target: torch.Tensor, ignore_index: int,  # type: ignore[override]
                comm: Communicator) -> torch.Tensor:
        loss, state = rows_forward(logits.float(), target, ignore_index, 0.0, comm)
        ctx.save_for_backward(logits, target)
        ctx.state, ctx.ignore_index, ctx.world_size = state, ignore_index, comm.world_size
        return loss

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        logits, target = ctx.saved_tensors
        scale = torch.where(target != ctx.ignore_index, grad.float(), 0.0)
        return rows_backward(logits.float(), ctx.state, scale, 0.0, ctx.world_size).to(logits.dtype), None, None, None


def vocab_parallel_rows(logits: torch.Tensor, target: torch.Tensor, ignore_index: int,
                        comm: Communicator) -> torch.Tensor:
    """Per-row fp32 losses (0 where the target is ``ignore_index``) of vocabulary-split ``logits``."""
    return _VocabParallelRows.apply(logits, target, ignore_index, comm)
