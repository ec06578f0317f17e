"""The process's engine: installed by ``init_distributed`` (with the job's communicator), read by every
layer that runs blocks. The top of the runtime: it also hands ``DistributedParameter(...)`` the engine's
way of building a parameter of its own (param.py sits below the engine and never imports it).
"""

from __future__ import annotations

from ..errors import NOT_INITIALIZED, NotInitializedError
from .engine import Engine
from .param import install_standalone

_ENGINE: Engine | None = None


def install_engine(engine: Engine | None) -> None:
    """Make ``engine`` the process's engine (``init_distributed`` does; None when communication ends)."""
    global _ENGINE
    _ENGINE = engine
    install_standalone(engine.standalone_parameter if engine is not None else None)


def get_engine() -> Engine:
    """The engine of this process; raises ``NotInitializedError`` before ``init_distributed``."""
    if _ENGINE is None:
        raise NotInitializedError(NOT_INITIALIZED)
    return _ENGINE


def reset_engine() -> None:
    """Forget every group and schedule, keeping the communicator (tests; wrapping models one after another)."""
    if _ENGINE is not None:
        install_engine(Engine(_ENGINE.comm, _ENGINE.device, debug=_ENGINE.debug))
