"""``bmt.config`` (BMTrain's ``bmtrain.global_var.config``): the job's layout as a dict-like view.

The keys BMTrain code reads (``rank``, ``world_size``, ``comm``, ``tp_size`` …) are derived from the
distributed state on every read, so they are right before and after ``init_distributed`` and cannot
drift from it; other keys are the script's own, stored as in a dict.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import dataclass
from typing import Any

from ..errors import BMTError
from ..job import distributed
from ..runtime.comm import ParallelLayout


def _state_or(read: Callable[[distributed.DistState], Any], default: Any) -> Callable[[], Any]:
    def get() -> Any:
        state = distributed.current_state()
        return default if state is None else read(state)
    return get


def _tp_or(read: Callable[[ParallelLayout], Any], default: Any) -> Callable[[], Any]:
    return _state_or(lambda _: read(distributed.parallel_layout()), default)


@dataclass(frozen=True)
class Topology:
    """BMTrain's ``config["topology"]``, read from the job's layout (``bmt.parallel_layout()``).

    ``stage_id`` is this rank's pipeline stage of ``stages``, ``pipe_idx`` its place within the stage (its
    pipe group is the ranks at that place in every stage); ``tp_id`` is its rank in the TP group and
    ``tp_idx`` which TP group (``rank // tp_size``). The ``*_zero_*`` pairs name the ZeRO groups as BMTrain
    does: ``pp_zero`` the ranks of one stage, ``tp_zero`` and ``pp_tp_zero`` the data-parallel ranks of a
    TP rank (here always within one stage), ``zero`` the whole job."""

    rank: int
    stages: int
    stage_id: int
    pipe_idx: int
    tp_id: int
    tp_idx: int
    dp_rank: int
    tp_size: int

    @property
    def pp_zero_id(self) -> int:
        """Rank within the stage."""
        return self.pipe_idx

    @property
    def pp_zero_idx(self) -> int:
        """Which stage (its ZeRO group)."""
        return self.stage_id

    @property
    def tp_zero_id(self) -> int:
        """Rank in the data-parallel group of this TP rank."""
        return self.dp_rank

    @property
    def tp_zero_idx(self) -> int:
        """Which data-parallel group: the one of the ranks with this ``tp_id``."""
        return self.tp_id

    @property
    def pp_tp_zero_id(self) -> int:
        """Rank in the data-parallel group of this stage and TP rank (BMTrain's ``pp_tp_zero``)."""
        return self.dp_rank

    @property
    def pp_tp_zero_idx(self) -> int:
        """Which such group."""
        return self.stage_id * self.tp_size + self.tp_id

    @property
    def zero_id(self) -> int:
        """Rank in the whole job."""
        return self.rank

    @property
    def zero_idx(self) -> int:
        """The whole job is one group."""
        return 0

    @property
    def next_rank(self) -> int:
        """The next stage's index, or -1 on the last stage."""
        return self.stage_id + 1 if self.stage_id < self.stages - 1 else -1

    @property
    def prev_rank(self) -> int:
        """The previous stage's index, or -1 on the first stage."""
        return self.stage_id - 1 if self.stage_id > 0 else -1

    def get_group_rank(self, group_name: str) -> int:
        """This rank's index in group ``"pipe"``, ``"zero"``, ``"tp"`` or ``"tp_zero"`` (BMTrain's method)."""
        return {"pipe": self.stage_id, "zero": self.rank, "tp": self.tp_id, "tp_zero": self.tp_zero_id,
                "pp_zero": self.pp_zero_id}[group_name]

    def get_group_id(self, group_name: str) -> int:
        """Which group of kind ``group_name`` this rank is in (BMTrain's method)."""
        return {"pipe": self.pipe_idx, "zero": self.zero_idx, "tp": self.tp_idx, "tp_zero": self.tp_zero_idx,
                "pp_zero": self.pp_zero_idx}[group_name]


def _topology(t: ParallelLayout) -> Topology:
    state = distributed.get_state()
    stage_size = state.world_size // t.pp_size
    return Topology(state.rank, t.pp_size, t.pp_rank, state.rank % stage_size, t.tp_rank, state.rank // t.tp_size,
                    t.dp_rank, t.tp_size)


_DERIVED: dict[str, Callable[[], Any]] = {
    "initialized": distributed.is_initialized,
    "rank": _state_or(lambda s: s.rank, 0),
    "local_rank": _state_or(lambda s: s.local_rank, 0),
    "world_size": _state_or(lambda s: s.world_size, 1),
    "local_size": _state_or(lambda s: int(os.environ.get("LOCAL_WORLD_SIZE", s.world_size)), 1),
    "comm": _state_or(lambda s: s.comm, None),
    "device": _state_or(lambda s: s.device, None),
    "zero_level": lambda: 3,  # per block here (CheckpointBlock(zero_level=)); 3 is BMTrain's default
    # Pipeline stages and tensor parallelism: BMTrain's layout (stage = rank // (world / pipe_size),
    # tp_rank = rank % tp_size), read from the one description of the job's ranks.
    "pipe_size": _tp_or(lambda t: t.pp_size, 1),
    "pipe_rank": _tp_or(lambda t: t.pp_rank, 0),
    "pipe_enabled": _tp_or(lambda t: t.pp_size > 1, False),
    "pipe_comm": _tp_or(lambda t: t.pp, None),
    "micros": _state_or(lambda s: s.micro_batches or distributed.parallel_layout().pp_size, 1),
    "pp_zero_comm": _tp_or(lambda t: t.stage if t.stage is not None else distributed.get_state().comm, None),
    "pp_tp_zero_comm": _tp_or(lambda t: t.dp.shard, None),
    "tp_size": _tp_or(lambda t: t.tp_size, 1),
    "tp_rank": _tp_or(lambda t: t.tp_rank, 0),
    "tp_comm": _tp_or(lambda t: t.tp, None),
    "zero_size": _state_or(lambda s: s.world_size // distributed.parallel_layout().pp_size, 1),
    "zero_rank": _state_or(lambda s: s.rank, 0),
    "zero_comm": _state_or(lambda s: s.comm, None),
    "tp_zero_size": _tp_or(lambda t: t.dp_size, 1),
    "tp_zero_rank": _tp_or(lambda t: t.dp_rank, 0),
    "tp_zero_comm": _tp_or(lambda t: t.dp.shard, None),
    "topology": _tp_or(_topology, None),
}


class Config(MutableMapping):
    """BMTrain's ``config`` mapping; see the module docstring."""

    def __init__(self) -> None:
        self._own: dict[str, Any] = {}

    def __getitem__(self, key: str) -> Any:
        if key in _DERIVED:
            return _DERIVED[key]()
        return self._own[key]

    def __setitem__(self, key: str, value: Any) -> None:
        if key in _DERIVED:
            raise BMTError(f"bmt.config[{key!r}] follows the distributed state and cannot be set; pass what "
                           "you need to bmt.init_distributed(...) instead")
        self._own[key] = value

    def __delitem__(self, key: str) -> None:
        del self._own[key]

    def __iter__(self) -> Iterator[str]:
        yield from _DERIVED
        yield from self._own

    def __len__(self) -> int:
        return len(_DERIVED) + len(self._own)

    def __repr__(self) -> str:
        return f"Config({dict(self)!r})"


config = Config()

