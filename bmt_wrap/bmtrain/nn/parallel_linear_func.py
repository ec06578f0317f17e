"""BMTrain's ``OpParallelLinear``: a linear layer's matmul with the tensor-parallel communication around it.

Built from the TP ops (``runtime/tp_ops.py``) instead of hand-written backward passes, so each gradient
is the one autograd derives under Megatron's convention; BMTrain's CUDA-stream overlap
(``async_gather_chunks``) has no CPU meaning and is accepted and ignored.
"""

from __future__ import annotations

from enum import Enum

import torch
import torch.nn.functional as F

from ...job.distributed import parallel_layout
from ...runtime import tp_ops


class ReduceType(Enum):
    """How a row-parallel linear combines its partial outputs (BMTrain's names)."""

    ALL_REDUCE = 1
    REDUCE_SCATTER = 2


class OpParallelLinear:
    """``OpParallelLinear.apply(input, weight, bias=None, gather_input=False, gather_output=False,
    split_input=False, reduce_output_type=None, async_gather_chunks=2)``, BMTrain's signature.

    - ``gather_input``: ``input`` is this rank's rows (dim 0); the rows of every TP rank are gathered first.
    - ``split_input``: this rank's slice of the features (last dim) is used.
    - ``gather_output``: every rank's output columns are gathered along the last dim.
    - ``reduce_output_type``: partial outputs (row-parallel) are summed on every rank (``ALL_REDUCE``) or
      summed and split by rows (``REDUCE_SCATTER``, dim 0).
    """

    @staticmethod
    def apply(input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
              gather_input: bool = False, gather_output: bool = False, split_input: bool = False,
              reduce_output_type: ReduceType | int | None = None, async_gather_chunks: int = 2) -> torch.Tensor:
        """The linear map with its communication; differentiable."""
        comm = parallel_layout().tp
        reduce = ReduceType(reduce_output_type) if reduce_output_type is not None else None
        x = input
        if gather_input and split_input:
            # Gathered rows, then this rank's features: the features' gradients are gathered back, and
            # each rank keeps the gradient of its own rows.
            x = tp_ops.scatter_to_tp(tp_ops.gather_from_tp(x, comm, dim=0), comm, dim=-1)
        elif gather_input:
            x = tp_ops.gather_sum_grads(x, comm, dim=0)  # each rank uses every row with its own columns
        elif split_input:
            x = tp_ops.scatter_to_tp(x, comm, dim=-1)
        elif reduce is None:
            x = tp_ops.copy_to_tp(x, comm)  # a whole input used with this rank's columns
        out = F.linear(x, weight, bias)
        if gather_output:
            out = tp_ops.gather_from_tp(out, comm, dim=-1)
        if reduce is ReduceType.ALL_REDUCE:
            out = tp_ops.reduce_from_tp(out, comm)
        elif reduce is ReduceType.REDUCE_SCATTER:
            out = tp_ops.reduce_scatter_to_tp(out, comm, dim=0)
        return out
