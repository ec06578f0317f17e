"""BMTrain's ``bmt.nn`` layers: ``Linear`` and the tensor-parallel ones (``init_distributed(tp_size=)``)."""

from .linear import Linear
from .parallel_embedding import VPEmbedding
from .parallel_linear import ColumnParallelLinear, RowParallelLinear
from .parallel_linear_func import OpParallelLinear, ReduceType

__all__ = ["ColumnParallelLinear", "Linear", "OpParallelLinear", "ReduceType", "RowParallelLinear", "VPEmbedding"]
