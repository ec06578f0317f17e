"""The plan's data types, shared by ``passes/`` (which produce a plan) and ``runtime/`` (which executes one).

Plain dataclasses with a JSON round-trip: no torch.fx, no communication, no storage. This module is
also the one place that knows the rank layout of a flat buffer: offsets are aligned and independent of
the world size; padding, shard size and each rank's slice are derived here when a plan is applied.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Collection
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import PlanError
from .cp_plan import ContextParallelPlan
from .dtypes import align_elems, dtype_name, itemsize
from .expert_plan import ExpertPlan, experts_text
from .fused_loss_plan import FusedLossPlan
from .pipeline_plan import PipelinePlan, pipeline_text
from .tp_plan import TensorParallelPlan, tp_text

PLAN_VERSION = 1
ROOT = "root"  # name of the group holding parameters outside every block
#: Full-gradient buffers reduce-scattering at once: one overlaps the next block's whole backward.
GRADS_IN_FLIGHT = 1
#: Elements of each tensor ``AdamOptimizer`` brings to the device at once to step shards offloaded to host
#: memory (``offload="host"``, optim/host_chunks.py): 16 MiB of fp32.
HOST_STEP_CHUNK_ELEMS = 1 << 22
#: Bytes per parameter of the per-step all-reduce that agrees which parameters got a gradient.
USED_MASK_BYTES = 4
#: Notes the schedule writes start with this, so re-scheduling replaces them instead of piling up.
SCHEDULE_NOTE = "schedule: "
#: Start of capture's note that fx could not trace the model (expected where torch.export then captures it).
FX_FAILED_NOTE = "fx.symbolic_trace failed"
#: Start of its note that torch.export could not either (the first call then records the block order with hooks).
EXPORT_FAILED_NOTE = "torch.export failed"


@dataclass
class ParamSlot:
    """One original parameter inside a flat buffer."""

    fqn: str  # canonical name (first occurrence in ``named_parameters(remove_duplicate=False)``)
    shape: list[int]
    offset: int  # element offset in the unsharded flat buffer, aligned
    aliases: list[str] = field(default_factory=list)  # other names of the same Parameter (tied weights)

    @property
    def numel(self) -> int:
        """Number of elements of the original parameter."""
        return math.prod(self.shape)

    @property
    def names(self) -> list[str]:
        """Every name of this parameter, canonical first."""
        return [self.fqn, *self.aliases]


@dataclass
class FlatBufferSpec:
    """Parameters of one dtype and one ``requires_grad`` flag, laid out in one contiguous buffer.

    ``dtype`` is the shard's: what the optimizer updates and checkpoints hold. Under mixed precision
    gathers communicate and blocks compute in ``param_dtype``, and gradients are reduce-scattered in
    ``reduce_dtype``; None means the shard's dtype and the gathered dtype respectively.
    """

    dtype: str
    requires_grad: bool
    slots: list[ParamSlot]
    param_dtype: str | None = None
    reduce_dtype: str | None = None
    # Under tensor parallelism: parameters every TP peer holds whole, sharded over the shard group x the TP
    # group (each rank 1/(shard x T) of them) instead of over the shard group alone (#38 item 5).
    over_tp: bool = False
    # Under expert parallelism (the EP size; 0: not an expert buffer): this EP rank's experts (values differ
    # by EP rank), sharded over the shard_size / ep_split ranks that own the same experts (x T under TP, which
    # never splits them) instead of over the shard group (base/mesh.py ``expert_shard_group``).
    ep_split: int = 0

    def ranks(self, shard_size: int, tp_size: int) -> int:
        """Ranks this buffer is split over when the shard group has ``shard_size`` and TP ``tp_size``."""
        ranks = shard_size * tp_size if self.over_tp else shard_size
        return ranks // self.ep_split if self.ep_split else ranks

    @property
    def gather_dtype(self) -> str:
        """dtype of the gathered full buffer (what blocks compute in)."""
        return self.param_dtype or self.dtype

    @property
    def grad_dtype(self) -> str:
        """dtype of the full gradient and of its reduce-scatter."""
        return self.reduce_dtype or self.gather_dtype

    @property
    def numel(self) -> int:
        """Unpadded length: the end of the last slot."""
        return max((s.offset + s.numel for s in self.slots), default=0)

    @property
    def param_numel(self) -> int:
        """Elements that belong to parameters (no alignment gaps, no padding)."""
        return sum(s.numel for s in self.slots)

    # ---- rank layout: the one place that knows it ------------------------------------------------
    def padded_numel(self, world_size: int) -> int:
        """Length padded so every rank's shard has the same, aligned, size."""
        unit = world_size * align_elems(self.dtype)
        return max(unit, -(-self.numel // unit) * unit)

    def shard_numel(self, world_size: int) -> int:
        """Elements each rank owns."""
        return self.padded_numel(world_size) // world_size

    def shard_range(self, rank: int, world_size: int) -> tuple[int, int]:
        """``[start, end)`` of rank ``rank``'s shard in the unsharded buffer."""
        size = self.shard_numel(world_size)
        return rank * size, (rank + 1) * size

    def local_range(self, slot: ParamSlot, rank: int, world_size: int) -> tuple[int, int]:
        """``[start, end)`` of ``slot``'s elements inside rank ``rank``'s shard (possibly empty)."""
        lo, hi = self.shard_range(rank, world_size)
        start, end = max(slot.offset, lo), min(slot.offset + slot.numel, hi)
        if start >= end:
            return 0, 0
        return start - lo, end - lo

    def source_range(self, slot: ParamSlot, rank: int, world_size: int) -> tuple[int, int]:
        """``[start, end)`` of the flattened original parameter that rank ``rank``'s slice of ``slot`` holds."""
        a, b = self.local_range(slot, rank, world_size)
        if a == b:
            return 0, 0
        lo = self.shard_range(rank, world_size)[0]
        return lo + a - slot.offset, lo + b - slot.offset

    def nbytes(self) -> int:
        """Bytes of the parameters themselves in the shard dtype (no padding)."""
        return self.param_numel * itemsize(self.dtype)

    def gathered_bytes(self, world_size: int) -> int:
        """Bytes of the gathered (padded) buffer at this world size."""
        return self.padded_numel(world_size) * itemsize(self.gather_dtype)

    def full_grad_bytes(self, world_size: int) -> int:
        """Bytes of the full (padded) gradient reduce-scattered at this world size."""
        return self.padded_numel(world_size) * itemsize(self.grad_dtype)


@dataclass
class ShardGroupSpec:
    """A unit of gathering: a block (or the root), with one flat buffer per (dtype, requires_grad)."""

    name: str  # the block module's FQN, or ROOT
    buffers: list[FlatBufferSpec]
    checkpoint: bool = True  # recompute the block in backward
    zero_level: int = 3  # 3: release gathered params after forward; 2: keep them until backward

    @property
    def is_root(self) -> bool:
        """True for the group of parameters outside every block."""
        return self.name == ROOT

    def slots(self) -> list[tuple[FlatBufferSpec, ParamSlot]]:
        """Every (buffer, slot) of the group."""
        return [(b, s) for b in self.buffers for s in b.slots]

    def param_numel(self) -> int:
        """Elements of parameters in the group."""
        return sum(b.param_numel for b in self.buffers)

    def param_bytes(self) -> int:
        """Bytes of parameters in the group (unsharded, unpadded)."""
        return sum(b.nbytes() for b in self.buffers)

    def padded_bytes(self, world_size: int) -> int:
        """Bytes of the gathered (padded) buffers at this world size."""
        return sum(b.gathered_bytes(world_size) for b in self.buffers)


@dataclass
class ParamInfo:
    """What layout needs to know about one parameter (built by the caller from a real or meta tensor)."""

    fqn: str
    shape: list[int]
    dtype: str
    requires_grad: bool
    aliases: list[str] = field(default_factory=list)
    param_dtype: str | None = None  # see FlatBufferSpec
    reduce_dtype: str | None = None
    over_tp: bool = False  # see FlatBufferSpec
    ep_split: int = 0  # see FlatBufferSpec

    @property
    def numel(self) -> int:
        """Elements of the parameter."""
        return math.prod(self.shape)


def layout_buffers(params: list[ParamInfo], alone: Collection[str] = ()) -> list[FlatBufferSpec]:
    """Lay parameters out in flat buffers, one per (dtypes, requires_grad), offsets aligned, order kept;
    a parameter named in ``alone`` gets a buffer of its own (its gradient is reduced as soon as it exists)."""
    buffers: dict[tuple[str, bool, str | None, str | None, bool, str, int], FlatBufferSpec] = {}
    for p in params:
        key = (dtype_name(p.dtype), p.requires_grad, p.param_dtype, p.reduce_dtype, p.over_tp,
               p.fqn if p.fqn in alone else "", p.ep_split)
        buf = buffers.setdefault(key, FlatBufferSpec(dtype=key[0], requires_grad=key[1], slots=[],
                                                     param_dtype=key[2], reduce_dtype=key[3], over_tp=key[4],
                                                     ep_split=key[6]))
        align = align_elems(key[0])
        offset = -(-buf.numel // align) * align
        buf.slots.append(ParamSlot(fqn=p.fqn, shape=list(p.shape), offset=offset, aliases=list(p.aliases)))
    # Trainable buffers first, so a group's gradient buffers line up with its first flat buffers.
    return sorted(buffers.values(), key=lambda b: (not b.requires_grad, b.dtype, b.over_tp, b.ep_split))


@dataclass
class MemoryEstimate:
    """Per-rank bytes the plan predicts, and communication per training step.

    Shards, their gradients and optimizer state count in the shard dtype; gathered parameters and
    all-gathers in the gathered dtype; full gradients and reduce-scatters in the gradient dtype.
    """

    world_size: int
    params: int = 0
    grads: int = 0
    optimizer: int = 0
    gathered: int = 0  # root group + (prefetch depth + 1) x largest zero-3 block + zero_level=2 blocks
    grads_in_flight: int = 0
    activations: int | None = None  # needs a batch shape
    # Of ``activations``: what the root saves (outside every block) and one recompute's transient; the
    # rest is what the block calls keep. The process's peak counts them by phase (passes/capacity.py).
    activations_root: int = 0
    activations_recompute: int = 0
    activations_objects: int = 0  # held by the output's objects (a KV cache) until the blocks' backward ends
    comm_all_gather: int = 0
    comm_reduce_scatter: int = 0
    comm_all_reduce: int = 0
    zero3_bound: int = 0  # 3 * Psi * (N-1) / N in bytes (2 gathers + 1 reduce-scatter, each in its dtype)
    # Extra while a ``model.no_sync()`` window holds gradients unreduced: every trainable buffer's full
    # gradient in the gradient dtype (not in ``total``: only accumulation without communication pays it).
    no_sync_grads: int = 0
    # HSDP (passes.estimate_mesh): shards over shard_size ranks, world_size / shard_size replicas
    shard_size: int | None = None
    comm_replicas: int | None = None  # gradient all-reduce across replicas (included in comm_all_reduce)
    comm_shard: int | None = None  # the shard group's all-gathers and reduce-scatters (of the two totals)
    comm_intra_node: int | None = None  # of comm_total: collectives whose group lies within one node
    comm_inter_node: int | None = None  # of comm_total: collectives whose group spans nodes
    # Tensor parallelism (passes.estimate_tp): ZeRO shards over world_size / tp_size data-parallel ranks
    tp_size: int | None = None
    comm_tp: int | None = None  # TP all-reduces and all-gathers of activations (included in comm_all_reduce/gather)
    # offload="disk" (passes.estimate.shards_off_device): params and grads above are the shards in flight; the
    # rest is in each rank's file, read and written every step
    disk_read: int | None = None
    disk_written: int | None = None
    # offload="host" (the same count): the rest is in host memory, copied to and from the device every step
    host_to_device: int | None = None
    device_to_host: int | None = None
    # Expert parallelism: the all-to-all buffers one MoE layer's exchange holds on a rank
    # (``ExpertPlan.exchange_bytes``), counted with a block's backward (passes/capacity.training_phases).
    exchange: int = 0
    # The step's peak: the largest of training's phases (passes/capacity.training_phases), where ``total`` sums
    # terms that peak at different moments. What ``memory_budget=`` bounds. None where not counted.
    peak: int | None = None

    @property
    def total(self) -> int:
        """Sum of every memory term that is known."""
        return (self.params + self.grads + self.optimizer + self.gathered + self.grads_in_flight
                + (self.activations or 0))

    @property
    def comm_total(self) -> int:
        """All communicated bytes per step."""
        return self.comm_all_gather + self.comm_reduce_scatter + self.comm_all_reduce


@dataclass
class WrapPlan:
    """Everything the runtime needs to shard and schedule a model, plus what the passes estimated."""

    groups: list[ShardGroupSpec]
    prefetch_depth: int = 1
    order: list[str] = field(default_factory=list)  # block calls of one forward, in order (may repeat)
    resident: list[str] = field(default_factory=list)  # parameters kept unsharded
    capture: str = "none"  # "fx", "export", "eager" or "explicit"
    notes: list[str] = field(default_factory=list)
    # Modules whose own (transformers) gradient checkpointing applying the plan turns off, because the
    # plan's checkpointing recomputes those blocks (left on, each would run, and gather, a third time).
    self_checkpointing_off: list[str] = field(default_factory=list)
    estimates: dict[str, MemoryEstimate] = field(default_factory=dict)  # keyed by str(world_size)
    version: int = PLAN_VERSION
    memory_budget: int | None = None  # bytes per rank the schedule was fitted to (None: options as given)
    tensor_parallel: TensorParallelPlan | None = None  # modules split across TP ranks (None: no TP)
    fused_loss: FusedLossPlan | None = None  # the vocabulary projection and its cross-entropy (None: not looked for)
    # "disk": shards and gradient shards in a file per rank; "host": in host memory (estimates count so)
    offload: str | None = None
    pipeline: PipelinePlan | None = None  # the stages each block and root parameter runs on (None: one stage)
    experts: ExpertPlan | None = None  # mixture-of-experts layers and their placement (None: not looked for)
    context_parallel: ContextParallelPlan | None = None  # attentions split over CP ranks (None: no CP)

    def group(self, name: str) -> ShardGroupSpec:
        """The group called ``name``."""
        for g in self.groups:
            if g.name == name:
                return g
        raise PlanError(f"the plan has no group {name!r}; groups: {[g.name for g in self.groups]}")

    def blocks(self) -> list[ShardGroupSpec]:
        """Every block group, in plan order."""
        return [g for g in self.groups if not g.is_root]

    def all_fqns(self) -> list[str]:
        """Every parameter name (aliases included) the plan places."""
        return [n for g in self.groups for _, s in g.slots() for n in s.names]

    def summary(self) -> None:
        """Print what ``bmt-wrap dump`` shows of the plan: groups, checkpointed blocks, bytes per rank."""
        print(self)

    def __str__(self) -> str:
        return plan_text(self)

    def __repr__(self) -> str:
        return f"<WrapPlan {summary_line(self)}>"

    def to_json(self, indent: int | None = 1) -> str:
        """Serialise to JSON (diffable, editable, re-appliable)."""
        return json.dumps(asdict(self), indent=indent)

    @classmethod
    def from_json(cls, text: str) -> WrapPlan:
        """Parse a plan written by ``to_json``."""
        try:
            raw: dict[str, Any] = json.loads(text)
        except json.JSONDecodeError as exc:
            raise PlanError(f"plan is not valid JSON: {exc}") from exc
        if raw.get("version") != PLAN_VERSION:
            raise PlanError(f"plan version {raw.get('version')!r} is not supported (expected {PLAN_VERSION}); "
                            "regenerate it with `bmt-wrap dump --format json`")
        try:
            groups = [ShardGroupSpec(
                name=g["name"], checkpoint=g["checkpoint"], zero_level=g["zero_level"],
                buffers=[FlatBufferSpec(dtype=b["dtype"], requires_grad=b["requires_grad"],
                                        slots=[ParamSlot(**s) for s in b["slots"]],
                                        param_dtype=b.get("param_dtype"), reduce_dtype=b.get("reduce_dtype"),
                                        over_tp=b.get("over_tp", False),
                                        ep_split=b.get("ep_split", 0))
                         for b in g["buffers"]])
                for g in raw["groups"]]
            estimates = {k: MemoryEstimate(**v) for k, v in raw.get("estimates", {}).items()}
            return cls(groups=groups, prefetch_depth=raw["prefetch_depth"], order=raw["order"],
                       resident=raw["resident"], capture=raw["capture"], notes=raw["notes"],
                       self_checkpointing_off=raw.get("self_checkpointing_off", []),
                       estimates=estimates, version=raw["version"], memory_budget=raw.get("memory_budget"),
                       tensor_parallel=(TensorParallelPlan.from_dict(raw["tensor_parallel"])
                                        if raw.get("tensor_parallel") else None),
                       fused_loss=(FusedLossPlan.from_dict(raw["fused_loss"]) if raw.get("fused_loss") else None),
                       offload=raw.get("offload"),
                       pipeline=PipelinePlan.from_dict(raw["pipeline"]) if raw.get("pipeline") else None,
                       experts=ExpertPlan.from_dict(raw["experts"]) if raw.get("experts") else None,
                       context_parallel=(ContextParallelPlan.from_dict(raw["context_parallel"])
                                         if raw.get("context_parallel") else None))
        except (KeyError, TypeError) as exc:
            raise PlanError(f"plan JSON is missing or has a malformed field: {exc}") from exc

    def validate(self) -> None:
        """Check structural invariants: unique names, aligned non-overlapping offsets, known zero levels."""
        seen: set[str] = set()
        for g in self.groups:
            if g.zero_level not in (2, 3):
                raise PlanError(f"group {g.name!r}: zero_level must be 2 or 3, got {g.zero_level}")
            for b in g.buffers:
                end = 0
                for s in b.slots:
                    if s.offset % align_elems(b.dtype) or s.offset < end:
                        raise PlanError(f"group {g.name!r}: parameter {s.fqn!r} has a misaligned or "
                                        f"overlapping offset {s.offset}")
                    end = s.offset + s.numel
                    for n in s.names:
                        if n in seen:
                            raise PlanError(f"parameter {n!r} is placed twice in the plan")
                        seen.add(n)
        if self.prefetch_depth < 0:
            raise PlanError(f"prefetch_depth must be >= 0, got {self.prefetch_depth}")


# A plan as text for people: the summary line and tables ``bmt-wrap`` prints, and ``str(plan)``. It sits
# beside the dataclasses rather than in ``passes/`` so the runtime, which holds plans, can show one
# without loading ``torch.fx``.

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: int | None) -> str:
    """Human-readable bytes (binary units)."""
    if n is None:
        return "n/a"
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(value)} B" if unit == 0 else f"{value:.2f} {_UNITS[unit]}"


def summary_line(plan: WrapPlan) -> str:
    """One line: capture method, blocks, calls, prefetch depth, checkpointed blocks; blocks kept gathered
    through backward and the memory budget when there are any."""
    blocks = plan.blocks()
    ckpt = sum(g.checkpoint for g in blocks)
    kept = sum(g.zero_level == 2 for g in blocks)
    return (f"capture: {capture_text(plan)} | blocks: {len(blocks)} | calls: {len(plan.order)} | "
            f"prefetch depth: {plan.prefetch_depth} | checkpointed: {ckpt}/{len(blocks)}"
            + (f" | kept gathered: {kept}/{len(blocks)}" if kept else "")
            + (f" | memory budget: {fmt_bytes(plan.memory_budget)}" if plan.memory_budget is not None else ""))


def capture_text(plan: WrapPlan) -> str:
    """How the block order was captured; for a plan not captured yet, what the wrapper's first call does."""
    if plan.capture != "none":
        return plan.capture
    if any(n.startswith(SCHEDULE_NOTE + EXPORT_FAILED_NOTE) for n in plan.notes):
        return "at the first call (hooks on it: torch.export failed)"
    return "at the first call (torch.export)"


def shown_notes(plan: WrapPlan, verbose: bool = False) -> list[str]:
    """The notes worth a reader's attention; ``verbose`` adds the expected fallbacks."""
    # fx fails on every transformers model and torch.export then captures it (or will, at the first call):
    # nothing to act on.
    expected = SCHEDULE_NOTE + FX_FAILED_NOTE
    return [n for n in plan.notes if verbose or plan.capture not in ("export", "none") or not n.startswith(expected)]


def render_groups(plan: WrapPlan) -> str:
    """Table of shard groups: parameters, bytes, checkpointing, ZeRO level."""
    rows = [("group", "params", "bytes", "buffers", "checkpoint", "zero")]
    for g in plan.groups:
        rows.append((g.name, f"{g.param_numel():,}", fmt_bytes(g.param_bytes()),
                     ",".join(f"{b.dtype}{'' if b.gather_dtype == b.dtype else '->' + b.gather_dtype}"
                              f"{'' if b.requires_grad else '(frozen)'}" for b in g.buffers) or "-",
                     "-" if g.is_root else str(g.checkpoint).lower(), "-" if g.is_root else str(g.zero_level)))
    return _table(rows)


def _table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                                      enumerate(zip(r, widths, strict=True))).rstrip() for r in rows)


