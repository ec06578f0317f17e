"""BMTrain's ``bmt.nn`` layers that need no tensor parallelism."""

from .linear import Linear

__all__ = ["Linear"]
