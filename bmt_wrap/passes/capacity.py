"""A training process's peak memory per rank, and the largest model that fits a memory limit
(docs/design.md "Capacity: the process's peak").

``estimate`` counts the tensors a plan keeps; a process holds more: what it held before the model
(the process baseline: the interpreter, torch, bmt_wrap, the model library, and what a first real step
leaves: kernels' code, the allocator's heap), the model built before wrapping (a full copy, unless it
was built on the meta device and loaded by ``bmt.from_pretrained``/``bmt.load``), and the root group's
backward, which no block holds. Training's peak is counted by phase, because the terms ``estimate``
sums peak at different moments: activations are all held when backward starts and freed block by
block as the blocks' gradient shards arrive. Tensors are counted, not the allocator's holes: the
count is the process's peak when freed tensors leave the process (on CPU, glibc with
``MALLOC_MMAP_THRESHOLD_=65536``; docs/design.md "Capacity").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..base.dtypes import LOW_PRECISION, itemsize, master_dtype, to_dtype
from ..base.plan import GRADS_IN_FLIGHT, FlatBufferSpec, MemoryEstimate, WrapPlan
from ..errors import PlanError
from .activations import ActivationProfile
from .estimate import estimate, estimate_tp, tp_of
from .pipeline import RankEstimate, StageEstimate

#: The count's known error, kept beside it on ``plan --memory``'s answers instead of answering at 99% of the
#: limit: its largest shortfall measured against a job, 1.04x per rank (issue 49: a 2-rank Llama with
#: grouped-query attention, tied embeddings and a width not a power of two, state on disk; the same machine
#: also moved a process's resident baseline by 60 MiB within an hour). docs/design.md "Capacity".
MARGIN = 0.04
MARGIN_REASON = "its largest shortfall measured against a job, 1.04x per rank"


@dataclass(frozen=True)
class ProcessPeak:
    """Bytes per rank: what the layers add beside their tensors, then the larger of wrapping's peak above the
    process as it is before its first step and training's above the process baseline."""

    baseline: int
    wrapping: int  # the model built whole before wrapping, and the shards made from it (wrapping_bytes)
    training: int  # the largest of training's phases (training_phases)
    beside: int = 0  # beside the tensors the layers add above the baseline's (measured per layer)
    # The process before its first step (libraries imported, nothing run): what wrapping sits on. A first
    # step leaves tens of MiB for good (kernels paged in, the autograd engine, the optimizer's module), which
    # the baseline holds and wrapping, done before it, does not. None: the baseline.
    wrapping_baseline: int | None = None
    margin_fraction: float = 0.0  # of the count, kept beside it for the count's known error (MARGIN)

    @property
    def before_first_step(self) -> int:
        """The process wrapping sits on."""
        return self.baseline if self.wrapping_baseline is None else self.wrapping_baseline

    @property
    def counted(self) -> int:
        """The process's peak resident bytes as counted."""
        return self.beside + max(self.before_first_step + self.wrapping, self.baseline + self.training)

    @property
    def margin(self) -> int:
        """Bytes kept beside the count for its known error."""
        return round(self.counted * self.margin_fraction)

    @property
    def total(self) -> int:
        """The process's peak resident bytes that an answer must fit: the count and its margin."""
        return self.counted + self.margin


def _root_grad_bytes(plan: WrapPlan, world_size: int) -> int:
    t = tp_of(plan)
    return sum(b.full_grad_bytes(b.ranks(world_size, t)) for g in plan.groups if g.is_root
               for b in g.buffers if b.requires_grad)


def _shard_ranks(est: MemoryEstimate) -> int:
    """The shard group's size ``est`` was made for (under TP without a mesh, its world over T)."""
    if est.shard_size is not None:
        return est.shard_size
    return est.world_size // (est.tp_size or 1)


def _head_slot(plan: WrapPlan) -> tuple[int, FlatBufferSpec] | None:
    """The vocabulary head's gradient bytes (for a tied head, the shared weight's) and its root buffer; None
    without a head found."""
    weight = plan.fused_loss.weight if plan.fused_loss is not None else None
    if weight is None:
        return None
    return next(((slot.numel * itemsize(b.grad_dtype), b) for g in plan.groups if g.is_root for b in g.buffers
                 if b.requires_grad for slot in b.slots if weight in (slot.fqn, *slot.aliases)), None)


