"""A shard group: the unit of gathering (one block, or the root), and where its parameters live.

A group is in one ``GroupState`` at a time — released, gathering (collectives in flight), gathered — and
every transition asserts the state it starts from (FSDP2's ``_assert_in_states``), so a schedule bug fails
at the transition instead of reading a half-gathered buffer. Four ``StorageMode``s, chosen from the group's checkpoint and ZeRO settings:
- ``pooled``: gathered into a pool buffer and given back right after use (checkpointed blocks: nothing
  from forward references the parameters, recompute gathers again);
- ``resizable``: one dedicated buffer whose storage is freed after forward and refilled in place before
  backward (non-checkpointed blocks: the kept autograd graph references it, so a pool would make reuse
  undetectable corruption; the refill's version bump is undone);
- ``kept``: a dedicated buffer gathered in forward and kept until backward ends (``zero_level=2``); its
  storage stays allocated between steps and the next gather refills it in place;
- ``graph``: gathered for code outside blocks (the root group, a bare parameter); once released the
  autograd graph owns the buffer. When the group's gradient arrives, every use of the parameters has
  been differentiated, so the buffer takes the flat gradient (``take_last``), then waits as the next
  gather's storage (``give_spare``); without a backward it is reused once backward ended (``recycle``).
  A graph kept with ``retain_graph`` that still read it would fail autograd's version check, not read
  new values.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..base._compat import set_version_counters, tensor_version
from ..base.plan import ShardGroupSpec
from ..errors import PipelineError, UninitializedParameterError, WrapError
from .buffer_pool import BufferPool
from .comm import Communicator, Handle
from .flat_buffer import FlatBuffer, GhostBuffer
from .module_params import Location, put
from .offload import release_pages


class StorageMode(enum.Enum):
    """How a group's gathered storage is managed (module docstring)."""

    POOLED = "pooled"
    RESIZABLE = "resizable"
    KEPT = "kept"
    GRAPH = "graph"


class GroupState(enum.Enum):
    """Where a group's gathered parameters are."""

    RELEASED = "released"  # only the shards exist
    GATHERING = "gathering"  # full buffers allocated, all-gathers in flight
    GATHERED = "gathered"  # full buffers hold every rank's shard


def _assert_in(group: ShardGroup, action: str, *states: GroupState) -> None:
    if group.state not in states:
        raise AssertionError(f"bmt_wrap internal error: {action} on group {group.name!r} in state "
                             f"{group.state.value}, expected {' or '.join(s.value for s in states)}")


