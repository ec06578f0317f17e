"""What ZeRO over the data-parallel group adds under tensor parallelism: the start-up broadcast of values
that differ between TP peers, and the gradients TP peers sum.

Every group is sharded over the dp group (the ranks with this rank's ``tp_rank``; under a 3-D mesh, those
of its replica, the replicas averaging the gradient shards as HSDP does), and TP peers hold the
same ranges of their own flat buffers, whose slots have the same TP-local shapes. Two kinds of parameter
live there (``tp_marks.py``): a TP-split one (each peer its slice) and one every TP peer holds whole.
A whole one gets either the same gradient on every TP peer (marked ``tp_mode``, split dim -1; the
one-liner's replicated parameters, which see the same activations on every peer), or a part of it,
when each peer runs it on its own part of the sequence (BMTrain's sequence-split activations between
its parallel linears: layer norms, position embeddings): those are summed over the TP group after the
dp reduce-scatter, as BMTrain's reduction over the world sums them. Unmarked parameters of the explicit
API are of that second kind, as in BMTrain; a wrapped model's are of the first, except those its sequence
parallelism runs on sequence parts (marked ``_tp_sequence_part``).
"""

from __future__ import annotations

import torch

from .comm import Communicator, Handle, RankLayout
from .flat_buffer import FlatBuffer
from .tp_marks import sequence_part, tp_identical, tp_split_dim


def broadcast_under_tp(buf: FlatBuffer, full: torch.Tensor, originals: list[torch.Tensor | None],
                       dp: RankLayout, tp: Communicator, name: str) -> None:
    """Make ``full`` (a flat buffer's unsharded values) rank 0's for whole parameters and the first dp
    replica's for TP-split ones (whose slices differ between TP peers)."""
    dp.shard.broadcast(full, 0, label=f"{name} parameters")
    if dp.replicate is not None:  # HSDP x TP: the first replica's, as rank 0 is the first replica's rank 0
        dp.replicate.broadcast(full, 0, label=f"{name} parameters (replicas)")
    split = [o is not None and tp_split_dim(o) is not None for o in originals]
    if not any(split) or all(split):
        if not any(split):
            tp.broadcast(full, 0, label=f"{name} parameters (tp)")
        return
    mine = full.clone()
    tp.broadcast(full, 0, label=f"{name} parameters (tp)")
    for is_split, dst, src in zip(split, buf.slot_views(full), buf.slot_views(mine), strict=True):
        if is_split:
            dst.copy_(src)


def tp_sum_ranges(buf: FlatBuffer, tp: Communicator, sum_unmarked: bool
                  ) -> tuple[Communicator, list[tuple[int, int]]] | None:
    """The TP group and this rank's gradient-shard ranges it sums, merged where adjacent; None if none."""
    ranges: list[tuple[int, int]] = []
    for p, (a, b) in zip(buf.params, buf.local_ranges, strict=True):
        if a == b or tp_split_dim(p) is not None:
            continue
        if not sequence_part(p) and (tp_identical(p) or not sum_unmarked):
            continue
        if ranges and ranges[-1][1] == a:
            ranges[-1] = (ranges[-1][0], b)
        else:
            ranges.append((a, b))
    return (tp, ranges) if ranges else None


def tp_scale_ranges(buf: FlatBuffer, tp_size: int, sum_unmarked: bool) -> tuple[int, list[tuple[int, int]]] | None:
    """For a buffer sharded over shard x tp ranks: ``tp_size`` and this rank's gradient-shard ranges of
    parameters each TP peer runs on its own part (summed over TP, not averaged), merged; None if none.

    The reduce-scatter averages over dp x T ranks. A parameter with the same gradient on every TP peer
    gets the dp average from that, as before; one whose TP peers each hold a part of its gradient gets
    the sum of the parts over T, i.e. the dp average of the TP sums, once multiplied by T (exact for T a
    power of two, as the division by T was)."""
    ranges: list[tuple[int, int]] = []
    for p, (a, b) in zip(buf.params, buf.local_ranges, strict=True):
        if a == b or not (sequence_part(p) or (not tp_identical(p) and sum_unmarked)):
            continue
        if ranges and ranges[-1][1] == a:
            ranges[-1] = (ranges[-1][0], b)
        else:
            ranges.append((a, b))
    return (tp_size, ranges) if ranges else None


class ThenScale(Handle):
    """A reduce-scatter into ``shard``, then some of its ranges multiplied by ``factor`` in place."""

    def __init__(self, first: Handle, factor: float, ranges: list[tuple[int, int]], shard: torch.Tensor) -> None:
        self._first, self._factor, self._ranges, self._shard = first, factor, ranges, shard

    def wait(self) -> None:
        """Finish the reduce-scatter, then scale the ranges."""
        self._first.wait()
        for a, b in self._ranges:
            self._shard[a:b].mul_(self._factor)


class ThenSumOverTP(Handle):
    """A dp reduce-scatter into ``shard``, then the sum of some of its ranges over the TP group (posted
    when the reduce-scatter is waited for, so no backend reads the shard before it is written)."""

    def __init__(self, first: Handle, tp: Communicator, ranges: list[tuple[int, int]], shard: torch.Tensor,
                 label: str) -> None:
        self._first, self._tp, self._shard, self._ranges, self._label = first, tp, shard, ranges, label

    def wait(self) -> None:
        """Finish the reduce-scatter, then sum the ranges over the TP group."""
        self._first.wait()
        if len(self._ranges) == 1 and self._ranges[0] == (0, self._shard.numel()):
            self._tp.all_reduce(self._shard, "sum", label=f"{self._label} tp sum")
            return
        packed = torch.cat([self._shard[a:b] for a, b in self._ranges])
        self._tp.all_reduce(packed, "sum", label=f"{self._label} tp sum")
        pos = 0
        for a, b in self._ranges:
            self._shard[a:b].copy_(packed[pos:pos + b - a])
            pos += b - a
