"""BMTrain's ``bmtrain.loss._function`` helpers that scripts call directly."""

from __future__ import annotations

import torch

from ..errors import BMTError


def has_inf_nan(g: torch.Tensor, out: torch.Tensor) -> None:
    """Set the one-element uint8 ``out`` to 1 if ``g`` holds an inf or a nan, else 0 (no host sync)."""
    if out.dtype != torch.uint8 or out.numel() != 1:
        raise BMTError(f"has_inf_nan writes a one-element uint8 tensor, got {out.dtype} with {out.numel()} "
                       "elements: pass torch.zeros(1, dtype=torch.uint8, device=g.device)")
    if not g.is_floating_point():
        raise BMTError(f"has_inf_nan checks a floating-point tensor, got {g.dtype}")
    out.copy_((~torch.isfinite(g)).any().reshape(out.shape))
