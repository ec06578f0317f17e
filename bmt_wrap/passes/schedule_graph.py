"""The schedule drawn into the captured graph: ``prefetch``/``wait``/``release`` and checkpoint markers
around every block call, for ``bmt-wrap dump`` (the model itself is changed by ``wrapping/apply_plan.py``).

The markers show ``PrefetchSchedule`` (base/prefetch_schedule.py), the rule the runtime executes: each
``prefetch`` stands where the schedule first requests a call's gather (the first ``depth`` as soon as
the inputs exist, then call i + depth just before call i), then ``wait(i)``; ``release(i)`` follows it.
Every block call gets exactly one of each. The graph is for display; it is never executed (the model's
own forward runs, with blocks replaced in place, and the runtime reads the same schedule).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import fx

from ..base.plan import WrapPlan
from ..base.prefetch_schedule import PrefetchSchedule
from ..errors import PlanError
from .capture import Capture

_META = "bmt_schedule"


def prefetch(group: str, call: int) -> None:
    """Schedule marker: start gathering ``group`` for block call ``call`` (never executed)."""


def wait(group: str, call: int) -> None:
    """Schedule marker: block until ``group``'s gather for ``call`` has landed (never executed)."""


def checkpoint_begin(group: str, call: int) -> None:
    """Schedule marker: ``call`` runs without keeping activations; backward recomputes it (never executed)."""


def checkpoint_end(group: str, call: int) -> None:
    """Schedule marker: end of a recomputed region (never executed)."""


def release(group: str, call: int) -> None:
    """Schedule marker: return ``group``'s gathered buffer to the pool (never executed)."""


_TARGETS = {"prefetch": prefetch, "wait": wait, "checkpoint_begin": checkpoint_begin,
            "checkpoint_end": checkpoint_end, "release": release}
MARKER_KINDS = tuple(_TARGETS)


@dataclass(frozen=True)
class Step:
    """One entry of the schedule: a marker or a block call."""

    kind: str  # "call" or one of MARKER_KINDS
    group: str
    call: int  # index into ``plan.order``


def schedule_graph(capture: Capture, plan: WrapPlan) -> fx.Graph:
    """A copy of ``capture.graph`` with the schedule's markers inserted around each block call."""
    blocks = {g.name: g for g in plan.blocks()}
    calls = [n for n in capture.graph.nodes if n.op == "call_module" and n.target in blocks]
    order = [str(n.target) for n in calls]
    if order != plan.order:
        raise PlanError(f"the plan's block order {plan.order} does not match the captured graph's {order}; "
                        "re-plan from this capture (passes.schedule)")
    schedule = PrefetchSchedule(len(calls), plan.prefetch_depth)
    requested: set[int] = set()
    index = {n: i for i, n in enumerate(calls)}
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}

    def request(wanted: list[int]) -> None:
        for j in wanted:
            if j not in requested:
                requested.add(j)
                mark("prefetch", j)

    def mark(kind: str, call: int) -> None:
        node = out.call_function(_TARGETS[kind], (order[call], call))
        node.meta[_META] = Step(kind, order[call], call)

    started = False
    for node in capture.graph.nodes:
        if not started and node.op != "placeholder":
            started = True
            request(schedule.at_start())
        i = index.get(node)
        if i is None:
            env[node] = out.node_copy(node, env.__getitem__)
            continue
        request(schedule.forward(i))  # its own gather counts where nothing prefetched it (depth 0)
        mark("wait", i)
        checkpointed = blocks[order[i]].checkpoint
        if checkpointed:
            mark("checkpoint_begin", i)
        env[node] = out.node_copy(node, env.__getitem__)
        env[node].meta[_META] = Step("call", order[i], i)
        if checkpointed:
            mark("checkpoint_end", i)
        mark("release", i)
    return out


def steps(graph: fx.Graph) -> list[Step]:
    """The schedule of a rewritten graph, in order: markers and block calls."""
    return [n.meta[_META] for n in graph.nodes if _META in n.meta]


def step_of(node: fx.Node) -> Step | None:
    """The schedule step a node of a rewritten graph stands for (None for model code)."""
    return node.meta.get(_META)
