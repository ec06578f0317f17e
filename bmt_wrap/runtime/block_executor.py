"""The block executor: one ``BlockCall`` per call of a block, run in the model's own autograd graph.

Forward: wait for this block's gather, start the next block's, install the gathered parameters as the
outputs of a ``BlockParams`` node and run the block with grad on, in the real graph; a checkpointed block
runs under saved-tensor hooks that keep nothing (each saved tensor becomes a number), then its storage
goes back. Backward: the first saved tensor autograd asks for gathers the block again (prefetching the
calls backward reaches next) and, when checkpointed, recomputes the block once with the forward's RNG,
autocast, argument and buffer state, handing autograd the recomputed tensors. The ``BlockParams`` node
runs once every use of the parameters was differentiated: it releases the storage and hands the
gradients to the reducer (async reduce-scatter).

Because the graph is the model's own (the recompute only refills saved tensors), autograd accumulates
every gradient in the same order as plain PyTorch: an encoder output read by every decoder layer gets
bit-identical gradients at world size 1 (a node per block, returning its input's gradient pre-summed,
added the decoder layers' contributions in another order).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, ExitStack, contextmanager, nullcontext
from typing import Any, Protocol

import torch
from torch import nn

from ..base._compat import is_compiled_callable, pytree, tensor_version
from ..errors import RecomputeError, WrapError
from .group import ShardGroup
from .module_params import Location, installed
from .replay import Replay, ReplayMemory


class BlockHost(Protocol):
    """What a block call needs from the engine that runs it (engine.py, the layer above)."""

    debug: bool

    def cuda_devices(self, tensors: Iterable[torch.Tensor]) -> list[int]:
        """CUDA devices whose RNG a recompute restores."""

    def replay_memory(self, group: ShardGroup) -> ReplayMemory:
        """What the group's earlier calls wrote, for a faithful recompute."""

    def inside_block(self, recompute: bool = False) -> AbstractContextManager[None]:
        """The block's own code runs (again, when ``recompute``)."""

    def acquire_for_backward(self, call: BlockCall) -> None:
        """Gather the call's group for its backward, prefetching what backward reaches next."""

    def reduce_group_grads(self, group: ShardGroup, grads: list[list[torch.Tensor | None]],
                           defer: bool = False) -> None:
        """Start reducing the group's parameter gradients (``defer``: only accumulate them, a later call of
        the group in the same backward reduces the sum)."""

    def release_after_use(self, group: ShardGroup, backward_follows: bool = True) -> None:
        """The call is done with the group's gathered storage."""

# ---- pytrees of inputs and outputs ------------------------------------------------------------------
def _flatten(tree: Any) -> tuple[list[Any], pytree.TreeSpec]:
    leaves, spec = pytree.tree_flatten(tree)
    # Unregistered dataclasses (user outputs) would hide their tensors from autograd: register them.
    if any(dataclasses.is_dataclass(x) and not isinstance(x, type) for x in leaves):
        for x in leaves:
            if dataclasses.is_dataclass(x) and not isinstance(x, type) and type(x) not in pytree.SUPPORTED_NODES:
                pytree.register_dataclass(type(x))
        leaves, spec = pytree.tree_flatten(tree)
    return leaves, spec


class _Tree:
    """A pytree split into its tensors (which cross the Function boundary) and everything else.

    Only the structure and the non-tensor leaves are kept: holding the tensors here would keep a block's
    inputs alive for as long as the user holds the loss.
    """

    def __init__(self, tree: Any) -> None:
        leaves, self.spec = _flatten(tree)
        self.tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        self.first_tensors = [leaves[i] for i in self.tensor_pos]
        for i in self.tensor_pos:
            leaves[i] = None
        self.leaves = leaves

    def take_tensors(self) -> list[torch.Tensor]:
        """The tensors found at construction; the tree forgets them."""
        tensors, self.first_tensors = self.first_tensors, []
        return tensors

    def rebuild(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...], leaves: list[Any] | None = None) -> Any:
        """The tree with ``tensors`` in its tensor positions (and ``leaves`` as its other leaves)."""
        leaves = list(self.leaves if leaves is None else leaves)
        for i, t in zip(self.tensor_pos, tensors, strict=True):
            leaves[i] = t
        return pytree.tree_unflatten(leaves, self.spec)


def _differentiable(t: torch.Tensor) -> bool:
    return t.is_floating_point() or t.is_complex()


def _leaf(t: torch.Tensor, requires_grad: bool) -> torch.Tensor:
    return t.detach().requires_grad_(requires_grad and _differentiable(t))


