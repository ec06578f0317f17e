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
from ..runtime.comm import TensorParallelLayout


def _state_or(read: Callable[[distributed.DistState], Any], default: Any) -> Callable[[], Any]:
    def get() -> Any:
        state = distributed.current_state()
        return default if state is None else read(state)
    return get


def _tp_or(read: Callable[[TensorParallelLayout], Any], default: Any) -> Callable[[], Any]:
    return _state_or(lambda _: read(distributed.tensor_parallel()), default)


@dataclass(frozen=True)
class Topology:
    """BMTrain's ``config["topology"]``: ``tp_id`` is the rank in the TP group, ``tp_idx`` which TP group
    (also the rank in the data-parallel group, ``tp_zero_id``)."""

    tp_id: int
    tp_idx: int

    @property
    def tp_zero_id(self) -> int:
        """Rank in the data-parallel (tp_zero) group."""
        return self.tp_idx

    @property
    def tp_zero_idx(self) -> int:
        """Which data-parallel group: the one of the ranks with this ``tp_id``."""
        return self.tp_id

    def get_group_rank(self, group_name: str) -> int:
        """This rank's index in group ``"tp"``, ``"tp_zero"`` or ``"zero"`` (BMTrain's method)."""
        state = distributed.get_state()
        return {"tp": self.tp_id, "tp_zero": self.tp_idx, "zero": state.rank, "pipe": 0}[group_name]


_DERIVED: dict[str, Callable[[], Any]] = {
    "initialized": distributed.is_initialized,
    "rank": _state_or(lambda s: s.rank, 0),
    "local_rank": _state_or(lambda s: s.local_rank, 0),
    "world_size": _state_or(lambda s: s.world_size, 1),
    "local_size": _state_or(lambda s: int(os.environ.get("LOCAL_WORLD_SIZE", s.world_size)), 1),
    "comm": _state_or(lambda s: s.comm, None),
    "device": _state_or(lambda s: s.device, None),
    "zero_level": lambda: 3,  # per block here (CheckpointBlock(zero_level=)); 3 is BMTrain's default
    # No pipeline parallelism: one stage. Tensor parallelism: BMTrain's layout (tp_rank = rank % tp_size).
    "pipe_size": lambda: 1,
    "pipe_rank": lambda: 0,
    "tp_size": _tp_or(lambda t: t.tp_size, 1),
    "tp_rank": _tp_or(lambda t: t.tp_rank, 0),
    "tp_comm": _tp_or(lambda t: t.tp, None),
    "zero_size": _state_or(lambda s: s.world_size, 1),
    "zero_rank": _state_or(lambda s: s.rank, 0),
    "tp_zero_size": _tp_or(lambda t: t.dp_size, 1),
    "tp_zero_rank": _tp_or(lambda t: t.dp_rank, 0),
    "tp_zero_comm": _tp_or(lambda t: t.dp.shard, None),
    "topology": _tp_or(lambda t: Topology(t.tp_rank, t.dp_rank), None),
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

