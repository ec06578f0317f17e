"""Planning: parameter placement, JSON round-trip, estimates against the ZeRO formulas, memory budgets."""

from __future__ import annotations

import functools

import models as M
import pytest
import torch
from dist_harness import run_distributed

from bmt_wrap import BMTrainModelWrapper
from bmt_wrap.dtypes import align_elems
from bmt_wrap.errors import MemoryBudgetError, PlanError
from bmt_wrap.passes import (
    Capture,
    build_plan,
    capture,
    discover_blocks,
    estimate,
    schedule,
    self_checkpointing_modules,
)
from bmt_wrap.passes.budget import MAX_PREFETCH_DEPTH
from bmt_wrap.passes.capacity import training_peak
from bmt_wrap.passes.planner import SCHEDULE_NOTE
from bmt_wrap.plan import GRADS_IN_FLIGHT, ROOT, WrapPlan, heading, plan_text

ALL = {**M.TOY, **M.HF}


@functools.cache
def captured(name: str) -> tuple[torch.nn.Module, Capture]:
    factory, inputs, _ = ALL[name]
    model = factory()
    return model, capture(model, discover_blocks(model), inputs())


def plan_for(name: str, world_size: int = 4, **kw: object) -> WrapPlan:
    model, c = captured(name)
    return build_plan(model, discover_blocks(model), world_size=world_size, capture=c, **kw)


@pytest.mark.parametrize("name", list(ALL))
def test_every_parameter_is_placed_exactly_once(name: str) -> None:
    model, _ = captured(name)
    plan = plan_for(name)
    plan.validate()
    assert [g.name for g in plan.groups] == [ROOT, *ALL[name][2]], "root first, then blocks in module order"
    assert sorted(plan.all_fqns()) == sorted(n for n, _ in model.named_parameters(remove_duplicate=False))
    params = dict(model.named_parameters(remove_duplicate=False))
    for g in plan.groups:
        for _, s in g.slots():
            assert s.shape == list(params[s.fqn].shape)
            assert all(params[a] is params[s.fqn] for a in s.aliases)
            if not g.is_root:
                assert all(n.startswith(g.name + ".") for n in s.names), "a block holds only its own parameters"


def test_tied_embedding_is_one_root_slot_with_an_alias() -> None:
    plan = plan_for("tied_gpt")
    root = {s.fqn: s for _, s in plan.group(ROOT).slots()}
    assert root["embed.weight"].aliases == ["head.weight"]
    gpt2 = plan_for("gpt2")
    (slot,) = [s for _, s in gpt2.group(ROOT).slots() if s.aliases]
    assert slot.names == ["transformer.wte.weight", "lm_head.weight"]


def test_parameter_used_by_several_blocks_goes_to_the_root() -> None:
    plan = plan_for("cross_tied")
    root = {s.fqn: s for _, s in plan.group(ROOT).slots()}
    assert root["layers.0.fc1.weight"].aliases == ["layers.1.fc1.weight", "layers.2.fc1.weight"]
    assert all("fc1.weight" not in s.fqn for g in plan.blocks() for _, s in g.slots())
    assert any("used by several blocks" in n for n in plan.notes)


def test_no_blocks_gives_a_root_only_plan() -> None:
    plan = plan_for("mlp")
    assert [g.name for g in plan.groups] == [ROOT] and plan.order == []
    assert "no repeated blocks: every parameter stays in the root group" in plan.notes


@pytest.mark.parametrize("name", ["toy_gpt", "shared_layer", "t5", "encoder_decoder"])
def test_plan_json_round_trip_is_exact(name: str) -> None:
    plan = plan_for(name, memory_budget=2**30)
    again = WrapPlan.from_json(plan.to_json())
    assert again == plan
    assert again.to_json() == plan.to_json()


