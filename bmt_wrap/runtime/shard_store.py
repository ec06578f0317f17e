"""Where an offloaded model's shards live on one rank (``ShardStore``), and one flat buffer's place in it
(``ShardHome``).

Two backends implement the store: ``offload.ShardFile`` (``offload="disk"``: ranges of a file, each mapped
as an ordinary tensor) and ``host_store.HostStore`` (``offload="host"``: host tensors, pinned for a CUDA job).
The engine streams through this interface alone: it reads a block's shard ahead of its gather
(``read_ahead``), takes it to the device for the gather (``to_device``), and, for a store that keeps its
tensors away from the compute device (``staged``), reduces gradients on the device and copies the
gradient shard home as soon as its reduce-scatter ends.
"""

from __future__ import annotations

import abc
import weakref

import torch


class ShardStore(abc.ABC):
    """One model's offloaded tensors on one rank: reserved ranges, each handed out as a tensor."""

    #: True when the store's tensors are not where blocks compute (host memory of a CUDA job): gathers
    #: read a device copy (``to_device``) and gradients are reduced on the device, then copied home.
    staged: bool = False

    @property
    @abc.abstractmethod
    def device(self) -> torch.device:
        """Where the model computes: gathers and full gradients live there."""

    @abc.abstractmethod
    def reserve(self, numel: int, dtype: torch.dtype) -> object:
        """Reserve room for ``numel`` elements of ``dtype`` (an error naming the store when there is none)."""

    @abc.abstractmethod
    def map(self, region: object) -> torch.Tensor:
        """The tensor over a reserved region (its values as last written; zeros when never written)."""

    @abc.abstractmethod
    def read_ahead(self, tensors: list[torch.Tensor]) -> None:
        """Start bringing ``tensors`` (shards gathered soon) towards the compute device, in the background."""

    @abc.abstractmethod
    def wait_read(self, t: torch.Tensor) -> None:
        """Before reading ``t``: let a read-ahead of it finish."""

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` where the gathers read it: itself, or (``staged``) a copy on the compute device."""
        return t

    def drop_read_ahead(self) -> None:
        """Forget copies read ahead (the shards may change before they are gathered: an optimizer step)."""
        return None  # a store that reads nothing ahead has nothing to forget

    def truncated(self) -> str | None:
        """Why the store no longer holds what was written to it, or None."""
        return None


class ShardHome:
    """Where one flat buffer's tensors live in a ``ShardStore``: its shard, its gradient shard and, under
    ``no_sync``, its full-size gradient accumulator."""

    def __init__(self, store: ShardStore, numel: int, dtype: torch.dtype) -> None:
        self.store = store
        self._numel, self._dtype = numel, dtype
        self._shard = store.reserve(numel, dtype)
        # Gradient shards: a region each, with the tensor last handed out over it. A region is reused once
        # nothing holds that tensor (zero_grad(set_to_none=True) freed it), as torch reuses memory.
        self._grads: list[tuple[torch.Tensor, weakref.ref[torch.Tensor] | None]] = []
        self._grad_region = store.reserve(numel, dtype)
        self._accumulator: torch.Tensor | None = None

    def shard(self) -> torch.Tensor:
        """The shard (zeros until written)."""
        return self.store.map(self._shard)

    def grad_shard(self) -> torch.Tensor:
        """A gradient shard over a region no live gradient uses (old values: the caller overwrites or zeroes)."""
        for i, (mapped, out) in enumerate(self._grads):
            if out is None or out() is None:
                view = mapped[:]
                self._grads[i] = (mapped, weakref.ref(view))
                return view
        # The first region was reserved at wrap time; another is needed only while the user holds an old
        # gradient across zero_grad(set_to_none=True).
        region = self._grad_region if not self._grads else self.store.reserve(self._numel, self._dtype)
        mapped = self.store.map(region)
        view = mapped[:]
        self._grads.append((mapped, weakref.ref(view)))
        return view

    def accumulator(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """The buffer's full-size ``no_sync`` accumulator (reserved at its first use)."""
        if self._accumulator is None or self._accumulator.numel() != numel or self._accumulator.dtype != dtype:
            self._accumulator = self.store.map(self.store.reserve(numel, dtype))
        return self._accumulator
