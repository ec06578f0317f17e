"""Optimizers built before wrapping: moved onto the sharded parameters at their next step.

DDP leaves parameters as they are, so `opt = SGD(model.parameters()); model = DDP(model)` is a common
habit. Wrapping replaces every parameter, so such an optimizer would update the originals, which no
forward reads any more: training nothing, in silence. Each replaced original remembers its sharded
successor (``runtime.param.replaced_by``); before any optimizer step, a global step pre-hook swaps
successors into the param groups and carries existing state over (this rank's range of each tensor
shaped like the parameter), as accelerate and composer re-key optimizers. The originals, with their
full storage, are then free once nothing else holds them. The same hook gives state loaded as plain
tensors before an optimizer's first step the parameter's layout (``lay_out_state``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from ..base.log import get_logger
from ..runtime.param import DistributedParameter, replaced_by
from ..runtime.sharded_tensor import ShardedTensor
from ..save_load.optim_shards import local_value

_HOOK: list[Any] = []
_STEPPED = "_bmt_stepped"


def install_rebind_hook() -> None:
    """Once per process: every optimizer step first moves the optimizer off replaced parameters."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_rebind_hook))
        _HOOK.append(register_optimizer_step_post_hook(_mark_stepped))


def _rebind_hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    rebind(optimizer)
    # AdamOptimizer keeps its own local views; after a first step optim_shards' load hooks lay state out.
    if getattr(optimizer, "_init_state", None) is None and not optimizer.__dict__.get(_STEPPED):
        lay_out_state(optimizer)


def _mark_stepped(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    optimizer.__dict__[_STEPPED] = True


def lay_out_state(optimizer: torch.optim.Optimizer) -> None:
    """Give state a ``load_state_dict`` put in as plain tensors (this rank's range, as per-rank
    ``torch.save`` writes it, or the full tensor) its sharded parameter's layout, so the step's elementwise
    ops see one layout. Optimizers that stepped once have hooks that do this at load; this covers one
    loaded before its first step."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if not isinstance(p, DistributedParameter):
                continue
            state = optimizer.state.get(p)
            if not state:
                continue
            for key, v in state.items():
                if isinstance(v, torch.Tensor) and not isinstance(v, ShardedTensor) and v.dim() > 0:
                    state[key] = local_value(p, key, v)


def rebind(optimizer: torch.optim.Optimizer) -> int:
    """Point ``optimizer`` at the sharded successors of any parameters wrapping replaced; returns how many."""
    moved: dict[int, tuple[torch.Tensor, DistributedParameter]] = {}
    for group in optimizer.param_groups:
        params = group["params"]
        successors = [None if isinstance(p, ShardedTensor) else replaced_by(p) for p in params]
        if any(s is not None for s in successors):
            for p, s in zip(params, successors, strict=True):
                if s is not None:
                    moved[id(p)] = (p, s)
            group["params"] = [p if s is None else s for p, s in zip(params, successors, strict=True)]
    # An optimizer keeping its state elsewhere (AdamDiskOptimizer's file) reads it in to carry it over.
    stepped = any(optimizer.state.get(old) for old, _ in moved.values())
    full = optimizer.full_state() if stepped and hasattr(optimizer, "full_state") else optimizer.state
    for old, new in moved.values():
        state = full.get(old)
        optimizer.state.pop(old, None)
        if state:
            _carry_state(optimizer, old, new, state)
    if moved:
        get_logger().info("%s was built before wrapping: moved it onto %d sharded parameters",
                          type(optimizer).__name__, len(moved))
    return len(moved)


@torch.no_grad()
def _carry_state(optimizer: torch.optim.Optimizer, old: torch.Tensor, new: DistributedParameter,
                 state: dict[str, Any]) -> None:
    layout = new.shard_layout
    carried = {k: ShardedTensor.wrap(layout.local_of_full(v).clone(), layout)
               if isinstance(v, torch.Tensor) and v.shape == old.shape and v.dim() > 0 else v
               for k, v in state.items()}
    init_state = getattr(optimizer, "_init_state", None)  # AdamOptimizer keeps fused local views
    if init_state is not None:
        init_state(new, optimizer.state[new], carried)
    else:
        optimizer.state[new] = carried