def _early_buffer(plan: WrapPlan, found: tuple[int, FlatBufferSpec] | None = None) -> FlatBufferSpec | None:
    """The root buffer reduce-scattered when the head's backward ends, before the blocks': the head's
    (``found``, else looked up), when the head is alone in it and untied (planner.reduced_alone)."""
    found = found or _head_slot(plan)
    if found is None:
        return None
    buf = found[1]
    # Its module regathers it at its call (apply_plan._regather_hook); a parameter of the root module itself
    # (a bare ``lm_head`` Parameter in a product) is gathered at the root's call, reduced with the rest.
    return buf if len(buf.slots) == 1 and not buf.slots[0].aliases and "." in buf.slots[0].fqn else None


def _head_grad_bytes(plan: WrapPlan, world_size: int) -> tuple[int, int]:
    """The root gradient that exists while the blocks' backward starts: the vocabulary head's, the root's
    first use in backward; without a head found, the root's whole. Then the part of it reduce-scattered and
    freed when the head's backward ends (``_early_buffer``'s whole gradient), else 0."""
    found = _head_slot(plan)
    if found is None:
        return _root_grad_bytes(plan, world_size), 0
    early = _early_buffer(plan, found)
    return found[0], early.full_grad_bytes(early.ranks(world_size, tp_of(plan))) if early is not None else 0


def _grad_shards_beside(plan: WrapPlan, est: MemoryEstimate) -> int:
    """The gradient shards a rank holds from the blocks' backward end through the root's gradient: every
    shard but the root's that its reduce-scatter makes last, after the blocks' (all of the root's but the
    early head's, ``_early_buffer``, which exists from before the blocks' backward). With the shards off the
    device (on disk or the host: ``shards_off_device``) only those in flight (``est.grads``), and never more
    than the same moment holds with them on it: the root's shard comes after its gradient either way (at
    2 ranks, GPT-2 of width 768 offloaded answered fewer layers than in memory, counting the root's shard
    there as in flight)."""
    n, t, early = _shard_ranks(est), tp_of(plan), _early_buffer(plan)
    every = late = 0
    for g in plan.groups:
        for b in g.buffers:
            if b.requires_grad:
                shard = b.shard_numel(b.ranks(n, t)) * itemsize(b.dtype)
                every += shard
                late += shard if g.is_root and b is not early else 0
    return min(est.grads, every - late)