class ShardGroup:
    """Flat buffers of one block (or the root) plus the module attributes their parameters occupy."""

    def __init__(self, spec: ShardGroupSpec, buffers: list[FlatBuffer], locations: list[list[list[Location]]],
                 comm: Communicator, pool: BufferPool, mode: StorageMode,
                 replicas: Communicator | None = None) -> None:
        self.spec = spec
        self.name = spec.name
        self.buffers = buffers
        self.locations = locations  # [buffer][slot] -> every (module, attribute) holding the parameter
        self.comm = comm  # the shard group: gathers, reduce-scatters, reductions over sharded tensors
        self.replicas = replicas  # ranks holding the same shards (HSDP), or None: gradients averaged over it
        self.pool = pool
        self.mode = mode
        self.state = GroupState.RELEASED
        self._full: list[torch.Tensor] | None = None
        self._handles: list[Handle] | None = None
        self._versions: list[int] = []
        self._dedicated: list[torch.Tensor] | None = None
        # "graph" mode, per buffer: what the autograd graph may still read, and what nothing holds any more
        self._last: list[torch.Tensor | None] = [None] * len(buffers)
        self._spare: list[torch.Tensor | None] = [None] * len(buffers)
        self.in_use = 0  # executors currently running on the gathered parameters
        # What the gathers send (device or param_dtype copies of the shards) while they read it; True: a pool buffer
        self._sends: list[tuple[torch.Tensor, bool]] = []
        self.standalone = False  # a bare DistributedParameter's own group (a block may adopt it)
        for b in buffers:
            b.group = self

    # ---- state -------------------------------------------------------------------------------------
    @property
    def gathered(self) -> bool:
        """True while gathered or gathering."""
        return self.state is not GroupState.RELEASED

    @property
    def ghost(self) -> bool:
        """True for another pipeline stage's group as this rank holds it: parameters over empty ranges."""
        return all(isinstance(b, GhostBuffer) for b in self.buffers)

    @property
    def trainable(self) -> bool:
        """True if any parameter of the group requires grad now (``requires_grad_`` after wrapping counts)."""
        return any(p.requires_grad for b in self.buffers for p in b.params)

    def check_unfrozen(self) -> None:
        """Refuse a parameter frozen when it was sharded and unfrozen since: its buffer keeps no gradient."""
        for b in self.buffers:
            if not b.spec.requires_grad:
                thawed = [slot.fqn for slot, p in zip(b.spec.slots, b.params, strict=True) if p.requires_grad]
                if thawed:
                    raise WrapError(
                        f"{thawed[:5]} of {self.name!r} had requires_grad=False when sharded and were unfrozen "
                        "afterwards; a frozen parameter is sharded without gradient storage. Set "
                        "requires_grad before wrapping (freezing after wrapping works).")


    # ---- gather / release -----------------------------------------------------------------------------
    def start_gather(self) -> None:
        """Start gathering every buffer in its ``gather_dtype`` (no-op if gathered or in flight)."""
        if self.state is not GroupState.RELEASED:
            return
        self._check_materialised()
        self._check_on_this_stage()
        for b in self.buffers:
            if b.home is not None:
                b.home.store.wait_read(b.shard)
        # Buffers outlive this call: made under inference_mode they could never serve training again.
        with torch.inference_mode(False):
            full = [self._alloc(i, b) for i, b in enumerate(self.buffers)]
            self._versions = [tensor_version(t) for t in full] if self._dedicated_storage else []
        sends = [self._cast_shard(b) for b in self.buffers]
        self._handles = [b.comm.all_gather_into(f, s, async_op=True, label=self.name)
                         for f, (s, _), b in zip(full, sends, self.buffers, strict=True)]
        self._sends = sends
        self._full = full
        self.state = GroupState.GATHERING

    def _cast_shard(self, b: FlatBuffer) -> tuple[torch.Tensor, bool]:
        """The shard to send, and whether it is a pool buffer: the shard itself, its copy on the device
        (offloaded to host memory), or (mixed precision) its param_dtype copy, so the gather moves
        param_dtype bytes while the shard stays the fp32 master."""
        shard = b.home.store.to_device(b.shard) if b.home is not None else b.shard
        if b.gather_dtype == b.dtype:
            return shard, False
        send = self.pool.acquire(b.shard_numel, b.gather_dtype, b.device)
        return send.copy_(shard), True

    def gather_values(self, only: FlatBuffer | None = None) -> list[torch.Tensor]:
        """Full buffers (every one, or ``only`` that one) in the shard dtype, for reading or saving values
        (``state_dict``, ``bmt.gathered``, ``bmt.save``): a collective of its own that leaves the group's
        gather state alone, so mixed precision never hands out (or writes back) param_dtype copies."""
        self._check_materialised()
        buffers = self.buffers if only is None else [only]
        full = [torch.empty(b.full_numel, dtype=b.dtype, device=b.device) for b in buffers]
        here = [(f, b) for f, b in zip(full, buffers, strict=True) if b.stage is None or b.stage.here]
        handles = [b.comm.all_gather_into(f, b.home.store.to_device(b.shard) if b.home is not None else b.shard,
                                             async_op=True, label=f"{self.name} values")
                   for f, b in here]
        for h in handles:
            h.wait()
        release_pages(*(b.shard for b in buffers))
        for f, b in zip(full, buffers, strict=True):
            if b.stage is not None:  # one stage holds it (pipeline parallelism): every stage gets its values
                b.stage.pp.broadcast(f, b.stage.owner, label=f"{self.name} values from stage {b.stage.owner}")
        return full

    def read_ahead(self) -> None:
        """Offloaded shards: start bringing them in now, in the background (this group is gathered next)."""
        for b in self.buffers:
            if b.home is not None:
                b.home.store.read_ahead([b.shard])

    def param_values(self) -> dict[int, torch.Tensor]:
        """Every parameter's full value (shard dtype), keyed by ``id`` of its ``DistributedParameter``: views
        of one ``gather_values()``; the one way layers above read whole parameters (a collective)."""
        values = {}
        for b, full in zip(self.buffers, self.gather_values(), strict=True):
            for p, view in zip(b.params, b.slot_views(full), strict=True):
                values[id(p)] = view
        return values

    def _check_on_this_stage(self) -> None:
        other = next((b.stage for b in self.buffers if b.stage is not None and not b.stage.held_here), None)
        if other is not None:
            raise PipelineError(
                f"{self.name!r} belongs to pipeline stage {other.owner}, and this rank runs stage {other.pp.rank}: "
                "it holds none of its parameters, so it cannot run it. Under pipeline parallelism a stage runs "
                "its own blocks only (PipelineTransformerBlockList, or BMTrainModelWrapper(pp_size=) calls them).")

    def _check_materialised(self) -> None:
        meta = [f for b in self.buffers if b.shard.is_meta for f in b.fqns()]
        if meta:
            raise UninitializedParameterError(
                f"parameters of {self.name!r} are still on the meta device: {meta[:5]}"
                f"{' ...' if len(meta) > 5 else ''}. Materialise them first: bmt.init_parameters(model), "
                "or bmt.load(model, path).")

    def wait_gathered(self) -> list[torch.Tensor]:
        """The gathered full buffers, waiting for (or starting) the gather."""
        if self.state is GroupState.RELEASED:
            self.start_gather()
        if self.state is GroupState.GATHERING:
            assert self._handles is not None
            for h in self._handles:
                h.wait()
            self._handles = None
            for send, pooled in self._sends:
                if pooled:
                    self.pool.release(send)
            self._sends = []
            release_pages(*(b.shard for b in self.buffers))  # offloaded: sent, so out of memory again
            self.state = GroupState.GATHERED
            if self._dedicated_storage:
                # Saved tensors of a kept autograd graph view this storage; the refill is the same
                # values, so the version bump it caused must not fail their check in backward.
                set_version_counters(self._full, self._versions)
        _assert_in(self, "reading the gathered buffers", GroupState.GATHERED)
        assert self._full is not None
        return self._full

    def release(self) -> None:
        """Give the gathered storage back (waits for an in-flight gather first)."""
        if self.state is GroupState.RELEASED:
            return
        if self.state is GroupState.GATHERING:
            self.wait_gathered()
        _assert_in(self, "release", GroupState.GATHERED)
        full, self._full = self._full, None
        assert full is not None
        self.state = GroupState.RELEASED
        if self.mode is StorageMode.POOLED:
            for f in full:
                self.pool.release(f)
        elif self.mode is StorageMode.RESIZABLE:
            for f in full:
                f.untyped_storage().resize_(0)
        # A kept (zero_level=2) buffer keeps its storage for the next step's gather: it is held through
        # every backward anyway, and a fresh allocation over 32 MB page-faults on CPU (docs/design.md).
        else:
            self._last = list(full)

    def recycle(self) -> None:
        """No autograd graph holds the last gathered buffers any more (backward ended, or no grad)."""
        for i, t in enumerate(self._last):
            if t is not None:
                self.give_spare(i, t)
        self._last = [None] * len(self.buffers)

    def take_last(self, i: int) -> torch.Tensor | None:
        """Buffer ``i`` of the last gather, for a caller that knows the graph is done reading it."""
        t, self._last[i] = self._last[i], None
        return t

    def give_spare(self, i: int, t: torch.Tensor) -> None:
        """Storage the next gather of buffer ``i`` may reuse."""
        self._spare[i] = t

    @property
    def _dedicated_storage(self) -> bool:
        # One buffer per group, freed and refilled in place: saved tensors of a kept graph view it.
        return self.mode in (StorageMode.RESIZABLE, StorageMode.KEPT)

    def _alloc(self, i: int, b: FlatBuffer) -> torch.Tensor:
        if self.mode is StorageMode.POOLED:
            return self.pool.acquire(b.full_numel, b.gather_dtype, b.device)
        if self.mode is StorageMode.GRAPH:
            spare, self._spare[i] = self._spare[i], None
            if spare is not None:
                return spare
            return torch.empty(b.full_numel, dtype=b.gather_dtype, device=b.device)
        if self._dedicated is None:
            self._dedicated = [torch.empty(x.full_numel, dtype=x.gather_dtype, device=x.device)
                               for x in self.buffers]
        t = self._dedicated[i]
        nbytes = b.full_numel * b.gather_dtype.itemsize
        if t.untyped_storage().nbytes() != nbytes:
            t.untyped_storage().resize_(nbytes)
        return t

    # ---- installing tensors into the modules ----------------------------------------------------------
    def slot_views(self) -> list[list[torch.Tensor]]:
        """Per buffer, per slot: views of the gathered parameters in their original shapes."""
        return [b.slot_views(f) for b, f in zip(self.buffers, self.wait_gathered(), strict=True)]

    def install(self, tensors: list[list[torch.Tensor]]) -> None:
        """Put full tensors where the sharded parameters are, at every location (tied aliases too)."""
        put((module, attr, t) for per_buffer, locs in zip(tensors, self.locations, strict=True)
            for t, slot_locs in zip(per_buffer, locs, strict=True) for module, attr in slot_locs)

    def restore(self) -> None:
        """Put the sharded parameters back at every location."""
        put((module, attr, p) for b, locs in zip(self.buffers, self.locations, strict=True)
            for p, slot_locs in zip(b.params, locs, strict=True) for module, attr in slot_locs)

    @contextmanager
    def installed(self, tensors: list[list[torch.Tensor]]) -> Iterator[None]:
        """Full tensors installed for the duration of the block."""
        self.install(tensors)
        try:
            yield
        finally:
            self.restore()
