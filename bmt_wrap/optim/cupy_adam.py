"""The CuPy fused Adam kernel (``kernels/adam.cu``): one launch per flat range on a CUDA device."""

from __future__ import annotations

import numpy as np
import torch

from ..kernels import grid_for, launch
from .adam_math import AdamHyper, adam_scalars

_FUNCTION = {torch.float32: "bmt_adam_f32", torch.bfloat16: "bmt_adam_bf16", torch.float16: "bmt_adam_f16"}
_BLOCK = 256

#: Parameter dtypes the kernel handles.
KERNEL_DTYPES = frozenset(_FUNCTION)


def cupy_step(param: torch.Tensor, grad: torch.Tensor, master: torch.Tensor | None, exp_avg: torch.Tensor,
              exp_avg_sq: torch.Tensor, hyper: AdamHyper, scale: float) -> None:
    """Update one contiguous range: unscale the gradient, update moments and master, write the parameter."""
    n = param.numel()
    scalars = tuple(np.float32(x) for x in adam_scalars(hyper, scale))
    master_ptr = master if master is not None else np.uint64(0)
    launch("adam.cu", _FUNCTION[param.dtype], param.device, grid_for(n, _BLOCK, param.device), _BLOCK,
           (param, grad, master_ptr, exp_avg, exp_avg_sq, np.int64(n)) + scalars)
