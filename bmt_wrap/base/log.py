"""The ``bmt_wrap`` logger: every line carries the rank that wrote it."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

_logger = logging.getLogger("bmt_wrap")


def _no_rank() -> int | None:
    return None


# log.py sits below everything in the package, so the layer that knows the rank hands it in.
_rank_source: Callable[[], int | None] = _no_rank


def set_rank_source(source: Callable[[], int | None]) -> None:
    """Make ``source`` tell each log line's rank (None before the process group exists)."""
    global _rank_source
    _rank_source = source


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        rank = _rank_source()
        record.rank = rank if rank is not None else int(os.environ.get("RANK", "0"))
        return True


def get_logger() -> logging.Logger:
    """Return the rank-prefixing ``bmt_wrap`` logger, configuring it on first use."""
    if not _logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[rank %(rank)s] %(message)s"))
        handler.addFilter(_RankFilter())
        _logger.addHandler(handler)
        _logger.setLevel(os.environ.get("BMT_WRAP_LOG_LEVEL", "INFO").upper())
        _logger.propagate = False
    return _logger


def says_for_node() -> bool:
    """Whether this process speaks for its node: torchrun's local rank 0 (or a process not started by it).
    A warning every rank would give alike (same optimizer, same offload directory) is given once per node
    instead of once per rank."""
    return os.environ.get("LOCAL_RANK", "0") == "0"
