"""The ``bmt_wrap`` logger: every line carries the rank that wrote it."""

from __future__ import annotations

import logging
import os

_logger = logging.getLogger("bmt_wrap")


class _RankFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        # Imported lazily: log.py sits below distributed.py in the layering.
        from . import distributed

        state = distributed.current_state()
        record.rank = state.rank if state is not None else int(os.environ.get("RANK", "0"))
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
