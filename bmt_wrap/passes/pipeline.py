"""Where pipeline stages are cut, pure: the plan's pipeline section (``base/pipeline_plan.py``).

Stages are cut between discovered blocks, in call order, balanced by each block's parameter bytes (a
contiguous split minimising the largest stage). The root's parameters go where the forward uses them:
those used before the first block to the first stage, after the last block to the last stage; one used on
both sides (a tied embedding and head) to both. Their place is read from the captured graph when there is
one (a parameter's first and last use against the first and last block call), else from module
registration order, which the first call's capture then checks (``check_root_order``).
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import fx, nn

from ..base.dtypes import itemsize
from ..base.pipeline_plan import PipelinePlan, PipelineStage
from ..base.plan import ROOT, FlatBufferSpec, ParamInfo, ShardGroupSpec, WrapPlan, layout_buffers
from ..errors import PipelineError, PlanError


def plan_pipeline(model: nn.Module, plan: WrapPlan, size: int, microbatches: int,
                  graph: fx.Graph | None = None) -> PipelinePlan:
    """The pipeline section for ``plan`` over ``size`` stages (``graph``: the captured forward, if any)."""
    if not isinstance(size, int) or size < 1:
        raise PipelineError(f"pp_size={size!r}: a positive int")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise PipelineError(f"pp_microbatches={microbatches!r}: a positive int")
    order = list(dict.fromkeys(plan.order or [g.name for g in plan.blocks()]))
    if len(order) < size:
        raise PipelineError(f"{type(model).__name__} has {len(order)} block(s) ({', '.join(order) or 'none found'}) "
                            f"for {size} pipeline stages: every stage needs at least one block. Use pp_size <= "
                            f"{len(order)}, or a model with more layers")
    if len(plan.order) != len(order):
        raise PipelineError(f"{type(model).__name__} calls a block more than once per forward ({plan.order}); "
                            "pipeline stages are cut between blocks called once each, in order")
    cost = {g.name: g.param_bytes() for g in plan.blocks()}
    cuts = balanced_split([cost[b] for b in order], size)
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
    notes = [f"root parameter {n!r} is used on stages 0 and {size - 1}: both hold it, its gradient is the sum "
             "of both" for n in names if size > 1 and n in stages[0].root and n in stages[-1].root]
    return PipelinePlan(size, microbatches, stages, root_source=source, notes=notes)


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
