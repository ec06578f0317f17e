"""Rewrite: exactly one prefetch/wait/release per block call, placed by prefetch depth; renderers agree."""

from __future__ import annotations

import functools
import json
from collections import Counter

import models as M
import pytest
import torch

from bmt_wrap.errors import PlanError
from bmt_wrap.passes import Capture, Step, build_plan, capture, discover_blocks, schedule_graph, steps
from bmt_wrap.passes.render import graph_records, render_dot, render_json, render_text
from bmt_wrap.passes.schedule_graph import MARKER_KINDS, step_of
from bmt_wrap.plan import WrapPlan

ALL = {**M.TOY, **M.HF}


@functools.cache
def captured(name: str, with_inputs: bool = True) -> tuple[torch.nn.Module, Capture]:
    factory, inputs, _ = ALL[name]
    model = factory()
    return model, capture(model, discover_blocks(model), inputs() if with_inputs else None)


def planned(name: str, **kw: object) -> tuple[Capture, WrapPlan]:
    model, c = captured(name)
    return c, build_plan(model, discover_blocks(model), world_size=2, capture=c, **kw)


def check_schedule(schedule: list[Step], plan: WrapPlan) -> None:
    """The invariants of a schedule, stated independently of how schedule_graph builds it."""
    depth, n = plan.prefetch_depth, len(plan.order)
    assert {s.kind for s in schedule} <= {"call", *MARKER_KINDS}
    for kind in ("prefetch", "wait", "call", "release"):
        assert sorted(s.call for s in schedule if s.kind == kind) == list(range(n)), kind
    assert all(s.group == plan.order[s.call] for s in schedule)
    pos = {(s.kind, s.call): i for i, s in enumerate(schedule)}
    for i in range(n):
        assert pos["prefetch", i] < pos["wait", i] < pos["call", i] < pos["release", i]
        assert pos["release", i] == pos["call", i] + 1 + plan.group(plan.order[i]).checkpoint
        if i + depth < n:  # the prefetch of call i + depth is issued just before waiting for call i
            assert pos["prefetch", i + depth] < pos["wait", i]
            assert i == 0 or pos["prefetch", i + depth] > pos["release", i - 1]
    in_flight = 0
    for s in schedule:  # gathered buffers never exceed depth + 1
        in_flight += {"prefetch": 1, "release": -1}.get(s.kind, 0)
        assert in_flight <= depth + 1
    ckpt = [s.call for s in schedule if s.kind == "checkpoint_begin"]
    assert ckpt == [s.call for s in schedule if s.kind == "checkpoint_end"]
    assert ckpt == [i for i in range(n) if plan.group(plan.order[i]).checkpoint]


@pytest.mark.parametrize("name", list(ALL))
@pytest.mark.parametrize("depth", [0, 1, 2])
def test_one_prefetch_wait_release_per_block_call(name: str, depth: int) -> None:
    c, plan = planned(name, prefetch_depth=depth)
    graph = schedule_graph(c, plan)
    check_schedule(steps(graph), plan)
    calls = [n for n in graph.nodes if n.op == "call_module" and n.target in {g.name for g in plan.blocks()}]
    assert [str(n.target) for n in calls] == plan.order


def test_shared_layer_gets_markers_for_each_call() -> None:
    c, plan = planned("shared_layer")
    schedule = steps(schedule_graph(c, plan))
    check_schedule(schedule, plan)
    assert Counter((s.kind, s.group) for s in schedule)["wait", "layers.0"] == 2


def test_checkpoint_markers_follow_the_plan() -> None:
    c, plan = planned("toy_gpt", checkpoint=False)
    schedule = steps(schedule_graph(c, plan))
    assert not any(s.kind.startswith("checkpoint") for s in schedule)
    plan.group("layers.2").checkpoint = True
    schedule = steps(schedule_graph(c, plan))
    assert [(s.kind, s.call) for s in schedule if s.kind.startswith("checkpoint")] == \
        [("checkpoint_begin", 2), ("checkpoint_end", 2)]


def test_rewrite_leaves_the_capture_untouched_and_keeps_model_code() -> None:
    c, plan = planned("gpt2")
    before = [(n.name, n.op, str(n.target)) for n in c.graph.nodes]
    graph = schedule_graph(c, plan)
    assert [(n.name, n.op, str(n.target)) for n in c.graph.nodes] == before
    model_nodes = [(n.op, str(n.target)) for n in graph.nodes if step_of(n) is None or step_of(n).kind == "call"]
    assert model_nodes == [(op, t) for _, op, t in before]


def test_order_mismatch_raises_plan_error() -> None:
    c, plan = planned("toy_gpt")
    plan.order = list(reversed(plan.order))
    with pytest.raises(PlanError, match="re-plan"):
        schedule_graph(c, plan)


def test_fx_and_module_order_graphs_rewrite_too() -> None:
    for name, with_inputs in (("encoder_decoder", False), ("llama", False)):
        model, c = captured(name, with_inputs)
        plan = build_plan(model, discover_blocks(model), world_size=4, capture=c)
        check_schedule(steps(schedule_graph(c, plan)), plan)


def test_json_render_holds_the_plan_and_the_schedule() -> None:
    c, plan = planned("t5")
    graph = schedule_graph(c, plan)
    doc = json.loads(render_json(graph, plan))
    assert WrapPlan.from_json(json.dumps(doc["plan"])) == plan
    records = [r for r in doc["graph"] if r["step"] is not None]
    assert [(r["step"]["kind"], r["step"]["call"]) for r in records] == [(s.kind, s.call) for s in steps(graph)]
    assert doc["graph"] == graph_records(graph)


def test_dot_render_has_one_node_per_graph_node_and_valid_edges() -> None:
    c, plan = planned("llama")
    graph = schedule_graph(c, plan)
    dot = render_dot(graph, plan)
    assert dot.startswith("digraph") and dot.rstrip().endswith("}")
    declared = {line.split('"')[1] for line in dot.splitlines() if "[" in line and "->" not in line
                and line.strip().startswith('"')}
    assert declared == {n.name for n in graph.nodes}
    for line in dot.splitlines():
        if "->" in line:
            a, b = line.split('"')[1], line.split('"')[3]
            assert a in declared and b in declared
    assert dot.count("style=dashed") == len(steps(graph)) - 1


def test_text_render_lists_each_marker_once_per_call() -> None:
    c, plan = planned("bert")
    text = render_text(schedule_graph(c, plan), plan)
    assert text.splitlines()[0].startswith("capture: export")
    for i, block in enumerate(plan.order):
        for kind in ("prefetch", "wait", "release"):
            assert sum(line.split() == [kind, block, "(call", f"{i})"] for line in text.splitlines()) == 1
        assert f"BLOCK {block}(" in text
