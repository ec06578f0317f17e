"""Collectives on tensors of any shape, differentiable as BMTrain's ``bmt.distributed`` ops are, and
BMTrain's point-to-point ``send_activations`` / ``recv_activations`` between pipeline stages.

``all_reduce``, ``all_gather``, ``reduce_scatter`` and ``broadcast`` run through the job's communicator
(gloo on CPU, NCCL on GPUs), so they interleave safely with the engine's own traffic. Gradients follow
BMTrain: each op's backward is local to the rank (``all_reduce(op="sum")`` passes the gradient through
unchanged, ``all_gather`` hands back this rank's slice), so a loss that every rank computes from the
same reduced value gets the gradient of one copy, not of the sum over ranks.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import CommError, UnsupportedError
from ..runtime.active_engine import get_engine
from ..runtime.comm import Communicator
from ..runtime.pipeline import recv_tensors, send_tensors

#: Reductions every op here accepts ("prod" is computed from a gather: no backend reduces with it).
OPS = ("sum", "avg", "max", "min", "prod")


def communicator(comm: Communicator | None) -> Communicator:
    """``comm``, or the job's communicator when None (what ``bmt.config["comm"]`` holds)."""
    if comm is None:
        return get_engine().comm
    if not isinstance(comm, Communicator):
        raise CommError(f"comm must be a bmt_wrap communicator (bmt.config['comm']) or None, got "
                        f"{type(comm).__name__}: bmt_wrap has one communicator per job, NCCL handles of "
                        "bmtrain.nccl.commInitRank do not exist here")
    return comm


def _check_op(op: str) -> None:
    if op not in OPS:
        raise CommError(f"unsupported reduce op {op!r}; use one of {OPS}")


def gather_flat(x: torch.Tensor, comm: Communicator) -> torch.Tensor:
    """Every rank's ``x`` stacked along a new first dimension (no autograd)."""
    flat = x.detach().contiguous().reshape(-1)
    out = torch.empty(comm.world_size * flat.numel(), dtype=x.dtype, device=x.device)
    comm.all_gather_into(out, flat, label="bmt.distributed.all_gather")
    return out.view(comm.world_size, *x.shape)