def training_phases(plan: WrapPlan, est: MemoryEstimate) -> dict[str, int]:
    """Bytes per rank above the baseline at the moments a step peaks. All hold the shards, their
    optimizer state and the gathered buffers (the root's stay gathered from forward to its gradient).

    - ``vocabulary head and loss``: every activation the forward kept and what the head and its
      cross-entropy hold at their peak beyond them (``FusedLossPlan.peak_bytes``: unfused, at the loss's
      backward, the gradients of the log-probabilities and of the logits; fused, in forward, one chunk and
      the head's gradient). No root gradient exists yet.
    - ``backward start``: every activation the forward kept, and the head's gradient (the root's first use
      in backward).
    - ``blocks' backward end``: the head's gradient (none when it was reduced before the blocks: an untied
      head alone in its buffer, ``_head_grad_bytes``), every block's gradient shard, the gradients in
      flight and one recompute's saved tensors (under expert parallelism with the all-to-all buffers of
      one MoE layer's exchange, ``est.exchange``). The activations are gone by then: each block's went with
      its backward; but a KV cache the blocks were passed stays until the first block's recompute is done
      (the calls keep their arguments for it).
    - ``root's gradient``: after the blocks, the root's other uses (the embedding's) make their gradients:
      the root's full gradient (less the head's buffer, reduced before the blocks) and, for a tied weight,
      one use's gradient and their sum, beside every gradient shard but the root's still to come
      (``_grad_shards_beside``). Its reduce-scatter starts from a copy of that gradient in the gathered
      storage (``engine._full_grad_buffer``) and writes the shard as the other ranks' pieces arrive, on the
      communicator's thread: the gradient autograd made goes as soon as the root's backward node returns,
      before the pieces arrive, so the shard's pages are written after it is gone (its receipt is the
      shard itself at 2 ranks, one scratch piece beside it at more, ``comm/gloo.py``: less than the
      gradient it follows). Counting the shard and a receipt beside the gradient put the plan 125 MiB a
      rank over the fused Llama's root (2 ranks, vocabulary 128,256, width 256). The recompute and the
      cache are gone.
    - ``blocks' backward start``: every kept activation beside the first block's backward
      (``_first_block_backward``), for a plan with blocks. With the shards offloaded it is where the blocks'
      backward peaks, since their gradient shards leave as they come; in memory the end is usually higher,
      but this moment is there too, and a placement that moves more off the process must count no more at
      any moment.

    The forward's peak is below the first two (no gradient yet, no pair's peak but the fused op's, which is
    the first), the optimizer step's below the last two (no recompute, no root gradient). Without an
    activation profile the activations count at backward start.
    """
    n = _shard_ranks(est)
    head, early = _head_grad_bytes(plan, n)
    full = _root_grad_bytes(plan, n) - early
    held = est.params + est.optimizer + est.gathered
    kept = (est.activations or 0) - est.activations_recompute
    shards = _grad_shards_beside(plan, est)
    phases = {"backward start": held + head + kept,
              "blocks' backward end": held + (0 if early else head) + shards + est.grads_in_flight
              + est.activations_recompute + est.exchange + est.activations_objects,
              "root's gradient": held + full + _largest_root_use(plan) + shards}
    if plan.blocks():
        phases["blocks' backward start"] = phases["backward start"] + _first_block_backward(plan, est)
    if plan.fused_loss is not None and plan.fused_loss.logits_bytes is not None:
        phases = {"vocabulary head and loss": held + kept + plan.fused_loss.peak_bytes, **phases}
    return phases


def _first_block_backward(plan: WrapPlan, est: MemoryEstimate) -> int:
    """The first block's backward beyond what backward's start holds: one recompute's saved tensors (and
    one MoE layer's all-to-all buffers, ``est.exchange``), the gradients in flight, and the gradient shards there are then: the early head's (``_early_buffer``) and
    one reduce-scatter's of a block in flight, no more than ``est.grads`` (with the shards offloaded, those
    in flight). The root's other shards come after the blocks' backward. Offloaded, the blocks' backward
    peaks here (measured, 2 ranks, GPT of width 1024: the peak grew by 0.66 MiB a layer from 8 to 24
    layers, its checkpointed inputs 0.5 MiB and each layer's objects the rest; the blocks' backward end did
    not grow)."""
    n, t, early = _shard_ranks(est), tp_of(plan), _early_buffer(plan)
    block = max((sum(b.shard_numel(b.ranks(n, t)) * itemsize(b.dtype) for b in g.buffers if b.requires_grad)
                 for g in plan.blocks()), default=0)
    head = early.shard_numel(early.ranks(n, t)) * itemsize(early.dtype) if early is not None else 0
    # A first block that kept its activations (a budget's choice) recomputes nothing: they are among the kept.
    first = plan.group(plan.order[-1]) if plan.order else plan.blocks()[-1]
    recompute = est.activations_recompute if first.checkpoint else 0
    return min(est.grads, head + GRADS_IN_FLIGHT * block) + est.grads_in_flight + recompute + est.exchange


def training_peak(plan: WrapPlan, est: MemoryEstimate) -> int:
    """Bytes per rank above the baseline at a training step's peak: the largest of its phases."""
    return max(training_phases(plan, est).values())


def with_peak(plan: WrapPlan, est: MemoryEstimate) -> MemoryEstimate:
    """``est`` with its step's peak (``training_peak``), which the plan's table prints beside the total."""
    return replace(est, peak=training_peak(plan, est))