def test_reapplied_plan_gives_identical_groups_and_schedule_keeps_layout() -> None:
    model, c = captured("llama")
    d = discover_blocks(model)
    first = build_plan(model, d, world_size=2)
    second = build_plan(M.llama(), discover_blocks(M.llama()), world_size=8, capture=c)
    assert first.groups == second.groups
    resched = schedule(WrapPlan.from_json(first.to_json()), c, world_size=2, prefetch_depth=2)
    assert resched.groups == first.groups
    assert (resched.capture, resched.prefetch_depth) == ("export", 2)
    assert first.capture == "none" and resched.order == c.order
    twice = schedule(resched, c, world_size=2)
    assert [n for n in twice.notes if n.startswith(SCHEDULE_NOTE)] == \
        [n for n in resched.notes if n.startswith(SCHEDULE_NOTE)], "schedule notes are replaced, not piled up"


def test_meta_and_real_models_give_the_same_plan() -> None:
    with torch.device("meta"):
        meta = M.ToyGPT(tie=True)
    real = M.ToyGPT(tie=True)
    assert build_plan(meta, discover_blocks(meta), world_size=4) == \
        build_plan(real, discover_blocks(real), world_size=4)


@pytest.mark.parametrize("dtype,state", [(torch.bfloat16, 2 + 2 + 12), (torch.float16, 16), (torch.float32, 4 + 4 + 8)])
@pytest.mark.parametrize("world_size", [1, 8, 64])
def test_model_states_follow_the_zero_paper(dtype: torch.dtype, state: int, world_size: int) -> None:
    plan = plan_for("llama", world_size=world_size, dtype=dtype)
    est = plan.estimates[str(world_size)]
    psi = sum(g.param_numel() for g in plan.groups)
    exact = state * psi / world_size
    padding = sum(b.padded_numel(world_size) - b.param_numel for g in plan.groups for b in g.buffers)
    model_states = est.params + est.grads + est.optimizer
    assert exact <= model_states <= exact + state * padding / world_size
    assert plan.groups[1].buffers[0].dtype == {torch.bfloat16: "bfloat16", torch.float16: "float16",
                                               torch.float32: "float32"}[dtype]


def test_communication_and_gathered_bytes_follow_the_formulas() -> None:
    n = 8
    plan = plan_for("shared_layer", world_size=n, prefetch_depth=2)
    est = plan.estimates[str(n)]
    root = plan.group(ROOT).padded_bytes(n)
    blocks = {g.name: g.padded_bytes(n) for g in plan.blocks()}
    psi = sum(g.padded_bytes(n) for g in plan.groups)
    calls = 2 * (sum(blocks.values()) + blocks["layers.0"])  # layers.0 runs twice; forward + recompute
    assert est.comm_all_gather == (root + calls) * (n - 1) // n
    assert est.comm_reduce_scatter == psi * (n - 1) // n
    assert est.zero3_bound == 3 * psi * (n - 1) // n
    # The pool holds, per distinct block size, depth + 2 buffers (one size here: every layer's is equal).
    assert len(set(blocks.values())) == 1
    assert est.gathered == root + (2 + 2) * max(blocks.values())
    assert est.grads_in_flight == GRADS_IN_FLIGHT * max(blocks.values())
    assert est.activations is not None and est.total > est.params + est.grads + est.optimizer
    # Without repeated calls and with every block checkpointed, traffic stays under the ZeRO-3 bound.
    plain = plan_for("toy_gpt", world_size=n).estimates[str(n)]
    assert plain.comm_total <= plain.zero3_bound


@pytest.mark.parametrize("checkpoint", [True, False])
def test_zero2_blocks_are_gathered_once_and_stay_resident(checkpoint: bool) -> None:
    n = 4
    z3 = plan_for("toy_gpt", world_size=n, checkpoint=checkpoint).estimates[str(n)]
    z2 = plan_for("toy_gpt", world_size=n, checkpoint=checkpoint, zero_level=2)
    est = z2.estimates[str(n)]
    root = z2.group(ROOT).padded_bytes(n)
    blocks = sum(g.padded_bytes(n) for g in z2.blocks())
    assert est.gathered == root + blocks  # every block kept; no prefetch buffers needed
    assert z3.gathered == root + 3 * max(g.padded_bytes(n) for g in z2.blocks())  # depth 1: 3 pooled
    assert est.comm_all_gather == (root + blocks) * (n - 1) // n
    assert z3.comm_all_gather == (root + 2 * blocks) * (n - 1) // n
    assert all(g.zero_level == 2 and g.checkpoint == checkpoint for g in z2.blocks())


