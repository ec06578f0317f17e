"""Renderers for ``bmt-wrap``: the rewritten graph as text, JSON or Graphviz dot, and the estimates table."""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import pairwise

from torch import fx

from ..plan import MemoryEstimate, WrapPlan
from .rewrite import step_of

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def fmt_bytes(n: int | None) -> str:
    """Human-readable bytes (binary units)."""
    if n is None:
        return "n/a"
    value, unit = float(n), 0
    while abs(value) >= 1024 and unit < len(_UNITS) - 1:
        value, unit = value / 1024, unit + 1
    return f"{int(value)} B" if unit == 0 else f"{value:.2f} {_UNITS[unit]}"


def _target(node: fx.Node) -> str:
    target = node.target
    # ATen overloads print as ``aten.mm.default``; Python callables by name.
    if isinstance(target, str) or hasattr(target, "_schema"):
        return str(target)
    return getattr(target, "__name__", str(target))


def _arg(a: object) -> str:
    if isinstance(a, fx.Node):
        return f"%{a.name}"
    if isinstance(a, (tuple, list)):
        return "(" + ", ".join(_arg(x) for x in a) + ")"
    text = repr(a)
    return text if len(text) <= 40 else text[:37] + "..."


def node_line(node: fx.Node) -> str:
    """One line of the text dump for ``node``."""
    step = step_of(node)
    if step is not None and step.kind != "call":
        return f"    {step.kind:<16} {step.group}  (call {step.call})"
    args = ", ".join([_arg(a) for a in node.args] + [f"{k}={_arg(v)}" for k, v in node.kwargs.items()])
    if step is not None:
        ops = node.meta.get("aten_ops")
        extra = f"  [{ops} aten ops]" if ops else ""
        return f"    %{node.name} = BLOCK {step.group}({args}){extra}"
    if node.op in ("placeholder", "get_attr"):
        return f"    %{node.name} = {node.op} {node.target}"
    if node.op == "output":
        return f"    return {args}"
    return f"    %{node.name} = {_target(node)}({args})"


def summary(plan: WrapPlan) -> str:
    """One line: capture method, blocks, calls, prefetch depth, checkpointed blocks."""
    blocks = plan.blocks()
    ckpt = sum(g.checkpoint for g in blocks)
    return (f"capture: {plan.capture} | blocks: {len(blocks)} | calls: {len(plan.order)} | "
            f"prefetch depth: {plan.prefetch_depth} | checkpointed: {ckpt}/{len(blocks)}")


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
    ("all-gather / step", lambda e: e.comm_all_gather),
    ("reduce-scatter / step", lambda e: e.comm_reduce_scatter),
    ("= communicated / step", lambda e: e.comm_total),
    ("ZeRO-3 bound 3Ψ(N-1)/N", lambda e: e.zero3_bound),
]


def render_estimates(plans: list[WrapPlan]) -> str:
    """Per-rank estimates table, one column per plan (each plan holds one world size's estimate)."""
    estimates = [est for p in plans for est in p.estimates.values()]
    rows = [("per rank", *(f"N={e.world_size}" for e in estimates))]
    rows += [(label, *(fmt_bytes(get(e)) for e in estimates)) for label, get in _ESTIMATE_ROWS]
    return _table(rows)


def render_text(graph: fx.Graph, plan: WrapPlan) -> str:
    """The rewritten graph and the plan, for people."""
    lines = [summary(plan)]
    lines += [f"  note: {n}" for n in plan.notes]
    lines.append("graph:")
    lines += [node_line(n) for n in graph.nodes]
    lines.append("groups:")
    lines.append(render_groups(plan))
    if plan.estimates:
        lines.append("estimates:")
        lines.append(render_estimates([plan]))
    return "\n".join(lines)


def graph_records(graph: fx.Graph) -> list[dict[str, object]]:
    """The graph as plain records: name, op, target, input names, and the schedule step if any."""
    records: list[dict[str, object]] = []
    for n in graph.nodes:
        step = step_of(n)
        records.append({"name": n.name, "op": n.op, "target": _target(n),
                        "inputs": [a.name for a in n.all_input_nodes],
                        "step": None if step is None else {"kind": step.kind, "group": step.group,
                                                           "call": step.call}})
    return records


def render_json(graph: fx.Graph, plan: WrapPlan) -> str:
    """The plan and the rewritten graph as one JSON document (the plan part is ``WrapPlan.from_json``-able)."""
    return json.dumps({"plan": json.loads(plan.to_json()), "graph": graph_records(graph)}, indent=1)


_DOT_STYLE = {
    "prefetch": 'shape=cds, style=filled, fillcolor="#cfe2ff"',
    "wait": 'shape=octagon, style=filled, fillcolor="#fff3cd"',
    "release": 'shape=invhouse, style=filled, fillcolor="#d1e7dd"',
    "checkpoint_begin": 'shape=triangle, style=filled, fillcolor="#f8d7da"',
    "checkpoint_end": 'shape=invtriangle, style=filled, fillcolor="#f8d7da"',
    "call": 'shape=box, style="filled,bold", fillcolor="#e2e3e5"',
}


def render_dot(graph: fx.Graph, plan: WrapPlan) -> str:
    """Graphviz: data flow as solid edges, schedule order (markers and block calls) as a dashed chain."""
    lines = ["digraph bmt_wrap {", "  rankdir=TB;", '  node [fontname="monospace", fontsize=10];',
             f'  label="{summary(plan)}";']
    for n in graph.nodes:
        step = step_of(n)
        if step is None:
            style, label = "shape=ellipse", f"{n.name}\\n{_target(n)}".replace('"', "'")
        else:
            style, label = _DOT_STYLE[step.kind], f"{step.kind}\\n{step.group} #{step.call}"
        lines.append(f'  "{n.name}" [{style}, label="{label}"];')
    for n in graph.nodes:
        lines += [f'  "{a.name}" -> "{n.name}";' for a in n.all_input_nodes]
    chain = [n.name for n in graph.nodes if step_of(n) is not None]
    lines += [f'  "{a}" -> "{b}" [style=dashed, color="#6c757d"];' for a, b in pairwise(chain)]
    lines.append("}")
    return "\n".join(lines)