def reduce_(flat: torch.Tensor, op: str, comm: Communicator) -> None:
    """Reduce a contiguous 1-D tensor in place across ranks with any of ``OPS``."""
    _check_op(op)
    if op == "prod":
        flat.copy_(gather_flat(flat, comm).prod(dim=0))
    else:
        comm.all_reduce(flat, op, label="bmt.distributed.all_reduce")


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: str, comm: Communicator) -> torch.Tensor:  # type: ignore[override]
        ctx.op, ctx.world_size = op, comm.world_size
        if op == "prod":
            stacked = gather_flat(x, comm)
            out = stacked.prod(dim=0)
            # d out / d x is the product of the other ranks' values (exact, also where x is 0).
            others = torch.cat([stacked[:comm.rank], stacked[comm.rank + 1:]]).prod(dim=0)
            ctx.save_for_backward(others)
            return out
        out = x.detach().contiguous().reshape(-1).clone()
        reduce_(out, op, comm)
        out = out.view(x.shape)
        if op in ("max", "min"):
            ctx.save_for_backward(out != x)  # only the ranks holding the extreme get a gradient
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.op == "sum":
            return grad, None, None
        if ctx.op == "avg":
            return grad / ctx.world_size, None, None
        (saved,) = ctx.saved_tensors
        if ctx.op == "prod":
            return grad * saved, None, None
        return grad.masked_fill(saved, 0), None, None


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, comm: Communicator) -> torch.Tensor:  # type: ignore[override]
        ctx.rank = comm.rank
        return gather_flat(x, comm)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad[ctx.rank], None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, op: str, comm: Communicator) -> torch.Tensor:  # type: ignore[override]
        ctx.op, ctx.comm = op, comm
        n = comm.world_size
        shape = (x.shape[0] // n, *x.shape[1:])
        full = x.detach().contiguous().reshape(-1)
        if op in ("sum", "avg"):
            out = torch.empty(full.numel() // n, dtype=x.dtype, device=x.device)
            comm.reduce_scatter_into(out, full, op, label="bmt.distributed.reduce_scatter")
            return out.view(shape)
        # Rows [rank*S, (rank+1)*S) of the whole reduction: no backend reduce-scatters with these ops.
        reduced = full.clone()
        reduce_(reduced, op, comm)
        return reduced.view(x.shape)[comm.rank * shape[0]:(comm.rank + 1) * shape[0]].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.op not in ("sum", "avg"):
            raise UnsupportedError(f"reduce_scatter(op={ctx.op!r}) has no backward (as in BMTrain); use "
                                   "op='sum' or 'avg' for a differentiable reduce-scatter")
        full = gather_flat(grad, ctx.comm).flatten(0, 1)
        return (full / ctx.comm.world_size if ctx.op == "avg" else full), None, None


class _Broadcast(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, root: int, comm: Communicator) -> torch.Tensor:  # type: ignore[override]
        ctx.comm = comm
        out = x.detach().contiguous().reshape(-1).clone()
        comm.broadcast(out, root, label="bmt.distributed.broadcast")
        return out.view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        # As BMTrain: every rank's input gets the sum of every rank's output gradient.
        summed = grad.contiguous().reshape(-1).clone()
        reduce_(summed, "sum", ctx.comm)
        return summed.view(grad.shape), None, None


def all_reduce(x: torch.Tensor, op: str = "sum", comm: Communicator | None = None) -> torch.Tensor:
    """``x`` reduced over ranks with ``op`` (sum, avg, max, min, prod); differentiable, ``x`` unchanged."""
    _check_op(op)
    return _AllReduce.apply(x, op, communicator(comm))


def all_gather(x: torch.Tensor, comm: Communicator | None = None) -> torch.Tensor:
    """Every rank's ``x`` stacked: shape ``(world_size, *x.shape)``; differentiable."""
    return _AllGather.apply(x, communicator(comm))


def reduce_scatter(x: torch.Tensor, op: str = "sum", comm: Communicator | None = None) -> torch.Tensor:
    """Rows ``[rank*S, (rank+1)*S)`` of ``x`` reduced over ranks, ``S = x.shape[0] // world_size``."""
    _check_op(op)
    c = communicator(comm)
    if x.dim() == 0 or x.shape[0] % c.world_size:
        raise CommError(f"reduce_scatter splits dimension 0 across {c.world_size} ranks, so it must be a "
                        f"multiple of the world size; got shape {tuple(x.shape)}")
    return _ReduceScatter.apply(x, op, c)


def broadcast(x: torch.Tensor, root: int, comm: Communicator | None = None) -> torch.Tensor:
    """Rank ``root``'s ``x`` on every rank; differentiable (each input gets the summed gradient)."""
    return _Broadcast.apply(x, root, communicator(comm))


def send_activations(hidden_state: torch.Tensor, next_rank: int, comm: Communicator) -> None:
    """Send ``hidden_state`` to rank ``next_rank`` of ``comm`` (BMTrain's: ``bmt.config["pipe_comm"]`` and
    a stage index), which takes it with ``recv_activations``: a small header (dtype, shape), then the data."""
    send_tensors(communicator(comm), [hidden_state], next_rank, 0, "bmt.distributed.send_activations")


def recv_activations(prev_rank: int, comm: Communicator) -> torch.Tensor:
    """What rank ``prev_rank`` of ``comm`` sent with ``send_activations``, as a new tensor of its dtype and
    shape on this rank's device."""
    device = get_engine().device
    (got, _), = recv_tensors(communicator(comm), prev_rank, 0, "bmt.distributed.send_activations", device)
    return got
