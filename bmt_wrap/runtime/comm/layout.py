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


@dataclass(frozen=True)
class TensorParallelLayout:
    """This rank's tensor-parallel group (``tp``: the T adjacent ranks that split layers between them)
    and its data-parallel layout (``dp``: the ranks with the same ``tp_rank``, which ZeRO shards over).

    Built by ``distributed.tensor_parallel()``; BMTrain's order: ``tp_rank = rank % T``,
    ``dp_rank = rank // T``. With T = 1, ``tp`` is a single-process group and ``dp`` the job's layout.
    """

    tp: Communicator
    dp: RankLayout
    # The ranks of this rank's replica (dp shard group x tp group): what parameters every TP peer holds
    # whole are sharded over (None with T = 1, where that is ``dp.shard``).
    whole: Communicator | None = None

    @property
    def tp_size(self) -> int:
        """Ranks a tensor-parallel layer is split over."""
        return self.tp.world_size

    @property
    def tp_rank(self) -> int:
        """This rank's index in its tensor-parallel group (which slice of a split layer it holds)."""
        return self.tp.rank

    @property
    def dp_size(self) -> int:
        """Data-parallel replicas of the tensor-parallel model (gradients and losses average over them)."""
        return self.dp.shard_size * self.dp.num_replicas

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas."""
        return self.dp.replica_rank * self.dp.shard_size + self.dp.shard_rank
