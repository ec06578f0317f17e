"""The engine: builds shard groups from a plan's specs and runs them (gather, prefetch, reduce, release).

One engine per process holds what every wrapped model shares: the communicator it is given, the buffer
pool, the gradient reducer with its end-of-backward callback, and the phase, so a backward that spans
several models (teacher and student, or an explicit block list beside a wrapped model) ends once. Each
model's groups and prefetch schedule live in its own ``ModelRuntime`` (model_runtime.py). The layer that
initialises communication installs the engine (active_engine.py); nothing here reads global state.
"""

from __future__ import annotations

import enum
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from ..base.dtypes import to_dtype
from ..base.plan import FlatBufferSpec, ShardGroupSpec
from ..errors import OffloadError, UnsupportedError, WrapError
from .block_executor import BlockCall, _Tree
from .buffer_pool import BufferPool
from .comm import Communicator, ParallelLayout, RankLayout, SingleProcessCommunicator, StagePlacement
from .flat_buffer import FlatBuffer, GhostBuffer
from .gather_function import gathered_tensors
from .grad_reduce import GradReducer
from .group import ShardGroup, StorageMode
from .local_grads import LocalGrads
from .model_runtime import ModelRuntime
from .module_params import Location
from .offload import agree_offload, check_files, release_all, release_pages
from .param import DistributedParameter, mark_replaced
from .replay import ReplayMemory
from .shard_store import ShardHome
from .standalone import shard_standalone
from .tp_marks import copy_tp_marks, tp_split_dim
from .tp_reduce import broadcast_under_tp, tp_scale_ranges, tp_sum_ranges


def storage_mode(spec: ShardGroupSpec) -> StorageMode:
    """How a block's gathered storage is managed (see ``group.py``)."""
    if spec.zero_level == 2:
        return StorageMode.KEPT
    return StorageMode.POOLED if spec.checkpoint else StorageMode.RESIZABLE


class Phase(enum.Enum):
    """Where the process's training step is (``Engine.phase``), and what runs inside it (``Engine.nested``)."""

    IDLE = "idle"
    FORWARD = "forward"  # a root forward (a wrapped model's or a DistributedModule's) runs
    BACKWARD = "backward"  # from the first block or root gradient until the end-of-backward callback
    BLOCK = "block"  # a block's own code runs (nested in any phase)
    RECOMPUTE = "recompute"  # a checkpointed block runs again in backward (nested in BACKWARD)


def _assert_in(phase: Phase, allowed: tuple[Phase, ...], transition: str) -> None:
    # A failure here is an engine bug (a hook ran out of order), never a user error.
    assert phase in allowed, f"engine transition {transition!r} from phase {phase.value}, expected {[p.value for p in allowed]}"


