"""Per-row cross-entropy with the CuPy kernels of ``kernels/cross_entropy.cu`` (one block per row)."""

from __future__ import annotations

import numpy as np
import torch

from ..kernels import grid_for, launch, source_define

_SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}
_SOURCE = "cross_entropy.cu"
_BLOCK = 256

#: Logit dtypes the kernels handle.
KERNEL_DTYPES = frozenset(_SUFFIX)


def forward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss (0 for ignored rows, NaN for an out-of-range target) and log-sum-exp, both fp32."""
    n_rows, n_classes = logits.shape
    loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(loss)
    launch(_SOURCE, f"bmt_ce_forward_{_SUFFIX[logits.dtype]}", logits.device, n_rows,
           source_define(_SOURCE, "BMT_CE_THREADS"),
           (logits, target, loss, lse, np.int64(n_classes), np.int64(ignore_index), np.float32(smoothing)))
    return loss, lse


def backward(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, row_scale: torch.Tensor,
             smoothing: float) -> torch.Tensor:
    """d(sum of row_scale * row loss)/d logits, in the logits' dtype."""
    n_rows, n_classes = logits.shape
    grad = torch.empty_like(logits)
    launch(_SOURCE, f"bmt_ce_backward_{_SUFFIX[logits.dtype]}", logits.device,
           grid_for(n_rows * n_classes, _BLOCK, logits.device), _BLOCK,
           (logits, target, lse, row_scale, grad, np.int64(n_rows), np.int64(n_classes), np.float32(smoothing)))
    return grad
