"""``model.no_sync()``: accumulate micro-batches' gradients on each rank with no communication.

DDP's name, called by accelerate's ``accumulate()`` and Lightning. Backwards inside the window reduce
nothing; the first backward outside it reduces the window's sum with its own gradient, so ``.grad`` then
holds the rank average of every micro-batch's gradient summed, as after plain accumulation. What a
backward does is decided when it runs (as FSDP decides): a forward inside the window whose backward
runs outside it is reduced. The cost is memory: each rank holds its trainable buffers' full, unsharded
gradients for the window (``runtime/local_grads.py``; the plan's estimate line "unsharded grads in
no_sync"). Until the synchronising backward those sums are not in ``.grad``, so an optimizer step or a
clip in between raises ``GradSyncError`` rather than update from part of the gradient.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..errors import GradSyncError, NotInitializedError, OffloadError, listed
from ..runtime.active_engine import get_engine
from ..runtime.flat_buffer import FlatBuffer
from ..runtime.group import ShardGroup
from ..runtime.offload import agree_offload
from ..runtime.param import DistributedParameter

_HOOK: list[Any] = []


def module_groups(module: nn.Module) -> list[ShardGroup]:
    """The shard groups of ``module``'s parameters, each once."""
    groups: dict[int, ShardGroup] = {}
    for p in module.parameters():
        if isinstance(p, DistributedParameter):
            groups.setdefault(id(p.shard_group), p.shard_group)  # type: ignore[arg-type]
    return list(groups.values())


def _buffers(params: Iterable[torch.Tensor]) -> list[FlatBuffer]:
    buffers: dict[int, FlatBuffer] = {}
    for p in params:
        if isinstance(p, DistributedParameter):
            buffers.setdefault(id(p.flat_buffer), p.flat_buffer)  # type: ignore[arg-type]
    return list(buffers.values())


def no_sync(module: nn.Module) -> AbstractContextManager[None]:
    """Backwards inside reduce none of ``module``'s gradients; the first one outside reduces them all."""
    return no_sync_groups(module_groups(module))


@contextmanager
def no_sync_groups(groups: list[ShardGroup]) -> Iterator[None]:
    """``no_sync`` for ``groups`` only (a pipeline schedule's backward: this rank's other stages')."""
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(lambda opt, args, kwargs: check_synced(
            (p for g in opt.param_groups for p in g["params"]), f"{type(opt).__name__}.step()")))
    engine = get_engine()
    _reserve_accumulators(engine.comm, groups)
    engine.local_grads.pause(groups)
    try:
        yield
    finally:
        engine.local_grads.resume(groups)


def _reserve_accumulators(comm: Any, groups: list[ShardGroup]) -> None:
    """Offloaded buffers accumulate the window in their file: reserve it now, so a full disk stops every
    rank here rather than one rank in a backward."""
    offloaded = [b for g in groups for b in g.buffers if b.home is not None and b.spec.requires_grad]
    if not offloaded:
        return
    problem = None
    try:
        for b in offloaded:
            b.home.accumulator(b.full_numel, b.grad_dtype)
    except OffloadError as exc:
        problem = exc
    agree_offload(comm, problem, "no_sync accumulators")


def check_synced(params: Iterable[torch.Tensor], what: str) -> None:
    """Raise ``GradSyncError`` if gradients of ``params`` wait, unreduced, for a synchronising backward."""
    try:
        local = get_engine().local_grads
    except NotInitializedError:  # nothing can be waiting
        return
    if not local.pending():
        return
    waiting = local.pending(_buffers(params))
    if waiting:
        names = [s.fqn for loc in waiting for s, used in zip(loc.buffer.spec.slots, loc.used, strict=True) if used]
        raise GradSyncError(
            f"{what} while the gradients of {listed(names or [loc.buffer.group_name for loc in waiting])} are "
            "accumulated on this rank, unreduced, from backwards under model.no_sync(): .grad does not hold them "
            "yet, so this would use part of the gradient. Run the last micro-batch's backward outside the "
            "no_sync() block (it reduces the window's gradients with its own) before stepping or clipping, or "
            "discard them with model.zero_grad().")


def discard_unsynced(module: nn.Module) -> None:
    """Forget what no_sync windows accumulated for ``module`` (``model.zero_grad()``; every rank calls it)."""
    try:
        local = get_engine().local_grads
    except NotInitializedError:  # nothing to forget
        return
    local.discard(_buffers(module.parameters()))
