"""What ``optimizer.state_dict()`` holds for sharded parameters, so each tool that saves it gets it right.

An optimizer over ``model.parameters()`` keeps, for each sharded parameter, state tensors shaped like
this rank's slice. Saved under the same key on every rank, such tensors look replicated to
``torch.distributed.checkpoint`` (DCP), which would keep one rank's and silently mix ranks. So every
optimizer over sharded parameters gets two hooks (on its first step, or at construction for ours):

- ``state_dict()`` returns those tensors as ``LocalShard``s: DCP saves each rank's elements and
  reshards on load; ``torch.save`` per rank still writes plain tensors. Inside DCP's
  ``get_state_dict(..., options=StateDictOptions(full_state_dict=True))`` they are gathered whole instead
  (one all-gather per dtype), because DCP's own gather knows only DTensors.
- ``load_state_dict()`` accepts, per state tensor, this rank's slice, a ``LocalShard`` of the same
  range, or the full tensor (of which it keeps this rank's range).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from itertools import chain
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..base._compat import dcp_state_dict_request
from ..errors import CheckpointError
from ..job import tp_values
from ..job.distributed import current_state, parallel_layout
from ..job.tp_values import expert_split, whole_shape, whole_value
from ..runtime.param import DistributedParameter
from ..runtime.sharded_tensor import ShardedTensor, local_view
from ..runtime.tp_marks import tp_split_dim, tp_split_parts
from .local_shard import LocalShard
from .reshard import Piece

_CHECKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_HOOKED: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_GLOBAL_HOOK: list[Any] = []


def install_step_hook() -> None:
    """Once per process: any optimizer over sharded parameters gets the state hooks at its first step."""
    if not _GLOBAL_HOOK:
        _GLOBAL_HOOK.append(register_optimizer_step_pre_hook(_on_step))


def _on_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _CHECKED:
        return
    _CHECKED.add(optimizer)
    if any(isinstance(p, DistributedParameter) for p in _params(optimizer)):
        attach_state_hooks(optimizer)


def attach_state_hooks(optimizer: torch.optim.Optimizer) -> None:
    """Give ``optimizer`` the state-dict hooks described in the module docstring (idempotent)."""
    if optimizer in _HOOKED:
        return
    _HOOKED.add(optimizer)
    optimizer.register_state_dict_post_hook(_state_dict_post_hook)
    optimizer.register_load_state_dict_pre_hook(_load_state_dict_pre_hook)


def _params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    return chain.from_iterable(g["params"] for g in optimizer.param_groups)


def is_state_slice(p: torch.Tensor, v: Any) -> bool:
    """``v`` is a state tensor laid out like sharded parameter ``p``: a ``ShardedTensor`` (torch's optimizers
    make their state with ``zeros_like(p)``) or this rank's 1-D range (``AdamOptimizer``'s fused state)."""
    if not isinstance(p, DistributedParameter) or not isinstance(v, torch.Tensor) or isinstance(v, LocalShard):
        return False
    return isinstance(v, ShardedTensor) or (v.dim() == 1 and v.numel() == p.to_local().numel())


def _state_dict_post_hook(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    params = list(_params(optimizer))
    request = dcp_state_dict_request()
    full = request is not None and bool(request.full_state_dict)
    to_cpu = request is not None and bool(request.cpu_offload)
    slices = [(pid, key, params[pid], v) for pid, st in state_dict["state"].items() for key, v in st.items()
              if isinstance(pid, int) and pid < len(params) and is_state_slice(params[pid], v)]
    # Torch hands out the optimizer's own per-parameter dicts: replace them, never write into them.
    state = {pid: dict(st) for pid, st in state_dict["state"].items()}
    values = None
    if full:  # whole: the dp ranks' ranges gathered, then (TP-split) the TP peers' slices, in one order everywhere
        gathered = gather_full([(p, v) for _, _, p, v in slices])
        values = [whole_value(p, x) for (_, _, p, _), x in zip(slices, gathered, strict=True)]
    for i, (pid, key, p, v) in enumerate(slices):
        if values is not None:
            state[pid][key] = values[i].to("cpu") if to_cpu else values[i]
        else:
            local = local_view(v)
            state[pid][key] = param_shard(p, local.to("cpu") if to_cpu else local)
    return {**state_dict, "state": state}


def _load_state_dict_pre_hook(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    return local_state_dict(optimizer, state_dict)


def local_state_dict(optimizer: torch.optim.Optimizer, state_dict: dict[str, Any]) -> dict[str, Any]:
    """``state_dict`` with every state tensor of a sharded parameter cut to this rank's slice."""
    saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
    owners = dict(zip(saved_ids, _params(optimizer), strict=False))
    state = {}
    for pid, st in state_dict["state"].items():
        p = owners.get(pid)
        if isinstance(p, DistributedParameter):
            st = {key: local_value(p, key, v) for key, v in st.items()}
        state[pid] = st
    return {**state_dict, "state": state}


