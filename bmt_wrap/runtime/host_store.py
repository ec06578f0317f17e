"""Offloaded shards in host memory (``offload="host"``): the host backend of ``shard_store.ShardStore``.

Each rank's parameter shards, gradient shards and ``no_sync`` accumulators are host tensors (pinned on a
CUDA job, so copies to and from the device run without a staging copy and off the compute stream). The
device holds only what the schedule needs: a block's shard is copied to the device one block ahead of its
all-gather, on a side stream (``read_ahead``), so the copy overlaps the running block's compute, and
dropped once gathered; a gradient is reduce-scattered on the device and its shard copied home when the
reduce-scatter ends (grad_reduce.py). The optimizer steps on the host copies (optim/host_chunks.py runs
``AdamOptimizer``'s update on the device chunk by chunk, so it is the in-memory job's kernel and bits).

On a CPU job the same store runs with CPU tensors and plain copies instead of pinned memory and a side
stream: that saves no memory (the shards are host memory already) and exists so that the streaming logic
is exercised without a GPU (``offload_option.HOST_ON_CPU``, a test seam).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from ..errors import OffloadError
from .shard_store import ShardStore

_stores: weakref.WeakSet[HostStore] = weakref.WeakSet()


@dataclass
class StagingStats:
    """How gathers got their device copies: read ahead (overlapping compute) or copied when needed."""

    read_ahead: int = 0
    copied_when_needed: int = 0


def compute_device(t: torch.Tensor) -> torch.device | None:
    """The device the model of a host-offloaded tensor computes on, when ``t`` lies in a host store (its
    optimizer steps there, chunk by chunk: optim/host_chunks.py); else None."""
    if t.device.type != "cpu" or t.numel() == 0:
        return None
    addr = t.data_ptr()
    for store in list(_stores):
        if store.holds(addr):
            return store.device
    return None


class HostStore(ShardStore):
    """One model's offloaded tensors on one rank, in host memory; ``device`` is where the model computes."""

    staged = True

    def __init__(self, device: torch.device) -> None:
        self._device = torch.device(device)
        self._cuda = self._device.type == "cuda"
        self._stream = torch.cuda.Stream(self._device) if self._cuda else None
        # Shards read ahead, by address: the device copy and (CUDA) the event its copy recorded.
        self._ahead: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._spans: list[tuple[int, int]] = []  # (start, end) addresses of what ``reserve`` made
        self.reserved_bytes = 0
        self.stats = StagingStats()
        _stores.add(self)

    @property
    def device(self) -> torch.device:
        """Where the model computes."""
        return self._device

    def reserve(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A zeroed host tensor of ``numel`` elements (pinned on a CUDA job)."""
        try:
            t = torch.zeros(numel, dtype=dtype, pin_memory=self._cuda)
        except RuntimeError as exc:
            raise OffloadError(
                f"cannot {'pin' if self._cuda else 'allocate'} {numel * dtype.itemsize:,} bytes of host memory "
                f"for offloaded shards ({self.reserved_bytes:,} bytes held so far): {str(exc).splitlines()[0]}. "
                "Use offload='disk' with offload_dir= on a disk, or shard over more ranks") from None
        self.reserved_bytes += t.numel() * t.element_size()
        self._spans.append((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()))
        return t

    def holds(self, addr: int) -> bool:
        """True when address ``addr`` lies in a tensor of this store."""
        return any(start <= addr < end for start, end in self._spans)

    def map(self, region: object) -> torch.Tensor:
        """The host tensor ``reserve`` made."""
        assert isinstance(region, torch.Tensor)
        return region

    def read_ahead(self, tensors: list[torch.Tensor]) -> None:
        """Start copying ``tensors`` to the device (a side stream on CUDA), for their gathers."""
        for t in tensors:
            key = t.data_ptr()
            if t.numel() == 0 or key in self._ahead:
                continue
            if self._stream is None:
                self._ahead[key] = (t.to(self._device, copy=True), None)
                continue
            out = torch.empty(t.shape, dtype=t.dtype, device=self._device)
            # The copy may land in memory the compute stream used last: it waits for that stream first.
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream):
                out.copy_(t, non_blocking=True)
                done = torch.cuda.Event()
                done.record(self._stream)
            self._ahead[key] = (out, done)

    def wait_read(self, t: torch.Tensor) -> None:
        """Nothing: ``to_device`` orders the gather after the copy."""

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` on the device: its read-ahead copy (the compute stream waits for it), or a copy made now."""
        ahead = self._ahead.pop(t.data_ptr(), None)
        if ahead is None or ahead[0].shape != t.shape or ahead[0].dtype != t.dtype:
            self.stats.copied_when_needed += 1
            return t.to(self._device, copy=True)
        self.stats.read_ahead += 1
        out, done = ahead
        if done is not None:
            torch.cuda.current_stream(self._device).wait_event(done)
        return out

    def drop_read_ahead(self) -> None:
        """Forget copies read ahead: the shards may be written before they would be gathered."""
        self._ahead.clear()
