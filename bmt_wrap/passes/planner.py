"""Planning: place parameters in shard groups (the layout), then choose the schedule.

The layout (which parameter lives in which flat buffer, at which offset) depends on the module tree
only, never on inputs or world size. The schedule (call order, checkpointing, prefetch depth) may be
re-chosen when a capture arrives at the first forward: ``schedule`` does that on an existing plan.
"""

from __future__ import annotations

import copy
from collections import defaultdict

import torch
from torch import nn

from ..base.dtypes import dtype_name
from ..base.expert_plan import ExpertPlan
from ..base.mixed_precision import MixedPrecision
from ..base.plan import ROOT, SCHEDULE_NOTE, ParamInfo, ShardGroupSpec, WrapPlan, layout_buffers
from ..base.tp_plan import TensorParallelPlan
from ..errors import PlanError
from .budget import fit_budget
from .capacity import scheduled_estimate
from .capture import Capture
from .discover import Discovery
from .util import self_checkpointing_modules


def place_parameters(model: nn.Module, discovery: Discovery, dtype: str | torch.dtype | None = None,
                     mixed_precision: MixedPrecision | None = None, local_shapes: dict[str, list[int]] | None = None,
                     split: set[str] | None = None, experts: set[str] | None = None, ep_size: int = 1
                     ) -> tuple[list[ShardGroupSpec], list[str]]:
    """Shard groups (root first, then blocks in module order) and notes on parameters moved to the root.

    A parameter reachable from more than one block, or from a block and the root, goes to the root
    group: each parameter has exactly one home. Tied names become aliases of the first name.
    ``dtype`` replaces floating parameters' own dtype (a model to be cast before wrapping);
    ``mixed_precision`` sets the shard, gathered and gradient dtypes of their buffers. ``local_shapes``
    (tensor parallelism) gives a split parameter's shape on one TP rank, by any of its names; ``split``
    (TP) names the parameters split along a dimension: the others are sharded over shard x TP ranks.
    ``experts`` (EP over ``ep_size`` ranks) names the expert parameters each EP rank holds its own experts of
    (``local_shapes`` gives their shape there): they get buffers of their own, sharded over the ranks owning
    the same experts.
    """
    names: dict[int, list[str]] = defaultdict(list)
    tensors: dict[int, nn.Parameter] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names[id(p)].append(name)
        tensors[id(p)] = p
    members: dict[str, list[ParamInfo]] = {ROOT: [], **{b.fqn: [] for b in discovery.blocks}}
    shared: list[str] = []
    for key, fqns in names.items():
        owners = {discovery.owner(n) or ROOT for n in fqns}
        home = next(iter(owners)) if len(owners) == 1 else ROOT
        if len(owners) > 1:
            shared.append(fqns[0])
        p = tensors[key]
        own = dtype if dtype is not None and p.dtype.is_floating_point else p.dtype
        try:
            shard, gather, reduce = (mixed_precision.buffer_dtypes(own) if mixed_precision is not None
                                     else (dtype_name(own), None, None))
        except KeyError:
            raise PlanError(f"parameter {fqns[0]!r} has dtype {own}, which bmt_wrap cannot shard; "
                            "cast it to a floating dtype before wrapping") from None
        shape = next((local_shapes[n] for n in fqns if n in local_shapes), None) if local_shapes else None
        # Under TP a parameter no TP plan splits is held whole by every TP peer: shard it over them too.
        members[home].append(ParamInfo(fqns[0], list(shape or p.shape), shard, p.requires_grad, fqns[1:], gather,
                                       reduce, over_tp=split is not None and not split.intersection(fqns),
                                       ep_split=ep_size if experts and experts.intersection(fqns) else 0))
    notes = []
    if shared:
        notes.append(f"{len(shared)} parameter(s) used by several blocks (or a block and the root) live in "
                     f"the root group: {', '.join(shared[:3])}{' ...' if len(shared) > 3 else ''}")
    # The root's large untied matrices (a vocabulary head) get buffers of their own, so each one's gradient is
    # reduce-scattered and freed when its own backward ends instead of when the blocks' does (issue #35).
    # Only one registered after the first block (a head): one used before the blocks (an embedding) has its
    # gradient last anyway, and a buffer of its own would cost a collective per step for nothing.
    order = list(names.values())
    first_block = next((i for i, fqns in enumerate(order) if any(discovery.owner(n) for n in fqns)), len(order))
    after_blocks = {fqns[0] for fqns in order[first_block:]}
    alone = reduced_alone(members[ROOT], after_blocks) if discovery.blocks else set()
    groups = [ShardGroupSpec(name=g, buffers=layout_buffers(infos, alone if g == ROOT else ()))
              for g, infos in members.items()]
    return groups, notes


#: A root parameter holding at least 1/ALONE_SHARE of the root's trainable elements gets its own buffer.
ALONE_SHARE = 8


