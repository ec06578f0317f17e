"""BMTrain's ``ColumnParallelLinear``: a linear layer whose output features are split over the TP group."""

from __future__ import annotations

import torch

from ...explicit.module import DistributedModule
from .parallel_linear_func import OpParallelLinear
from .tp_parameter import split_size, tp_parameter


class ColumnParallelLinear(DistributedModule):
    """``y = x W^T + b`` with ``W``'s rows (output features) and ``b`` split over the TP group.

    ``ColumnParallelLinear(in_features, out_features, bias=True, dtype=None, gather_output=False,
    gather_input=True, async_gather_chunks=2)`` as in BMTrain: with ``gather_input`` the input is this
    rank's rows (dim 0) and every rank's rows are gathered first; the output is this rank's columns, or
    every column with ``gather_output``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype | None = None,
                 gather_output: bool = False, gather_input: bool = True, async_gather_chunks: int = 2) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.gather_input = gather_output, gather_input
        self.async_gather_chunks = async_gather_chunks
        self.out_features_per_partition = split_size(out_features, "ColumnParallelLinear out_features")
        self.weight = tp_parameter((out_features, in_features), 0, torch.nn.init.xavier_normal_, dtype)
        if bias:
            self.bias = tp_parameter((out_features,), 0, torch.nn.init.zeros_, dtype)
        else:
            self.register_parameter("bias", None)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """This rank's output columns (all of them with ``gather_output``)."""
        return OpParallelLinear.apply(input, self.weight, self.bias, self.gather_input, self.gather_output,
                                      False, None, self.async_gather_chunks)

    def extra_repr(self) -> str:
        """BMTrain's text, per partition."""
        return (f"in_features={self.in_features}, out_features={self.out_features_per_partition}, "
                f"bias={self.bias is not None}")
