"""Apply a plan's sequence-parallel section in place (``passes/sequence_parallel.py`` proves where): hooks
that cut a block's hidden states to this TP rank's part of the sequence, gather a unit's input whole, and
gather the head's; row Linears reduce-scatter and the column Linears in units skip their copy (their
split forwards in ``tensor_parallel.py`` read ``_bmt_tp.sequence``); dropouts on parts draw the whole
sequence's mask; parameters used on parts are marked so their gradients are summed over the TP group.

A forward runs sequence-parallel when gradients are on (training) or its sequence length divides by T;
a no-grad call whose length does not (``generate``'s one-token steps) runs as plain TP, the same function.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..base._compat import pytree
from ..base.tp_plan import SequenceParallel
from ..errors import TensorParallelError, TPShapeError
from ..runtime.comm import Communicator
from ..runtime.tp_marks import mark_sequence_part
from ..runtime.tp_ops import gather_from_tp, gather_sum_grads, scatter_to_tp
from .compiled import never_traced


class SequenceState:
    """The TP group, the sequence dimension, and whether the forward under way runs on sequence parts."""

    def __init__(self, comm: Communicator, dim: int) -> None:
        self.comm, self.dim, self.active = comm, dim, True
        self.skip: set[tuple[str, str]] = set()  # (block, "enter"/"leave") points the first forward chained
        self.chained: set[str] = set()  # blocks whose output stays cut

    def __deepcopy__(self, memo: dict[int, Any]) -> SequenceState:
        return self  # a communicator is not copied with the module (meta skeletons, reference copies)


def apply_sequence_parallel(model: nn.Module, sp: SequenceParallel, comm: Communicator) -> None:
    """Install ``sp`` on ``model`` (already split by ``apply_tensor_parallel`` over ``comm``)."""
    state = SequenceState(comm, sp.dim)
    model._bmt_sequence = state
    modules = dict(model.named_modules())
    for point in sp.points:
        module = modules[point.module]
        if point.kind in ("column", "gather", "head", "row"):
            module._bmt_tp.sequence = state
        if point.kind in ("unit", "unit_whole", "gather", "head", "head_whole"):
            where = point.arg if point.kind.startswith("unit") else 0
            whole = point.kind in ("unit_whole", "head_whole")  # consumers hold whole gradients
            _hook_input(module, where, state, gather_from_tp if whole else gather_sum_grads)
        elif point.kind == "enter":
            _hook_input(module, 0, state, _cut(point.module, state), skip=(point.module, "enter"))
        elif point.kind == "leave":
            module.register_forward_hook(never_traced(
                lambda m, a, out, key=(point.module, "leave"): _gather_first(out, state, key)))
    for name in sp.dropouts:
        modules[name]._bmt_sequence = state
        modules[name].forward = _dropout_on_part.__get__(modules[name])
    params = dict(model.named_parameters(remove_duplicate=False))  # a tied alias is named too
    for name in sp.partial:
        mark_sequence_part(params[name])
    model.register_forward_pre_hook(never_traced(_decide(state)), with_kwargs=True)
    # Blocks chained by the root's graph hand on cut outputs: one reaching the caller means the root kept a
    # block's output in a way that graph did not show (a branch taken only now, e.g. every layer's states).
    blocks = {p.block for p in sp.points if p.block is not None}
    state.chained = blocks - {p.module for p in sp.points if p.kind == "leave"}
    for block in sorted(blocks):
        modules[block].register_forward_hook(never_traced(lambda m, a, out, b=block: _mark_cut(out, state, b)))
    model.register_forward_hook(never_traced(lambda m, a, out: _refuse_cut(m, out, state)))


def adopt_sequence_chain(model: nn.Module, sp: SequenceParallel | None) -> None:
    """Follow ``sp``'s chain (the first forward's, ``passes.chain_from_capture``): a block cut point or
    gather point it no longer lists is skipped from now on."""
    state: SequenceState | None = getattr(model, "_bmt_sequence", None)
    if state is None or sp is None:
        return
    kept = {(p.module, p.kind) for p in sp.points if p.kind in ("enter", "leave")}
    blocks = {p.block for p in sp.points if p.block is not None}
    state.skip = {(b, k) for b in blocks for k in ("enter", "leave")} - kept
    state.chained = {b for b in blocks if (b, "leave") not in kept}


def _decide(state: SequenceState) -> Any:
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        if torch.is_grad_enabled():
            state.active = True  # a length that does not divide is then an error where the block cuts it
            return
        tokens = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > state.dim]
        state.active = not tokens or tokens[0].shape[state.dim] % state.comm.world_size == 0
    return hook


def _hook_input(module: nn.Module, where: int | str | None, state: SequenceState, op: Any,
                skip: tuple[str, str] | None = None) -> None:
    """Replace argument ``where`` (a position or keyword) of ``module``'s calls by ``op(it, comm, dim)``
    (not while ``skip`` is in ``state.skip``)."""
    def hook(m: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        if not state.active or skip in state.skip:
            return None
        if isinstance(where, str) and where in kwargs:
            return args, {**kwargs, where: op(kwargs[where], state.comm, state.dim)}
        if isinstance(where, int) and where < len(args):
            return (*args[:where], op(args[where], state.comm, state.dim), *args[where + 1:]), kwargs
        raise TPShapeError(f"sequence parallelism: {type(m).__name__} was called without its hidden states "
                           f"argument {where!r} the plan found; wrap with sequence_parallel=False")
    module.register_forward_pre_hook(never_traced(hook), with_kwargs=True)


def _cut(block: str, state: SequenceState) -> Any:
    def cut(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
        if x.dim() <= dim or x.shape[dim] % comm.world_size:
            raise TPShapeError(
                f"sequence_parallel=True: {block}'s hidden states {tuple(x.shape)} cannot be cut into "
                f"{comm.world_size} equal parts along dimension {dim} (the sequence); pad the sequence to a "
                f"multiple of tp_size={comm.world_size} (e.g. tokenizer(..., pad_to_multiple_of="
                f"{comm.world_size})), or wrap with sequence_parallel=False")
        return scatter_to_tp(x, comm, dim)
    return cut


def _gather_first(out: Any, state: SequenceState, key: tuple[str, str]) -> Any:
    if not state.active or key in state.skip:
        return None
    if isinstance(out, torch.Tensor):
        return gather_from_tp(out, state.comm, state.dim)
    return (gather_from_tp(out[0], state.comm, state.dim), *out[1:])


_CUT = "_bmt_sequence_part"


def _mark_cut(out: Any, state: SequenceState, block: str) -> None:
    if state.active and block in state.chained:
        setattr(out if isinstance(out, torch.Tensor) else out[0], _CUT, True)


def _refuse_cut(model: nn.Module, out: Any, state: SequenceState) -> None:
    if state.active and any(getattr(t, _CUT, False) for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)):
        raise TensorParallelError(
            f"sequence_parallel=True: {type(model).__name__} returned a block's output cut along the sequence "
            "(its forward kept a block's output, e.g. every layer's hidden states when asked for them): the "
            "blocks were chained from the root's graph (fx at wrap time, or the first forward's export), which "
            "did not show that use. Wrap with "
            "sequence_parallel=False for such calls")


def _dropout_on_part(self: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    """``nn.Dropout`` on this rank's part of the sequence, with the mask one process draws for the whole
    sequence (the same stream: bit-equal on CPU, where torch draws ``bernoulli_`` over the whole tensor)."""
    state: SequenceState = self._bmt_sequence
    if not (state.active and self.training) or self.p == 0:
        return F.dropout(x, self.p, self.training, self.inplace)
    n, t = x.shape[state.dim], state.comm.world_size
    shape = list(x.shape)
    shape[state.dim] = n * t
    if self.p == 1:
        return x * torch.zeros_like(x)
    noise = torch.empty(shape, dtype=x.dtype, device=x.device).bernoulli_(1 - self.p).div_(1 - self.p)
    return x * noise.narrow(state.dim, state.comm.rank * n, n).clone()
