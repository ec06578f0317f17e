"""One wrapped model's share of the runtime: its groups and its prefetch schedule.

The engine (one per process) owns what models must share: the communicator, the buffer pool, the
gradient reducer and its end-of-backward callback, and the phase (inside a block, recomputing), so a
backward that spans several models still ends once. Each model owns the rest, so wrapping a second model
(teacher and student, an EMA copy, a reward model) leaves the first model's schedule alone: a step of one
model gathers only its own blocks, in its own order.
"""

from __future__ import annotations

from ..errors import WrapError
from .group import ShardGroup
from .prefetch import Prefetcher
from .shard_store import ShardStore


class ModelRuntime:
    """The shard groups of one model (or of the explicit API's blocks) and the order it runs them."""

    def __init__(self, name: str, prefetch_depth: int = 1) -> None:
        self.name = name
        self.groups: list[ShardGroup] = []
        self.prefetcher: Prefetcher[ShardGroup] = Prefetcher(prefetch_depth)
        self.offload: ShardStore | None = None  # offload="disk"/"host": where this model's shards live on this rank

    def set_schedule(self, order: list[ShardGroup], prefetch_depth: int) -> None:
        """Run blocks in ``order`` (the plan's), gathering ``prefetch_depth`` groups ahead."""
        if prefetch_depth < 0:
            raise WrapError(f"prefetch_depth must be >= 0, got {prefetch_depth}")
        self.prefetcher.depth = prefetch_depth
        self.prefetcher.set_order(order)

    def __repr__(self) -> str:
        return f"ModelRuntime({self.name!r}, {len(self.groups)} groups)"
