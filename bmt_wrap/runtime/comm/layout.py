"""Where this rank sits in the job: the group its parameters are sharded over and the group that holds
replicas of its shard (HSDP: shard within a node, replicate across nodes).

Part of a ``ParallelLayout`` (below), built by ``distributed.job_layout`` (the one place that reads keywords
and device meshes); the runtime only reads it. With one replica it is plain ZeRO-3 over the shard group.
"""

from __future__ import annotations

from dataclasses import dataclass

from ...base.mesh import MeshLayout
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
class ParallelLayout:
    """This rank's communicators along each axis of the job's mesh (``base/mesh.py``: the one description
    of where ranks sit): ``tp``, the T adjacent ranks that split layers between them; ``dp``, the ranks with
    this rank's stage and TP rank, which ZeRO shards over (HSDP: its shard and replicate groups; with CP, the
    CP peers too); ``whole``,
    the shard x cp x tp ranks of one replica, which buffers of parameters every TP peer holds whole are sharded
    over; ``pp``, the stages of this rank's pipeline; ``stage``, every rank of this rank's stage; ``cp``, the
    ranks splitting each sequence of this rank's data slice between them (context parallelism).

    Built by ``distributed.job_layout()`` (the one place that reads keywords and device meshes); with
    every axis but the shard axis of size 1, ``tp`` is a single-process group and ``dp`` the whole job.
    """

    mesh: MeshLayout
    rank: int
    tp: Communicator
    dp: RankLayout
    whole: Communicator | None = None  # None with T = 1, where that is ``dp.shard``
    pp: Communicator | None = None  # None with one stage
    stage: Communicator | None = None  # None with one stage (then it is the job)
    # Expert parallelism (``mesh.ep > 1``): the ranks exchanging tokens, and the owners of this rank's
    # experts with their replicas (ZeRO-3 over ``experts.shard``).
    ep: Communicator | None = None
    experts: RankLayout | None = None
    cp: Communicator | None = None  # None with C = 1

    @property
    def cp_size(self) -> int:
        """Ranks each sequence is split over (context parallelism)."""
        return self.mesh.cp

    @property
    def cp_rank(self) -> int:
        """Which part of each sequence this rank holds (``base/cp_plan.py``: chunks i and 2C-1-i)."""
        return self.mesh.coords(self.rank)["cp"]

    @property
    def ep_size(self) -> int:
        """Ranks each MoE layer's experts are split over."""
        return self.mesh.ep

    @property
    def ep_rank(self) -> int:
        """Which ``1/ep_size`` of each MoE layer's experts this rank owns."""
        return self.mesh.ep_rank(self.rank)

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
        """Data-parallel replicas of one (TP-split, pipelined, context-parallel) model: how many slices the
        global batch is cut into."""
        return self.mesh.data_parallel_size

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel replicas: which slice of the global batch it takes (the
        mesh's answer: ZeRO's group also holds the CP peers, which take the same slice)."""
        return self.mesh.data_parallel_rank(self.rank)

    @property
    def pp_size(self) -> int:
        """Pipeline stages."""
        return self.mesh.pp

    @property
    def pp_rank(self) -> int:
        """This rank's stage (BMTrain's ``stage_id``)."""
        return self.mesh.coords(self.rank)["pp"]

    def describe(self) -> str:
        """For messages: the mesh's axes."""
        return self.mesh.describe()


@dataclass(frozen=True)
class StagePlacement:
    """Where a flat buffer's values live along the pipeline: stage ``owner`` of the pipe group ``pp``.

    Buffers of the owner's ranks hold shards; the other stages hold a ghost of the buffer (every parameter's
    full shape over an empty range), so reductions over its parameters combine over ``pp`` and a full value
    comes from the owner by one broadcast over ``pp``.
    """

    pp: Communicator
    owner: int
    # Every stage holding the values (a tied embedding and head: the first and last); () means ``(owner,)``.
    # Each holds its shards and its own gradient, summed between them at the end of a backward; only the
    # owner's count in norms and answer for values.
    holders: tuple[int, ...] = ()

    @property
    def here(self) -> bool:
        """True on the ranks of the owning stage."""
        return self.pp.rank == self.owner

    @property
    def held_here(self) -> bool:
        """True where this stage holds the values (the owner, or another holder of a shared buffer)."""
        return self.pp.rank in (self.holders or (self.owner,))

    @property
    def shared_with(self) -> tuple[int, ...]:
        """The other stages holding the values beside this one (a shared buffer's gradient partners)."""
        return tuple(s for s in self.holders if s != self.pp.rank) if self.held_here else ()
