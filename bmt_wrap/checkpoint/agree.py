"""Every rank reaches the same checkpoint verdict (``distributed.agree`` raising ``CheckpointError``)."""

from __future__ import annotations

from .. import distributed
from ..errors import CheckpointError


def agree(error: str | None, payload: list[int] | None = None, what: str = "checkpoint") -> list[list[int]]:
    """Raise ``CheckpointError`` on every rank if any rank passes an ``error``; else every rank's ``payload``."""
    return distributed.agree(error, payload, what, CheckpointError)
