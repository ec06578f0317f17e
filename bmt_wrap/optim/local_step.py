"""torch's elementwise optimizers step on plain local ranges: no per-op dispatch of sharded tensors.

SGD, Adam, AdamW and the other optimizers below compute each element from the same element of the
parameter, its gradient and its state, so on a sharded parameter their step is exactly the step on this
rank's range. Before such a step (the optimizer's own step hooks, ``install_fast_paths``) every sharded parameter in the
param groups is replaced by its *twin*, a plain 1-D tensor viewing the same range, with its gradient's
range as ``.grad`` and its state's ranges as state; after the step the parameters, and their state
as ``ShardedTensor``s again, are put back. The step then pays no ``__torch_dispatch__`` (1.3-1.5x on
benchmarks/param_ops.py before). Optimizers not listed, subclasses (their step may do anything) and steps
with a closure (it writes the sharded ``.grad``s) keep the per-op path.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..runtime.sharded_tensor import ShardedTensor
from .adafactor import sharded_adafactor_step
from .muon import sharded_muon_step

_ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, torch.optim.Adamax,
                torch.optim.NAdam, torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adadelta,
                torch.optim.ASGD, torch.optim.Rprop)
# Whole-matrix optimizers: their own sharded step replaces torch's (exact types: a subclass may differ).
_WHOLE_MATRIX = {torch.optim.Muon: sharded_muon_step, torch.optim.Adafactor: sharded_adafactor_step}
_SWAP = "_bmt_local_step"
_TWIN = "_bmt_twin"
_HIDDEN = "_bmt_hidden_grads"
_ATTACHED = "_bmt_fast_paths"
_HOOKS: list[Any] = []


def install_fast_paths() -> None:
    """Once per process: each optimizer, at its first step, gets this module's step hooks as its own.
    torch runs an optimizer's own pre-hooks after every global one and its own post-hooks before them,
    so the other hooks (state-dict, ``no_sync`` and GradScaler checks) see the sharded parameters."""
    if not _HOOKS:
        _HOOKS.append(register_optimizer_step_pre_hook(_attach))


def _attach(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if not optimizer.__dict__.get(_ATTACHED):
        optimizer.__dict__[_ATTACHED] = True
        optimizer.register_step_pre_hook(_before_step)
        optimizer.register_step_post_hook(_after_step)


def _before_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    if not take_whole_matrix_step(optimizer, args, kwargs):
        enter_local_step(optimizer, args, kwargs)


def _after_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    leave_local_step(optimizer)
    for p, g in optimizer.__dict__.pop(_HIDDEN, []):
        p.grad = g


def take_whole_matrix_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> bool:
    """Before a ``torch.optim.Muon``/``Adafactor`` step over sharded parameters: run the sharded step now
    and hide the gradients from torch's own step (given back after it); whether it did. A step with a
    closure makes its gradients inside, so it keeps torch's step (which materialises each matrix)."""
    step = _WHOLE_MATRIX.get(type(optimizer))
    if step is None or _closure(args, kwargs) is not None:
        return False
    if not any(isinstance(p, ShardedTensor) for g in optimizer.param_groups for p in g["params"]):
        return False
    step(optimizer)
    hidden = [(p, p.grad) for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    for p, _ in hidden:
        p.grad = None
    optimizer.__dict__[_HIDDEN] = hidden
    return True


def enter_local_step(optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
    """Swap twins in for the sharded parameters of an elementwise optimizer's step (args[0] is the optimizer)."""
    leave_local_step(optimizer)  # a step that raised left its twins in place
    if type(optimizer) not in _ELEMENTWISE or _closure(args, kwargs) is not None:
        return
    saved: list[tuple[dict, list]] = []
    pairs: list[tuple[ShardedTensor, torch.Tensor, list[tuple[str, ShardedTensor]]]] = []
    state = optimizer.state
    for group in optimizer.param_groups:
        params = group["params"]
        swapped = _twins(optimizer, params)
        if swapped is None:
            continue
        for p, twin in zip(params, swapped, strict=True):
            if twin is p:
                continue
            grad = p.grad
            twin.grad = None if grad is None else grad.to_local()
            kept = state.pop(p, None)
            sharded: list[tuple[str, ShardedTensor]] = []
            if kept:  # the same dict, its sharded values as their ranges
                for k, v in kept.items():
                    if isinstance(v, ShardedTensor):
                        sharded.append((k, v))
                        kept[k] = v.to_local()
                state[twin] = kept
            pairs.append((p, twin, sharded))
        saved.append((group, params))
        group["params"] = swapped
    if saved:
        optimizer.__dict__[_SWAP] = (saved, pairs)


def leave_local_step(optimizer: torch.optim.Optimizer) -> None:
    """Put the sharded parameters back, their state as ``ShardedTensor``s (the same objects when the step
    updated them in place, as these optimizers do after their first step)."""
    swap = optimizer.__dict__.pop(_SWAP, None)
    if swap is None:
        return
    saved, pairs = swap
    for group, params in saved:
        group["params"] = params
    state = optimizer.state
    for p, twin, sharded in pairs:
        twin.grad = None
        kept = state.pop(twin, None)
        if kept is None:
            continue
        for k, v in sharded:
            if kept.get(k) is v.to_local():
                kept[k] = v
        layout = p.shard_layout
        n = layout.end - layout.start
        for k, v in kept.items():  # state the step made (its first): sharded like the parameter
            if type(v) is torch.Tensor and v.dim() == 1 and v.numel() == n:
                kept[k] = ShardedTensor.wrap(v, layout)
        state[p] = kept


def _closure(args: tuple, kwargs: dict) -> Any:
    """The closure a step was given (a step hook's ``args[0]`` is the optimizer)."""
    return args[1] if len(args) > 1 else kwargs.get("closure")


def _twins(optimizer: torch.optim.Optimizer, params: list) -> list | None:
    """``params`` with each sharded parameter replaced by its twin (cached while the list is the same), or
    None when none is sharded."""
    cache = optimizer.__dict__.setdefault(_TWIN, {})
    key = tuple(map(id, params))
    hit = cache.get(id(params))
    if hit is not None and hit[0] == key and all(t is p or t is _twin(p) for p, t in zip(params, hit[1], strict=True)):
        return hit[1]
    if not any(isinstance(p, ShardedTensor) for p in params):
        return None
    swapped = [_twin(p) if isinstance(p, ShardedTensor) else p for p in params]
    cache[id(params)] = (key, swapped)
    return swapped


def _twin(p: ShardedTensor) -> torch.Tensor:
    """The plain 1-D view of ``p``'s range the step updates (made once per parameter and storage)."""
    local = p.to_local()
    cached = p.__dict__.get(_TWIN)
    if cached is not None and cached[0] is local:
        return cached[1]
    twin = local.detach()
    p.__dict__[_TWIN] = (local, twin)
    return twin