_ESTIMATE_ROWS: list[tuple[str, Callable[[MemoryEstimate], int | None]]] = [
    ("parameters (shard)", lambda e: e.params),
    ("gradients (shard)", lambda e: e.grads),
    ("optimizer state (shard)", lambda e: e.optimizer),
    ("= model states", lambda e: e.params + e.grads + e.optimizer),
    ("gathered parameters", lambda e: e.gathered),
    ("gradients in flight", lambda e: e.grads_in_flight),
    ("activations", lambda e: e.activations),
    ("= total per rank", lambda e: e.total),
    ("+ inside model.no_sync()", lambda e: e.no_sync_grads),
    ("all-gather / step", lambda e: e.comm_all_gather),
    ("reduce-scatter / step", lambda e: e.comm_reduce_scatter),
    ("all-reduce / step", lambda e: e.comm_all_reduce),
    ("= communicated / step", lambda e: e.comm_total),
    ("ZeRO-3 bound 3Ψ(N-1)/N", lambda e: e.zero3_bound),
]


#: The row of the step's peak (``MemoryEstimate.peak``), which the memory budget's note names too.
PEAK_ROW = "peak (by phase)"


_DISK_ROWS: list[tuple[str, Callable[[MemoryEstimate], int | None]]] = [
    ("offload file: read / step", lambda e: e.disk_read),
    ("offload file: written / step", lambda e: e.disk_written),
]


