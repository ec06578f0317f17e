"""Muon on sharded parameters: momentum stays on each rank's range, only straddling matrices move.

torch's Muon orthogonalises each update matrix with Newton-Schulz in bf16, which needs the whole matrix.
Here each rank updates the momentum of its own range (elementwise, as torch does), casts its range of the
update to bf16 (the cast commutes with the gather), and one reduce-scatter takes every straddling matrix to
its owner (``muon_plan.py``); the owner runs torch's own Newton-Schulz on it and a second reduce-scatter
returns each holder its range. The parameters then get torch's decoupled weight decay and update on their
ranges, so the result equals ``torch.optim.Muon`` on the unsharded model bit for bit.

``bmt.optim.Muon`` is ``torch.optim.Muon`` (same arguments, same ``state_dict``) with this step;
a plain ``torch.optim.Muon`` over sharded parameters takes the same path (``local_step.py``'s hooks).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..base._compat import muon_adjusted_lr, muon_orthogonalize
from ..runtime.comm import Communicator
from ..runtime.sharded_tensor import ShardedTensor
from .muon_plan import MatrixPieces, MuonPlan, plan_muon

_PLAN_ATTR = "_bmt_muon_plans"


class Muon(torch.optim.Muon):
    """``torch.optim.Muon`` whose step moves only the matrices that straddle ranks (same state_dict)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One Muon step over every param group (a collective when parameters are sharded)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        sharded_muon_step(self)
        return loss


def muon_plan(optimizer: torch.optim.Muon, group_index: int = 0) -> MuonPlan | None:
    """The exchange plan of a param group as its last step used it (owners, bytes per rank), or None."""
    return getattr(optimizer, _PLAN_ATTR, {}).get(group_index, (None, None))[1]


@torch.no_grad()
def sharded_muon_step(optimizer: torch.optim.Muon) -> None:
    """torch's Muon update for every param group, sharded matrices orthogonalised by their owners."""
    for gi, group in enumerate(optimizer.param_groups):
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            continue
        updates = []
        for p in params:
            state = optimizer.state[p]
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(p.grad, memory_format=torch.preserve_format)
            buf, grad = state["momentum_buffer"], p.grad
            buf.lerp_(grad, 1 - group["momentum"])
            update = grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf
            updates.append(_local(update).to(torch.bfloat16))  # what torch's Newton-Schulz starts with
        ortho = _orthogonalize_by_ranks(optimizer, gi, group, params, updates)
        lr, wd = group["lr"], group["weight_decay"]
        lr = lr.item() if isinstance(lr, torch.Tensor) else lr
        for p, o in zip(params, ortho, strict=True):
            local = _local(p)
            local.mul_(1 - lr * wd)
            local.add_(o, alpha=-muon_adjusted_lr(lr, group["adjust_lr_fn"], p.shape))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, ShardedTensor) else t.reshape(-1)


def _ranks_of(p: torch.Tensor) -> Communicator | None:
    return p.flat_buffer.comm if isinstance(p, ShardedTensor) and hasattr(p, "flat_buffer") else None


def _orthogonalize_by_ranks(optimizer: torch.optim.Muon, gi: int, group: dict, params: list[torch.Tensor],
                            updates: list[torch.Tensor]) -> list[torch.Tensor]:
    """``_orthogonalize`` per set of ranks the matrices are sharded over (under TP: the shard group for
    split matrices, shard x tp for whole ones), in first-seen order, the same on every rank."""
    parts: dict[int, list[int]] = {}
    for i, p in enumerate(params):
        parts.setdefault(id(_ranks_of(p)), []).append(i)
    if len(parts) <= 1:
        return _orthogonalize(optimizer, gi, group, params, updates)
    out: list[torch.Tensor | None] = [None] * len(params)
    for k, idx in enumerate(parts.values()):
        for i, o in zip(idx, _orthogonalize(optimizer, (gi, k), group, [params[i] for i in idx],
                                            [updates[i] for i in idx]), strict=True):
            out[i] = o
    return out  # type: ignore[return-value]


