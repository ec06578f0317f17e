"""What every module with sharded parameters does differently from plain torch, and nothing else:

- ``state_dict()`` is a collective returning full CPU tensors under the original names (one group
  gathered at a time), and ``load_state_dict`` takes full tensors and keeps this rank's slices. Inside
  ``torch.distributed.checkpoint``'s ``get_state_dict`` (sharded, its default) each sharded parameter is
  instead this rank's ``LocalShard`` (no communication), which DCP saves and loads at any world size;
- ``.to()/.half()/.cuda()`` that would change a sharded parameter raise ``WrapError`` (cast before
  wrapping, or use ``mixed_precision=``).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from ..base._compat import dcp_state_dict_request, register_state_dict_hooks
from ..errors import WrapError
from ..job.tp_values import every_ep_rank, list_expert_names, local_value, whole_shape, whole_value
from ..optim.local_step import install_fast_paths
from ..optim.rebind import install_rebind_hook
from ..runtime.active_engine import get_engine
from ..runtime.group import ShardGroup
from ..runtime.param import DistributedParameter
from ..save_load.local_shard import LocalShard
from ..save_load.optim_shards import install_step_hook, param_shard
from .grad_sync import discard_unsynced, no_sync


class _StateDictScope:
    """What the ``state_dict()`` being written asks for, and the one flat buffer gathered for it (buffers
    are visited in order, so one at a time suffices; per buffer, not per group: under pipeline parallelism
    a stage's groups hold other buffers than the ghosts other stages hold of them)."""

    depth = 0
    sharded = False  # DCP's sharded state dict: this rank's elements only, nothing gathered
    to_cpu = False
    rank0_only = False  # full values are copied out on rank 0 only (the others just join the gathers)
    buffer: Any = None
    values: dict[int, torch.Tensor] | None = None

    @classmethod
    def enter(cls, rank0_only: bool = False) -> None:
        if cls.depth == 0:
            request = dcp_state_dict_request()
            cls.sharded = request is not None and not request.full_state_dict
            cls.to_cpu = request is not None and bool(request.cpu_offload)
            cls.rank0_only = rank0_only and get_engine().rank != 0
        cls.depth += 1

    @classmethod
    def exit(cls) -> None:
        cls.depth -= 1
        if cls.depth == 0:
            cls.buffer, cls.values, cls.sharded, cls.to_cpu, cls.rank0_only = None, None, False, False, False

    @classmethod
    def value(cls, p: DistributedParameter) -> torch.Tensor:
        """What the state dict holds for ``p``: its full value on CPU, or this rank's ``LocalShard`` of it."""
        if cls.sharded:
            local = p.to_local().detach()
            local = local.to("cpu") if cls.to_cpu else local
            return param_shard(p, local)
        return cls.out(p, cls.whole(p))

    @classmethod
    def whole(cls, p: DistributedParameter) -> torch.Tensor:
        """``p``'s whole value, on every rank (a collective over its buffer's ranks, and its TP peers')."""
        buffer = p.flat_buffer
        if cls.buffer is not buffer:
            cls.buffer, cls.values = None, None  # the previous buffer's values go before the next gather
            full = buffer.group.gather_values(only=buffer)[0]
            cls.buffer, cls.values = buffer, {id(q): v for q, v in zip(buffer.params, buffer.slot_views(full),
                                                                          strict=True)}
        assert cls.values is not None
        return whole_value(p, cls.values[id(p)])  # TP-split: joined with its TP peers' slices (a collective)

    @classmethod
    def out(cls, p: DistributedParameter, value: torch.Tensor) -> torch.Tensor:
        """What the state dict holds for whole ``value``: a CPU copy (an empty slice where rank 0 alone keeps them)."""
        if cls.rank0_only:
            return p.to_local().detach()[:0]
        return value.detach().to("cpu", copy=True)


def _save_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    for attr, p in module._parameters.items():
        key = prefix + attr
        if isinstance(p, DistributedParameter) and key in state_dict and state_dict[key] is not p:
            state_dict[key] = _StateDictScope.value(p)


def _save_list_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any) -> None:
    """A ModuleList of one EP rank's experts (after its children wrote theirs): every EP rank's experts, each
    under its own name, in the order plain torch writes them. Each position among a rank's own experts is
    one gather over the EP group, in the same order on every rank. A sharded (DCP) or ``keep_vars`` state
    dict keeps each rank's own experts only."""
    held = {prefix + n: p for n, p in module.named_parameters()}
    if _StateDictScope.sharded or any(state_dict.get(k) is p for k, p in held.items()):
        return
    every: list[tuple[int, int, str, torch.Tensor]] = []  # (expert, its parameter's place, name, value)
    for place, (key, p) in enumerate(held.items()):
        stacked = every_ep_rank(_StateDictScope.whole(p))
        every += [(r, place, name, _StateDictScope.out(p, v))
                  for r, (name, v) in enumerate(zip(list_expert_names(p, key), stacked, strict=True))]
        state_dict.pop(key, None)
    # plain torch's order: expert by expert (EP rank, then place among a rank's own), each as it writes them
    state_dict.update((name, v) for *_, name, v in sorted(every, key=lambda t: t[:2]))


def _load_pre_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                   missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    for attr, p in module._parameters.items():
        key = prefix + attr
        if not isinstance(p, DistributedParameter) or key not in state_dict:
            continue
        value = state_dict[key]
        why = _load_into(p, value)
        if why:
            error_msgs.append(f"{why} for {key}")
        state_dict[key] = p.detach()  # what torch then copies is this rank's slice onto itself