def test_padding_keeps_shards_aligned_at_every_world_size() -> None:
    plan = plan_for("t5")
    for n in (1, 2, 3, 7, 64):
        for g in plan.groups:
            for b in g.buffers:
                assert b.padded_numel(n) % n == 0 and b.shard_numel(n) % align_elems(b.dtype) == 0
                assert b.padded_numel(n) - b.numel < n * align_elems(b.dtype)


def test_memory_budget_chooses_checkpointing_and_prefetch() -> None:
    model, c = captured("toy_gpt")
    d = discover_blocks(model)
    assert c.activations is not None
    everything = build_plan(model, d, world_size=2, capture=c)
    assert all(g.checkpoint for g in everything.blocks()) and everything.prefetch_depth == 1
    base = training_peak(everything, everything.estimates["2"])  # what a budget bounds: the step's peak

    roomy = build_plan(model, d, world_size=2, capture=c, memory_budget=10 * base)
    assert not any(g.checkpoint for g in roomy.blocks())
    assert roomy.prefetch_depth == MAX_PREFETCH_DEPTH

    with pytest.raises(MemoryBudgetError, match=f"at least {base} B") as info:
        build_plan(model, d, world_size=2, capture=c, memory_budget=base // 2)
    assert info.value.needed == base and info.value.world_size == 2

    # Parameters kept gathered come first (passes/budget.py): one block's worth keeps every block's
    # parameters (the pool held depth + 2 buffers of their size, which keeping every block frees) and the
    # last block's activations, which stand for its recompute at the first block's backward; the next
    # block's would add to every kept activation there.
    one_block = everything.blocks()[-1].padded_bytes(2)
    some = build_plan(model, d, world_size=2, capture=c, memory_budget=base + one_block + 1)
    assert [(g.name, g.checkpoint, g.zero_level) for g in some.blocks()] \
        == [("layers.0", True, 2), ("layers.1", True, 2), ("layers.2", True, 2), ("layers.3", False, 2)]
    assert training_peak(some, some.estimates["2"]) <= base + one_block + 1


def test_memory_budget_without_activations_keeps_every_block_checkpointed() -> None:
    model = M.ToyGPT()
    d = discover_blocks(model)
    plan = build_plan(model, d, world_size=2, capture=capture(model, d), memory_budget=2**40)
    assert all(g.checkpoint for g in plan.blocks())
    assert any("activation bytes unknown" in n for n in plan.notes)


def test_transformers_gradient_checkpointing_is_taken_over_not_doubled() -> None:
    model = M.llama_self_checkpointing()
    own = self_checkpointing_modules(model)
    assert own, "the model turns its own checkpointing on"
    plan = build_plan(model, discover_blocks(model), world_size=2)
    assert all(g.checkpoint for g in plan.blocks()), "bmt_wrap's checkpointing recomputes the blocks"
    assert plan.self_checkpointing_off == own, "applying the plan turns transformers' off"
    assert WrapPlan.from_json(plan.to_json()).self_checkpointing_off == own
    kept = build_plan(model, discover_blocks(model), world_size=2, checkpoint=False)
    assert not any(g.checkpoint for g in kept.blocks()) and kept.self_checkpointing_off == []
    assert any("stays on" in n for n in kept.notes)
    assert self_checkpointing_modules(model) == own, "planning leaves the model as it was"


def test_estimate_at_other_world_sizes_shrinks_model_states() -> None:
    plan = plan_for("llama", world_size=1)
    small, large = estimate(plan, 2), estimate(plan, 16)
    assert large.params < small.params and large.optimizer < small.optimizer
    assert large.gathered >= small.gathered  # gathered buffers are whole blocks: they do not shrink
    assert large.comm_reduce_scatter > small.comm_reduce_scatter  # (N-1)/N grows


@pytest.mark.parametrize("kw", [dict(world_size=0), dict(world_size=2, zero_level=1),
                                dict(world_size=2, prefetch_depth=-1)])
def test_bad_options_raise_plan_error(kw: dict[str, int]) -> None:
    model = M.ToyGPT()
    with pytest.raises(PlanError, match="must be"):
        build_plan(model, discover_blocks(model), **kw)


def test_unsupported_parameter_dtype_raises_with_a_fix() -> None:
    model = M.MLP()
    model.extra = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    with pytest.raises(PlanError, match="cast it to a floating dtype"):
        build_plan(model, discover_blocks(model), world_size=1)


def test_blocks_dropped_from_an_edited_plan_are_not_scheduled() -> None:
    model, c = captured("toy_gpt")
    plan = build_plan(model, discover_blocks(model), world_size=2)
    plan.groups = [g for g in plan.groups if g.name != "layers.3"]
    assert schedule(plan, c, world_size=2).order == ["layers.0", "layers.1", "layers.2"]


def test_a_plan_prints_as_the_clis_tables(capsys: pytest.CaptureFixture[str]) -> None:
    plan = plan_for("llama", world_size=4)
    text = str(plan)
    lines = text.splitlines()
    assert lines[0] == "capture: export | blocks: 2 | calls: 2 | prefetch depth: 1 | checkpointed: 2/2"
    groups, estimates = lines.index("groups:"), lines.index("estimates:")
    assert lines[groups + 1].split() == ["group", "params", "bytes", "buffers", "checkpoint", "zero"]
    assert [line.split()[0] for line in lines[groups + 2:estimates]] == ["root", "model.layers.0", "model.layers.1"]
    assert [line.split()[-1] for line in lines[groups + 3:estimates]] == ["3", "3"]
    assert lines[estimates + 1].split() == ["per", "rank", "N=4"]
    assert any(line.split()[:4] == ["=", "total", "per", "rank"] for line in lines[estimates:])
    assert "fx.symbolic_trace failed" not in text, "an expected fallback, not worth a reader's attention"
    assert plan.summary() is None and capsys.readouterr().out == text + "\n"
    assert repr(plan) == f"<WrapPlan {lines[0]}>"


def _plan_texts_around_the_first_call(fused_loss: bool) -> tuple[str, str, str]:
    """``str(model.plan)`` of a wrapped transformers Llama before its first call, with every note (verbose), and after."""
    model = BMTrainModelWrapper(M.llama(), fused_loss=fused_loss)
    before, verbose = str(model.plan), "\n".join(heading(model.plan, verbose=True))
    ids = M.token_ids()
    model(input_ids=ids, labels=ids)
    return before, verbose, plan_text(model.plan)


@pytest.mark.parametrize("fused_loss", [True, False])
def test_the_plan_before_the_first_call_says_what_the_first_call_does(fused_loss: bool) -> None:
    """fx cannot trace a transformers model: torch.export captures it at the first call, which is the expected
    path, not a failure; the fused loss asked for is applied then, not "not fused"."""
    (before, verbose, after), = run_distributed(_plan_texts_around_the_first_call, 1, fused_loss)
    first = before.splitlines()[0]
    assert first.startswith("capture: at the first call (torch.export) | blocks: 2"), first
    assert "capture: none" not in before and "failed" not in before, before
    assert "note: schedule: fx.symbolic_trace failed (" in verbose  # a detail, shown on asking
    fused = [line for line in before.splitlines() if line.startswith("fused loss")]
    if fused_loss:
        assert fused == ["fused loss: requested: applied at the first call, whose captured graph shows the "
                         "vocabulary head and its loss"], before
        assert "fused: one chunked op" in after
    else:
        assert fused == ["fused loss: off (fused_loss=True fuses the vocabulary head and its loss found at the "
                         "first call)"], before
        assert "  off (BMTrainModelWrapper(model, fused_loss=True)" in after
    assert "not fused" not in before and after.startswith("capture: export | "), after