# ---- RNG and autocast captured at forward, restored for recompute ------------------------------------------
class _ForwardState:
    def __init__(self, devices: list[int]) -> None:
        self.cpu_rng = torch.get_rng_state()
        self.devices = devices
        self.cuda_rng = [torch.cuda.get_rng_state(d) for d in devices]
        self.autocast = {dev: (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev))
                         for dev in ("cpu", "cuda")}

    @contextmanager
    def restored(self) -> Iterator[None]:
        with ExitStack() as stack:
            stack.enter_context(torch.random.fork_rng(devices=self.devices))
            torch.set_rng_state(self.cpu_rng)
            for d, s in zip(self.devices, self.cuda_rng, strict=True):
                torch.cuda.set_rng_state(s, d)
            for dev, (enabled, dtype) in self.autocast.items():
                if enabled or torch.is_autocast_enabled(dev):
                    stack.enter_context(torch.autocast(dev, dtype=dtype, enabled=enabled))
            stack.enter_context(torch.enable_grad())
            yield


# ---- one block call ----------------------------------------------------------------------------------------
_Meta = tuple[torch.Size, torch.dtype, torch.device]


def _meta(t: torch.Tensor) -> _Meta:
    return t.shape, t.dtype, t.device


class CallStage(enum.Enum):
    """Where one block call is between its forward and the end of its backward."""

    FORWARD = "forward"  # ran forward; its storage went back (or stays with a kept group)
    GATHERED = "gathered"  # gathered again for backward, not yet released
    RELEASED = "released"  # the storage went back after this call's backward