def param_piece(p: DistributedParameter, start: int, end: int) -> Piece:
    """Where elements ``[start, end)`` of ``p``'s flattened value sit in the whole tensor: under tensor
    parallelism they index this TP rank's slice, under expert parallelism an expert parameter's value is
    this EP rank's experts (dim 0) of every EP rank's."""
    layout = parallel_layout()
    if expert_split(p):
        return Piece(start, end, 0, layout.ep_rank, layout.ep_size)
    dim = tp_split_dim(p)
    if dim is None:
        return Piece(start, end)
    return Piece(start, end, dim, layout.tp_rank, layout.tp_size, tp_split_parts(p))


def param_shard(p: DistributedParameter, local: torch.Tensor) -> LocalShard:
    """``local`` (this rank's range of ``p``, or of state laid out like it) as a ``LocalShard`` of the whole
    tensor: under tensor (expert) parallelism, of every TP slice (EP rank's experts) together, placed by
    this rank's."""
    start = p.source_range()[0]
    piece = param_piece(p, start, start + local.numel())
    if piece.tp_dim is None:
        return LocalShard.of(local, p.full_shape, start)
    full = tuple(whole_shape(p))
    return LocalShard.of(local, full, start, piece.region(full), piece.boxes(full) if piece.tp_parts > 1 else None)


def local_value(p: DistributedParameter, key: str, v: Any) -> Any:
    """One saved state value as ``p``'s optimizer keeps it: element-wise state as a ``ShardedTensor`` of
    ``p``'s layout (from this rank's range, a ``LocalShard`` of it, the full tensor, or under tensor (expert)
    parallelism the whole tensor a full state dict holds: every TP slice (EP rank's experts)); others as saved."""
    if not isinstance(v, torch.Tensor):
        return v
    whole = tuple(whole_shape(p))
    if whole != tuple(p.full_shape) and tuple(v.shape) == whole and not isinstance(v, (ShardedTensor, LocalShard)):
        v = tp_values.local_value(p, v)  # this TP rank's slice, this EP rank's experts: then its range below
    if isinstance(v, ShardedTensor):
        v = v.to_local()
    start, end = p.source_range()
    if isinstance(v, LocalShard):
        why = v.range_mismatch(param_shard(p, p.to_local()))
        if why:
            raise CheckpointError(f"optimizer state {key!r} of {p.fqn!r}: {why}")
        return ShardedTensor.wrap(v.local(), p.shard_layout)
    full = p.full_shape.numel()
    # The full tensor, or flattened (also this rank's range when it holds all of ``p``: the same elements).
    if v.numel() == full and tuple(v.shape) in (tuple(p.full_shape), (full,)):
        return ShardedTensor.wrap(v.reshape(-1)[start:end], p.shard_layout)
    if v.dim() == 1 and v.numel() == end - start:
        return ShardedTensor.wrap(v, p.shard_layout)
    return v


def gather_full(items: list[tuple[DistributedParameter, torch.Tensor]]) -> list[torch.Tensor]:
    """Whole tensors from every rank's slices (``(parameter, slice)`` pairs in the same order on every rank):
    one all-gather per dtype; a collective."""
    state = current_state()
    out: list[torch.Tensor | None] = [None] * len(items)
    # Slices partition each tensor over its buffer's ranks (the whole job, one row under HSDP, under TP the
    # dp group or, for parameters every TP peer holds whole, shard x tp): one all-gather per (ranks, dtype),
    # in first-seen order, the same on every rank.
    by_comm: dict[int, tuple[Any, dict[torch.dtype, list[int]]]] = {}
    for i, (p, v) in enumerate(items):
        comm = p.flat_buffer.comm if state is not None else None
        by_comm.setdefault(id(comm), (comm, {}))[1].setdefault(v.dtype, []).append(i)
    for comm, by_dtype in by_comm.values():
        _gather_full(items, comm, by_dtype, state, out)
    return [t for t in out if t is not None]


def _gather_full(items: list[tuple[DistributedParameter, torch.Tensor]], comm: Any,
                 by_dtype: dict[torch.dtype, list[int]], state: Any, out: list[torch.Tensor | None]) -> None:
    world = 1 if comm is None else comm.world_size
    for dtype in sorted(by_dtype, key=str):
        idx = by_dtype[dtype]
        ranges = [[items[i][0].source_range(r) for r in range(world)] for i in idx]
        per_rank = [sum(b - a for a, b in (rs[r] for rs in ranges)) for r in range(world)]
        width = max(per_rank + [1])
        device = items[idx[0]][1].device if state is None else state.device
        mine = torch.zeros(width, dtype=dtype, device=device)
        local = torch.cat([local_view(items[i][1]).reshape(-1).to(device) for i in idx])
        mine[:local.numel()] = local
        gathered = mine if world == 1 else torch.empty(width * world, dtype=dtype, device=device)
        if world > 1:
            comm.all_gather_into(gathered, mine, label="full optimizer state")
        cursor = [r * width for r in range(world)]
        for i, rs in zip(idx, ranges, strict=True):
            p = items[i][0]
            full = torch.empty(p.full_shape.numel(), dtype=dtype, device=device)
            for r, (a, b) in enumerate(rs):
                full[a:b] = gathered[cursor[r]:cursor[r] + b - a]
                cursor[r] += b - a
            out[i] = full.view(p.full_shape)