def reduced_alone(root: list[ParamInfo], after_blocks: set[str]) -> set[str]:
    """Root parameters laid out alone: registered after the first block (``after_blocks``: a head, used after
    them), trainable, untied (a tied embedding's gradient comes last anyway), a matrix or more, and at least
    1/``ALONE_SHARE`` of the root's trainable elements."""
    total = sum(p.numel for p in root if p.requires_grad)
    return {p.fqn for p in root if p.requires_grad and not p.aliases and len(p.shape) >= 2
            and p.fqn in after_blocks and p.numel * ALONE_SHARE >= total > 0}


def _self_checkpointing_notes(names: list[str], checkpoint: bool) -> list[str]:
    if not names:
        return []
    if checkpoint:
        return [f"transformers gradient checkpointing is on for {len(names)} module(s): wrapping turns it "
                "off and bmt_wrap's checkpointing recomputes those blocks instead (once)"]
    return [f"transformers gradient checkpointing stays on for {len(names)} module(s) (checkpoint=False): "
            "their layers recompute themselves, gathering again in backward"]


def _check_options(world_size: int, zero_level: int, prefetch_depth: int) -> None:
    if world_size < 1:
        raise PlanError(f"world_size must be >= 1, got {world_size}")
    if zero_level not in (2, 3):
        raise PlanError(f"zero_level must be 2 or 3, got {zero_level}")
    if prefetch_depth < 0:
        raise PlanError(f"prefetch_depth must be >= 0, got {prefetch_depth}")


def schedule(plan: WrapPlan, capture: Capture | None = None, *, world_size: int, checkpoint: bool = True,
             zero_level: int = 3, prefetch_depth: int = 1, memory_budget: int | None = None,
             offload: str | None = None) -> WrapPlan:
    """A copy of ``plan`` with the schedule chosen from ``capture``; the layout is untouched. ``offload``:
    where the shards live (``"disk"``: the estimates count only those in flight)."""
    _check_options(world_size, zero_level, prefetch_depth)
    new = copy.deepcopy(plan)
    names = [g.name for g in new.blocks()]
    # A block missing from the plan (an edited plan) stays unscheduled: it runs as root code.
    new.order = [b for b in capture.order if b in names] if capture is not None else names
    new.capture = capture.method if capture is not None else "none"
    new.prefetch_depth = prefetch_depth
    new.offload = offload
    if capture is not None and capture.fused_loss is not None:
        new.fused_loss = capture.fused_loss  # before the budget: the head and loss are phases of the peak
    for group in new.blocks():
        group.zero_level = zero_level
        group.checkpoint = checkpoint
    notes = list(capture.notes) if capture is not None else []
    activations = capture.activations if capture is not None else None
    if new.experts is not None and new.experts.ep_size > 1 and activations is not None and not activations.tokens:
        notes.append("expert parallelism's all-to-all buffers are not counted: the inputs hold no token ids")
    if memory_budget is not None:
        notes += fit_budget(new, activations, world_size, memory_budget)
    new.memory_budget = memory_budget
    new.notes = [n for n in plan.notes if not n.startswith(SCHEDULE_NOTE)] + [SCHEDULE_NOTE + n for n in notes]
    # TP's activation traffic needs a batch: estimate_tp(plan, dp, tokens=) where one is known.
    new.estimates = {str(world_size): scheduled_estimate(new, world_size, activations)}
    return new


def build_plan(model: nn.Module, discovery: Discovery, *, world_size: int, checkpoint: bool = True,
               zero_level: int = 3, prefetch_depth: int = 1, memory_budget: int | None = None,
               dtype: str | torch.dtype | None = None, mixed_precision: MixedPrecision | None = None,
               capture: Capture | None = None, tensor_parallel: TensorParallelPlan | None = None,
               offload: str | None = None, experts: ExpertPlan | None = None) -> WrapPlan:
    """The full plan for ``model``: layout from the module tree, schedule from ``capture`` (if any).

    With ``tensor_parallel`` (``plan_tensor_parallel``'s section), split parameters are laid out in their
    TP-local shapes and ``world_size`` is the data-parallel size ZeRO shards over. With ``experts``
    (``plan_experts``' section, ``ep_size > 1``), expert parameters are laid out in their EP-local shapes.
    """
    _check_options(world_size, zero_level, prefetch_depth)
    local = tensor_parallel.local_shapes() if tensor_parallel is not None else None
    split = tensor_parallel.split_names() if tensor_parallel is not None and tensor_parallel.tp_size > 1 else None
    ep = experts.local_shapes() if experts is not None and experts.ep_size > 1 else None
    if ep:
        local = {**(local or {}), **ep}
    groups, notes = place_parameters(model, discovery, dtype, mixed_precision, local, split, set(ep or ()),
                                     experts.ep_size if experts is not None else 1)
    own = self_checkpointing_modules(model)
    plan = WrapPlan(groups=groups, notes=discovery.notes + notes + _self_checkpointing_notes(own, checkpoint),
                    self_checkpointing_off=own if checkpoint else [], tensor_parallel=tensor_parallel,
                    experts=experts)
    return schedule(plan, capture, world_size=world_size, checkpoint=checkpoint, zero_level=zero_level,
                    prefetch_depth=prefetch_depth, memory_budget=memory_budget, offload=offload)
