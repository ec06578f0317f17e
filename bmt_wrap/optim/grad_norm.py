"""Gradient norm and inf/nan check over sharded gradients: local reductions, then one all-reduce each.

Reductions run over covering views of the flat gradient buffers (adjacent views merge, as in the
optimizer), so a shard costs one call rather than one per parameter; alignment gaps and padding are
zero and contribute nothing. Shards partition the full gradient, so summing each rank's share gives
the whole; a parameter every rank holds in full (marked replicated) contributes 1/world_size per rank.
Under HSDP every replica holds the same shards, so each rank's shards count 1/replicas: the one
all-reduce still spans the job (as does the inf/nan flag, where a replica's verdict is its shard's).
Under tensor parallelism, TP peers hold the same shards of parameters none of them splits: 1/T each.
Under pipeline parallelism a stage's parameters are held by that stage only (the others' ranges are
empty); what every stage holds (the explicit API's layers outside a pipeline block list) counts 1/P.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from ..base._compat import foreach_mul_
from ..base.dtypes import LOW_PRECISION
from ..errors import OptimizerError
from ..job.distributed import current_state, parallel_layout
from ..runtime.active_engine import get_engine
from ..runtime.sharded_tensor import local_view
from ..runtime.tp_marks import tp_split_dim
from ..wrapping.grad_sync import check_synced
from .fusion import PlanCache
from .sharding import is_replicated
from .torch_adam import SCRATCH_ELEMS


@dataclass
class GradParts:
    """This rank's gradient ranges by how many ranks hold the same elements."""

    sharded: list[torch.Tensor]  # shards: together the whole gradient (under HSDP, once per replica)
    replicated: list[torch.Tensor]  # held whole on every rank
    tp_whole: list[torch.Tensor] = field(default_factory=list)  # shards every TP peer holds alike
    # Under pipeline parallelism, shards every stage holds alike (as ``sharded`` and ``tp_whole`` are held)
    every_stage: list[torch.Tensor] = field(default_factory=list)
    every_stage_tp_whole: list[torch.Tensor] = field(default_factory=list)

    def all(self) -> list[torch.Tensor]:
        """Every range, of every kind."""
        return self.sharded + self.replicated + self.tp_whole + self.every_stage + self.every_stage_tp_whole


