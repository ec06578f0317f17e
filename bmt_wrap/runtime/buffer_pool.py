"""Reusable flat buffers for gathered parameters and full gradients.

glibc ``mmap``s every allocation over 32 MB, so a fresh gathered buffer per block call page-faults its
whole size; reusing a few buffers (as many as prefetch depth keeps in flight) was ~30% faster end to
end on CPU (docs/design.md). Transformer blocks share one size, so exact-size free lists suffice.
"""

from __future__ import annotations

from collections import defaultdict

import torch

_Key = tuple[int, torch.dtype, torch.device]


class BufferPool:
    """Free lists of 1-D buffers keyed by (numel, dtype, device)."""

    def __init__(self) -> None:
        self._free: dict[_Key, list[torch.Tensor]] = defaultdict(list)

    def acquire(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A buffer of exactly ``numel`` elements (uninitialised contents)."""
        free = self._free[(numel, dtype, torch.device(device))]
        if free:
            return free.pop()
        return torch.empty(numel, dtype=dtype, device=device)

    def release(self, buf: torch.Tensor) -> None:
        """Give a buffer back for reuse."""
        self._free[(buf.numel(), buf.dtype, buf.device)].append(buf)
