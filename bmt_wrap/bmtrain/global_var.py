"""``bmt.config`` (BMTrain's ``bmtrain.global_var.config``): the job's layout as a dict-like view.

The keys BMTrain code reads (``rank``, ``world_size``, ``comm``, ``tp_size`` …) are derived from the
distributed state on every read, so they are right before and after ``init_distributed`` and cannot
drift from it; other keys are the script's own, stored as in a dict.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

from ..errors import BMTError
from ..job import distributed


def _state_or(read: Callable[[distributed.DistState], Any], default: Any) -> Callable[[], Any]:
    def get() -> Any:
        state = distributed.current_state()
        return default if state is None else read(state)
    return get


_DERIVED: dict[str, Callable[[], Any]] = {
    "initialized": distributed.is_initialized,
    "rank": _state_or(lambda s: s.rank, 0),
    "local_rank": _state_or(lambda s: s.local_rank, 0),
    "world_size": _state_or(lambda s: s.world_size, 1),
    "local_size": _state_or(lambda s: int(os.environ.get("LOCAL_WORLD_SIZE", s.world_size)), 1),
    "comm": _state_or(lambda s: s.comm, None),
    "device": _state_or(lambda s: s.device, None),
    "zero_level": lambda: 3,  # per block here (CheckpointBlock(zero_level=)); 3 is BMTrain's default
    # No tensor or pipeline parallelism: one stage, one tensor-parallel rank, ZeRO over every rank.
    "pipe_size": lambda: 1,
    "pipe_rank": lambda: 0,
    "tp_size": lambda: 1,
    "tp_rank": lambda: 0,
    "zero_rank": _state_or(lambda s: s.rank, 0),
    "tp_zero_size": _state_or(lambda s: s.world_size, 1),
    "tp_zero_rank": _state_or(lambda s: s.rank, 0),
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

