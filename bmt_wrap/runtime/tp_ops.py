"""Tensor-parallel autograd ops over a TP group's communicator (Megatron's four, plus the two they fuse to).

The gradient convention is Megatron's (and BMTrain's): a tensor every TP peer holds whole carries its
full gradient on every peer. So ``copy_to_tp`` (a replicated tensor about to be used differently on each
peer) sums its gradient over the group, ``reduce_from_tp`` passes it through, ``gather_from_tp`` keeps
this rank's slice of it and ``scatter_to_tp`` gathers it back. Communicators move contiguous 1-D buffers,
so these flatten (and move the gathered dimension) around each collective; bytes are counted by the
counting communicator like every other collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import TPShapeError
from .comm import Communicator


def _all_reduce(x: torch.Tensor, comm: Communicator, label: str) -> torch.Tensor:
    out = x.detach().contiguous().reshape(-1).clone()
    if comm.world_size > 1:
        comm.all_reduce(out, "sum", label=label)
    return out.view(x.shape)


def _all_gather(x: torch.Tensor, comm: Communicator, dim: int, label: str) -> torch.Tensor:
    """Every rank's ``x`` concatenated along ``dim`` (rank order)."""
    if comm.world_size == 1:
        return x.detach()
    flat = x.detach().contiguous().reshape(-1)
    out = torch.empty(comm.world_size * flat.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather_into(out, flat, label=label)
    return torch.cat(out.view(comm.world_size, *x.shape).unbind(0), dim=dim)


def _own_slice(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    return x.chunk(comm.world_size, dim=dim)[comm.rank].contiguous()


def _reduce_scatter(x: torch.Tensor, comm: Communicator, dim: int, label: str) -> torch.Tensor:
    """``x`` summed over ranks, this rank's slice along ``dim``."""
    if comm.world_size == 1:
        return x.detach()
    # Move ``dim`` first so each rank's slice is one contiguous run of the flat buffer.
    moved = x.detach().movedim(dim, 0).contiguous()
    out = torch.empty(moved.numel() // comm.world_size, dtype=x.dtype, device=x.device)
    comm.reduce_scatter_into(out, moved.reshape(-1), "sum", label=label)
    return out.view(moved.shape[0] // comm.world_size, *moved.shape[1:]).movedim(0, dim)


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:  # type: ignore[override]
        ctx.comm = comm
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.comm, "tp copy grad"), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:  # type: ignore[override]
        return _all_reduce(x, comm, "tp reduce")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


DimFn = Callable[[torch.Tensor, Communicator, int], torch.Tensor]


class _AlongDim(torch.autograd.Function):
    """A TP op along a dimension: ``forward_fn`` moves the value, ``backward_fn`` its gradient."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator, dim: int,  # type: ignore[override]
                forward_fn: DimFn, backward_fn: DimFn) -> torch.Tensor:
        ctx.comm, ctx.dim, ctx.backward_fn = comm, dim, backward_fn
        return forward_fn(x.detach(), comm, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        return ctx.backward_fn(grad, ctx.comm, ctx.dim), None, None, None, None


def _labelled(fn: Callable[..., torch.Tensor], label: str) -> DimFn:
    return lambda x, comm, dim: fn(x, comm, dim, label)


_GATHER = (_labelled(_all_gather, "tp gather"), _own_slice)
_SCATTER = (_own_slice, _labelled(_all_gather, "tp scatter grad"))
_GATHER_SUM_GRADS = (_labelled(_all_gather, "tp gather"), _labelled(_reduce_scatter, "tp gather grad"))
_REDUCE_SCATTER = (_labelled(_reduce_scatter, "tp reduce-scatter"),
                   _labelled(_all_gather, "tp reduce-scatter grad"))


def _check_split(x: torch.Tensor, comm: Communicator, dim: int, what: str) -> None:
    if x.shape[dim] % comm.world_size:
        raise TPShapeError(f"{what}: dimension {dim} of a tensor of shape {tuple(x.shape)} is not divisible by the "
                         f"tensor-parallel size {comm.world_size}; pad it or choose a tp_size that divides it")


def copy_to_tp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """``x`` unchanged; backward sums the gradient over the TP group (``x`` is used differently per rank)."""
    return _CopyToTP.apply(x, comm)


def reduce_from_tp(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """``x`` summed over the TP group; backward passes the gradient through."""
    return _ReduceFromTP.apply(x, comm)


def gather_from_tp(x: torch.Tensor, comm: Communicator, dim: int = -1) -> torch.Tensor:
    """Every TP rank's ``x`` concatenated along ``dim``; backward keeps this rank's slice of the gradient."""
    return _AlongDim.apply(x, comm, dim, *_GATHER)


def scatter_to_tp(x: torch.Tensor, comm: Communicator, dim: int = -1) -> torch.Tensor:
    """This TP rank's slice of ``x`` along ``dim``; backward gathers the gradient's slices."""
    _check_split(x, comm, dim, "scatter_to_tp")
    return _AlongDim.apply(x, comm, dim, *_SCATTER)


def gather_sum_grads(x: torch.Tensor, comm: Communicator, dim: int = 0) -> torch.Tensor:
    """``gather_from_tp`` for a result each rank uses differently (its own tokens, its own output columns):
    backward sums the gradient over the group and keeps this rank's slice (one reduce-scatter), which is
    ``copy_to_tp`` after ``gather_from_tp`` at half the bytes."""
    return _AlongDim.apply(x, comm, dim, *_GATHER_SUM_GRADS)


def reduce_scatter_to_tp(x: torch.Tensor, comm: Communicator, dim: int = 0) -> torch.Tensor:
    """``x`` summed over the TP group, this rank's slice along ``dim`` (``scatter_to_tp`` after
    ``reduce_from_tp`` at half the bytes); backward gathers the gradient's slices."""
    _check_split(x, comm, dim, "reduce_scatter_to_tp")
    return _AlongDim.apply(x, comm, dim, *_REDUCE_SCATTER)


def gather_tp_slices(x: torch.Tensor, comm: Communicator, dim: int) -> torch.Tensor:
    """Every TP rank's slice ``x`` concatenated along ``dim``, without autograd (a whole parameter's value)."""
    return _all_gather(x, comm, dim, "tp gather value")
