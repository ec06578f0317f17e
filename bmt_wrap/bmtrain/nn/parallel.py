"""BMTrain's tensor-parallel layers: importable (model files import them beside ``Linear``), but using
one raises, because bmt_wrap has no tensor parallelism (``init_distributed(tp_size>1)`` raises too)."""

from __future__ import annotations

from typing import Any

from torch import nn

from ...errors import UnsupportedError


def _refuse(name: str) -> UnsupportedError:
    return UnsupportedError(f"bmt.nn.{name} needs tensor parallelism, which bmt_wrap does not have: use "
                            "bmt.nn.Linear / torch.nn.Embedding (ZeRO-3 shards them across every rank)")


class _TensorParallel(nn.Module):
    """A tensor-parallel layer or op of BMTrain; constructing or applying it raises ``UnsupportedError``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise _refuse(type(self).__name__)

    @classmethod
    def apply(cls, *args: Any, **kwargs: Any) -> Any:
        """What BMTrain's autograd ops are called with; raises."""
        raise _refuse(cls.__name__)


class ColumnParallelLinear(_TensorParallel):
    """Not supported (tensor parallelism)."""


class RowParallelLinear(_TensorParallel):
    """Not supported (tensor parallelism)."""


class VPEmbedding(_TensorParallel):
    """Not supported (tensor parallelism)."""


class OpParallelLinear(_TensorParallel):
    """Not supported (tensor parallelism)."""