class GradRanges:
    """Covering views of the gradients of some parameters (``GradParts``)."""

    def __init__(self) -> None:
        self._plans = PlanCache()

    def __call__(self, params: Iterable[torch.Tensor]) -> GradParts:
        """Split the gradients present by how they are held, each kind merged into covering views."""
        parts = GradParts([], [], [])
        tp, pp = tp_size() > 1, pp_size() > 1
        for p in params:
            grad = None if p.grad is None else local_view(p.grad)
            if grad is not None and grad.numel() > 0:
                stages = pp and held_by_every_stage(p)
                kind = parts.replicated if is_replicated(p) else \
                    (parts.every_stage_tp_whole if stages else parts.tp_whole) if tp and held_by_tp_peers(p) else \
                    (parts.every_stage if stages else parts.sharded)
                kind.append(grad)
        return GradParts(*(self._cover(k) for k in (parts.sharded, parts.replicated, parts.tp_whole,
                                                    parts.every_stage, parts.every_stage_tp_whole)))

    def _cover(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        items = [(g,) for g in grads]
        return [run.views(items)[0] for run in self._plans.plan(items, [0] * len(items))]


def held_by_tp_peers(p: torch.Tensor) -> bool:
    """True for a whole parameter whose shard every TP peer holds (sharded over the dp group only); False
    for a TP slice and for a whole parameter sharded over shard x tp ranks (``FlatBufferSpec.over_tp``)."""
    layout = getattr(p, "_layout", None)
    buffer = getattr(layout, "buffer", None) if layout is not None else None
    return tp_split_dim(p) is None and not (buffer is not None and buffer.spec.over_tp)


def held_by_every_stage(p: torch.Tensor) -> bool:
    """True for a sharded parameter every pipeline stage holds (no stage placement on its buffer)."""
    layout = getattr(p, "_layout", None)
    buffer = getattr(layout, "buffer", None) if layout is not None else None
    return buffer is not None and getattr(buffer, "stage", None) is None


def _world() -> tuple[int, torch.device | None]:
    state = current_state()
    return (1, None) if state is None else (state.world_size, state.device)


def _replicas() -> int:
    """How many ranks hold each shard (HSDP's replicas; 1 for ZeRO-3 over the job)."""
    return 1 if current_state() is None else get_engine().layout.num_replicas


def _stack(values: list[torch.Tensor], device: torch.device | None) -> torch.Tensor:
    if device is None:
        device = values[0].device if values else torch.device("cpu")
    if not values:
        return torch.zeros(0, dtype=torch.float64, device=device)
    return torch.stack([v.to(device) for v in values])


def _norm_power(t: torch.Tensor, norm_type: float) -> torch.Tensor:
    """``sum |t|^p`` in float64 (``max |t|`` for the inf norm), without an fp32 copy of ``t``."""
    if math.isinf(norm_type):
        lo, hi = torch.aminmax(t)
        return torch.maximum(lo.abs(), hi.abs()).double()
    if t.dtype in LOW_PRECISION and t.device.type == "cpu":
        # CPU reductions of half types into fp32 run ~5x slower than converting slices and reducing those.
        flat = t.reshape(-1)
        scratch = torch.empty(min(flat.numel(), SCRATCH_ELEMS), dtype=torch.float32)
        total = torch.zeros((), dtype=torch.float64)
        for start in range(0, flat.numel(), SCRATCH_ELEMS):
            piece = scratch[:min(SCRATCH_ELEMS, flat.numel() - start)]
            piece.copy_(flat[start:start + piece.numel()])
            total += torch.linalg.vector_norm(piece, norm_type).double() ** norm_type
        return total
    dtype = torch.float32 if t.dtype in LOW_PRECISION else None
    return torch.linalg.vector_norm(t, norm_type, dtype=dtype).double() ** norm_type


def tp_size() -> int:
    """The job's tensor-parallel size (1 before ``init_distributed``)."""
    return 1 if current_state() is None else parallel_layout().tp_size


def pp_size() -> int:
    """The job's pipeline stages (1 before ``init_distributed``)."""
    return 1 if current_state() is None else parallel_layout().pp_size


def global_grad_norm(grads: GradParts, norm_type: float) -> torch.Tensor:
    """The norm of the full gradient (every rank's shards together), with one all-reduce; float64.

    Under tensor parallelism each TP peer holds its own slice of a split parameter, so those count on
    every rank; the shards of a parameter every TP peer holds whole count once per TP group (1/T each).
    """
    if not (norm_type > 0):
        raise OptimizerError(f"norm_type={norm_type} is not supported: use a positive p or 'inf'")
    world, device = _world()
    parts = _stack([_norm_power(t, norm_type) for t in grads.sharded], device)
    shared = _stack([_norm_power(t, norm_type) for t in grads.replicated], parts.device)
    tp_whole = _stack([_norm_power(t, norm_type) for t in grads.tp_whole], parts.device)
    stages = _stack([_norm_power(t, norm_type) for t in grads.every_stage], parts.device)
    stages_tp = _stack([_norm_power(t, norm_type) for t in grads.every_stage_tp_whole], parts.device)
    if math.isinf(norm_type):
        local = torch.cat([parts, shared, tp_whole, stages, stages_tp, parts.new_zeros(1)]).max().reshape(1)
        if world > 1:
            current_state().comm.all_reduce(local, "max", label="grad norm")
        return local[0]
    r, t, p = _replicas(), tp_size(), pp_size()
    local = (parts.sum() / r + tp_whole.sum() / (r * t) + stages.sum() / (r * p) + stages_tp.sum() / (r * t * p)
             + shared.sum() / world).reshape(1)
    if world > 1:
        current_state().comm.all_reduce(local, "sum", label="grad norm")
    return local[0] ** (1.0 / norm_type)


def _has_nonfinite(t: torch.Tensor) -> bool:
    lo, hi = torch.aminmax(t)
    return not (bool(torch.isfinite(lo)) and bool(torch.isfinite(hi)))


def local_overflow(grads: list[torch.Tensor]) -> bool:
    """Whether any of this rank's gradients holds inf or nan (one pass over each, no temporaries)."""
    summaries = []
    for g in grads:
        if g.dtype in LOW_PRECISION:  # min and max are elements: exact, and fast for half types on CPU
            lo, hi = torch.aminmax(g)
            summaries.append(lo.float() + hi.float())
        else:  # a sum is the fastest pass; a finite tensor can overflow it, so confirm suspects below
            summaries.append(g.sum().float())
    if not summaries:
        return False
    bad = (~torch.isfinite(_stack(summaries, None))).nonzero().flatten().tolist()
    return any(grads[i].dtype in LOW_PRECISION or _has_nonfinite(grads[i]) for i in bad)


def any_rank(flag: bool) -> bool:
    """True when ``flag`` is true on any rank (one all-reduce of one element)."""
    world, device = _world()
    if world == 1:
        return flag
    t = torch.tensor([1.0 if flag else 0.0], dtype=torch.float32, device=device)
    current_state().comm.all_reduce(t, "max", label="overflow flag")
    return bool(t.item() > 0)


def clip_grads_(grads: GradParts, max_norm: float, norm_type: float, eps: float, scale: float) -> torch.Tensor:
    """Scale gradients so the full gradient's norm is at most ``max_norm``; return the norm before clipping.

    Gradients arrive multiplied by ``scale`` (the loss scale); the returned norm is of the unscaled
    gradient. A non-finite norm leaves gradients alone: the overflow check skips that step.
    """
    total = global_grad_norm(grads, norm_type) / scale
    value = float(total)
    coef = max_norm / (value + eps)
    if math.isfinite(value) and coef < 1.0:
        foreach_mul_(grads.all(), coef)
    return total.float()


def clip_grad_norm_(parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float | str = 2.0,
                    eps: float = 1e-6) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for sharded parameters: clips to the norm of the full gradient
    over every rank (one all-reduce) and returns that norm. Call it on every rank."""
    parameters = list(parameters)
    check_synced(parameters, "clip_grad_norm_")
    return clip_grads_(GradRanges()(parameters), float(max_norm), float(norm_type), eps, 1.0)
