"""The job's rank layout, one description whatever keywords build it: named axes, outermost first.

``pp`` (pipeline stages), ``replicate`` (HSDP replicas), ``shard`` (the ranks ZeRO-3 splits a buffer over),
``cp`` (context parallelism) and ``tp`` (tensor parallelism). By default ranks are laid out row-major over
the axes, tensor parallelism fastest, pipeline stages slowest, as BMTrain and Megatron order them:

    rank = (((pp · R + replica) · S + shard) · C + cp) · T + tp

so TP peers are adjacent ranks (``tp_rank = rank % T``, BMTrain's) and a stage is a contiguous block of
``world / P`` ranks (BMTrain's ``stage_id = rank // (world // pipe_size)``). A 2-D (replicate, shard)
device mesh may place its ranks in any order (HSDP's rows are whatever the mesh says); every other layout
is in this order.

Ranks that differ only along ``pp``, ``cp`` and ``tp`` compute on the same data (``data_parallel_rank``): TP
peers split one computation, the stages of a pipeline run its parts one after another, CP peers split
each sequence of the slice between them (attention is where they meet: ``runtime/context_parallel.py``).
With C = 1 the formula is the one without ``cp``.

Expert parallelism (``ep``) is not an axis of its own: it borrows the fastest-varying ``ep`` ranks of the
shard axis, as torchtitan borrows its expert groups from ``dp_shard`` (``shard = outer · ep + ep_rank``).
The ``ep`` ranks of one group exchange tokens (each owns ``1/ep`` of every MoE layer's experts); an EP
group never crosses the ``tp`` axis: TP peers hold the same tokens, so each TP rank routes them within
its own EP group. The ranks of one stage and replica with the same ``ep_rank``, TP peers included, own
the same experts and shard them ZeRO-3 (across replicas they are replicas, as every shard is): TP peers
run those experts on the same tokens and get the same gradients, so averaging over them changes nothing.
Every ``tp`` group still takes one data slice, every other rank its own.

Pure: sizes and rank numbers only. ``job/distributed.py`` builds the communicators for it
(``runtime/comm/layout.py``) and is the one place that reads keywords and device meshes into one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import MeshError

#: The axes, outermost (slowest varying rank) first.
AXES = ("pp", "replicate", "shard", "cp", "tp")
#: Ranks that differ only along these axes take the same slice of the global batch.
SAME_DATA_AXES = ("pp", "cp", "tp")


@dataclass(frozen=True)
class MeshLayout:
    """Sizes of the axes and which rank sits where; ``grid`` lists the ranks row-major over ``AXES``."""

    pp: int = 1
    replicate: int = 1
    shard: int = 1
    cp: int = 1
    tp: int = 1
    grid: tuple[int, ...] = ()  # empty: the default order, rank i at flat index i
    ep: int = 1  # expert-parallel ranks, borrowed from the shard axis (its fastest-varying part)

    def __post_init__(self) -> None:
        for axis in AXES:
            size = getattr(self, axis)
            if not isinstance(size, int) or size < 1:
                raise MeshError(f"mesh axis {axis!r} must be a positive int, got {size!r}")
        if not isinstance(self.ep, int) or self.ep < 1 or self.shard % self.ep:
            raise MeshError(f"expert parallelism borrows ranks from the shard axis: ep {self.ep!r} must be a "
                            f"positive int dividing the shard size {self.shard}")
        if self.grid and sorted(self.grid) != list(range(self.world)):
            raise MeshError(f"a mesh grid lists every rank of {self.world} once, got {list(self.grid)[:8]}")
        if self.grid == tuple(range(self.world)):
            object.__setattr__(self, "grid", ())  # one spelling of the default order: equal layouts compare equal

    @classmethod
    def of(cls, world: int, *, pp: int = 1, replicate: int = 1, cp: int = 1, tp: int = 1,
           ep: int = 1) -> MeshLayout:
        """The default-order layout of ``world`` ranks; the shard axis takes what the others leave (``ep`` of
        its ranks are expert-parallel)."""
        rest = pp * replicate * cp * tp
        if world % rest:
            raise MeshError(f"pp {pp} x replicate {replicate} x cp {cp} x tp {tp} = {rest} does not divide the "
                             f"world size {world}")
        return cls(pp=pp, replicate=replicate, shard=world // rest, cp=cp, tp=tp, ep=ep)

    @property
    def world(self) -> int:
        """Ranks in the job."""
        return self.pp * self.replicate * self.shard * self.cp * self.tp

    def size(self, axis: str) -> int:
        """How many ranks one step along ``axis`` covers."""
        return getattr(self, axis)

    @property
    def sizes(self) -> tuple[int, ...]:
        """Every axis's size, in ``AXES`` order."""
        return tuple(self.size(a) for a in AXES)

    def _at(self, index: int) -> int:
        return self.grid[index] if self.grid else index

    def _index(self, rank: int) -> int:
        return self.grid.index(rank) if self.grid else rank

    def coords(self, rank: int) -> dict[str, int]:
        """``rank``'s position on every axis."""
        if not 0 <= rank < self.world:
            raise MeshError(f"rank {rank} is outside a mesh of {self.world} ranks")
        index, out = self._index(rank), {}
        for axis, size in reversed(list(zip(AXES, self.sizes, strict=True))):
            index, out[axis] = divmod(index, size)
        return {a: out[a] for a in AXES}

    def rank_at(self, coords: dict[str, int]) -> int:
        """The rank at ``coords`` (every axis)."""
        index = 0
        for axis, size in zip(AXES, self.sizes, strict=True):
            index = index * size + coords[axis]
        return self._at(index)

    def group(self, rank: int, axes: tuple[str, ...]) -> tuple[int, ...]:
        """The ranks that differ from ``rank`` only along ``axes``, row-major over them (``AXES`` order):
        ``group(r, ("tp",))`` is r's TP group, in TP-rank order."""
        base = self.coords(rank)
        ordered = [a for a in AXES if a in axes]
        ranks = []
        for flat in range(math.prod(self.size(a) for a in ordered)):
            coords = dict(base)
            for axis in reversed(ordered):
                flat, coords[axis] = divmod(flat, self.size(axis))
            ranks.append(self.rank_at(coords))
        return tuple(ranks)

    def groups(self, axes: tuple[str, ...]) -> list[tuple[int, ...]]:
        """Every group along ``axes`` (each once), ordered by its first rank: the order every rank creates
        process groups in."""
        return self.every(lambda rank: self.group(rank, axes))

    def every(self, group_of: Callable[[int], tuple[int, ...]]) -> list[tuple[int, ...]]:
        """Every group ``group_of`` puts a rank in (each once), ordered by its first rank."""
        seen: dict[int, tuple[int, ...]] = {}
        for rank in range(self.world):
            g = group_of(rank)
            seen.setdefault(min(g), g)
        return [seen[k] for k in sorted(seen)]

    @property
    def data_parallel_size(self) -> int:
        """How many slices the global batch is cut into: one per (replica, shard) position."""
        return self.replicate * self.shard

    def data_parallel_rank(self, rank: int) -> int:
        """Which slice of the global batch ``rank`` takes; ranks differing only along ``SAME_DATA_AXES``
        (TP peers, CP peers, the stages of one pipeline) take the same one."""
        c = self.coords(rank)
        return c["replicate"] * self.shard + c["shard"]

    def zero_axes(self, whole_on_tp: bool = False) -> tuple[str, ...]:
        """The axes ZeRO-3 shards a flat buffer over: ``shard`` and ``cp`` (CP peers hold the same parameters,
        torchtitan's ``dp_shard_cp``), and ``tp`` too for parameters every TP peer holds whole
        (``whole_on_tp``); the gradient is averaged over the same ranks."""
        return ("shard", "cp", "tp") if whole_on_tp else ("shard", "cp")

    # ---- expert parallelism: a split of the shard axis ------------------------------------------------
    def ep_rank(self, rank: int) -> int:
        """Which ``1/ep`` of every MoE layer's experts ``rank`` owns."""
        return self.coords(rank)["shard"] % self.ep

    def ep_group(self, rank: int) -> tuple[int, ...]:
        """The ``ep`` ranks ``rank`` exchanges tokens with, in EP-rank order."""
        c = self.coords(rank)
        first = c["shard"] - c["shard"] % self.ep
        return tuple(self.rank_at(c | {"shard": first + e}) for e in range(self.ep))

    def expert_shard_group(self, rank: int) -> tuple[int, ...]:
        """The ranks of ``rank``'s stage and replica that own its experts (its TP peers among them), which
        ZeRO-3 shards them over."""
        c = self.coords(rank)
        return tuple(self.rank_at(c | {"shard": o * self.ep + c["shard"] % self.ep, "tp": t})
                     for o in range(self.shard // self.ep) for t in range(self.tp))

    def describe(self) -> str:
        """For messages: the axes larger than one, e.g. ``pp 2 x shard 2``."""
        parts = [f"{a} {s}" + (f" (ep {self.ep})" if a == "shard" and self.ep > 1 else "")
                 for a, s in zip(AXES, self.sizes, strict=True) if s > 1]
        return " x ".join(parts) if parts else "one rank"
