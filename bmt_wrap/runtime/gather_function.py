"""Autograd-aware gather of a whole group for use outside any block (the root group, a bare
``DistributedParameter`` read inside a ``DistributedModule``'s forward).

Forward returns the gathered parameters as views of the full buffer. Backward runs once every use has
contributed (autograd sums tied uses), flattens the gradients and hands them to the reducer; the
sharded inputs get no gradient through autograd: the reducer sets their ``.grad`` at the end of backward.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from .group import ShardGroup


class GradSink(Protocol):
    """Where a gathered group's gradients go (the engine's reducer, engine.py, the layer above)."""

    def reduce_group_grads(self, group: ShardGroup, grads: list[list[torch.Tensor | None]],
                           only: int | None = None) -> None:
        """Start reducing the group's parameter gradients (of buffer ``only``, or of every buffer)."""


class GatherFunction(torch.autograd.Function):
    """Gathered views of one trainable flat buffer of ``group``; gradients go to the reducer."""

    @staticmethod
    def forward(ctx: Any, engine: GradSink, group: ShardGroup, index: int,  # type: ignore[override]
                *shards: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.engine, ctx.group, ctx.index = engine, group, index
        ctx.set_materialize_grads(False)  # an unused parameter's None must stay None (its .grad stays None)
        return tuple(group.slot_views()[index])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[None, ...]:
        grads_per_buffer: list[list[torch.Tensor | None]] = [[None] * len(b.params) for b in ctx.group.buffers]
        grads_per_buffer[ctx.index] = list(grads)
        # One Function per buffer: reduce this one only (each other trainable buffer's Function reduces
        # its own; reducing them here too sent every other buffer's zeros once more per buffer).
        ctx.engine.reduce_group_grads(ctx.group, grads_per_buffer, only=ctx.index)
        return (None, None, None, *([None] * len(grads)))


class LateGatherFunction(torch.autograd.Function):
    """One gathered root parameter again, differentiable from where its module is called rather than from the
    root's forward start: autograd runs a node in reverse order of creation, so the root's own node reduces
    last, after every block; this one reduces its buffer as soon as its module's backward is done."""

    @staticmethod
    def forward(ctx: Any, engine: GradSink, group: ShardGroup, index: int,  # type: ignore[override]
                gathered: torch.Tensor, *shards: torch.Tensor) -> torch.Tensor:
        ctx.engine, ctx.group, ctx.index, ctx.n = engine, group, index, len(shards)
        ctx.set_materialize_grads(False)
        return gathered.detach()  # the same storage, now an output of this node

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor | None) -> tuple[None, ...]:
        grads_per_buffer: list[list[torch.Tensor | None]] = [[None] * len(b.params) for b in ctx.group.buffers]
        grads_per_buffer[ctx.index] = [grad]
        ctx.engine.reduce_group_grads(ctx.group, grads_per_buffer, only=ctx.index)
        return (None, None, None, None, *([None] * ctx.n))


def regathered(engine: GradSink, group: ShardGroup, index: int, installed: torch.Tensor) -> torch.Tensor | None:
    """``installed`` (buffer ``index``'s single parameter, as the root's gather installed it) behind a node of
    its own made now; None when it is no such tensor (already regathered, no grad, or not the root's)."""
    if not torch.is_grad_enabled() or not isinstance(installed.grad_fn, GatherFunction._backward_cls):
        return None
    return LateGatherFunction.apply(engine, group, index, installed.detach(), *group.buffers[index].params)


def gathered_tensors(engine: GradSink, group: ShardGroup) -> list[list[torch.Tensor]]:
    """Per buffer, per slot: full tensors to install, differentiable w.r.t. the shards when grad is on."""
    views = group.slot_views()
    out: list[list[torch.Tensor]] = []
    for i, (b, v) in enumerate(zip(group.buffers, views, strict=True)):
        if torch.is_grad_enabled() and b.spec.requires_grad:
            out.append(list(GatherFunction.apply(engine, group, i, *b.params)))
        else:
            out.append([t.detach() for t in v])
    return out
