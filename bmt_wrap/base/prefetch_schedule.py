"""The prefetch schedule: which block calls' parameters start gathering when, in forward and backward.

One rule, read by everything that runs or shows a schedule: the runtime's prefetcher
(runtime/prefetch.py) executes it, the graph ``bmt-wrap dump`` prints (passes/schedule_graph.py)
marks it, and the tests compare the collectives the runtime issues against it. Calls are indices into
one forward's block calls (``WrapPlan.order``, or the order the explicit API learned at its first call).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefetchSchedule:
    """Gathers for ``calls`` block calls, ``depth`` calls ahead of the one running."""

    calls: int
    depth: int

    def at_start(self) -> list[int]:
        """Calls whose gathers start as the forward begins, before any block runs."""
        return list(range(min(self.depth, self.calls)))

    def forward(self, i: int) -> list[int]:
        """Gathers to start as forward call ``i`` begins, in order: its own (a no-op when already
        prefetched), then the ``depth`` calls after it."""
        return [i, *range(i + 1, min(i + 1 + self.depth, self.calls))]

    def backward(self, i: int) -> list[int]:
        """Gathers to start as the backward of call ``i`` begins: its own, then the ``depth`` calls before
        it (backward visits calls in reverse)."""
        return [i, *range(i - 1, max(-1, i - 1 - self.depth), -1)]