def _orthogonalize(optimizer: torch.optim.Muon, gi: Any, group: dict, params: list[torch.Tensor],
                   updates: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each matrix's orthogonalised update on this rank's range (1-D bf16), via the owners."""
    ns = (group["ns_coefficients"], group["ns_steps"], group["eps"])
    comm = next((c for c in map(_ranks_of, params) if c is not None), None)
    if comm is None or comm.world_size == 1:  # every matrix is whole here
        return [muon_orthogonalize(u.view(p.shape), *ns).reshape(-1)
                for p, u in zip(params, updates, strict=True)]
    plan = _plan_for(optimizer, gi, params, comm, group["ns_steps"])
    r, n = comm.rank, comm.world_size
    out: list[torch.Tensor | None] = [None] * len(params)
    there = updates[0].new_zeros(n * plan.there_segment)
    for i in plan.straddling:
        s, e = _range(params[i], r)
        if e > s:
            at = plan.owners[i] * plan.there_segment + plan.there_offsets[i] + s
            there[at:at + e - s].copy_(updates[i])
    mine = _exchange(comm, there, plan.there_segment, "muon: straddling matrices to their owners")
    back = updates[0].new_zeros(n * plan.back_segment)
    for i, p in enumerate(params):
        if plan.owners[i] != r:
            continue
        if i in plan.there_offsets:  # a straddling matrix this rank owns
            at = plan.there_offsets[i]
            full = muon_orthogonalize(mine[at:at + p.numel()].view(p.shape), *ns).reshape(-1)
            for h in range(n):
                s, e = _range(p, h)
                if e > s:
                    at_h = h * plan.back_segment + plan.back_offsets[(i, h)]
                    back[at_h:at_h + e - s].copy_(full[s:e])
        else:
            out[i] = muon_orthogonalize(updates[i].view(p.shape), *ns).reshape(-1)
    returned = _exchange(comm, back, plan.back_segment, "muon: orthogonalised ranges to their holders")
    for i in plan.straddling:
        s, e = _range(params[i], r)
        at = plan.back_offsets.get((i, r), 0)
        out[i] = returned[at:at + e - s]
    for i in range(len(params)):
        if out[i] is None:  # this rank holds none of it
            out[i] = updates[i][:0]
    return out  # type: ignore[return-value]


def _range(p: torch.Tensor, rank: int) -> tuple[int, int]:
    if isinstance(p, ShardedTensor):
        return p.source_range(rank)  # type: ignore[attr-defined]
    return 0, p.numel()


def _exchange(comm: Communicator, full: torch.Tensor, segment: int, label: str) -> torch.Tensor:
    """This rank's segment of ``full`` summed over ranks: every element has one writer, so the sum is a
    move. bf16 travels as int32 pairs: integer sums of a value and zeros are exact, -0.0 included."""
    out = full.new_empty(segment)
    if segment:
        comm.reduce_scatter_into(out.view(torch.int32), full.view(torch.int32), "sum", label=label)
    return out


def _plan_for(optimizer: torch.optim.Muon, gi: Any, params: list[torch.Tensor], comm: Communicator,
              ns_steps: int) -> MuonPlan:
    """The group's plan, made again only when the set of parameters with gradients changes."""
    plans = optimizer.__dict__.setdefault(_PLAN_ATTR, {})
    key = tuple(id(p) for p in params)
    cached = plans.get(gi)
    if cached is not None and cached[0] == key:
        return cached[1]
    if any(not isinstance(p, ShardedTensor) for p in params):
        raise TypeError("a Muon param group mixes sharded and plain matrices: give the plain ones a group "
                        "of their own")
    matrices = [MatrixPieces((p.shape[0], p.shape[1]), tuple(_range(p, h) for h in range(comm.world_size)))
                for p in params]
    plan = plan_muon(matrices, comm.world_size, ns_steps)
    plans[gi] = (key, plan)
    return plan
