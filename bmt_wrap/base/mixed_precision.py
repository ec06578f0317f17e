"""``MixedPrecision``: the dtype policy of a wrapped model (FSDP2's names)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import WrapError
from .dtypes import FLOATING, LOW_PRECISION, dtype_name, master_dtype, to_dtype


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP2's design: sharded parameters (what ``model.parameters()`` yields) stay fp32 and are the
    master weights, so any optimizer updates them at full precision; each gather casts the local shard
    to ``param_dtype`` and communicates that, and blocks compute in it. Gradients are reduce-scattered in
    ``reduce_dtype`` (None: ``param_dtype``) and land as fp32 ``.grad``. Floating inputs are cast to
    ``param_dtype`` on the way in when ``cast_forward_inputs``; floating outputs are cast to
    ``output_dtype`` (None: left as computed)."""

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

    def buffer_dtypes(self, dtype: torch.dtype | str) -> tuple[str, str | None, str | None]:
        """(shard, param, reduce) dtype names of a flat buffer of ``dtype`` parameters under this policy,
        as ``FlatBufferSpec`` stores them: param and reduce are None where they equal their default."""
        dtype = to_dtype(dtype)
        if dtype not in FLOATING:
            return dtype_name(dtype), None, None
        shard = master_dtype(dtype)  # fp16/bf16 parameters are upcast: the shard is the master
        reduce = self.reduce_dtype or self.param_dtype
        return (dtype_name(shard), None if self.param_dtype == shard else dtype_name(self.param_dtype),
                None if reduce == self.param_dtype else dtype_name(reduce))
