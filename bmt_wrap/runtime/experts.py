"""Expert parallelism's executor: a MoE layer's tokens go to the EP ranks that own their experts and come
back through ``all_to_all`` with uneven counts, with autograd (docs/design.md, "Expert parallelism").

Per call: each (token, expert) pair the router chose is sorted by expert, so the rows for EP rank p form
one contiguous piece; the per-expert counts are exchanged first (one fixed-size all-to-all), then the
rows (dispatch). The owner runs its own experts on what it received (the experts module's own forward,
with local expert indices and unit weights), sends the outputs back (combine), and the sender weights them
and sums them per token, as the unsplit layer does. Both all-to-alls run on every EP rank at every call, in
forward and in backward, whatever the routing: a rank that received no token still takes part (the
combine is tied to the dispatch's output, so autograd always reaches both), and the order check names a
rank that skipped one. No token is dropped unless the caller gives a capacity (``ep_capacity_factor=``):
then each expert takes at most that many of the call's pairs, the first in token order, and the others
are never sent: their output is zero, so the layer's residual carries those tokens on (GShard, Megatron).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .comm import Communicator

#: The experts module's own forward: (tokens [n, hidden], local indices [n, 1], weights [n, 1]) -> [n, hidden].
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def _exchange(comm: Communicator, rows: torch.Tensor, out_rows: list[int], in_rows: list[int],
              label: str) -> torch.Tensor:
    """``rows`` ([sum(in_rows), width]) cut by ``in_rows`` to the EP ranks; what they sent, by ``out_rows``."""
    width = rows.shape[1]
    out = rows.new_empty((sum(out_rows), width))
    comm.all_to_all(out.view(-1), rows.contiguous().view(-1), [n * width for n in out_rows],
                    [n * width for n in in_rows], label=label)
    return out


class _Dispatch(torch.autograd.Function):
    """Rows to their owners; in backward, their gradients back to the senders."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, comm: Communicator, out_rows: list[int], in_rows: list[int],
                label: str) -> torch.Tensor:
        ctx.comm, ctx.out_rows, ctx.in_rows, ctx.label = comm, out_rows, in_rows, label
        return _exchange(comm, rows, out_rows, in_rows, f"{label} dispatch")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = _exchange(ctx.comm, grad, ctx.in_rows, ctx.out_rows, f"{ctx.label} dispatch backward")
        return back, None, None, None, None


class _Combine(torch.autograd.Function):
    """The owners' outputs back to the senders. ``anchor`` (the dispatch's output) ties this op to the
    dispatch in the graph, so its backward runs even on a rank whose experts received no token."""

    @staticmethod
    def forward(ctx: Any, rows: torch.Tensor, anchor: torch.Tensor, comm: Communicator, out_rows: list[int],
                in_rows: list[int], label: str) -> torch.Tensor:
        ctx.comm, ctx.out_rows, ctx.in_rows, ctx.label = comm, out_rows, in_rows, label
        return _exchange(comm, rows, out_rows, in_rows, f"{label} combine")

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        back = _exchange(ctx.comm, grad, ctx.in_rows, ctx.out_rows, f"{ctx.label} combine backward")
        return back, None, None, None, None, None


def expert_parallel_call(local: LocalExperts, hidden: torch.Tensor, indices: torch.Tensor, weights: torch.Tensor,
                         comm: Communicator, num_experts: int, label: str, capacity: int | None = None) -> torch.Tensor:
    """The unsplit experts' output for ``hidden`` ([tokens, width]) routed by ``indices``/``weights``
    ([tokens, k]), computed by the EP ranks of ``comm`` that own the experts (``num_experts / comm.world_size``
    each, in rank order); ``label`` names the layer in the collectives (the same on every rank). ``capacity``:
    the most pairs each expert takes, the first in token order (the others add nothing); None: every pair."""
    ep, per = comm.world_size, num_experts // comm.world_size
    k = indices.shape[-1]
    flat = indices.reshape(-1)
    order = torch.argsort(flat, stable=True)  # by expert, so by owner; tokens in order within an expert
    counts = torch.bincount(flat, minlength=num_experts)
    if capacity is not None:  # each pair's place among its expert's, in token order: the first ``capacity`` stay
        first = torch.cumsum(counts, 0) - counts
        place = torch.arange(order.numel(), device=flat.device) - first.repeat_interleave(counts)
        order = order[place < capacity]
        counts = counts.clamp(max=capacity)
    token = torch.div(order, k, rounding_mode="floor")
    got = counts.new_empty(num_experts)  # got[s * per + j]: rows rank s sends for my j-th expert
    comm.all_to_all(got, counts, [per] * ep, [per] * ep, label=f"{label} counts")
    in_rows = counts.view(ep, per).sum(1).tolist()
    out_rows = got.view(ep, per).sum(1).tolist()
    received = _Dispatch.apply(hidden[token], comm, out_rows, in_rows, label)
    local_index = torch.arange(per, device=flat.device).repeat(ep).repeat_interleave(got)[:, None]
    ones = torch.ones(local_index.shape, dtype=weights.dtype, device=weights.device)
    out = local(received, local_index, ones)
    back = _Combine.apply(out, received, comm, in_rows, out_rows, label)
    weighted = back * weights.reshape(-1)[order, None].to(back.dtype)
    return torch.zeros_like(hidden).index_add(0, token, weighted.to(hidden.dtype))
