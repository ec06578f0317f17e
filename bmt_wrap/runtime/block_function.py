"""The block executor: one autograd ``Function`` per block call.

Forward: wait for this block's gather, start the next block's, run the block (under ``no_grad`` when
checkpointed), release. Backward: gather (prefetching the blocks backward reaches next), recompute with
the forward's RNG and autocast state when checkpointed, take input and parameter gradients with one
``torch.autograd.grad``, and hand the parameter gradient to the reducer (async reduce-scatter).

A Function rather than module hooks: hooks do not fire on recompute with checkpointing's early stop,
and ``torch.utils.checkpoint`` re-fires gather hooks on recompute (DESIGN.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._pytree as pytree
from torch import nn

from ..errors import RecomputeError, WrapError
from .group import Location, ShardGroup
from .replay import Replay

if TYPE_CHECKING:
    from .engine import Engine


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
@dataclasses.dataclass(eq=False)
class BlockCall:
    """Everything one call of a block needs between its forward and its backward."""

    engine: Engine
    group: ShardGroup
    module: nn.Module
    forward_fn: Callable[..., Any]
    inputs: _Tree
    ext_locations: list[list[Location]]  # root-owned parameters used inside the block
    call_index: int = -1
    outputs: _Tree | None = None
    state: _ForwardState | None = None
    graph: tuple | None = None  # non-checkpointed: (input leaves, param leaves, ext leaves, outputs)
    input_needs_grad: list[bool] = dataclasses.field(default_factory=list)
    replay: Replay | None = None  # the argument and buffer state a recompute runs against
    n_outputs: int = 0  # the block's own output tensors; the escaped tensors follow them
    out_meta: list[tuple[torch.Size, torch.dtype]] = dataclasses.field(default_factory=list)
    out_values: list[torch.Tensor] | None = None  # debug mode: the forward's outputs, to compare values

    @property
    def checkpoint(self) -> bool:
        return self.group.spec.checkpoint

    def run(self, tensors: tuple[torch.Tensor, ...], param_tensors: list[list[torch.Tensor]],
            ext_tensors: list[torch.Tensor], leaves: list[Any] | None = None) -> Any:
        """Run the block with the given inputs, parameters and external parameters installed."""
        n_in = len(self.inputs.tensor_pos)
        args, kwargs = self.inputs.rebuild(list(tensors[:n_in]), leaves)
        with self.group.installed(param_tensors), _installed_ext(self.ext_locations, ext_tensors), \
                self.engine.inside_block():
            return self.forward_fn(self.module, *args, **kwargs)

    def forget(self) -> None:
        """Drop what only the backward needed."""
        self.graph, self.state, self.replay, self.out_values = None, None, None, None

    def param_leaves(self, requires_grad: bool) -> list[list[torch.Tensor]]:
        """Fresh leaves viewing the gathered parameters (trainable buffers require grad)."""
        return [[_leaf(v, requires_grad and b.spec.requires_grad) for v in views]
                for b, views in zip(self.group.buffers, self.group.slot_views(), strict=True)]


@contextmanager
def _installed_ext(locations: list[list[Location]], tensors: list[torch.Tensor]) -> Iterator[None]:
    saved = [[(m, a, m._parameters[a]) for m, a in locs] for locs in locations]
    for locs, t in zip(locations, tensors, strict=True):
        for m, a in locs:
            m._parameters[a] = t
    try:
        yield
    finally:
        for entries in saved:
            for m, a, old in entries:
                m._parameters[a] = old


class BlockFunction(torch.autograd.Function):
    """Autograd node of one block call; see the module docstring."""

    @staticmethod
    def forward(ctx: Any, call: BlockCall, anchor: torch.Tensor,  # type: ignore[override]
                *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        ctx.set_materialize_grads(False)  # outputs nothing differentiated give None: no zero gradients
        n_in, n_ext = len(call.inputs.tensor_pos), len(call.ext_locations)
        ext = list(tensors[n_in:n_in + n_ext])
        call.input_needs_grad = list(ctx.needs_input_grad[2:])
        engine, group = call.engine, call.group
        assert call.replay is not None
        engine.acquire_for_forward(group)
        try:
            if call.checkpoint:
                call.state = _ForwardState(engine.cuda_devices(tensors))
                out = call.run(tensors, group.slot_views(), ext)
                call.outputs = _Tree(out)
                flat = call.outputs.take_tensors() + call.replay.after_forward(call.inputs.leaves)
                ctx.save_for_backward(*tensors)
                call.out_meta = [(t.shape, t.dtype) for t in flat]
                if engine.debug:
                    call.out_values = [t.detach().clone() for t in flat]
            else:
                with torch.enable_grad():
                    leaves = [_leaf(t, need) for t, need in zip(tensors, call.input_needs_grad, strict=True)]
                    params = call.param_leaves(True)
                    with call.replay.hidden_swapped(call.inputs.leaves, leaves[n_in + n_ext:]):
                        out = call.run(tuple(leaves[:n_in]), params, leaves[n_in:n_in + n_ext])
                call.outputs = _Tree(out)
                kept = call.outputs.take_tensors() + call.replay.after_forward(call.inputs.leaves)
                call.graph = (leaves, params, kept)
                flat = [t.detach() for t in kept]
        finally:
            engine.release_after_use(group)
        call.n_outputs = len(flat) - len(call.replay.escaped)
        ctx.mark_non_differentiable(*[t for t in flat if not _differentiable(t)])
        return tuple(flat)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        call: BlockCall = ctx.call
        engine, group = call.engine, call.group
        engine.acquire_for_backward(call)
        released = False
        try:
            input_grads, param_grads, needs = _block_grads(ctx, call, grads)
            # The gathered parameters are done with before the gradient is flattened, so the pool can
            # hand their buffer to the gradient: one block's worth less at the backward peak.
            call.forget()  # the user may hold the loss (and this node) much longer
            engine.release_after_use(group)
            released = True
            engine.reduce_group_grads(group, param_grads)
        finally:
            if not released:
                call.forget()
                engine.release_after_use(group)
        return (None, None, *[next(input_grads) if need else None for need in needs])


def _block_grads(ctx: Any, call: BlockCall, grads: tuple[torch.Tensor | None, ...]
                 ) -> tuple[Iterator[torch.Tensor | None], list[list[torch.Tensor | None]], list[bool]]:
    """Input gradients (in order, for inputs that need one), per-slot parameter gradients, and which
    inputs need one; recomputes the block first when it is checkpointed."""
    if (call.state if call.checkpoint else call.graph) is None:
        raise WrapError(f"backward ran twice through one call of block {call.group.name!r} (retain_graph=True): "
                        "a sharded block frees what its backward needs after the first one. Run the "
                        "forward again for a second backward.")
    if call.checkpoint:
        leaves = [_leaf(t, need) for t, need in zip(ctx.saved_tensors, call.input_needs_grad, strict=True)]
        params = call.param_leaves(True)
        n_in, n_ext = len(call.inputs.tensor_pos), len(call.ext_locations)
        assert call.replay is not None
        replayed = call.replay.leaves(call.inputs.leaves, leaves[n_in + n_ext:])
        with call.state.restored(), call.replay.buffers_swapped():
            out = call.run(tuple(leaves[:n_in]), params, leaves[n_in:n_in + n_ext], replayed)
        tree = _Tree(out)
        outs = tree.take_tensors() + call.replay.escaped_from(replayed)
        _check_recompute(call, tree, outs)
    else:
        leaves, params, outs = call.graph
    pairs = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None and o.requires_grad]
    wrt_inputs = [t for t in leaves if t.requires_grad]
    wrt_params = [p for b in params for p in b if p.requires_grad]
    if pairs and (wrt_inputs or wrt_params):
        got = torch.autograd.grad([o for o, _ in pairs], wrt_inputs + wrt_params, [g for _, g in pairs],
                                  allow_unused=True)
    else:
        got = (None,) * (len(wrt_inputs) + len(wrt_params))
    param_grads = iter(got[len(wrt_inputs):])
    per_slot = [[next(param_grads) if p.requires_grad else None for p in b] for b in params]
    return iter(got[:len(wrt_inputs)]), per_slot, [t.requires_grad for t in leaves]


def _check_recompute(call: BlockCall, tree: _Tree, outs: list[torch.Tensor]) -> None:
    """The recompute must reproduce the forward: structure, shapes and dtypes always, values in debug mode."""
    assert call.outputs is not None
    got = [(t.shape, t.dtype) for t in outs]
    if tree.spec != call.outputs.spec or got != call.out_meta:
        raise RecomputeError(
            f"block {call.group.name!r}: its recompute in backward returned {_summary(tree.spec, got)}, but its "
            f"forward returned {_summary(call.outputs.spec, call.out_meta)}. The block's output depends on state "
            "that changed between forward and backward; turn checkpointing off for it "
            "(BMTrainModelWrapper(model, checkpoint=False) or the plan's checkpoint flag).")
    if call.out_values is not None:
        for i, (a, b) in enumerate(zip(call.out_values, outs, strict=True)):
            if not torch.allclose(a, b.detach(), rtol=1e-5, atol=1e-6, equal_nan=True):
                diff = float((a.double() - b.detach().double()).abs().max()) if a.is_floating_point() else float("nan")
                raise RecomputeError(
                    f"block {call.group.name!r}: output tensor {i} of its recompute differs from its forward's "
                    f"(max abs difference {diff:.3g}; checked because BMT_WRAP_DEBUG=1). The block depends on "
                    "state that changed between forward and backward; turn checkpointing off for it.")


def _summary(spec: pytree.TreeSpec, meta: list[tuple[torch.Size, torch.dtype]]) -> str:
    shapes = ", ".join(f"{tuple(s)} {str(d).removeprefix('torch.')}" for s, d in meta[:6])
    return f"{len(meta)} tensor(s) [{shapes}{', ...' if len(meta) > 6 else ''}] in a {spec.type.__name__ if spec.type else 'leaf'}"
