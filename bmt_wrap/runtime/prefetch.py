"""Which groups to gather ahead: ``PrefetchSchedule`` (base/prefetch_schedule.py) over the forward's block
order, and over this step's calls replayed in reverse for backward.

The order comes from the plan, or is learned from the first forward (the explicit API). Every decision
is a function of the sequence of block calls alone, so ranks running the same program issue the same
gathers in the same order. A call that leaves the schedule (data-dependent control flow) stops
prefetching for the rest of that forward; correctness never depends on a prefetch.
"""

from __future__ import annotations

from typing import Generic, TypeVar

from ..base.prefetch_schedule import PrefetchSchedule

G = TypeVar("G")

_MAX_RECORDED = 100_000  # a schedule is one forward's calls; stop recording runaway sequences


class Prefetcher(Generic[G]):
    """Tracks the position in the forward schedule and the block calls backward will replay."""

    def __init__(self, depth: int = 1) -> None:
        self.depth = depth
        self.order: list[G] | None = None
        self._pos = 0
        self._diverged = False
        self._recording: list[G] = []
        self.calls: list[G] = []  # grad-enabled forward calls of this step, for backward
        # The group gathered after the ones the last call returned: offloaded shards are read that far ahead.
        self.ahead: list[G] = []

    def set_order(self, order: list[G]) -> None:
        """Use a known schedule (from the plan) instead of learning it from the first forward."""
        self.order = list(order) or None

    @property
    def _schedule(self) -> PrefetchSchedule:
        return PrefetchSchedule(len(self.order or ()), self.depth)

    def begin_forward(self) -> list[G]:
        """A forward starts at the root: returns the first groups worth gathering early."""
        self._pos, self._diverged, self._recording = 0, False, []
        return [self.order[c] for c in self._schedule.at_start()] if self.order else []

    def end_forward(self) -> None:
        """A forward ended: learn the schedule from it if none is known yet."""
        if self.order is None and self._recording:
            self.order = self._recording
        self._recording = []

    def forward_call(self, group: G) -> list[G]:
        """``group`` is being called in forward: returns the other groups to start gathering now."""
        if len(self._recording) < _MAX_RECORDED:
            self._recording.append(group)
        order = self.order
        self.ahead = []
        if order is None:
            return []
        if self._pos >= len(order) and group is order[0]:
            self._pos, self._diverged = 0, False  # a new forward without a root hook (explicit API)
        if self._diverged or self._pos >= len(order) or order[self._pos] is not group:
            self._diverged = True
            return []
        i, self._pos = self._pos, self._pos + 1
        self.ahead = [order[i + self.depth + 1]] if i + self.depth + 1 < len(order) else []
        return [order[c] for c in self._schedule.forward(i)[1:]]

    def record_call(self, group: G) -> int:
        """Remember a grad-enabled forward call; its index orders backward prefetch."""
        self.calls.append(group)
        return len(self.calls) - 1

    def backward_call(self, index: int) -> list[G]:
        """Backward of call ``index`` starts: returns the groups of the calls backward reaches next."""
        schedule = PrefetchSchedule(len(self.calls), self.depth)
        j = index - self.depth - 1
        self.ahead = [self.calls[j]] if 0 <= j < len(self.calls) else []
        # A graph built before an aborted backward may outlive the calls it indexed (cleared when the next
        # forward began): past the end there is nothing to prefetch.
        return [self.calls[j] for j in schedule.backward(index)[1:] if j < len(self.calls)]

    def end_backward(self) -> None:
        """The step's backward finished."""
        self.calls = []