def scheduled_estimate(plan: WrapPlan, world_size: int, activations: ActivationProfile | None) -> MemoryEstimate:
    """The estimate a schedule shows and a memory budget is fitted to (one count, so the budget's note and the
    table agree): ``estimate``, or under TP ``estimate_tp`` without a batch (its traffic unknown), with its peak;
    under expert parallelism with one MoE layer's all-to-all buffers for the measured batch's tokens."""
    est = (estimate(plan, world_size, activations) if plan.tensor_parallel is None
           else estimate_tp(plan, world_size, None, activations))
    if plan.experts is not None and activations is not None and activations.tokens:
        est.exchange = plan.experts.exchange_bytes(activations.tokens)  # beside a block's backward
    return with_peak(plan, est)


def _largest_root_use(plan: WrapPlan) -> int:
    """The most a second use of a root parameter makes before autograd adds it in: for a tied weight,
    the second use's gradient and their sum (measured on GPT-2 and Qwen2, whose embedding and head share
    one). A parameter of one name and one use writes its gradient straight into autograd's buffer, which
    the full gradient counts: an untied Llama head cost 29.3 MiB per rank at the blocks' backward end,
    where counting a use for it as well gave 41.1 (2 ranks, 4 layers, width 384, vocabulary 8000)."""
    return max((2 * slot.numel * itemsize(b.grad_dtype) for g in plan.groups if g.is_root for b in g.buffers
                if b.requires_grad for slot in b.slots if slot.aliases), default=0)


def process_peak(plan: WrapPlan, est: MemoryEstimate, baseline: int, built_full: bool = True,
                 beside: int = 0, wrapping_baseline: int | None = None,
                 margin_fraction: float = 0.0) -> ProcessPeak:
    """Peak bytes per rank of a process training ``plan`` at ``est``'s world size. ``built_full``: the model
    was built with real weights before wrapping (False when built on the meta device and loaded);
    ``beside``: the resident bytes beside the tensors the model's layers add above the baseline's;
    ``wrapping_baseline``: the process before its first step, under wrapping
    (``bmt_wrap.process_baseline``); ``margin_fraction``: of the count, kept beside it (``MARGIN``)."""
    wrapping = wrapping_bytes(plan, est) if built_full else 0
    return ProcessPeak(baseline, wrapping, training_peak(plan, est), beside, wrapping_baseline, margin_fraction)


def pipeline_peak(plan: WrapPlan, stages: Sequence[StageEstimate | RankEstimate], baseline: int,
                  schedule: str = "GPipe", built_full: bool = True, beside: int = 0,
                  wrapping_baseline: int | None = None, margin_fraction: float = 0.0) -> tuple[int, ProcessPeak]:
    """The stage whose ranks peak highest under ``schedule`` (its index in ``stages``) and that peak, for
    ``plan`` cut into ``stages`` (``estimate_pipeline``; with V stages per rank, ``rank_estimates``: the
    pipeline rank): its shards, its blocks held for the step with their summed gradients, the root group,
    and the activations the schedule holds (``peak``). Every rank builds the whole model before wrapping
    (``wrapping_bytes`` over every group: more than a stage keeps, never less)."""
    i = max(range(len(stages)), key=lambda i: stages[i].peak(schedule))
    worst = stages[i]
    wrapping = wrapping_bytes(plan, worst.zero) if built_full else 0
    return i, ProcessPeak(baseline, wrapping, worst.peak(schedule), beside, wrapping_baseline, margin_fraction)


