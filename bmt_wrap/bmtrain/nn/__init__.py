"""BMTrain's ``bmt.nn`` layers: ``Linear`` and the tensor-parallel ones (``init_distributed(tp_size=)``)."""

from .column_parallel_linear import ColumnParallelLinear
from .linear import Linear
from .parallel_embedding import VPEmbedding
from .parallel_linear_func import OpParallelLinear, ReduceType
from .row_parallel_linear import RowParallelLinear

__all__ = ["ColumnParallelLinear", "Linear", "OpParallelLinear", "ReduceType", "RowParallelLinear", "VPEmbedding"]
