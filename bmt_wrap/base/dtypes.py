"""The one place that maps dtype names to torch dtypes and knows which dtypes bmt_wrap supports."""

from __future__ import annotations

import torch

from ..errors import PlanError

_BY_NAME: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
_ALIASES: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16", "fp64": "float64",
                            "half": "float16", "float": "float32", "double": "float64"}
_NAME_OF: dict[torch.dtype, str] = {v: k for k, v in _BY_NAME.items()}

LOW_PRECISION: frozenset[torch.dtype] = frozenset({torch.float16, torch.bfloat16})
FLOATING: frozenset[torch.dtype] = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.float64})

#: Flat-buffer offsets are aligned to this many bytes (vectorised loads, NCCL's preferred alignment).
ALIGN_BYTES = 128


def to_dtype(name: str | torch.dtype) -> torch.dtype:
    """Return the torch dtype for a name such as ``"bf16"`` or ``"float32"`` (a dtype passes through)."""
    if isinstance(name, torch.dtype):
        return name
    key = _ALIASES.get(name.lower().removeprefix("torch."), name.lower().removeprefix("torch."))
    try:
        return _BY_NAME[key]
    except KeyError:
        raise PlanError(f"unknown dtype {name!r}; use one of {sorted(_BY_NAME) + sorted(_ALIASES)}") from None


def dtype_name(dtype: torch.dtype | str) -> str:
    """Return the canonical name (``"bfloat16"``) of a dtype, as stored in plans and checkpoints."""
    return _NAME_OF[to_dtype(dtype)]


def master_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """The dtype a sharded parameter keeps under mixed precision: fp32 for fp16/bf16, else its own."""
    dtype = to_dtype(dtype)
    return torch.float32 if dtype in LOW_PRECISION else dtype


def itemsize(dtype: torch.dtype | str) -> int:
    """Bytes per element of a dtype."""
    return to_dtype(dtype).itemsize


def align_elems(dtype: torch.dtype | str) -> int:
    """Number of elements in ``ALIGN_BYTES`` for this dtype."""
    return max(1, ALIGN_BYTES // itemsize(dtype))
