"""One flat buffer of a shard group: this rank's shard, its gradient, and a parameter view per slot."""

from __future__ import annotations

import weakref

import torch

from ..base.dtypes import to_dtype
from ..base.plan import FlatBufferSpec
from .comm import Communicator, StagePlacement
from .param import DistributedParameter, ParamGroup
from .shard_store import ShardHome
from .sharded_tensor import ShardedTensor


class FlatBuffer:
    """Parameters of one dtype laid out contiguously; this rank keeps ``[r*S, (r+1)*S)``.

    Alignment gaps and padding are zero in the shard and in the gradient shard, always: optimizers may
    update a covering range in one call and norms need no masking.
    """

    def __init__(self, spec: FlatBufferSpec, group_name: str, rank: int, world_size: int,
                 shard: torch.Tensor, home: ShardHome | None = None) -> None:
        self.spec = spec
        self.group_name = group_name
        self.rank = rank
        self.world_size = world_size
        self.dtype = to_dtype(spec.dtype)
        self.gather_dtype = to_dtype(spec.gather_dtype)  # what blocks compute in (see FlatBufferSpec)
        self.grad_dtype = to_dtype(spec.grad_dtype)  # the full gradient's, and its reduce-scatter's
        self.full_numel = spec.padded_numel(world_size)
        self.shard_numel = spec.shard_numel(world_size)
        if shard.shape != (self.shard_numel,) or shard.dtype != self.dtype:
            raise ValueError(f"shard of {group_name!r} must be ({self.shard_numel},) {self.dtype}")
        self.shard = shard
        self.home = home  # where the shard and its gradients live when offloaded (shard_store.py), else None
        # Weak: the parameters' ``.grad`` views keep the gradient shard alive, so
        # ``zero_grad(set_to_none=True)`` frees it as it frees plain torch gradients.
        self._grad_shard: weakref.ref[torch.Tensor] | None = None
        self.group: ParamGroup  # set by the owning ``group.ShardGroup``, the layer above
        # Under tensor parallelism: the TP group and the shard ranges whose gradients it sums (tp_reduce.py).
        self.tp_sum: tuple[Communicator, list[tuple[int, int]]] | None = None
        # A buffer sharded over shard x tp ranks (``spec.over_tp``): those ranks, else None (the group's),
        # and T with the shard ranges of sequence-part gradients, which the average over T peers divided by T.
        self.own_comm: Communicator | None = None
        # What the reduced gradient is multiplied by (an expert buffer's 1 / ep_size), or None.
        self.grad_scale: float | None = None
        self.tp_scale: tuple[int, list[tuple[int, int]]] | None = None
        # Under pipeline parallelism, a buffer of one stage's parameters: that stage (this rank's, or another's
        # in a GhostBuffer); None for a buffer every stage holds.
        self.stage: StagePlacement | None = None
        self.local_ranges = [spec.local_range(s, rank, world_size) for s in spec.slots]
        self.params = [DistributedParameter._view_of(self, i, shard[a:b], spec.requires_grad)
                       for i, (a, b) in enumerate(self.local_ranges)]

    @property
    def comm(self) -> Communicator:
        """The ranks this buffer is sharded over: the owning group's, or its own (``own_comm``)."""
        return self.own_comm if self.own_comm is not None else self.group.comm

    @property
    def replicas(self) -> Communicator | None:
        """The ranks holding this same shard (HSDP's replicate group), or None."""
        return self.group.replicas

    @property
    def device(self) -> torch.device:
        """Where the buffer is gathered and its gradient computed: the shard's device, or (offloaded) the
        device its store computes on."""
        return self.home.store.device if self.home is not None else self.shard.device

    @classmethod
    def empty(cls, spec: FlatBufferSpec, group_name: str, rank: int, world_size: int,
              device: torch.device | str, home: ShardHome | None = None) -> FlatBuffer:
        """A zeroed shard (on ``meta``: no storage at all, to be materialised later; with ``home``: in its
        offload store)."""
        numel = spec.shard_numel(world_size)
        if home is not None and torch.device(device).type != "meta":
            shard = home.shard()
        else:
            shard = torch.zeros(numel, dtype=to_dtype(spec.dtype), device=device)
        return cls(spec, group_name, rank, world_size, shard, home)

    @torch.no_grad()
    def materialize(self, device: torch.device | str) -> None:
        """Give a meta shard real, zeroed storage on ``device``; the parameter objects stay, re-pointed at it."""
        if not self.shard.is_meta:
            return
        shard = (self.home.shard() if self.home is not None
                 else torch.zeros(self.shard_numel, dtype=self.dtype, device=device))
        for i, (p, (a, b)) in enumerate(zip(self.params, self.local_ranges, strict=True)):
            fresh = DistributedParameter._view_of(self, i, shard[a:b], p.requires_grad)
            # swap_tensors exchanges __dict__ too: carry p's attributes over so p keeps them (all but
            # the local view, which is what changes).
            fresh.__dict__.update({k: v for k, v in p.__dict__.items() if k != "_local"})
            # Optimizers, modules and tied aliases hold p itself: swap its storage, not the object.
            torch.utils.swap_tensors(p, fresh)
        self.shard = shard

    # ---- moving data between full tensors and this rank's shard ----------------------------------
    def slot_source_range(self, i: int, rank: int | None = None) -> tuple[int, int]:
        """``[start, end)`` inside the flattened original parameter that this rank's (or ``rank``'s) slice covers."""
        return self.spec.source_range(self.spec.slots[i], self.rank if rank is None else rank, self.world_size)

    @torch.no_grad()
    def load_slot(self, i: int, full: torch.Tensor) -> None:
        """Copy this rank's part of the full tensor ``full`` of slot ``i`` into the shard."""
        a, b = self.local_ranges[i]
        if a == b:
            return
        s, e = self.slot_source_range(i)
        self.shard[a:b].copy_(full.reshape(-1)[s:e])

    @torch.no_grad()
    def load_full_flat(self, full: torch.Tensor) -> None:
        """Keep this rank's piece of an unsharded, padded flat buffer."""
        lo = self.rank * self.shard_numel
        self.shard.copy_(full[lo:lo + self.shard_numel])

    @torch.no_grad()
    def pack_full_flat(self, tensors: list[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Write full per-slot tensors into ``out``, a padded flat buffer, gaps zeroed."""
        out.zero_()
        for slot, t in zip(self.spec.slots, tensors, strict=True):
            out[slot.offset:slot.offset + slot.numel].copy_(t.reshape(-1))
        return out

    def slot_views(self, full: torch.Tensor) -> list[torch.Tensor]:
        """Views of a gathered full buffer, one per slot, in the original shapes."""
        return [full[s.offset:s.offset + s.numel].view(s.shape) for s in self.spec.slots]

    def flatten_grads_into(self, out: torch.Tensor, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """Concatenate per-slot gradients into ``out`` (gaps, padding and missing grads as zeros)."""
        pieces: list[torch.Tensor] = []
        pos = 0
        for slot, g in zip(self.spec.slots, grads, strict=True):
            if slot.offset > pos:
                pieces.append(out.new_zeros(slot.offset - pos))
            pieces.append(g.reshape(-1) if g is not None else out.new_zeros(slot.numel))
            pos = slot.offset + slot.numel
        if pos < out.numel():
            pieces.append(out.new_zeros(out.numel() - pos))
        # One cat into a pooled buffer is much cheaper than per-slice copies (docs/design.md, CPU facts).
        return torch.cat([p.to(out.dtype) for p in pieces], out=out)

    # ---- gradients -----------------------------------------------------------------------------------
    @property
    def grad_shard(self) -> torch.Tensor | None:
        """The flat gradient shard while any parameter (or the reducer) holds it, else None."""
        return self._grad_shard() if self._grad_shard is not None else None

    def ensure_grad_shard(self) -> torch.Tensor:
        """The flat gradient shard, allocated (zeroed) when none is alive; callers keep it alive."""
        grad = self.grad_shard
        return grad if grad is not None else self.new_grad_shard(zeroed=True)

    def new_grad_shard(self, zeroed: bool) -> torch.Tensor:
        """A fresh gradient shard; uninitialised only for a caller that overwrites all of it (a
        reduce-scatter does: zero-filling every shard each step cost as much as the copies)."""
        if self.home is not None:
            grad = self.home.grad_shard()
            if zeroed:
                grad.zero_()
        else:
            grad = torch.zeros_like(self.shard) if zeroed else torch.empty_like(self.shard)
        self._grad_shard = weakref.ref(grad)
        return grad

    def grad_view(self, i: int) -> torch.Tensor:
        """Slot ``i``'s range of the gradient shard (1-D, local)."""
        a, b = self.local_ranges[i]
        return self.ensure_grad_shard()[a:b]

    def grad_tensor(self, i: int) -> ShardedTensor:
        """Slot ``i``'s gradient as its parameter's ``.grad``: the full shape over ``grad_view(i)``."""
        return ShardedTensor.wrap(self.grad_view(i), self.params[i].shard_layout)

    def fqns(self) -> list[str]:
        """Canonical names of the parameters in this buffer."""
        return [s.fqn for s in self.spec.slots]


class GhostBuffer(FlatBuffer):
    """Another pipeline stage's flat buffer as this rank sees it: each parameter with its full shape over an
    empty range. Its values live on stage ``stage.owner`` (reductions combine over the pipe group, full
    values come from that stage); a rank never holds memory for it.

    ``world_size``: the ranks the owner shards it over, which fixes its padded size.
    """

    def __init__(self, spec: FlatBufferSpec, group_name: str, world_size: int, stage: StagePlacement,
                 device: torch.device | str) -> None:
        self.spec = spec
        self.group_name = group_name
        self.rank, self.world_size = 0, world_size
        self.dtype = to_dtype(spec.dtype)
        self.gather_dtype = to_dtype(spec.gather_dtype)
        self.grad_dtype = to_dtype(spec.grad_dtype)
        self.full_numel = spec.padded_numel(world_size)
        self.shard_numel = 0
        self.shard = torch.empty(0, dtype=self.dtype, device=device)
        self.home = None
        self._grad_shard = None
        self.tp_sum, self.own_comm, self.tp_scale = None, None, None
        self.stage = stage
        self.local_ranges = [(0, 0)] * len(spec.slots)
        self.params = [DistributedParameter._view_of(self, i, self.shard, spec.requires_grad)
                       for i in range(len(spec.slots))]

    def slot_source_range(self, i: int, rank: int | None = None) -> tuple[int, int]:
        """Nothing of any slot is held on this stage."""
        return 0, 0

    def load_full_flat(self, full: torch.Tensor) -> None:
        """Nothing to keep: the owning stage holds these values."""
