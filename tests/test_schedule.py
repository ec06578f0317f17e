"""The prefetch schedule: its rule, and the collectives the runtime really issues against it.

``PrefetchSchedule`` is the one rule the runtime executes and ``bmt-wrap dump`` shows. Its calls are
checked against literal expectations; then a wrapped model's actual collectives, interleaved with its
block calls, are checked against what the plan's schedule implies, at every prefetch depth.
"""

from __future__ import annotations

import pytest
import torch
from dist_harness import run_distributed
from parity import lm_batches
from toy import ToyGPT, manual_plan

from bmt_wrap import distributed
from bmt_wrap.apply_plan import apply_plan
from bmt_wrap.plan import ROOT
from bmt_wrap.prefetch_schedule import PrefetchSchedule

LAYERS = 4


def test_schedule_rule_at_each_depth() -> None:
    s0, s1, s2 = (PrefetchSchedule(4, d) for d in (0, 1, 2))
    assert (s0.at_start(), s1.at_start(), s2.at_start()) == ([], [0], [0, 1])
    assert [s1.forward(i) for i in range(4)] == [[0, 1], [1, 2], [2, 3], [3]]
    assert [s2.forward(i) for i in range(4)] == [[0, 1, 2], [1, 2, 3], [2, 3], [3]]
    assert [s0.forward(i) for i in range(4)] == [[0], [1], [2], [3]]
    assert [s1.backward(i) for i in range(4)] == [[0], [1, 0], [2, 1], [3, 2]]
    assert [s2.backward(i) for i in range(4)] == [[0], [1, 0], [2, 1, 0], [3, 2, 1]]
    assert PrefetchSchedule(1, 3).at_start() == [0] and PrefetchSchedule(0, 1).at_start() == []


def expected_step(order: list[str], depth: int, kept: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
    """The collectives (and block calls) one training step of checkpointed blocks issues under
    ``PrefetchSchedule``: a gather starts when the schedule first asks for a group that is not gathered;
    a ZeRO-3 block releases its parameters after its forward, a ``kept`` one (``zero_level=2``, what a
    memory budget buys) only after its backward; each reduce-scatters after its backward."""
    schedule = PrefetchSchedule(len(order), depth)
    gathered: set[str] = set()
    out: list[tuple[str, str]] = [("all_gather", ROOT)]

    def gather(calls: list[int]) -> None:
        for c in calls:
            if order[c] not in gathered:
                gathered.add(order[c])
                out.append(("all_gather", order[c]))

    gather(schedule.at_start())
    for i, name in enumerate(order):
        out.append(("call", name))
        gather(schedule.forward(i))
        if name not in kept:
            gathered.discard(name)
    for i in reversed(range(len(order))):
        gather(schedule.backward(i))
        gathered.discard(order[i])
        out.append(("reduce_scatter", order[i]))
    return out + [("reduce_scatter", ROOT)]


def _traced_steps_body(depth: int, kept: frozenset[str] = frozenset()) -> list[list[tuple[str, str]]]:
    torch.manual_seed(0)
    model = ToyGPT(d=16, n_layers=LAYERS)
    plan = manual_plan(model, [f"layers.{i}" for i in range(LAYERS)], prefetch_depth=depth)
    for g in plan.blocks():
        g.zero_level = 2 if g.name in kept else 3
    model = apply_plan(model, plan)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    n, rank = distributed.world_size(), distributed.rank()
    traces = []
    for idx, tgt in lm_batches(2, 4 * n):
        with distributed.comm().trace() as ops:
            hooks = [layer.register_forward_pre_hook(lambda m, a, name=f"layers.{i}": ops.append(("call", name, 0)))
                     for i, layer in enumerate(model.layers)]
            model(idx.chunk(n)[rank], tgt.chunk(n)[rank]).backward()
            for h in hooks:
                h.remove()
        opt.step()
        opt.zero_grad()
        traces.append([(op, label) for op, label, _ in ops if op in ("call", "all_gather", "reduce_scatter")])
    return traces


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_runtime_issues_the_plans_schedule(depth: int) -> None:
    order = [f"layers.{i}" for i in range(LAYERS)]
    want = expected_step(order, depth)
    for rank, traces in enumerate(run_distributed(_traced_steps_body, 2, depth)):
        for step, got in enumerate(traces):
            assert got == want, f"rank {rank} step {step}, prefetch depth {depth}:\n got  {got}\n want {want}"


@pytest.mark.parametrize("depth", [1, 2])
def test_blocks_kept_gathered_by_a_budget_are_not_gathered_again(depth: int) -> None:
    # A memory budget keeps the last-called blocks' parameters first (passes/budget.py).
    order = [f"layers.{i}" for i in range(LAYERS)]
    kept = frozenset(order[-2:])
    want = expected_step(order, depth, kept)
    assert [x for x in want if x[0] == "all_gather"].count(("all_gather", "layers.3")) == 1
    for rank, traces in enumerate(run_distributed(_traced_steps_body, 2, depth, kept)):
        for step, got in enumerate(traces):
            assert got == want, f"rank {rank} step {step}, prefetch depth {depth}:\n got  {got}\n want {want}"
