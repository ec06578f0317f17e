"""The process's engine: installed by ``init_distributed`` (with the job's communicator), read by every
layer that runs blocks, including ``DistributedParameter(...)`` itself.

It lives apart from engine.py so that the parameter class can reach the engine without importing it
(the engine imports the parameter class).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ..errors import NotInitializedError

if TYPE_CHECKING:
    from .engine import Engine

_ENGINE: Engine | None = None


def install_engine(engine: Engine | None) -> None:
    """Make ``engine`` the process's engine (``init_distributed`` does; None when communication ends)."""
    global _ENGINE
    _ENGINE = engine


def get_engine() -> Engine:
    """The engine of this process; raises ``NotInitializedError`` before ``init_distributed``."""
    if _ENGINE is None:
        raise NotInitializedError(
            "bmt_wrap's distributed state is not initialised: call bmt.init_distributed() first "
            "(under torchrun it reads RANK/WORLD_SIZE; without them it runs as a single process).")
    return _ENGINE


def reset_engine() -> None:
    """Forget every group and schedule, keeping the communicator (tests; wrapping models one after another)."""
    if _ENGINE is not None:
        install_engine(type(_ENGINE)(_ENGINE.comm, _ENGINE.device, debug=_ENGINE.debug))
