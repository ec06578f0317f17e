"""``MixedPrecision``: the dtype policy of a wrapped model (FSDP2's names)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dtypes import FLOATING, LOW_PRECISION
from .errors import WrapError


@dataclass(frozen=True)
class MixedPrecision:
    """Shards store ``param_dtype``; gradients are reduce-scattered in ``reduce_dtype``; floating inputs
    are cast to ``param_dtype`` on the way in when ``cast_forward_inputs``; floating outputs are cast to
    ``output_dtype`` (None: left as computed). The optimizer keeps fp32 master weights for low-precision
    shards."""

    param_dtype: torch.dtype = torch.bfloat16
    reduce_dtype: torch.dtype | None = torch.float32
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and value not in FLOATING:
                raise WrapError(f"MixedPrecision.{name} must be a floating dtype, got {value}")
        if self.param_dtype not in LOW_PRECISION | {torch.float32}:
            raise WrapError(f"MixedPrecision.param_dtype must be bfloat16, float16 or float32, "
                            f"got {self.param_dtype}")

    def cast_input(self, t: object) -> object:
        """Cast one forward input if it is a floating tensor and the policy asks for it."""
        if self.cast_forward_inputs and isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.to(self.param_dtype)
        return t

    def cast_output(self, t: object) -> object:
        """Cast one forward output if it is a floating tensor and ``output_dtype`` is set."""
        if self.output_dtype is not None and isinstance(t, torch.Tensor) and t.is_floating_point():
            return t.to(self.output_dtype)
        return t