def _load_into(p: DistributedParameter, value: torch.Tensor) -> str | None:
    """Set ``p``'s slice from a full tensor or from a ``LocalShard`` of the same range; why not, or None."""
    if isinstance(value, LocalShard):
        why = value.range_mismatch(param_shard(p, p.to_local()))
        if why:
            return f"cannot load this LocalShard: {why}"
        local = value.local()
        mine = p.to_local()
        if local.data_ptr() != mine.data_ptr() or local.device != mine.device:
            with torch.no_grad():
                mine.copy_(local)
        return None
    if tuple(value.shape) != tuple(whole_shape(p)):
        return (f"size mismatch: copying a param with shape {tuple(value.shape)} from checkpoint, the shape in "
                f"current model is {tuple(whole_shape(p))}.")
    p.load_full(local_value(p, value.detach()).to(p.device, p.dtype))
    return None


def _load_list_pre_hook(module: nn.Module, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                        missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
    """A ModuleList of one EP rank's experts takes a whole state dict: other EP ranks' experts are theirs."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        if key[len(prefix):].partition(".")[0] not in module._modules:
            del state_dict[key]


def install_state_hooks(module: nn.Module) -> None:
    """Make ``module``'s own sharded parameters save as full tensors and load from full tensors (and a
    list of one EP rank's experts save and take every EP rank's)."""
    if getattr(module, "_bmt_state_hooks", False):
        return
    if getattr(module, "_bmt_ep_list", False):
        register_state_dict_hooks(module, _save_list_hook, _load_list_pre_hook)
    register_state_dict_hooks(module, _save_hook, _load_pre_hook)
    module._bmt_state_hooks = True
    install_rebind_hook()  # first: optimizers built before wrapping move onto these parameters
    install_step_hook()  # optimizers over these parameters then save their state per rank (LocalShard)
    install_fast_paths()  # last: Muon's exchange, elementwise optimizers on plain ranges


def _install_below(root: nn.Module) -> None:
    # Bare DistributedParameters are assigned to modules after they are built, so their holders are
    # found here rather than when the parameter is made.
    for m in root.modules():
        if getattr(m, "_bmt_ep_list", False) or any(isinstance(p, DistributedParameter) for p in m._parameters.values()):
            install_state_hooks(m)


def full_state_dict(model: nn.Module, rank0_only: bool = True) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` with full CPU tensors on rank 0 only (``{}`` elsewhere, no copies made there),
    or on every rank; a collective gathering one group at a time (FSDP's ``rank0_only`` full state dict)."""
    _StateDictScope.enter(rank0_only=rank0_only)
    try:
        state = model.state_dict()
    finally:
        _StateDictScope.exit()
    return {} if rank0_only and get_engine().rank != 0 else state


class ShardedModuleMixin:
    """Mixed into blocks, ``DistributedModule`` and wrapped roots (see the module docstring)."""

    def hand_over_root(self) -> ShardGroup | None:
        """Give a ``CheckpointBlock`` around this module its root group, if it has one (wrapped models do)."""
        return None

    def no_sync(self) -> AbstractContextManager[None]:
        """Backwards inside accumulate gradients on each rank with no communication; the first backward
        outside reduces them all (DDP's ``no_sync``; costs the unsharded gradients' memory, docs/api.md)."""
        return no_sync(self)  # type: ignore[arg-type]

    def pipeline_step(self, *args: Any, schedule: str | None = None, **kwargs: Any) -> torch.Tensor:
        """One training step (every micro-batch's forward and backward) in the order of torch's pipeline
        ``schedule`` ("1F1B", "GPipe", "Interleaved1F1B", "LoopedBFS"; default 1F1B, or Interleaved1F1B
        with ``pp_virtual_stages`` > 1); returns the whole batch's loss on every stage (docs/api.md)."""
        from .pipeline_schedule import pipeline_step  # the pipeline's modules import this one

        return pipeline_step(self, args, kwargs, schedule)  # type: ignore[arg-type]

    def zero_grad(self, set_to_none: bool = True) -> None:
        """``nn.Module.zero_grad``, which also discards gradients a ``no_sync`` window holds unreduced."""
        discard_unsynced(self)  # type: ignore[arg-type]
        super().zero_grad(set_to_none)  # type: ignore[misc]

    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """Full tensors on CPU under the original names; a collective (every rank must call it)."""
        _install_below(self)  # type: ignore[arg-type]
        _StateDictScope.enter()
        try:
            return super().state_dict(*args, **kwargs)  # type: ignore[misc]
        finally:
            _StateDictScope.exit()

    def load_state_dict(self, state_dict: Any, *args: Any, **kwargs: Any) -> Any:
        """Load full tensors; each rank keeps its slices of sharded parameters."""
        _install_below(self)  # type: ignore[arg-type]
        return super().load_state_dict(state_dict, *args, **kwargs)  # type: ignore[misc]

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> Any:
        for p in self.parameters():  # type: ignore[attr-defined]
            if isinstance(p, DistributedParameter):
                moved = fn(p)
                if moved is not p and (moved.dtype != p.dtype or moved.device != p.device):
                    raise WrapError(
                        f"cannot move or cast {p.fqn!r} after it was sharded ({p.dtype} on {p.device} -> "
                        f"{moved.dtype} on {moved.device}). Call .to()/.half()/.cuda() before wrapping, or "
                        "pass mixed_precision=bmt.MixedPrecision(...) to the wrapper.")
        return super()._apply(lambda t: t if isinstance(t, DistributedParameter) else fn(t),  # type: ignore[misc]
                              recurse)