def cut_bytes(plan: WrapPlan, world_size: int) -> tuple[int, int]:
    """What tensor and expert parallelism cut from a model built whole before sharding it (every TP slice
    but this rank's, every expert but this EP rank's: the plan counts the kept parts only), and the most one
    cut holds beside the model as built: a parameter's kept part (``split_parameter``'s slice, an EP rank's
    experts) and, at more than one rank, an expert tensor's copy for rank 0's broadcast (the whole packed
    tensor, or one listed expert's: ``wrapping/experts._from_rank0``)."""
    removed = held = 0
    tp = plan.tensor_parallel
    if tp is not None:
        # every name of a sharded parameter (its aliases too) -> (its canonical name, its element size)
        slots = {n: (s.fqn, itemsize(b.dtype)) for g in plan.groups for b in g.buffers for s in b.slots
                 for n in (s.fqn, *s.aliases)}
        seen: set[str] = set()
        for entry in tp.entries:
            for name in entry.split_dims:
                fqn = f"{entry.module}.{name}" if entry.module else name
                if fqn not in slots or slots[fqn][0] in seen:  # a tied weight is cut once
                    continue
                canonical, size = slots[fqn]
                seen.add(canonical)
                full, local = math.prod(entry.full_shapes[name]), math.prod(entry.local_shape(name, tp.tp_size))
                removed += (full - local) * size
                held = max(held, local * size)
    experts = plan.experts
    if experts is not None and experts.ep_size > 1:
        for layer in experts.layers:
            per_elem = layer.expert_bytes // sum(math.prod(s) for s in layer.params.values())
            for shape in layer.params.values():
                whole = math.prod(shape) * per_elem
                removed += whole - whole // experts.ep_size
                copy = (whole if layer.layout == "packed" else whole // shape[0]) if world_size > 1 else 0
                held = max(held, copy + (whole // experts.ep_size if layer.layout == "packed" else 0))
    return removed, held


def wrapping_bytes(plan: WrapPlan, est: MemoryEstimate) -> int:
    """Bytes per rank above the process at wrapping's peak, for a model built whole before it: the model as
    built, and at its peak while one group is sharded (groups go in the plan's order, each letting its
    original parameters go once its shard holds them): the shards made so far, less the originals already
    gone, and at more than one rank the group's largest buffer packed whole for rank 0's broadcast. Under
    tensor or expert parallelism the model is built whole and cut to this rank's parts first (``cut_bytes``),
    so the peak is the larger of the model as built with one cut's bytes and the kept parts' sharding.

    Shards kept off the device (``offload``) count only while their group is made. The gathered buffers
    count nothing: the pool's are allocated at wrapping but first written by a forward. Measured, 2 ranks,
    GPT of width 1024 at 21 layers: 113 MiB above the model as built (this count 64.5 MiB; the rest is a first
    wrap's one-time imports, which the process before its first step holds), where keeping every original
    to the end peaked at 706."""
    n, t = _shard_ranks(est), tp_of(plan)
    kept = est.disk_read is None and est.host_to_device is None
    made = gone = peak = 0
    for g in plan.groups:
        shard = sum(b.shard_numel(b.ranks(n, t)) * itemsize(b.dtype) for b in g.buffers)
        packed = max((b.padded_numel(b.ranks(n, t)) * itemsize(b.dtype) for b in g.buffers
                      if b.ranks(n, t) > 1), default=0)
        peak = max(peak, made + shard - gone + packed)
        made += shard if kept else 0
        gone += g.param_bytes()
    removed, held = cut_bytes(plan, est.world_size)
    return sum(g.param_bytes() for g in plan.groups) + max(peak, removed + held if removed else 0)


def optimizer_on_disk(plan: WrapPlan, est: MemoryEstimate, buffer_bytes: int) -> tuple[MemoryEstimate, int]:
    """``est`` with the optimizer state in a file (``bmt.optim.AdamDiskOptimizer``), and the bytes it reads
    per step per rank (it writes as many back): memory keeps only what a step touches of the staging buffer
    (``staging_bytes``), and every step streams the whole state through it once."""
    small = replace(est, optimizer=staging_bytes(plan, est, buffer_bytes))
    return (small if est.peak is None else with_peak(plan, small)), est.optimizer


def staging_bytes(plan: WrapPlan, est: MemoryEstimate, buffer_bytes: int) -> int:
    """The resident part of ``AdamDiskOptimizer``'s ``buffer_bytes`` staging buffer on a CPU rank: its pages
    are mapped at their first write and every pass fills it from the front, so it holds its largest pass.
    A pass covers one flat buffer's shard (a region of the state file) up to the buffer: its moments (and an
    fp32 master with the gradient's fp32 copy, for a half-precision shard) per element. Counting the whole
    buffer put the plan 3-4% over 2-rank jobs whose largest pass fills a third of its 32 MiB."""
    n, t = _shard_ranks(est), tp_of(plan)
    largest = 0
    for b in (b for g in plan.groups for b in g.buffers if b.requires_grad):
        state = itemsize(master_dtype(b.dtype))  # the moments' (and master's) dtype, as AdamDiskOptimizer's
        master = to_dtype(b.dtype) in LOW_PRECISION
        per_elem = (3 if master else 2) * state + (4 if master else 0)
        largest = max(largest, min(buffer_bytes, b.shard_numel(b.ranks(n, t)) * per_elem))
    return min(largest, est.optimizer)


def largest_fitting(peak_of: Callable[[int], int], limit: int, start: int = 1) -> tuple[int, int]:
    """The largest ``k >= 1`` with ``peak_of(k) <= limit`` (peaks grow with ``k``), and its peak.
    ``PlanError`` when even ``k = 1`` does not fit."""
    # Each probe builds and captures a model (seconds for a deep one), and peaks are nearly affine in layers and
    # nearly quadratic in a sequence's length (attention's scores): a probe where the curve through the three
    # nearest known peaks meets the limit, then its neighbour, usually settles it in five or six probes where
    # doubling and bisection took ten to twelve. A round of the curve that does not halve the bracket is
    # followed by one doubling or bisection step, so the bracket halves at least every three probes.
    peaks: dict[int, int] = {}

    def fits(k: int) -> bool:
        if k not in peaks:
            peaks[k] = peak_of(k)
        return peaks[k] <= limit

    if not fits(1):
        raise PlanError(f"even the smallest model (1) needs {peaks[1]:,} bytes per rank, over the limit of "
                        f"{limit:,}: give more memory or more ranks")
    lo, hi = 1, None  # peaks[lo] fits; hi, once known, does not

    def probe(k: int) -> None:
        nonlocal lo, hi
        if fits(k):
            lo = k
        else:
            hi = k

    def settled() -> bool:
        return hi is not None and hi - lo <= 1

    def halved(before: tuple[int, int | None]) -> bool:
        """Whether the bracket shrank to half since ``before`` (or, unbounded, its fit doubled)."""
        lo0, hi0 = before
        if hi0 is None:
            return hi is not None or lo >= 2 * lo0
        return hi is not None and 2 * (hi - lo) <= hi0 - lo0

    probe(max(start, 2))
    while not settled():
        guess = _on_the_curve(peaks, lo, hi, limit)
        # Above every known k the curve may run far off (a nearly flat slope): at most 8x the largest fit.
        top = hi - 1 if hi is not None else 8 * lo
        before = (lo, hi)
        if guess is not None and lo < top:
            k = max(lo + 1, min(guess, top))
            probe(k)
            if guess <= top and not settled():  # the answer is usually the guess or its neighbour
                probe(k + 1 if lo == k else k - 1)
        if not settled() and not halved(before):
            probe(2 * lo if hi is None else (lo + hi) // 2)
    return lo, peaks[lo]


def _on_the_curve(peaks: dict[int, int], lo: int, hi: int | None, limit: int) -> int | None:
    """The largest k above ``lo`` whose peak, on the parabola (or, with two points, the line) through the
    known peaks nearest ``lo`` and ``hi``, is within ``limit``; None without a rising curve."""
    near = sorted(sorted(peaks, key=lambda k: (abs(k - lo) if hi is None else min(abs(k - lo), abs(k - hi)), k))[:3])
    if len(near) < 2:
        return None
    if len(near) == 3:
        (x0, x1, x2), (y0, y1, y2) = near, (peaks[k] for k in near)
        d01, d12 = (y1 - y0) / (x1 - x0), (y2 - y1) / (x2 - x1)
        a = (d12 - d01) / (x2 - x0)
        b = d01 - a * (x0 + x1)
        c = y0 - a * x0 * x0 - b * x0
        if a > 0 and b * b - 4 * a * (c - limit) >= 0:  # the rising branch's root
            return int((-b + (b * b - 4 * a * (c - limit)) ** 0.5) / (2 * a))
        near = near[1:] if abs(near[0] - lo) > abs(near[2] - lo) else near[:2]
    (x0, x1), (y0, y1) = near, (peaks[k] for k in near)
    if y1 <= y0:
        return None
    return x0 + int((limit - y0) * (x1 - x0) // (y1 - y0))
