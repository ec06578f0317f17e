"""Renderers for ``bmt-wrap dump``: the rewritten graph as text, JSON or Graphviz dot (the plan's own tables are
``base/plan.py``'s)."""

from __future__ import annotations

import json
from itertools import pairwise

from torch import fx

from ..base.plan import WrapPlan, heading, summary_line, tables
from .schedule_graph import step_of


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


def render_text(graph: fx.Graph, plan: WrapPlan, verbose: bool = False) -> str:
    """The rewritten graph and the plan, for people; ``verbose`` adds the expected fallbacks' notes."""
    return "\n".join([*heading(plan, verbose), "graph:", *(node_line(n) for n in graph.nodes), *tables(plan)])


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
             f'  label="{summary_line(plan)}";']
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
