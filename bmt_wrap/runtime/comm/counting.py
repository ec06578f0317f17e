"""A communicator wrapper that records calls and algorithmic bytes per op (always on: it is cheap).

Algorithmic bytes are what a bandwidth-optimal algorithm moves per rank, independent of how the
backend implements the op (gloo's native reduce-scatter is an all-reduce on the wire):
all-gather and reduce-scatter ``shard_bytes * (N-1)``, all-reduce ``2 * bytes * (N-1) / N``,
broadcast ``bytes``. ``trace()`` also records the ops themselves, in the order they are issued (tests
compare one model's collectives with and without another model beside it, and against its plan).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from .base import Communicator, CommunicatorWrapper, Handle


class CountingCommunicator(CommunicatorWrapper):
    """Forwards every op to ``inner`` and counts it."""

    def __init__(self, inner: Communicator) -> None:
        super().__init__(inner)
        self.stats: dict[str, dict[str, int]] = {}
        self._trace: list[tuple[str, str, int]] | None = None

    def reset(self) -> None:
        """Forget every count."""
        self.stats = {}

    def snapshot(self) -> dict[str, dict[str, int]]:
        """A copy of the counts: op -> {"calls", "bytes"}."""
        return {op: dict(v) for op, v in self.stats.items()}

    @contextmanager
    def trace(self) -> Iterator[list[tuple[str, str, int]]]:
        """Record every op issued inside the ``with`` block as (op, label, elements), in issue order."""
        outer, self._trace = self._trace, []
        try:
            yield self._trace
        finally:
            self._trace = outer

    def _count(self, op: str, nbytes: float, label: str = "", numel: int = 0) -> None:
        if self._trace is not None:
            self._trace.append((op, label, numel))
        entry = self.stats.setdefault(op, {"calls": 0, "bytes": 0})
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



def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()
