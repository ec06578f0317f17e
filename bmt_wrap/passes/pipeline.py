"""Where pipeline stages are cut, pure: the plan's pipeline section (``base/pipeline_plan.py``).

Stages are cut between discovered blocks, in call order, balanced by each block's forward FLOPs when the
plan was made from inputs (parameter bytes breaking ties), else by its parameter bytes (a contiguous split
minimising the largest stage). The root's parameters go where the forward uses them:
those used before the first block to the first stage, after the last block to the last stage; one used on
both sides (a tied embedding and head) to both. Their place is read from the captured graph when there is
one (a parameter's first and last use against the first and last block call), else from module
registration order, which the first call's capture then checks (``check_root_order``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import fx, nn

from ..base.dtypes import itemsize
from ..base.pipeline_plan import PipelinePlan, PipelineStage
from ..base.plan import (
    ROOT,
    FlatBufferSpec,
    MemoryEstimate,
    ParamInfo,
    ShardGroupSpec,
    WrapPlan,
    fmt_bytes,
    layout_buffers,
)
from ..errors import PipelineError, PlanError
from .activations import ActivationProfile
from .estimate import estimate, gathered_traffic, held_gathered, tp_of


def plan_pipeline(model: nn.Module, plan: WrapPlan, size: int, microbatches: int,
                  graph: fx.Graph | None = None, *, virtual: int = 1,
                  activations: ActivationProfile | None = None) -> PipelinePlan:
    """The pipeline section for ``plan`` over ``size`` ranks of ``virtual`` stages each (stage ``s`` on rank
    ``s % size``); ``graph``: the captured forward, if any; ``activations``: its profile at a batch, whose
    FLOPs balance the stages."""
    if not isinstance(size, int) or size < 1:
        raise PipelineError(f"pp_size={size!r}: a positive int")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise PipelineError(f"pp_microbatches={microbatches!r}: a positive int")
    check_virtual(virtual)
    order = list(dict.fromkeys(plan.order or [g.name for g in plan.blocks()]))
    total = size * virtual
    if len(order) < total:
        per = f" x pp_virtual_stages={virtual}" if virtual > 1 else ""
        fix = f"pp_size x pp_virtual_stages <= {len(order)}" if virtual > 1 else f"pp_size <= {len(order)}"
        raise PipelineError(f"{type(model).__name__} has {len(order)} block(s) ({', '.join(order) or 'none found'}) "
                            f"for {total} pipeline stages (pp_size={size}{per}): every stage needs at least one "
                            f"block. Use {fix}, or a model with more layers")
    if len(plan.order) != len(order):
        raise PipelineError(f"{type(model).__name__} calls a block more than once per forward ({plan.order}); "
                            "pipeline stages are cut between blocks called once each, in order")
    cost = {g.name: g.param_bytes() for g in plan.blocks()}
    cuts = balanced_split(block_costs(order, cost, activations), total)
    stages = [PipelineStage(order[a:b]) for a, b in zip([0, *cuts], [*cuts, len(order)], strict=True)]
    root = plan.group(ROOT) if any(g.is_root for g in plan.groups) else None
    names = [s.fqn for _, s in root.slots()] if root is not None else []
    if graph is not None:
        sides, source = root_sides_from_graph(graph, names, _aliases(root), order), "graph"
    else:
        sides, source = root_sides_from_registration(model, names, order), "registration"
    for name in names:
        before, after = sides.get(name, (True, False))
        if before:
            stages[0].root.append(name)
        if after and (size > 1 or not before):
            stages[-1].root.append(name)
    bytes_of = {s.fqn: s.numel * itemsize(b.dtype) for b, s in (root.slots() if root is not None else [])}
    for s in stages:
        s.param_bytes = sum(cost[b] for b in s.blocks) + sum(bytes_of[n] for n in s.root)
    notes = [f"root parameter {n!r} is used on stages 0 and {total - 1}: both hold it, its gradient is the sum "
             "of both" for n in names if size > 1 and n in stages[0].root and n in stages[-1].root]
    return PipelinePlan(size, microbatches, stages, root_source=source, notes=notes, virtual=virtual)


def check_virtual(virtual: object) -> None:
    """``PipelineError`` unless ``virtual`` (stages per rank) is a positive int."""
    if not isinstance(virtual, int) or isinstance(virtual, bool) or virtual < 1:
        raise PipelineError(f"pp_virtual_stages={virtual!r}: a positive int (the stages each pipeline rank runs; "
                            "1 for one contiguous run of blocks per rank)")


def balanced_split(costs: list[int], parts: int) -> list[int]:
    """Cut points (``parts - 1`` indices) of a contiguous split of ``costs`` minimising the largest part."""
    n = len(costs)
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(parts + 1)]  # best[k][i]: first i costs in k parts
    cut = [[0] * (n + 1) for _ in range(parts + 1)]
    best[0][0] = 0
    for k in range(1, parts + 1):
        for i in range(k, n + 1):
            for j in range(k - 1, i):  # the last part holds costs[j:i]
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    points, i = [], n
    for k in range(parts, 1, -1):
        i = cut[k][i]
        points.append(i)
    return sorted(points)


def block_costs(order: list[str], param_bytes: dict[str, int], activations: ActivationProfile | None) -> list[int]:
    """What each block of ``order`` weighs in the stage split: its forward FLOPs at the profiled batch (a
    stage's compute, which paces the pipeline) when the profile counted some for every block, the last one
    with the FLOPs after it (a head and its loss, which only the last stage runs), its parameter bytes
    breaking ties (they weigh less than one FLOP); else its parameter bytes alone (no inputs known)."""
    flops = dict.fromkeys(order, 0)
    for call in activations.calls if activations is not None else []:
        if call.block in flops:
            flops[call.block] += call.flops
    if not all(flops.values()):
        return [param_bytes[b] for b in order]
    assert activations is not None  # every block's FLOPs came from it
    flops[order[-1]] += activations.tail_flops
    scale = sum(param_bytes[b] for b in order) + 1
    return [flops[b] * scale + param_bytes[b] for b in order]


def root_sides_from_graph(graph: fx.Graph, names: list[str], aliases: dict[str, str],
                          blocks: list[str]) -> dict[str, tuple[bool, bool]]:
    """For each root parameter, whether the forward uses it before the first block call and after the last
    one (a parameter of a module the graph calls counts as used there)."""
    nodes = list(graph.nodes)
    position = {n: i for i, n in enumerate(nodes)}
    calls = [i for i, n in enumerate(nodes) if n.op == "call_module" and str(n.target) in blocks]
    first, last = (calls[0], calls[-1]) if calls else (len(nodes), -1)
    sides: dict[str, tuple[bool, bool]] = {}
    for i, n in enumerate(nodes):
        if n.op == "get_attr":  # one node per parameter, read by every op that uses it
            used, at = [aliases.get(str(n.target), str(n.target))], [position[u] for u in n.users] or [i]
        elif n.op == "call_module" and str(n.target) not in blocks:
            prefix = f"{n.target}."
            used, at = [aliases.get(a, a) for a in aliases if a.startswith(prefix)], [i]
        else:
            continue
        for name in used:
            if name not in names:
                continue
            before, after = sides.get(name, (False, False))
            if any(first < j < last for j in at):
                raise PlanError(f"root parameter {name!r} is used between two blocks; pipeline stages are cut "
                                "between blocks that only pass activations on: move it into a block")
            sides[name] = (before or any(j < first for j in at), after or any(j > last for j in at))
    return sides


def root_sides_from_registration(model: nn.Module, names: list[str], blocks: list[str]
                                 ) -> dict[str, tuple[bool, bool]]:
    """The same from module registration order: a parameter's modules registered before the first block's
    are used before it, after the last block's after it (the root's own parameters count as before)."""
    index = {name: i for i, (name, _) in enumerate(model.named_modules(remove_duplicate=False))}
    first = min(index[b] for b in blocks)
    last = max(i for name, i in index.items() if any(name == b or name.startswith(b + ".") for b in blocks))
    canonical = {id(p): n for n, p in model.named_parameters()}
    sides: dict[str, tuple[bool, bool]] = {}
    wanted = set(names)
    for full, p in model.named_parameters(remove_duplicate=False):
        name = canonical[id(p)]
        if name not in wanted:
            continue
        i = index.get(full.rpartition(".")[0], 0)
        before, after = sides.get(name, (False, False))
        sides[name] = (before or i < first, after or i > last)
    return sides


def check_root_order(section: PipelinePlan, graph: fx.Graph, plan: WrapPlan) -> None:
    """Raise ``PlanError`` when the captured forward uses root parameters on other stages than the
    registration order placed them (at wrap time, without a capture)."""
    root = plan.group(ROOT) if any(g.is_root for g in plan.groups) else None
    if root is None or section.root_source == "graph":
        return
    names = [s.fqn for _, s in root.slots()]
    blocks = [b for s in section.stages for b in s.blocks]
    sides = root_sides_from_graph(graph, names, _aliases(root), blocks)
    placed = {n: (n in section.stages[0].root, n in section.stages[-1].root) for n in names}
    wrong = [n for n in names if n in sides and sides[n] != placed[n] and (sides[n][0] or sides[n][1])]
    if wrong:
        raise PlanError(f"the first forward uses root parameters {wrong[:4]} on other pipeline stages than their "
                        "module order suggested when the model was wrapped (it could not be captured without "
                        "inputs): pass example_inputs= to BMTrainModelWrapper so the stages are planned from "
                        "the captured forward")


def stage_root_spec(root: ShardGroupSpec, names: Iterable[str]) -> ShardGroupSpec:
    """The root group restricted to ``names``, each buffer laid out again over its remaining slots (same
    dtypes and flags, aligned offsets): one stage's, or several stages', root parameters."""
    keep = set(names)
    buffers: list[FlatBufferSpec] = []
    for b in root.buffers:
        infos = [ParamInfo(s.fqn, list(s.shape), b.dtype, b.requires_grad, list(s.aliases), b.param_dtype,
                           b.reduce_dtype, b.over_tp) for s in b.slots if s.fqn in keep]
        if infos:
            buffers += layout_buffers(infos)
    return ShardGroupSpec(ROOT, buffers, root.checkpoint, root.zero_level)


def _aliases(root: ShardGroupSpec | None) -> dict[str, str]:
    """Every name of a root parameter (aliases too) -> its canonical name."""
    return {n: s.fqn for _, s in (root.slots() if root is not None else []) for n in s.names}


@dataclass
class StageEstimate:
    """One stage's bytes per rank and per step under the one-liner's GPipe loop (``wrapping/pipeline.py``:
    a stage's blocks gathered once per step, their gradients summed over the micro-batches and reduced once)."""

    stage: int
    blocks: int
    zero: MemoryEstimate  # ZeRO-3 over the stage's data-parallel ranks: shards, pooled gathers, traffic
    gathered_step: int  # the stage's blocks held gathered through the step (and their full gradients summed)
    boundary_in: int | None  # bytes one micro-batch's activations from the previous stage take (None: unknown)
    boundary_out: int | None  # to the next stage
    held_gpipe: int | None  # received activations GPipe holds until their backward: all M micro-batches'
    held_1f1b: int | None  # 1F1B holds at most (P - stage) of them
    p2p: int | None  # bytes this rank sends and receives per step (activations forward, gradients back)
    zero_traffic: int = 0  # the stage's all-gathers (each group once per step) and reduce-scatters per rank
    microbatches: int = 1
    in_flight_1f1b: int = 1  # micro-batches whose forward 1F1B has run and backward not: min(M, P - stage)

    @property
    def total(self) -> int:
        """Memory per rank at the step's peak: shards, the held gathered blocks and their summed gradients,
        the root group and activations (GPipe's received ones included)."""
        root = self.zero.gathered  # the root group (the blocks' pooled buffers are the held ones here)
        return (self.zero.params + self.zero.grads + self.zero.optimizer + 2 * self.gathered_step + root
                + (self.zero.activations or 0) + (self.held_gpipe or 0))

    def peak(self, schedule: str = "GPipe") -> int:
        """``total`` under ``schedule``: GPipe (the loop users write) holds every micro-batch's activations
        and received inputs until its backward; 1F1B holds ``in_flight_1f1b`` micro-batches' of each."""
        if schedule.lower() == "gpipe":
            return self.total
        kept = self.zero.activations or 0
        return (self.total - kept - (self.held_gpipe or 0) + kept * self.in_flight_1f1b // self.microbatches
                + (self.held_1f1b or 0))


def estimate_pipeline(plan: WrapPlan, section: PipelinePlan, shard_size: int,
                      activations: ActivationProfile | None = None) -> list[StageEstimate]:
    """Each stage's ``StageEstimate`` with ``shard_size`` data-parallel ranks per stage; activations (the
    whole local batch's, cut into ``section.microbatches``) give the boundaries and what the schedules hold.
    Under the plan's tensor parallelism: per TP rank (its slices; whole parameters sharded over shard x tp)."""
    root = plan.group(ROOT) if any(g.is_root for g in plan.groups) else None
    t = tp_of(plan)
    inputs = {c.block: c.input_bytes for c in (activations.calls if activations is not None else [])}
    blocks = [b for s in section.stages for b in s.blocks]
    m, p = section.microbatches, len(section.stages)
    out = []
    for i, s in enumerate(section.stages):
        groups = [plan.group(b) for b in s.blocks]
        if root is not None and s.root:
            groups.insert(0, stage_root_spec(root, s.root))
        sub = WrapPlan(groups=groups, prefetch_depth=plan.prefetch_depth, order=list(s.blocks),
                       tensor_parallel=plan.tensor_parallel)
        own = None
        if activations is not None:
            own = ActivationProfile(activations.root_bytes if i in (0, p - 1) else 0,
                                    [c for c in activations.calls if c.block in s.blocks], activations.object_bytes)
        zero = estimate(sub, shard_size, own)
        zero.gathered = sum(held_gathered(g, shard_size, t) for g in groups if g.is_root)
        step = sum(held_gathered(g, shard_size, t) for g in groups if not g.is_root)
        # What crosses a boundary: the inputs of the next stage's first block (its hidden states, and
        # whatever else it reads that the first stage computed), one micro-batch's worth.
        first = blocks.index(s.blocks[0])
        b_in = inputs.get(s.blocks[0]) // m if i > 0 and s.blocks[0] in inputs else None if i > 0 else 0
        nxt = blocks[first + len(s.blocks)] if i < p - 1 else None
        b_out = (inputs[nxt] // m if nxt in inputs else None) if nxt is not None else 0
        known = b_in is not None and b_out is not None
        out.append(StageEstimate(
            i, len(s.blocks), zero, step, b_in, b_out,
            held_gpipe=m * b_in if b_in is not None else None,
            held_1f1b=min(m, p - i) * b_in if b_in is not None else None,
            p2p=2 * m * (b_in + b_out) if known else None,
            zero_traffic=sum(gathered_traffic(g, shard_size, t) for g in groups) + zero.comm_reduce_scatter,
            microbatches=m, in_flight_1f1b=min(m, p - i)))
    return out


def interleaved_in_flight(size: int, virtual: int, microbatches: int, rank: int) -> int:
    """The most micro-batch x stage forwards torch's Interleaved1F1B has run on ``rank`` of ``size`` and not
    yet run backward: its warm-up (torch's ``_get_warmup_ops``, rounds of ``M // max(1, M // P)``) and one
    more in the steady state, at most every one (M x V)."""
    per_round = microbatches // max(1, microbatches // size)
    return min(microbatches * virtual, (virtual - 1) * per_round + 2 * (size - 1 - rank) + 1)


@dataclass
class RankEstimate:
    """One pipeline rank's bytes per rank and per step with ``pp_virtual_stages=V``: the sum of its V stages'
    (every block of the rank held gathered for the step)."""

    rank: int
    stages: list[StageEstimate]
    in_flight: int  # micro-batch x stage forwards Interleaved1F1B holds at most (``interleaved_in_flight``)

    @property
    def zero(self) -> MemoryEstimate:
        """Its first stage's ZeRO estimate (the shard group every stage of the rank is sharded over)."""
        return self.stages[0].zero

    def peak(self, schedule: str = "GPipe") -> int:
        """Memory per rank at the step's peak under ``schedule``: GPipe (the loop users write) and LoopedBFS
        hold every micro-batch's activations and received inputs of every stage until its backward;
        Interleaved1F1B ``in_flight`` micro-batch x stage forwards', each counted at the rank's largest."""
        if schedule.lower() in ("gpipe", "loopedbfs"):
            return sum(e.total for e in self.stages)
        if schedule.lower() != "interleaved1f1b":
            raise PipelineError(f"RankEstimate.peak({schedule!r}): one of 'GPipe', 'LoopedBFS', 'Interleaved1F1B'")
        fixed = sum(e.total - (e.zero.activations or 0) - (e.held_gpipe or 0) for e in self.stages)
        chunk = max((e.zero.activations or 0) // e.microbatches + (e.boundary_in or 0) for e in self.stages)
        return fixed + self.in_flight * chunk


def rank_estimates(section: PipelinePlan, stages: list[StageEstimate]) -> list[RankEstimate]:
    """Each pipeline rank's ``RankEstimate`` from its stages' (``section.stages_on``)."""
    return [RankEstimate(r, [stages[s] for s in section.stages_on(r)],
                         interleaved_in_flight(section.size, section.virtual, section.microbatches, r))
            for r in range(section.size)]


def pipeline_report(section: PipelinePlan, stages: list[StageEstimate]) -> list[str]:
    """The stage table ``bmt-wrap plan --pp-size`` prints (with V stages per rank, each rank's sums too)."""
    def b(n: int | None) -> str:
        return fmt_bytes(n) if n is not None else "?"

    if section.virtual > 1:
        return _interleaved_report(section, stages, b)
    lines = [f"pipeline: {section.size} stages x {section.microbatches} micro-batches, {section.schedule}; "
             f"bubble (P-1)/(M+P-1) = {section.bubble():.1%}",
             f"  {'stage':<6}{'blocks':>7}{'shards':>12}{'held/step':>12}{'activations':>13}"
             f"{'GPipe holds':>13}{'1F1B holds':>12}{'p2p/step':>11}{'ZeRO/step':>11}{'total':>11}"]
    for e in stages:
        lines.append(f"  {e.stage:<6}{e.blocks:>7}{_held_cells(e, b)}{b(e.held_1f1b):>12}{b(e.p2p):>11}"
                     f"{b(e.zero_traffic):>11}{b(e.total):>11}")
    lines.append("  shards: parameters, gradients and Adam state per rank; held/step: the stage's blocks gathered "
                 "for the step (and as much again for their summed gradients in backward); p2p: activations "
                 "and their gradients sent and received per rank per step")
    if any(e.p2p is None for e in stages):
        lines.append("  note: activation and point-to-point bytes need an input shape (--input)")
    return lines


def _held_cells(e: StageEstimate, b: Callable[[int | None], str]) -> str:
    """A stage row's shards, held/step, activations and GPipe-holds cells, as both stage tables print them."""
    z = e.zero
    return f"{b(z.params + z.grads + z.optimizer):>12}{b(e.gathered_step):>12}{b(z.activations):>13}{b(e.held_gpipe):>13}"


def _interleaved_report(section: PipelinePlan, stages: list[StageEstimate], b: Callable[[int | None], str]
                        ) -> list[str]:
    """``pipeline_report`` with ``pp_virtual_stages=V``: the P x V stages, then each rank's sums over its
    stages under the GPipe loop and Interleaved1F1B."""
    p, v, m = section.size, section.virtual, section.microbatches
    lines = [f"pipeline: {p} ranks x {v} stages = {p * v} stages (rank r runs stages r, r+{p}, ...) x {m} "
             f"micro-batches; bubble under Interleaved1F1B (P-1)/(V*M+P-1) = {section.bubble():.1%} (the GPipe loop "
             "runs a rank's stages one after another)",
             f"  {'stage':<6}{'rank':>5}{'blocks':>7}{'shards':>12}{'held/step':>12}{'activations':>13}"
             f"{'GPipe holds':>13}{'p2p/step':>11}{'ZeRO/step':>11}"]
    for e in stages:
        lines.append(f"  {e.stage:<6}{section.rank_of(e.stage):>5}{e.blocks:>7}{_held_cells(e, b)}{b(e.p2p):>11}"
                     f"{b(e.zero_traffic):>11}")
    known = all(e.p2p is not None for e in stages)
    lines.append(f"  {'rank':<6}{'stages':>9}{'shards':>12}{'held/step':>12}{'GPipe':>11}{'Interleaved':>13}"
                 f"{'in flight':>11}{'p2p/step':>11}{'ZeRO/step':>11}")
    for r in rank_estimates(section, stages):
        zs = [e.zero for e in r.stages]
        lines.append(f"  {r.rank:<6}{','.join(str(e.stage) for e in r.stages):>9}"
                     f"{b(sum(z.params + z.grads + z.optimizer for z in zs)):>12}"
                     f"{b(sum(e.gathered_step for e in r.stages)):>12}{b(r.peak('GPipe')):>11}"
                     f"{b(r.peak('Interleaved1F1B')):>13}{r.in_flight:>11}"
                     f"{b(sum(e.p2p for e in r.stages) if known else None):>11}"  # type: ignore[misc]
                     f"{b(sum(e.zero_traffic for e in r.stages)):>11}")
    lines.append("  per rank, over its stages: GPipe is the loop's (and LoopedBFS's) peak, every micro-batch's "
                 "activations held; Interleaved is Interleaved1F1B's, 'in flight' micro-batch x stage forwards held "
                 "at most, each at the rank's largest; shards, held/step and p2p as without virtual stages")
    if not known:
        lines.append("  note: activation and point-to-point bytes need an input shape (--input)")
    return lines