class Engine:
    """Owns the communicator view, buffer pool and reducer of this process, and its models' runtimes."""

    def __init__(self, comm: Communicator, device: torch.device, debug: bool = False) -> None:
        self.comm = comm  # the whole job's: wrap-time broadcasts, the used-parameter mask
        self.debug = debug  # BMT_WRAP_DEBUG: also compare recomputed outputs' values
        self.rank, self.world_size = comm.rank, comm.world_size
        # Which ranks new groups shard over and replicate across; one per process (see adopt_layout).
        self.layout = RankLayout(comm)
        self.parallel: ParallelLayout | None = None  # the whole rank layout once one was adopted
        self.tp: Communicator | None = None  # the tensor-parallel group, when tp_size > 1 (see adopt_layout)
        self.whole: Communicator | None = None  # under TP: the shard x tp ranks (see adopt_layout)
        self.device = device
        self.pool = BufferPool()
        self.reducer = GradReducer(comm, self.pool, device)
        self.reducer.on_finalize.append(self._end_backward)
        self.local_grads = LocalGrads()  # what no_sync windows accumulate unreduced
        self.reducer.before_finalize.append(self._settle_local_grads)
        # Wrapped models hold their runtime; a model that is gone takes its groups with it.
        self._runtimes: weakref.WeakSet[ModelRuntime] = weakref.WeakSet()
        # The explicit API's blocks and bare parameters have no model to belong to: they share this one.
        self.explicit = self.new_runtime("explicit API")
        self.phase = Phase.IDLE
        # Set by a pipeline's forward for micro-batches whose backward another one's follows: their block
        # calls accumulate gradients, the last one's reduce them (BlockCall.defer_reduce).
        self.defer_reduce = False
        # Set by a zero-bubble schedule's forward: its block calls are differentiated in two passes
        # (BlockCall.split) and collected here, for the schedule to end each after its weights' pass.
        self.split_calls: list[BlockCall] | None = None
        self.nested: list[Phase] = []  # BLOCK or RECOMPUTE per block whose own code is running
        self._acquired_calls: list[BlockCall] = []  # gathered for backward, released when done
        self._standalone_cache: dict[int, torch.Tensor] = {}
        self._replay_memory: weakref.WeakKeyDictionary[ShardGroup, ReplayMemory] = weakref.WeakKeyDictionary()
        # Each group's model runtime: a group knows nothing of the schedule that runs it. The runtime holds
        # its groups, so it is held weakly here: a strong value would keep its own key, and every model
        # ever wrapped, alive for the engine's life.
        self._runtime_of: weakref.WeakKeyDictionary[ShardGroup, weakref.ref[ModelRuntime]] = \
            weakref.WeakKeyDictionary()

    # ---- building groups --------------------------------------------------------------------------------
    def new_runtime(self, name: str) -> ModelRuntime:
        """A runtime for one model's groups and schedule; the caller (the model) keeps it alive."""
        runtime = ModelRuntime(name)
        self._runtimes.add(runtime)
        return runtime

    def adopt_layout(self, layout: ParallelLayout) -> None:
        """Build new groups over ``layout``'s dp group; refused while groups of another layout live (the
        optimizer's norm and overflow reductions assume one layout for every parameter). Its ``tp``: the
        tensor-parallel group whose ranks hold different slices of TP-split parameters; its ``whole``: the
        shard x tp ranks that buffers of parameters every TP peer holds whole are sharded over."""
        if layout.dp != self.layout and self.groups:
            raise UnsupportedError(
                f"this process already holds models sharded as {self.layout.describe()}; a model sharded as "
                f"{layout.dp.describe()} beside them is not supported (gradient norms would mix layouts). Wrap "
                "every model of the process with the same mesh= (or none), or drop the others first.")
        self.parallel = layout
        self.layout = layout.dp
        self.tp = layout.tp if layout.tp.world_size > 1 else None
        self.whole = layout.whole if self.tp is not None else None
        # Every rank of a stage uses the same groups, so the used-parameter mask is agreed within the stage;
        # the stages agree on what one stage holds through the pipe group (GradReducer.finalize).
        self.reducer.mask_comm = layout.stage if layout.stage is not None else self.comm

    @property
    def groups(self) -> list[ShardGroup]:
        """Every live group of every model."""
        return [g for rt in list(self._runtimes) for g in rt.groups]

    def build_group(self, spec: ShardGroupSpec, locations: list[list[list[Location]]],
                    sources: list[list[torch.Tensor | None]], device: torch.device | str,
                    sync_from: int | None = 0, used_outside_blocks: bool = False,
                    runtime: ModelRuntime | None = None, tp_sum_unmarked: bool | None = None) -> ShardGroup:
        """Shard ``sources`` (full tensors per buffer and slot) into a new group of ``runtime``
        (default: the explicit API's).

        ``sync_from``: rank whose values every rank keeps (one group-sized broadcast), or None when every
        rank passes identical values (BMTrain's contract for ``DistributedParameter``). Sources on the
        meta device give a meta shard, materialised later by ``init_parameters`` or ``load``.
        ``used_outside_blocks``: gathered for code outside any block (the root, a bare parameter).
        ``tp_sum_unmarked``: under tensor parallelism, parameters without TP marks get their gradients
        summed over the TP group (the explicit API: BMTrain reduces them over the world; see tp_reduce.py).
        """
        buffers: list[FlatBuffer] = []
        layout = self.layout
        homes = self._reserve_homes(spec, runtime)
        sum_unmarked = runtime is None if tp_sum_unmarked is None else tp_sum_unmarked
        # The parameters the new ones replace carry the TP marks (a bare DistributedParameter: its source).
        marked = [[_original(locs, t) for locs, t in zip(per_buffer, tensors, strict=True)]
                  for per_buffer, tensors in zip(locations, sources, strict=True)]
        for bspec, tensors, originals, home in zip(spec.buffers, sources, marked, homes, strict=True):
            meta = any(t is not None and t.is_meta for t in tensors)
            over = self._buffer_comm(bspec)
            buf = FlatBuffer.empty(bspec, spec.name, over.rank, over.world_size, "meta" if meta else device, home)
            if over is not layout.shard:
                buf.own_comm = over
            if not meta:
                # An EP rank's experts are its own (wrapping/experts.py took them from rank 0's): loaded as given.
                if sync_from is not None and self.world_size > 1 and not bspec.ep_split:
                    full = torch.empty(buf.full_numel, dtype=buf.dtype, device=buf.device)
                    buf.pack_full_flat([_or_zeros(t, s.shape, buf.dtype) for t, s in zip(tensors, bspec.slots, strict=True)],
                                       full)
                    if self.tp is None or bspec.over_tp:
                        # Over the whole job, not the shard group: every replica must start from rank 0's values.
                        self.comm.broadcast(full, sync_from, label=f"{spec.name} parameters")
                    else:
                        broadcast_under_tp(buf, full, originals, layout, self.tp, spec.name)
                    buf.load_full_flat(full)
                    del full
                else:
                    for i, t in enumerate(tensors):
                        if t is not None:
                            buf.load_slot(i, t.to(buf.dtype))
                release_pages(buf.shard)  # offloaded: written to its file, out of memory until gathered
            buffers.append(buf)
        mode = StorageMode.GRAPH if used_outside_blocks or spec.is_root else storage_mode(spec)
        group = ShardGroup(spec, buffers, locations, layout.shard, self.pool, mode, replicas=layout.replicate)
        self._install(group, locations)
        for olds, buf in zip(marked, buffers, strict=True):
            for old, new in zip(olds, buf.params, strict=True):
                if old is not None and old is not new:
                    copy_tp_marks(old, new)
                    if self.tp is not None and tp_split_dim(new) is not None:
                        new.shard_layout.tp = self.tp  # its norms (and its gradient's) combine over TP too
            if buf.spec.ep_split:
                # The owners' average is over the ranks owning the same experts; every EP peer's tokens
                # reached them, so the job's average is that divided by the EP size.
                buf.grad_scale = 1 / self._experts().ep_size
            if self.tp is not None and buf.spec.over_tp:
                buf.tp_scale = tp_scale_ranges(buf, self.tp.world_size, sum_unmarked)
            elif self.tp is not None:
                buf.tp_sum = tp_sum_ranges(buf, self.tp, sum_unmarked)
        return self._register(group, runtime)

    def _buffer_comm(self, spec: FlatBufferSpec) -> Communicator:
        """The ranks a new buffer is sharded over: the shard group, under TP the shard x tp ranks for a
        buffer of parameters every TP peer holds whole, under EP the owners of an expert buffer's experts."""
        if spec.ep_split:
            experts = self._experts().experts
            assert experts is not None
            return experts.shard
        return self.whole if spec.over_tp and self.whole is not None else self.layout.shard

    def _experts(self) -> ParallelLayout:
        """The layout an expert buffer is placed in; ``WrapError`` without expert parallelism."""
        if self.parallel is None or self.parallel.experts is None:
            raise WrapError("this plan holds expert-parallel buffers (ep_split), but the job's layout has no "
                            "expert parallelism: wrap with the ep_size= the plan was made for")
        return self.parallel

    def _reserve_homes(self, spec: ShardGroupSpec, runtime: ModelRuntime | None) -> list[ShardHome | None]:
        """Each buffer's place in its model's offload store (None when not offloaded); a rank that cannot
        reserve one (full disk, no host memory) fails every rank here, before any collective sized by the group."""
        store = runtime.offload if runtime is not None else None
        if store is None:
            return [None] * len(spec.buffers)
        homes: list[ShardHome | None] = []
        problem = None
        try:
            homes = [ShardHome(store, b.shard_numel(self._buffer_comm(b).world_size), to_dtype(b.dtype))
                     for b in spec.buffers]
        except OffloadError as exc:
            problem = exc
        agree_offload(self.comm, problem, f"placing {spec.name!r}")
        return homes

    def standalone_parameter(self, data: torch.Tensor, requires_grad: bool = True,
                             init_method: Callable[[torch.Tensor], Any] | None = None,
                             group: str | None = None, tp_mode: bool = False,
                             tp_split_dim: int = -1) -> DistributedParameter:
        """A bare ``DistributedParameter``: ``data`` (identical on every rank, or on every rank of the dp
        group for a TP slice) sharded into its own group."""
        tp_size = self.tp.world_size if self.tp is not None else 1
        return shard_standalone(self, data, requires_grad, init_method, group, tp_mode, tp_split_dim, tp_size)

    def _runtime(self, group: ShardGroup) -> ModelRuntime:
        runtime = self._runtime_of[group]()
        assert runtime is not None  # a live group's runtime holds it
        return runtime

    def place_on_stage(self, group: ShardGroup, stage: StagePlacement) -> None:
        """``group`` holds parameters of this rank's pipeline stage only: its norms and values combine over
        the pipe group (the other stages hold ghosts of it, ``ghost_group``)."""
        for b in group.buffers:
            self.place_buffer(b, stage)

    def place_buffer(self, buffer: FlatBuffer, stage: StagePlacement) -> None:
        """One buffer's stage (``place_on_stage``), e.g. a tied embedding's, held by two stages."""
        buffer.stage = stage
        self.reducer.staged.append(weakref.ref(buffer))

    def ghost_group(self, spec: ShardGroupSpec, locations: list[list[list[Location]]], stage: StagePlacement,
                    device: torch.device | str, runtime: ModelRuntime | None = None) -> ShardGroup:
        """A group of another pipeline stage as this rank holds it: its parameters (full shapes over empty
        ranges) put at ``locations``, no storage; ``stage.owner`` holds the values (``place_on_stage``)."""
        buffers: list[FlatBuffer] = [GhostBuffer(b, spec.name, self._buffer_comm(b).world_size, stage, device)
                                     for b in spec.buffers]
        group = ShardGroup(spec, buffers, locations, SingleProcessCommunicator(self.comm.timeout), self.pool,
                           StorageMode.GRAPH)
        for old, new in self._install(group, locations):
            copy_tp_marks(old, new)
            if self.tp is not None and tp_split_dim(new) is not None:
                new.shard_layout.tp = self.tp
        self.reducer.staged.extend(weakref.ref(buf) for buf in buffers)
        return self._register(group, runtime)

    @staticmethod
    def _install(group: ShardGroup, locations: list[list[list[Location]]]) -> list[tuple[Any, Any]]:
        """Put ``group``'s parameters at ``locations``; each (original, new) pair it replaced, marked so."""
        originals = [[locs[0][0]._parameters.get(locs[0][1]) if locs else None for locs in per_buffer]
                     for per_buffer in locations]
        group.restore()
        pairs = [(old, new) for olds, buf in zip(originals, group.buffers, strict=True)
                 for old, new in zip(olds, buf.params, strict=True) if old is not None and old is not new]
        for old, new in pairs:
            mark_replaced(old, new)
        return pairs

    def _register(self, group: ShardGroup, runtime: ModelRuntime | None) -> ShardGroup:
        """Make ``group`` one of ``runtime``'s (the explicit API's by default)."""
        runtime = runtime or self.explicit
        runtime.groups.append(group)
        self._runtime_of[group] = weakref.ref(runtime)
        return group

    def forget(self, group: ShardGroup) -> None:
        """Drop a group whose parameters moved elsewhere (a standalone parameter adopted by a block)."""
        group.release()
        runtime = self._runtime_of.pop(group)()
        assert runtime is not None  # it holds the group
        runtime.groups = [g for g in runtime.groups if g is not group]

    @torch.no_grad()
    def sync_buffers(self, module: nn.Module, src: int | None) -> None:
        """Give every rank rank ``src``'s module buffers (one broadcast each; meta buffers skipped)."""
        if src is None or self.world_size == 1:
            return
        for name, buf in module.named_buffers():
            if buf.is_meta:
                continue
            flat = buf.detach().reshape(-1).contiguous()
            self.comm.broadcast(flat, src, label=f"buffer {name}")
            if flat.data_ptr() != buf.data_ptr():
                buf.copy_(flat.view_as(buf))

    def replay_memory(self, group: ShardGroup) -> ReplayMemory:
        """What this group's earlier calls wrote (buffers, argument tensors), for faithful recompute."""
        if group not in self._replay_memory:
            self._replay_memory[group] = ReplayMemory()
        return self._replay_memory[group]

    def cuda_devices(self, tensors: Iterable[torch.Tensor]) -> list[int]:
        """CUDA devices whose RNG a checkpointed block's recompute must restore."""
        devices = {t.device.index for t in tensors if isinstance(t, torch.Tensor) and t.is_cuda}
        if self.device.type == "cuda":
            devices.add(self.device.index if self.device.index is not None else torch.cuda.current_device())
        return sorted(d for d in devices if d is not None)

    # ---- forward -------------------------------------------------------------------------------------------
    def begin_forward(self, runtime: ModelRuntime, lead: ShardGroup | None = None) -> None:
        """A root forward of ``runtime``'s model starts: drop stray gathers, gather ``lead`` (the root),
        prefetch the model's first blocks."""
        self._recover_from_aborted_backward(new_step=True)
        _assert_in(self.phase, (Phase.IDLE,), "begin forward")
        if runtime.offload is not None:
            check_files(self.comm, [runtime.offload])  # a truncated file fails here, on every rank
            release_all()  # what checkpoints or user code read since leaves memory
            runtime.offload.drop_read_ahead()  # copied before the optimizer stepped
        self.phase = Phase.FORWARD
        self._release_strays()
        if lead is not None:
            lead.start_gather()
        for g in runtime.prefetcher.begin_forward():
            g.start_gather()

    def end_forward(self, runtime: ModelRuntime) -> None:
        """A root forward ended: learn the model's schedule, drop gathers the forward did not use."""
        _assert_in(self.phase, (Phase.FORWARD,), "end forward")
        self.phase = Phase.IDLE
        self._standalone_cache.clear()
        runtime.prefetcher.end_forward()
        self._release_strays()
        if runtime.offload is not None:
            runtime.offload.drop_read_ahead()  # read for a gather the forward did not reach

    @contextmanager
    def inside_block(self, recompute: bool = False) -> Iterator[None]:
        """A block's own code is running: modules inside it are not model roots, even in a recompute."""
        if recompute:
            _assert_in(self.phase, (Phase.BACKWARD,), "begin recompute")
        self.nested.append(Phase.RECOMPUTE if recompute else Phase.BLOCK)
        try:
            yield
        finally:
            self.nested.pop()

    @property
    def in_forward(self) -> bool:
        """True while a root forward runs (blocks called inside it are not new forwards)."""
        return self.phase is Phase.FORWARD

    @property
    def in_block(self) -> bool:
        """True while a block's own code runs, in forward or in a recompute."""
        return bool(self.nested)

    @property
    def recomputing(self) -> bool:
        """True while a checkpointed block runs again in backward (its side effects already happened)."""
        return Phase.RECOMPUTE in self.nested

    def gathered_standalone(self, p: DistributedParameter) -> torch.Tensor:
        """A bare ``DistributedParameter`` read during forward: gathered once per forward and grad mode."""
        key = id(p) * 2 + int(torch.is_grad_enabled())
        if key not in self._standalone_cache:
            self._standalone_cache[key] = self.gather_for_root(p.shard_group)[0][0]
        return self._standalone_cache[key]

    def acquire_for_forward(self, group: ShardGroup) -> None:
        """Gather this group for its forward, starting the gathers of the groups forward reaches next."""
        prefetcher = self._runtime(group).prefetcher
        self._acquire(group, prefetcher.forward_call(group), prefetcher.ahead)

    def _acquire(self, group: ShardGroup, upcoming: list[ShardGroup], ahead: list[ShardGroup]) -> None:
        # This group's gather is queued first, so prefetches never delay the one needed now.
        group.start_gather()
        for g in upcoming:
            g.start_gather()
        for g in ahead:  # offloaded shards: read one group beyond the gathers, while this block computes
            g.read_ahead()
        group.wait_gathered()
        group.in_use += 1

    def release_after_use(self, group: ShardGroup, backward_follows: bool = True) -> None:
        """A block is done with its parameters; ``kept`` (zero_level=2) groups stay until the step ends."""
        group.in_use -= 1
        if group.in_use == 0 and not (backward_follows and group.mode is StorageMode.KEPT):
            group.release()

    def run_block(self, group: ShardGroup, module: nn.Module, forward_fn: Callable[..., Any],
                  args: tuple, kwargs: dict, ext_locations: list[list[Location]]) -> Any:
        """Execute one call of a block: the entry point of every block's forward."""
        ext = [locs[0][0]._parameters[locs[0][1]] for locs in ext_locations]
        inputs = _Tree((args, kwargs))
        tensors = inputs.take_tensors()
        if torch.is_grad_enabled():
            group.check_unfrozen()
        # ``trainable`` reads each parameter's requires_grad now: a block frozen after wrapping whose
        # inputs need no gradient builds no graph, so it is not recomputed and its outputs need no grad.
        needs_graph = torch.is_grad_enabled() and (
            group.trainable or any(t.requires_grad for t in tensors) or any(t.requires_grad for t in ext))
        if not needs_graph:
            self.acquire_for_forward(group)
            try:
                with group.installed(group.slot_views()), self.inside_block():
                    return forward_fn(module, *args, **kwargs)
            finally:
                self.release_after_use(group, backward_follows=False)
        call = BlockCall(self, group, module, forward_fn, inputs, ext_locations)
        call.defer_reduce = self.defer_reduce
        if self.split_calls is not None:
            call.split = True
            self.split_calls.append(call)
        call.call_index = self._runtime(group).prefetcher.record_call(group)
        self.acquire_for_forward(group)
        try:
            return call.forward(args, kwargs, tensors)
        finally:
            self.release_after_use(group)

    def gather_for_root(self, group: ShardGroup) -> list[list[torch.Tensor]]:
        """Gather a group used outside blocks; tensors are autograd-connected to the shards."""
        group.start_gather()
        tensors = gathered_tensors(self, group)
        if group.in_use == 0:  # not held resident (generation)
            group.release()  # from here on the autograd graph owns the storage
            if not torch.is_grad_enabled():
                group.recycle()
        return tensors

    @contextmanager
    def resident(self, groups: list[ShardGroup]) -> Iterator[None]:
        """Keep ``groups`` gathered until the block exits: forwards in it communicate nothing (generation,
        where each token would otherwise gather the whole model again)."""
        held: list[ShardGroup] = []
        try:
            for g in groups:
                g.start_gather()
            for g in groups:
                g.wait_gathered()
                g.in_use += 1
                held.append(g)
            yield
        finally:
            for g in held:
                g.in_use -= 1
                if g.in_use == 0:
                    g.release()
                    g.recycle()

    # ---- backward --------------------------------------------------------------------------------------------
    def acquire_for_backward(self, call: BlockCall) -> None:
        """Gather this call's group, prefetching the calls backward reaches next."""
        self._enter_backward()
        self._acquired_calls.append(call)
        prefetcher = self._runtime(call.group).prefetcher
        self._acquire(call.group, prefetcher.backward_call(call.call_index), prefetcher.ahead)

    def reduce_group_grads(self, group: ShardGroup, grads: list[list[torch.Tensor | None]],
                           only: int | None = None, defer: bool = False) -> None:
        """Flatten per-slot gradients of each trainable buffer (or of buffer ``only``) and start their
        reduce-scatter (``defer``: accumulate them for a later call of the group in this backward)."""
        self._enter_backward()
        for i, (buf, per_slot) in enumerate(zip(group.buffers, grads, strict=True)):
            if only is not None and i != only:
                continue  # another buffer's own backward reduces it
            if not buf.spec.requires_grad or not any(p.requires_grad for p in buf.params):
                continue  # frozen, before or after wrapping (alike on every rank): nothing to reduce
            # A parameter frozen after wrapping still got a gradient through its leaf: drop it, so its
            # .grad stays what it was (None, or what it held when frozen), as in torch.
            per_slot = [g if p.requires_grad else None for g, p in zip(per_slot, buf.params, strict=True)]
            used = [g is not None for g in per_slot]
            if not any(used) and self.world_size == 1:
                continue
            dtype = buf.grad_dtype
            syncing = self.local_grads.syncing(group) and not defer
            if syncing:
                self.reducer.make_room()
            full, release = self._full_grad_buffer(group, i, dtype)
            buf.flatten_grads_into(full, per_slot)
            if not syncing:
                self.local_grads.keep(buf, full, used, release)  # no_sync: no communication
                continue
            local = self.local_grads.take(buf)
            if local is not None:  # the first synchronising backward reduces the window's sum with its own
                full.add_(local.full.to(full.device))
                release_pages(local.full)
                used = [a or b for a, b in zip(used, local.used, strict=True)]
            self.reducer.reduce(buf, full, used, release)

    def _settle_local_grads(self) -> None:
        """Before a backward's end: one that reduced anything synchronises, so it also reduces what no_sync
        windows left in buffers it did not reach (in the order they were kept, alike on every rank); then
        ``.grad`` of what stays accumulated is pointed where ``zero_grad()`` is seen."""
        if self.reducer.reduced_any:
            for local in self.local_grads.take_syncing():
                self.reducer.make_room()
                full, release = self._on_device(local.full, local.buffer)
                self.reducer.reduce(local.buffer, full, local.used, release)
        self.local_grads.mark_all()

    def _on_device(self, full: torch.Tensor, buf: FlatBuffer) -> tuple[torch.Tensor, Callable[[], None]]:
        """A ``no_sync`` window's sum where its reduce-scatter runs (offloaded to host memory: a device copy),
        and how to give that back."""
        if buf.home is None or not buf.home.store.staged:
            return full, lambda: release_pages(full)
        staged = self.pool.acquire(full.numel(), full.dtype, buf.device).copy_(full)
        return staged, lambda: self.pool.release(staged)

    def _full_grad_buffer(self, group: ShardGroup, i: int, dtype: torch.dtype
                          ) -> tuple[torch.Tensor, Callable[[], None]]:
        """Where buffer ``i``'s flat gradient goes, and how to give that storage back."""
        buf = group.buffers[i]
        if group.mode is StorageMode.GRAPH and dtype == buf.gather_dtype:
            # The gradient of a root-like group arrives once every use was differentiated: its gathered
            # parameters are no longer read, so their storage takes the gradient (one full copy less at
            # the peak of backward) and then serves the next forward's gather.
            full = group.take_last(i)
            if full is None:
                full = torch.empty(buf.full_numel, dtype=dtype, device=buf.device)
            return full, lambda: group.give_spare(i, full)
        full = self.pool.acquire(buf.full_numel, dtype, buf.device)
        return full, lambda: self.pool.release(full)

    def _enter_backward(self) -> None:
        """The first block or root gradient of a backward: queue its end, once per backward."""
        if self.phase is Phase.BACKWARD and not self.reducer.aborted:
            return
        self._recover_from_aborted_backward(new_step=False)
        _assert_in(self.phase, (Phase.IDLE,), "begin backward")
        self.phase = Phase.BACKWARD
        self.reducer.ensure_callback()
        for runtime in list(self._runtimes):
            runtime.prefetcher.end_forward()  # explicit API without a root hook learns its schedule here

    def _recover_from_aborted_backward(self, new_step: bool) -> None:
        """Undo what a backward that raised midway left (its end-of-backward callback never ran): its
        half-done reductions, its calls still gathered, the phase. Without this the next backward queues no
        callback, so no ``.grad`` is ever set, and stale gathered groups serve old parameter values.

        Waits only on collectives the aborted backward already posted and posts none: ranks that failed at
        the same point stay in step. A rank that failed alone diverges from its peers, and the order check
        (or the timeout) raises on every rank at the next collective.
        """
        if not self.reducer.aborted:
            return
        self.reducer.abandon()
        # A new forward starts a new step: the aborted step's calls must not feed backward prefetch. A
        # backward entering here may belong to a graph built before the failure, whose call indices stand.
        self._end_backward(clear_calls=new_step)

    def _end_backward(self, clear_calls: bool = True) -> None:
        _assert_in(self.phase, (Phase.BACKWARD,), "end backward")
        self.phase = Phase.IDLE
        # Calls whose saved tensors autograd never asked for (outputs the loss did not use) hold their
        # storage until here.
        calls, self._acquired_calls = self._acquired_calls, []
        for call in calls:
            call.try_release(end_of_backward=True)
        if clear_calls:
            for runtime in list(self._runtimes):
                runtime.prefetcher.end_backward()
        for runtime in list(self._runtimes):
            if runtime.offload is not None:
                runtime.offload.drop_read_ahead()  # the optimizer may step before any is gathered
        for g in self.groups:
            if g.in_use == 0:
                g.release()
                g.recycle()

    def _release_strays(self) -> None:
        for g in self.groups:
            if g.in_use == 0 and g.gathered and g.mode is not StorageMode.KEPT:
                g.release()



def _original(locations: list[Location], source: torch.Tensor | None) -> torch.Tensor | None:
    """The parameter registered at a slot's first location (a bare parameter has none: its source)."""
    return locations[0][0]._parameters.get(locations[0][1]) if locations else source


def _or_zeros(t: torch.Tensor | None, shape: list[int], dtype: torch.dtype) -> torch.Tensor:
    return t if t is not None else torch.zeros(shape, dtype=dtype)
