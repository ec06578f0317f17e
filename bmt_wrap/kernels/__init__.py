"""CUDA sources for the fused optimizer and loss, and their lazy CuPy loader.

The ``.cuh`` headers hold the per-element math as ``__host__ __device__`` functions (compiled into the
CuPy kernels here and into a g++ host harness in the tests); the ``.cu`` files hold the kernels.
CuPy is imported only when a kernel is first launched, so this module imports without a GPU.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .source import KERNEL_DIR, kernel_source, source_define

__all__ = ["KERNEL_DIR", "cupy_function", "cupy_usable", "grid_for", "kernel_source", "launch", "source_define"]


def cupy_usable(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` lives on a CUDA device and CuPy imports, so the CuPy kernels can run on it."""
    if tensor.device.type != "cuda":
        return False
    try:
        import cupy  # noqa: F401
    except Exception:  # ImportError, or a CuPy build that does not match the driver
        return False
    return True


@functools.cache
def cupy_function(source: str, function: str) -> Any:
    """The compiled CuPy kernel ``function`` from source file ``source`` (compiled once per process)."""
    import cupy

    return cupy.RawModule(code=kernel_source(source), options=("--std=c++17",)).get_function(function)


def launch(source: str, function: str, device: torch.device, grid: int, block: int, args: tuple) -> None:
    """Launch a kernel on ``device``'s current torch stream; tensors in ``args`` are passed as pointers."""
    import cupy
    import numpy as np

    packed = tuple(np.uint64(a.data_ptr()) if isinstance(a, torch.Tensor) else a for a in args)
    kernel = cupy_function(source, function)
    with cupy.cuda.Device(device.index), _cupy_stream(cupy, torch.cuda.current_stream(device)):
        kernel((grid,), (block,), packed)


def _cupy_stream(cupy: Any, stream: torch.cuda.Stream) -> Any:
    """CuPy's view of a torch stream: ``Stream.from_external`` where CuPy has it (CuPy 14 deprecates
    ``ExternalStream``, warning at every launch) and torch's stream speaks the CUDA stream protocol."""
    from_external = getattr(cupy.cuda.Stream, "from_external", None)
    if from_external is not None and hasattr(stream, "__cuda_stream__"):
        return from_external(stream)
    return cupy.cuda.ExternalStream(stream.cuda_stream)


def grid_for(numel: int, block: int, device: torch.device) -> int:
    """Blocks for a grid-stride loop over ``numel`` elements: enough to fill every SM a few times."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min((numel + block - 1) // block, sms * 8))
