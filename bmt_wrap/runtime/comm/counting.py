"""A communicator wrapper that records calls and algorithmic bytes per op (always on: it is cheap).

Algorithmic bytes are what a bandwidth-optimal algorithm moves per rank, independent of how the
backend implements the op (gloo's native reduce-scatter is an all-reduce on the wire):
all-gather and reduce-scatter ``shard_bytes * (N-1)``, all-reduce ``2 * bytes * (N-1) / N``,
broadcast ``bytes``, all-to-all the bytes this rank sends to the others; point to point, ``send`` and ``recv`` each count the bytes this rank sent or received. ``trace()`` also records the ops themselves, in the order they are issued (tests
compare one model's collectives with and without another model beside it, and against its plan).

Sub-group communicators (HSDP's shard and replicate groups) count into their parent's ledger, each bytes
figure at its own group size, and also under their scope name (``by_scope()``), so traffic within a node
and across nodes can be told apart.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch

from .base import Communicator, CommunicatorWrapper, Handle


@dataclass
class _Ledger:
    """Counts shared by a communicator and its sub-groups."""

    stats: dict[str, dict[str, int]] = field(default_factory=dict)
    scopes: dict[str, dict[str, dict[str, int]]] = field(default_factory=dict)
    trace: list[tuple[str, str, int]] | None = None


class CountingCommunicator(CommunicatorWrapper):
    """Forwards every op to ``inner`` and counts it."""

    def __init__(self, inner: Communicator, scope: str = "world", ledger: _Ledger | None = None) -> None:
        super().__init__(inner)
        self.scope = scope
        self._ledger = ledger if ledger is not None else _Ledger()

    @property
    def stats(self) -> dict[str, dict[str, int]]:
        """Calls and bytes per op, every group of this ledger together."""
        return self._ledger.stats

    def reset(self) -> None:
        """Forget every count (the sub-groups' too)."""
        self._ledger.stats.clear()
        self._ledger.scopes.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A copy of the counts: op -> {"calls", "bytes"}."""
        return {op: dict(v) for op, v in self._ledger.stats.items()}

    def by_scope(self) -> dict[str, dict[str, dict[str, int]]]:
        """A copy of the counts per group scope ("world", "shard", "replicate"): scope -> op -> counts."""
        return {scope: {op: dict(v) for op, v in ops.items()} for scope, ops in self._ledger.scopes.items()}

    def subgroup_counted(self, ranks: tuple[int, ...], group: Any, scope: str) -> CountingCommunicator:
        """``subgroup(ranks, group)``, counted into this ledger under ``scope``."""
        return CountingCommunicator(self.inner.subgroup(ranks, group), scope, self._ledger)

    def _subgroup(self, ranks: tuple[int, ...], group: Any) -> Communicator:
        return self.subgroup_counted(ranks, group, f"ranks {list(ranks)}")

    @contextmanager
    def trace(self) -> Iterator[list[tuple[str, str, int]]]:
        """Record every op issued inside the ``with`` block as (op, label, elements), in issue order."""
        outer, self._ledger.trace = self._ledger.trace, []
        try:
            yield self._ledger.trace
        finally:
            self._ledger.trace = outer

    def _count(self, op: str, nbytes: float, label: str = "", numel: int = 0) -> None:
        if self._ledger.trace is not None:
            self._ledger.trace.append((op, label, numel))
        for table in (self._ledger.stats, self._ledger.scopes.setdefault(self.scope, {})):
            entry = table.setdefault(op, {"calls": 0, "bytes": 0})
            entry["calls"] += 1
            entry["bytes"] += int(round(nbytes))

    def _all_gather_into(self, out: torch.Tensor, shard: torch.Tensor, label: str) -> Handle:
        self._count("all_gather", _nbytes(shard) * (self.world_size - 1), label, shard.numel())
        return self.inner._all_gather_into(out, shard, label)

    def _reduce_scatter_into(self, out: torch.Tensor, full: torch.Tensor, op: str, label: str) -> Handle:
        self._count("reduce_scatter", _nbytes(out) * (self.world_size - 1), label, out.numel())
        return self.inner._reduce_scatter_into(out, full, op, label)

    def _all_reduce(self, tensor: torch.Tensor, op: str, label: str) -> Handle:
        self._count("all_reduce", 2 * _nbytes(tensor) * (self.world_size - 1) / self.world_size, label,
                    tensor.numel())
        return self.inner._all_reduce(tensor, op, label)

    def _broadcast(self, tensor: torch.Tensor, src: int, label: str) -> Handle:
        self._count("broadcast", _nbytes(tensor) if self.world_size > 1 else 0, label, tensor.numel())
        return self.inner._broadcast(tensor, src, label)

    def _barrier(self, label: str) -> Handle:
        self._count("barrier", 0, label)
        return self.inner._barrier(label)

    def _all_to_all(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int], in_splits: list[int],
                    label: str) -> Handle:
        # What this rank sends to the others (its own piece stays): uneven, so bytes differ by rank.
        self._count("all_to_all", (inp.numel() - in_splits[self.rank]) * inp.element_size(), label, inp.numel())
        return self.inner._all_to_all(out, inp, out_splits, in_splits, label)

    def _send(self, tensor: torch.Tensor, dst: int, tag: int, label: str) -> Handle:
        self._count("send", _nbytes(tensor), label, tensor.numel())
        return self.inner._send(tensor, dst, tag, label)

    def _recv(self, tensor: torch.Tensor, src: int, tag: int, label: str) -> Handle:
        self._count("recv", _nbytes(tensor), label, tensor.numel())
        return self.inner._recv(tensor, src, tag, label)



def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
