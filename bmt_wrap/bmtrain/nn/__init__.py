"""BMTrain's ``bmt.nn`` layers; the tensor-parallel ones exist only to raise a clear error."""

from .linear import Linear
from .parallel import ColumnParallelLinear, OpParallelLinear, RowParallelLinear, VPEmbedding

__all__ = ["ColumnParallelLinear", "Linear", "OpParallelLinear", "RowParallelLinear", "VPEmbedding"]
