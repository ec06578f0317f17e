"""Where this rank sits in the job: the group its parameters are sharded over and the group that holds
replicas of its shard (HSDP: shard within a node, replicate across nodes).

Built by ``distributed.rank_layout`` (the one place that reads a device mesh); the runtime only reads it.
With one replica it is plain ZeRO-3 over the shard group, which is then the whole job.
"""

from __future__ import annotations

from dataclasses import dataclass

from .base import Communicator


@dataclass(frozen=True)
class RankLayout:
    """This rank's shard group and, when there are several replicas, its replicate group."""

    shard: Communicator  # parameters and gradients are sharded over it: gathers, reduce-scatters, norms
    replicate: Communicator | None = None  # ranks holding the same shard: gradients are averaged over it

    @property
    def shard_rank(self) -> int:
        """This rank's index in its shard group (which piece of every flat buffer it holds)."""
        return self.shard.rank

    @property
    def shard_size(self) -> int:
        """Ranks one flat buffer is split over."""
        return self.shard.world_size

    @property
    def replica_rank(self) -> int:
        """Which replica of the sharded model this rank belongs to."""
        return self.replicate.rank if self.replicate is not None else 0

    @property
    def num_replicas(self) -> int:
        """How many ranks hold each shard."""
        return self.replicate.world_size if self.replicate is not None else 1

    def describe(self) -> str:
        """For messages: the mesh as (replicas, shard size)."""
        return f"{self.num_replicas} replica(s) x shard groups of {self.shard_size}"