@dataclasses.dataclass(eq=False)
class BlockCall:
    """Everything one grad-enabled call of a block needs between its forward and its backward."""

    engine: BlockHost
    group: ShardGroup
    module: nn.Module
    forward_fn: Callable[..., Any]
    inputs: _Tree | None  # None once no recompute can follow (see _forget_forward)
    ext_locations: list[list[Location]]  # root-owned parameters used inside the block
    call_index: int = -1
    saved_inputs: list[torch.Tensor] | None = None  # checkpointed: the recompute's inputs
    input_versions: list[int] = dataclasses.field(default_factory=list)
    ext: list[torch.Tensor] = dataclasses.field(default_factory=list)
    state: _ForwardState | None = None
    replay: Replay | None = None  # the argument and buffer state a recompute runs against
    packed: list[_Meta] = dataclasses.field(default_factory=list)  # what the forward saved, in order
    packed_values: list[torch.Tensor] | None = None  # debug mode: the forward's saved values
    recomputed: dict[int, torch.Tensor] | None = None
    stage: CallStage = CallStage.FORWARD
    params_done: bool = False  # the BlockParams node ran (its gradients went to the reducer)
    # A pipeline's micro-batch whose backward runs before another call of the same block in the same
    # backward: its gradients accumulate, that later call reduces the sum (one reduce-scatter per step).
    defer_reduce: bool = False
    # Under a zero-bubble schedule autograd runs through the call twice: the inputs' gradients (B), then,
    # later, the weights' from the nodes B retained (W). The recompute's tensors serve both passes, and the
    # call ends when the schedule's W for it ran (``finish_split``), not at the end of B's backward.
    split: bool = False
    param_refs: int = 0  # saved tensors viewing the gathered storage that autograd has not asked for yet
    _storage: set[int] = dataclasses.field(default_factory=set)  # data pointers of the gathered buffers

    @property
    def checkpoint(self) -> bool:
        return self.group.spec.checkpoint

    # ---- forward ---------------------------------------------------------------------------------------
    def forward(self, args: tuple, kwargs: dict, tensors: list[torch.Tensor]) -> Any:
        """Run the block in the caller's graph (gathered storage held by the caller)."""
        engine = self.engine
        assert self.inputs is not None
        if self.checkpoint:
            self.ext = [locs[0][0]._parameters[locs[0][1]] for locs in self.ext_locations]
            self.state = _ForwardState(engine.cuda_devices(tensors))
            self.saved_inputs = list(tensors)
            self.input_versions = [tensor_version(t) for t in tensors]
            self.replay = Replay(self.group.name, self.module, self.inputs.leaves,
                                 engine.replay_memory(self.group), watch=not is_compiled_callable(self.forward_fn))
            if engine.debug:
                self.packed_values = []
        params = self._param_nodes()
        self._storage = {f.untyped_storage().data_ptr() for f in self.group.wait_gathered()}
        watching = self.replay.watching() if self.replay is not None else nullcontext()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack), \
                self.group.installed(params), engine.inside_block(), watching:
            out = self.forward_fn(self.module, *args, **kwargs)
        if self.replay is not None:
            self.replay.after_forward()
        else:
            self.inputs = None  # no recompute will rebuild the arguments
        return out

    def _param_nodes(self) -> list[list[torch.Tensor]]:
        """The gathered parameters to install: outputs of one ``BlockParams`` node when any needs grad."""
        views = self.group.slot_views()
        shards = [p for b in self.group.buffers for p in b.params if p.requires_grad and b.spec.requires_grad]
        if not shards:
            self.params_done = True  # no parameter gradient to wait for
            return [[v.detach() for v in per] for per in views]
        flat = iter(BlockParams.apply(self, *shards))
        return [[next(flat) for _ in per] for per in views]

    def _aliases_params(self, t: torch.Tensor) -> bool:
        try:
            return t.untyped_storage().data_ptr() in self._storage
        except RuntimeError:  # a tensor without storage (sparse, nested): never a parameter view
            return False

    def _pack(self, t: torch.Tensor) -> Any:
        if not self.checkpoint:
            if self._aliases_params(t):
                self.param_refs += 1
                return (t, True)
            return (t, False)
        self.packed.append(_meta(t))
        if self.packed_values is not None:
            self.packed_values.append(t.detach().clone())
        return len(self.packed) - 1

    def _unpack(self, handle: Any) -> torch.Tensor:
        if not self.checkpoint:
            t, aliases = handle
            if aliases:
                if self.stage is CallStage.RELEASED:
                    raise _second_backward(self.group.name)
                self._ensure_gathered()
                if not self.split:
                    self.param_refs -= 1
                    self.try_release()
            return t
        if self.recomputed is None:
            self._ensure_gathered()
            self._recompute()
        assert self.recomputed is not None
        if handle not in self.recomputed:
            raise _second_backward(self.group.name)
        if self.split:
            return self.recomputed[handle]  # W may unpack it again; finish_split drops them all
        t = self.recomputed.pop(handle)
        if self._aliases_params(t):
            self.param_refs -= 1
            self.try_release()
        return t

    # ---- backward --------------------------------------------------------------------------------------
    def _ensure_gathered(self) -> None:
        if self.stage is not CallStage.GATHERED:
            self.engine.acquire_for_backward(self)
            self.stage = CallStage.GATHERED
            self._storage = {f.untyped_storage().data_ptr() for f in self.group.wait_gathered()}

    def _recompute(self) -> None:
        """Run the block again on the forward's state; keep what it saves, in order."""
        assert self.saved_inputs is not None and self.state is not None and self.replay is not None
        assert self.inputs is not None
        changed = [i for i, (t, v) in enumerate(zip(self.saved_inputs, self.input_versions, strict=True))
                   if tensor_version(t) != v]
        if changed:
            raise RecomputeError(f"block {self.group.name!r}: its input tensor {changed[0]} was modified in place "
                                 "after the block's forward, so its recompute cannot see what the forward saw. "
                                 "Clone it before the in-place change, or turn checkpointing off for this block.")
        leaves = [_leaf(t, t.requires_grad) for t in self.saved_inputs]
        params = [[_leaf(v, p.requires_grad and b.spec.requires_grad) for v, p in zip(views, b.params, strict=True)]
                  for b, views in zip(self.group.buffers, self.group.slot_views(), strict=True)]
        ext = [_leaf(t, t.requires_grad) for t in self.ext]
        hidden = [_leaf(t, True) for t in self.replay.hidden()]
        replayed = self.replay.leaves(self.inputs.leaves, hidden)
        args, kwargs = self.inputs.rebuild(leaves, replayed)
        saved: list[torch.Tensor] = []

        def keep(t: torch.Tensor) -> int:
            saved.append(t.detach())  # the recompute's own graph is never differentiated: let it go
            return len(saved) - 1

        with self.state.restored(), self.replay.buffers_swapped(), \
                torch.autograd.graph.saved_tensors_hooks(keep, lambda i: saved[i]), \
                self.group.installed(params), installed(_ext_entries(self.ext_locations, ext)), \
                self.engine.inside_block(recompute=True):
            self.forward_fn(self.module, *args, **kwargs)
        self._check_recompute(saved)
        self.recomputed = dict(enumerate(saved))
        self.param_refs = sum(1 for t in saved if self._aliases_params(t))
        self._forget_forward()

    def _forget_forward(self) -> None:
        """Drop what only a recompute needs. The call lives as long as any tensor its forward made (its
        ``BlockParams`` node reaches it), so what it keeps must not reach those tensors back: a transformers
        cache among its arguments holds keys and values whose graph leads here, a cycle through autograd's
        C++ nodes that the garbage collector cannot see, and every step would leak the whole cache."""
        self.saved_inputs, self.state, self.replay, self.packed_values, self.inputs = None, None, None, None, None
        self.ext = []

    def _check_recompute(self, saved: list[torch.Tensor]) -> None:
        """The recompute must save what the forward saved: count, shapes and dtypes always, values in debug mode."""
        got = [_meta(t) for t in saved]
        if got != self.packed:
            raise RecomputeError(
                f"block {self.group.name!r}: its recompute in backward saved {_summary(got)} for autograd, but its "
                f"forward saved {_summary(self.packed)}. The block depends on state that changed between forward "
                "and backward; turn checkpointing off for it (BMTrainModelWrapper(model, checkpoint=False) or the "
                "plan's checkpoint flag).")
        for i, (a, b) in enumerate(zip(self.packed_values or [], saved, strict=False)):
            if a.is_floating_point() and not torch.allclose(a, b.detach(), rtol=1e-5, atol=1e-6, equal_nan=True):
                diff = float((a.double() - b.detach().double()).abs().max())
                raise RecomputeError(
                    f"block {self.group.name!r}: saved tensor {i} of its recompute differs from its forward's "
                    f"(max abs difference {diff:.3g}; checked because BMT_WRAP_DEBUG=1). The block depends on "
                    "state that changed between forward and backward; turn checkpointing off for it.")

    def parameters_differentiated(self, grads: list[list[torch.Tensor | None]]) -> None:
        """The ``BlockParams`` node ran: release the storage (unless a saved tensor still views it), reduce."""
        self.params_done = True
        self.try_release()
        self.engine.reduce_group_grads(self.group, grads, defer=self.defer_reduce)

    def finish_split(self) -> None:
        """A zero-bubble schedule's W for this call ran (or never will): drop the recompute's tensors, give
        the storage back."""
        self.split = False
        self.try_release(end_of_backward=True)

    def try_release(self, end_of_backward: bool = False) -> bool:
        """Give the storage back once nothing autograd may still read views it; True when released."""
        if self.split:
            return False  # W still reads it: finish_split ends the call
        if self.stage is not CallStage.GATHERED or (not end_of_backward and (self.param_refs > 0 or not self.params_done)):
            # A saved tensor still views the gathered storage, or the parameters' gradients are not all in.
            return False
        self.stage = CallStage.RELEASED
        if end_of_backward:
            self.recomputed = {}  # saved tensors autograd never asked for
            self._forget_forward()
        self.engine.release_after_use(self.group)
        return True


