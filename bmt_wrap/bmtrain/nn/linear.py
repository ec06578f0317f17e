"""``bmt.nn.Linear``: a ``DistributedModule`` linear layer with sharded weight and bias (BMTrain's)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...explicit.module import DistributedModule
from ...job.distributed import get_state
from ...runtime.param import DistributedParameter


class Linear(DistributedModule):
    """``y = x W^T + b`` with ``W`` (out, in) Xavier-normal and ``b`` zeros, both ``DistributedParameter``s.

    ``Linear(in_features, out_features, bias=True, dtype=None)`` as in BMTrain. The values are drawn at
    construction (``bmt.init_parameters`` draws them again, as BMTrain's initialisation does), so the
    layer is usable without it.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        device = get_state().device
        weight = torch.empty(out_features, in_features, dtype=dtype, device=device)
        torch.nn.init.xavier_normal_(weight)
        self.weight = DistributedParameter(weight, init_method=torch.nn.init.xavier_normal_)
        if bias:
            self.bias = DistributedParameter(torch.zeros(out_features, dtype=dtype, device=device),
                                             init_method=torch.nn.init.zeros_)
        else:
            self.register_parameter("bias", None)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        """The affine map of ``input``'s last dimension."""
        return F.linear(input, self.weight, self.bias)

    def extra_repr(self) -> str:
        """As ``torch.nn.Linear`` prints itself."""
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
