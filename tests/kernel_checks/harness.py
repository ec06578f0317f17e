"""Build ``harness.cpp`` (which includes the kernels' headers) with g++ once, and call it on CPU tensors."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from bmt_wrap.kernels import KERNEL_DIR

SOURCE = Path(__file__).with_name("harness.cpp")
DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_F = ctypes.c_float
_P = ctypes.c_void_p
_I = ctypes.c_longlong


@functools.cache
def library() -> ctypes.CDLL:
    """The compiled harness, rebuilt whenever the harness or a header changes."""
    compiler = shutil.which("g++")
    if compiler is None:
        raise RuntimeError("the kernel host harness needs g++ on PATH (apt-get install g++)")
    inputs = [SOURCE, *sorted(KERNEL_DIR.glob("*.cuh"))]
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in inputs)).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"bmt_wrap_kernel_harness_{digest}.so"
    if not out.exists():
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        subprocess.run([compiler, "-O2", "-std=c++17", "-Wall", "-Wextra", "-Werror", "-shared", "-fPIC",
                        "-I", str(KERNEL_DIR), "-o", str(tmp), str(SOURCE)], check=True, capture_output=True, text=True)
        tmp.replace(out)  # atomic: parallel test sessions never load a half-written library
    lib = ctypes.CDLL(str(out))
    lib.h_to_float.argtypes = [ctypes.c_int, _P, _P, _I]
    lib.h_from_float.argtypes = [ctypes.c_int, _P, _P, _I]
    lib.h_is_finite.argtypes = [_P, _P, _I]
    lib.h_adam.argtypes = [ctypes.c_int, _P, _P, _P, _P, _P, _I] + [_F] * 7
    lib.h_ce_forward.argtypes = [ctypes.c_int, _P, _P, _P, _P, _I, _I, _I, _F, ctypes.c_int]
    lib.h_ce_backward.argtypes = [ctypes.c_int, _P, _P, _P, _P, _P, _I, _I, _F]
    return lib


def _ptr(t: torch.Tensor | None) -> int | None:
    if t is None:
        return None
    assert t.is_contiguous() and t.device.type == "cpu"
    return t.data_ptr()


def to_float(x: torch.Tensor) -> torch.Tensor:
    """bf16/fp16 -> fp32 through the header's conversion."""
    out = torch.empty(x.shape, dtype=torch.float32)
    library().h_to_float(DTYPE_CODE[x.dtype], _ptr(x), _ptr(out), x.numel())
    return out


def from_float(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 -> bf16/fp16 through the header's rounding."""
    out = torch.empty(x.shape, dtype=dtype)
    library().h_from_float(DTYPE_CODE[dtype], _ptr(x), _ptr(out), x.numel())
    return out


def is_finite(x: torch.Tensor) -> torch.Tensor:
    """The header's finiteness test on fp32 values."""
    out = torch.empty(x.shape, dtype=torch.uint8)
    library().h_is_finite(_ptr(x), _ptr(out), x.numel())
    return out.bool()


def adam(param: torch.Tensor, grad: torch.Tensor, master: torch.Tensor | None, exp_avg: torch.Tensor,
         exp_avg_sq: torch.Tensor, scalars: tuple[float, ...]) -> None:
    """One kernel update of every element, in place (``scalars`` as ``adam_scalars`` returns them)."""
    library().h_adam(DTYPE_CODE[param.dtype], _ptr(param), _ptr(grad), _ptr(master), _ptr(exp_avg),
                     _ptr(exp_avg_sq), param.numel(), *scalars)


def ce_forward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float,
               threads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row loss and log-sum-exp, reduced as a block of ``threads`` threads would."""
    n_rows, n_classes = logits.shape
    loss = torch.empty(n_rows, dtype=torch.float32)
    lse = torch.empty(n_rows, dtype=torch.float32)
    library().h_ce_forward(DTYPE_CODE[logits.dtype], _ptr(logits), _ptr(target), _ptr(loss), _ptr(lse), n_rows,
                           n_classes, ignore_index, smoothing, threads)
    return loss, lse


def ce_backward(logits: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, row_scale: torch.Tensor,
                smoothing: float) -> torch.Tensor:
    """The gradient of sum(row_scale * row loss) in the logits' dtype."""
    grad = torch.empty_like(logits)
    n_rows, n_classes = logits.shape
    library().h_ce_backward(DTYPE_CODE[logits.dtype], _ptr(logits), _ptr(target), _ptr(lse), _ptr(row_scale),
                            _ptr(grad), n_rows, n_classes, smoothing)
    return grad