_HOST_ROWS: list[tuple[str, Callable[[MemoryEstimate], int | None]]] = [
    ("host -> device / step", lambda e: e.host_to_device),
    ("device -> host / step", lambda e: e.device_to_host),
]


_NODE_ROWS: list[tuple[str, Callable[[MemoryEstimate], int | None]]] = [
    ("  of which across replicas", lambda e: e.comm_replicas),
    ("  of which in a shard group", lambda e: e.comm_shard),
    ("  of which intra-node", lambda e: e.comm_intra_node),
    ("  of which inter-node", lambda e: e.comm_inter_node),
]


def layout_label(e: MemoryEstimate) -> str:
    """`` ZeRO-3``, `` HSDP RxS``, `` TP T x DP D`` or `` HSDP RxS x TP T`` for estimates made for a mesh
    (``estimate_mesh``, ``estimate_tp``), else nothing."""
    tp = f" TP {e.tp_size}" if e.tp_size is not None else ""
    dp = e.world_size // (e.tp_size or 1)
    if e.shard_size is None or e.shard_size == dp:
        return f"{tp} x DP {dp}" if tp else "" if e.shard_size is None else " ZeRO-3"
    return f" HSDP {dp // e.shard_size}x{e.shard_size}{' x' + tp if tp else ''}"