class BlockParams(torch.autograd.Function):
    """The gathered parameters of one block call; backward hands their gradients to the reducer."""

    @staticmethod
    def forward(ctx: Any, call: BlockCall, *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        ctx.call = call
        ctx.set_materialize_grads(False)  # a parameter nothing differentiated keeps .grad None
        views = call.group.slot_views()
        flat = [v for per in views for v in per]
        frozen = [v for b, per in zip(call.group.buffers, views, strict=True)
                  for v, p in zip(per, b.params, strict=True) if not (p.requires_grad and b.spec.requires_grad)]
        ctx.mark_non_differentiable(*frozen)
        return tuple(flat)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        call: BlockCall = ctx.call
        it = iter(grads)
        per_slot = [[next(it) for _ in b.params] for b in call.group.buffers]
        call.parameters_differentiated(per_slot)
        n_shards = sum(1 for b in call.group.buffers for p in b.params if p.requires_grad and b.spec.requires_grad)
        return (None, *([None] * n_shards))


def _ext_entries(locations: list[list[Location]],
                 tensors: list[torch.Tensor]) -> list[tuple[nn.Module, str, torch.Tensor]]:
    """The root-owned tensors a recompute installs, at every location each one is used in the block."""
    return [(m, a, t) for locs, t in zip(locations, tensors, strict=True) for m, a in locs]


def _second_backward(block: str) -> WrapError:
    return WrapError(f"backward ran twice through one call of block {block!r} (retain_graph=True): a sharded "
                     "block frees what its backward needs after the first one. Run the forward again for a "
                     "second backward.")


def _summary(meta: list[_Meta]) -> str:
    shapes = ", ".join(f"{tuple(s)} {str(d).removeprefix('torch.')}" for s, d, _ in meta[:6])
    return f"{len(meta)} tensor(s) [{shapes}{', ...' if len(meta) > 6 else ''}]"
