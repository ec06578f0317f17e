"""BMTrain's ``ColumnParallelLinear`` and ``RowParallelLinear``: a linear layer split over the TP group."""

from __future__ import annotations

import torch

from ...explicit.module import DistributedModule
from ...job.distributed import get_state
from ...runtime.param import DistributedParameter
from .parallel_linear_func import OpParallelLinear, ReduceType
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


class RowParallelLinear(DistributedModule):
    """``y = x W^T + b`` with ``W``'s columns (input features) split over the TP group.

    ``RowParallelLinear(in_features, out_features, bias=True, dtype=None, split_input=False,
    all_reduce_output=False, async_chunks=2)`` as in BMTrain: the input is this rank's features (or, with
    ``split_input``, this rank's rows of whole features, gathered and then split); the partial outputs
    are summed on every rank (``all_reduce_output``) or summed and split by rows (dim 0). ``b`` is whole on
    every rank and added after the sum.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, dtype: torch.dtype | None = None,
                 split_input: bool = False, all_reduce_output: bool = False, async_chunks: int = 2) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.split_input, self.all_reduce_output = split_input, all_reduce_output
        self.async_chunks = async_chunks
        self.in_features_per_partition = split_size(in_features, "RowParallelLinear in_features")
        self.weight = tp_parameter((out_features, in_features), 1, torch.nn.init.xavier_normal_, dtype)
        if not bias:
            self.register_parameter("bias", None)
        elif all_reduce_output:
            # Added to the summed output every rank holds: the same gradient on every TP peer.
            self.bias = tp_parameter((out_features,), -1, torch.nn.init.zeros_, dtype)
        else:
            # Added to this rank's rows only: its gradient is a part, summed over the TP group (BMTrain
            # marks it as the other kind and so keeps one rank's part).
            device = get_state().device
            self.bias = DistributedParameter(torch.zeros(out_features, dtype=dtype, device=device),
                                             init_method=torch.nn.init.zeros_)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """The whole output (``all_reduce_output``) or this rank's rows of it."""
        reduce = ReduceType.ALL_REDUCE if self.all_reduce_output else ReduceType.REDUCE_SCATTER
        out = OpParallelLinear.apply(input, self.weight, None, self.split_input, False, self.split_input, reduce,
                                     self.async_chunks)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        """BMTrain's text, per partition."""
        return (f"in_features={self.in_features_per_partition}, out_features={self.out_features}, "
                f"bias={self.bias is not None}")