def render_estimates(plans: list[WrapPlan]) -> str:
    """Per-rank estimates table, one column per plan (each plan holds one world size's estimate)."""
    estimates = [est for p in plans for est in p.estimates.values()]
    # Activations need an input shape; a total without them must not pass for the whole footprint.
    partial = " without activations" if any(e.activations is None for e in estimates) else ""
    rows = [("per rank", *(f"N={e.world_size}{layout_label(e)}" for e in estimates))]
    rows += [(label + (partial if label == "= total per rank" else ""), *(fmt_bytes(get(e)) for e in estimates))
             for label, get in _ESTIMATE_ROWS]
    if any(e.peak is not None for e in estimates):  # after the total, which it is not: terms peak apart
        at = next(i for i, r in enumerate(rows) if r[0].startswith("= total per rank")) + 1
        rows.insert(at, (PEAK_ROW + partial, *(fmt_bytes(e.peak) if e.peak is not None else "-" for e in estimates)))
    if any(e.comm_inter_node is not None for e in estimates):
        rows += [(label, *(fmt_bytes(get(e)) if get(e) is not None else "-" for e in estimates))
                 for label, get in _NODE_ROWS]
    for present, extra in ((any(e.disk_read is not None for e in estimates), _DISK_ROWS),
                           (any(e.host_to_device is not None for e in estimates), _HOST_ROWS)):
        if present:
            rows += [(label, *(fmt_bytes(get(e)) if get(e) is not None else "-" for e in estimates))
                     for label, get in extra]
    if any(e.tp_size is not None for e in estimates):
        # TP moves activations: without a batch shape (--input) its bytes are unknown, not zero.
        rows.append(("  of which TP activations", *(fmt_bytes(e.comm_tp) if e.tp_size else "-" for e in estimates)))
    return _table(rows)


def heading(plan: WrapPlan, verbose: bool = False) -> list[str]:
    """The summary line, then the notes worth showing."""
    return [summary_line(plan), *(f"  note: {n}" for n in shown_notes(plan, verbose))]


def tables(plan: WrapPlan) -> list[str]:
    """The groups table, then the per-rank estimates if the plan has them."""
    lines = ["groups:", render_groups(plan)]
    if plan.tensor_parallel is not None:
        lines += tp_text(plan.tensor_parallel)
    if plan.fused_loss is not None:
        lines += fused_loss_text(plan.fused_loss)
    if plan.pipeline is not None:
        lines += pipeline_text(plan.pipeline)
    if plan.experts is not None:
        lines += experts_text(plan.experts)
    if plan.context_parallel is not None:
        lines += cp_text(plan.context_parallel)
    if plan.estimates:
        lines += ["estimates:", render_estimates([plan])]
    return lines


def plan_text(plan: WrapPlan) -> str:
    """What ``str(plan)`` shows: summary, notes, groups and per-rank estimates."""
    return "\n".join([*heading(plan), *tables(plan)])


def fused_loss_text(section: FusedLossPlan) -> list[str]:
    """Lines ``str(plan)`` and the CLI show for the section."""
    if section.pending:  # what the first call will do, not a failure
        return ["fused loss: requested: applied at the first call, whose captured graph shows the vocabulary "
                "head and its loss" if section.enabled else
                "fused loss: off (fused_loss=True fuses the vocabulary head and its loss found at the first call)"]
    if not section.found:
        return [f"fused loss: {'not fused' if section.enabled else 'off'}: {section.reason}"]
    pair = f"{section.projection} -> {' -> '.join([*section.steps, section.loss or '?'])}"
    lines = [f"fused loss: {pair}"]
    if section.reason is not None:
        lines.append(f"  not fused: {section.reason}")
    else:
        lines.append("  fused: one chunked op, no logits returned" if section.enabled else
                     "  off (BMTrainModelWrapper(model, fused_loss=True) or --fused-loss fuses it)")
    if section.logits_bytes is not None:
        saved = (section.unfused_bytes or 0) - (section.fused_bytes or 0)
        lines.append(f"  logits at this input: {fmt_bytes(section.logits_bytes)} ({section.rows} tokens x "
                     f"{section.vocab} words); the unfused pair holds {fmt_bytes(section.unfused_bytes)}, the "
                     f"fused op {fmt_bytes(section.fused_bytes)} "
                     f"({fmt_bytes(abs(saved))} {'less' if saved >= 0 else 'more: too few tokens to gain'})")
    else:
        lines.append("  logits' bytes unknown: they need an input shape (example_inputs= or --input)")
    return lines


def cp_text(section: ContextParallelPlan) -> list[str]:
    """The section as ``str(plan)`` and ``bmt-wrap plan --cp-size`` show it."""
    lines = [f"context parallelism: cp_size={section.cp_size}, {section.method} over {section.layers} attention(s) "
             f"({section.heads} heads, {section.kv_heads} KV heads, head dim {section.head_dim}, {section.dtype})"]
    if section.seq_len is None:
        return [*lines, "  per-rank bytes need a sequence: give example_inputs= (or bmt-wrap plan --input)"]
    lines.append(f"  each rank holds {section.local_tokens()} of {section.seq_len} tokens x batch {section.batch}"
                 + (f": activations {fmt_bytes(section.activations)} per rank" if section.activations is not None
                    else ""))
    moved = section.exchange()
    assert moved is not None
    lines.append(f"  {section.method} bytes sent per rank per step: {fmt_bytes(moved['step'])} (forward "
                 f"{fmt_bytes(moved['forward'])}, backward {fmt_bytes(moved['backward'])}, recompute "
                 f"{fmt_bytes(moved['recompute'])}); one attention holds {fmt_bytes(section.attention_bytes())} "
                 "while it runs")
    return lines
