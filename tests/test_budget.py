"""``memory_budget=``: which blocks keep activations and parameters, in which order, and that the wrapper
executes exactly that (parity with plain PyTorch, communicated bytes equal to the plan's prediction)."""

from __future__ import annotations

import copy
import functools
import os
import platform
import warnings
from pathlib import Path

import models as M
import pytest
import torch
from dist_harness import run_distributed
from hypothesis import given
from hypothesis import strategies as st
from parity import train_side_by_side

import bmt_wrap as bmt
from bmt_wrap import BMTrainModelWrapper
from bmt_wrap.base.host_allocator import EXACT_SETTING, THRESHOLD_VAR, counts_exactly
from bmt_wrap.cli import main
from bmt_wrap.errors import MemoryBudgetError
from bmt_wrap.passes import (
    ActivationProfile,
    BlockCallActivations,
    Capture,
    build_plan,
    capture,
    discover_blocks,
    estimate,
)
from bmt_wrap.passes.budget import ACTIVATIONS, PARAMETERS, Choice, choices
from bmt_wrap.passes.capacity import training_peak
from bmt_wrap.passes.fused_loss import fused_loss_section, with_fused_loss
from bmt_wrap.plan import WrapPlan, fmt_bytes

MODELS = str(Path(__file__).with_name("models.py"))


@functools.cache
def captured(name: str = "toy_gpt", rows: int = 2) -> tuple[torch.nn.Module, Capture]:
    factory, inputs, _ = {**M.TOY, **M.HF}[name]
    model = factory()
    args, kwargs = inputs()  # 2 rows each
    if rows != 2:  # only the shape matters
        args = tuple(torch.cat([a] * rows)[:rows] for a in args)
    c = capture(model, discover_blocks(model), (args, kwargs))
    return model, with_fused_loss(c, fused_loss_section(model, c, enabled=False))  # as the wrapper plans


def base_plan(name: str, world_size: int, rows: int = 2) -> WrapPlan:
    """ZeRO-3 with every block recomputed: what no budget may go below."""
    model, c = captured(name, rows)
    return build_plan(model, discover_blocks(model), world_size=world_size, capture=c)


def prefix_totals(name: str, world_size: int, rows: int = 2) -> tuple[list[int], list[Choice]]:
    """The estimate with the first j choices made, for every j, and the choices in order."""
    plan = base_plan(name, world_size, rows)
    _, c = captured(name, rows)
    order = choices(plan, c.activations, world_size)
    totals = [training_peak(plan, estimate(plan, world_size, c.activations))]
    for choice in order:
        choice.apply(plan.group(choice.block))
        totals.append(training_peak(plan, estimate(plan, world_size, c.activations)))
    return totals, order


def budget_for(name: str, world_size: int, k: int, rows: int = 2) -> tuple[int, list[Choice]]:
    """The budget the first ``k`` choices need, and the choices that budget buys: the longest prefix that fits."""
    totals, order = prefix_totals(name, world_size, rows)
    budget = totals[min(k, len(order))]
    return budget, order[:max(j for j, t in enumerate(totals) if t <= budget)]


def budgeted(name: str, world_size: int, budget: int, rows: int = 2) -> WrapPlan:
    model, c = captured(name, rows)
    return build_plan(model, discover_blocks(model), world_size=world_size, capture=c, memory_budget=budget)


def peak(plan: WrapPlan, world_size: int) -> int:
    """What a budget bounds: the step's peak per rank by phase (passes/capacity.py)."""
    return training_peak(plan, plan.estimates[str(world_size)])


def decisions(plan: WrapPlan) -> list[tuple[str, bool, int]]:
    return [(g.name, g.checkpoint, g.zero_level) for g in plan.blocks()]


# ---- which choices, in which order ----------------------------------------------------------------------
def test_choices_go_by_saving_per_byte_parameters_before_activations() -> None:
    plan = base_plan("toy_gpt", 2)
    # Made-up measurements: layers.1 recomputes the most per byte it would keep, layers.2 the least.
    flops = {"layers.0": 100, "layers.1": 400, "layers.2": 50, "layers.3": 100}
    saved = {"layers.0": 10, "layers.1": 10, "layers.2": 10, "layers.3": 10}
    profile = ActivationProfile(0, [BlockCallActivations(b, 1, saved[b] + 1, flops[b]) for b in flops])
    order = choices(plan, profile, 2)
    assert [(c.kind, c.block) for c in order] == [
        # Every block saves (N-1)/N of what it holds: the last called goes first, its backward runs first.
        (PARAMETERS, "layers.3"), (PARAMETERS, "layers.2"), (PARAMETERS, "layers.1"), (PARAMETERS, "layers.0"),
        (ACTIVATIONS, "layers.1"), (ACTIVATIONS, "layers.3"), (ACTIVATIONS, "layers.0"), (ACTIVATIONS, "layers.2")]
    per_byte = [c.per_byte for c in order if c.kind == ACTIVATIONS]
    assert per_byte == sorted(per_byte, reverse=True)
    gathered = plan.group("layers.0").padded_bytes(2)
    assert order[0].saving == gathered // 2, "one all-gather of the block avoided, at (N-1)/N"


def test_one_rank_has_no_gather_to_save_and_choices_already_made_are_skipped() -> None:
    _, c = captured()
    assert {x.kind for x in choices(base_plan("toy_gpt", 1), c.activations, 1)} == {ACTIVATIONS}
    model = captured()[0]
    kept = build_plan(model, discover_blocks(model), world_size=2, capture=c, checkpoint=False)
    assert {x.kind for x in choices(kept, c.activations, 2)} == {PARAMETERS}
    z2 = build_plan(model, discover_blocks(model), world_size=2, capture=c, zero_level=2)
    assert {x.kind for x in choices(z2, c.activations, 2)} == {ACTIVATIONS}


@pytest.mark.parametrize("k", [0, 1, 2, 3, 4, 5, 6, 7, 8])
def test_a_budget_takes_the_longest_prefix_of_the_choices_that_fits(k: int) -> None:
    budget, taken = budget_for("toy_gpt", 2, k)
    # Keeping every block's parameters frees the pool's depth + 2 buffers, so the budget for one choice buys
    # all four; the last block's activations then cost nothing (they stand for its recompute, at the first
    # block's backward, and are gone by the blocks' backward end); each earlier block's cost at the first
    # block's backward, where every kept activation meets its gradients, so the budget for j buys j + 4.
    assert len(taken) == {0: 0, 1: 5, 2: 6, 3: 7, 4: 5}.get(k, k)
    plan = budgeted("toy_gpt", 2, budget)
    acts = {c.block for c in taken if c.kind == ACTIVATIONS}
    params = {c.block for c in taken if c.kind == PARAMETERS}
    assert decisions(plan) == [(g, g not in acts, 2 if g in params else 3) for g in M.TOY["toy_gpt"][2]]
    assert peak(plan, 2) <= budget == plan.memory_budget
    assert f"{len(params)} of 4 blocks keep parameters gathered" in plan.notes[-2]
    assert f"{len(acts)} of 4 keep activations" in plan.notes[-2]


def test_parameters_kept_gathered_are_gathered_once_per_step() -> None:
    base = base_plan("toy_gpt", 4).estimates["4"]
    budget, taken = budget_for("toy_gpt", 4, 1)
    plan = budgeted("toy_gpt", 4, budget)
    kept = [plan.group(c.block) for c in taken if c.kind == PARAMETERS]
    assert kept
    assert plan.estimates["4"].comm_all_gather == base.comm_all_gather - sum(g.padded_bytes(4) * 3 // 4 for g in kept)
    assert plan.estimates["4"].comm_reduce_scatter == base.comm_reduce_scatter


def test_a_roomy_budget_keeps_everything_and_prefetches_deeper() -> None:
    base = base_plan("toy_gpt", 2)
    plan = budgeted("toy_gpt", 2, 100 * peak(base, 2))
    assert all(not g.checkpoint and g.zero_level == 2 for g in plan.blocks()) and plan.prefetch_depth == 2


# ---- budgets too small ----------------------------------------------------------------------------------
def test_a_budget_below_full_recompute_raises_with_the_smallest_feasible_one() -> None:
    need = peak(base_plan("toy_gpt", 2), 2)
    with pytest.raises(MemoryBudgetError, match=f"at least {need} B .*Raise memory_budget to at least {need}"):
        budgeted("toy_gpt", 2, need - 1)
    assert decisions(budgeted("toy_gpt", 2, need)) == [(g, True, 3) for g in M.TOY["toy_gpt"][2]]


def test_without_activations_the_budget_waits_for_inputs_but_checks_what_it_knows() -> None:
    model = M.TOY["toy_gpt"][0]()
    d = discover_blocks(model)
    plain = build_plan(model, d, world_size=2, capture=capture(model, d))
    states = peak(plain, 2)  # everything but activations
    waiting = build_plan(model, d, world_size=2, capture=capture(model, d), memory_budget=states)
    assert decisions(waiting) == decisions(plain) and "activation bytes unknown" in waiting.notes[-1]
    with pytest.raises(MemoryBudgetError, match="plus activations") as info:
        build_plan(model, d, world_size=2, capture=capture(model, d), memory_budget=states - 1)
    assert info.value.needed == states and not info.value.activations_known


# ---- properties -----------------------------------------------------------------------------------------
@given(world_size=st.sampled_from([1, 2, 4]), extra=st.floats(0, 1.2), more=st.floats(0, 1.0),
       name=st.sampled_from(["toy_gpt", "llama"]))
def test_estimate_within_budget_and_more_budget_never_costs_speed(world_size: int, extra: float, more: float,
                                                                  name: str) -> None:
    base = peak(base_plan(name, world_size), world_size)
    small = int(base * (1 + extra))
    large = int(small * (1 + more))
    a, b = budgeted(name, world_size, small), budgeted(name, world_size, large)
    for plan, budget in ((a, small), (b, large)):
        assert peak(plan, world_size) <= budget
    ea, eb = a.estimates[str(world_size)], b.estimates[str(world_size)]
    assert eb.comm_all_gather <= ea.comm_all_gather, "more budget never gathers more"
    assert {g.name for g in b.blocks() if g.checkpoint} <= {g.name for g in a.blocks() if g.checkpoint}, \
        "more budget never recomputes a block the smaller one kept"


# ---- the plan shows and keeps the decisions ---------------------------------------------------------------
def test_budget_decisions_survive_json_and_show_in_the_plan_text() -> None:
    budget, _ = budget_for("toy_gpt", 2, 7)
    plan = budgeted("toy_gpt", 2, budget)
    again = WrapPlan.from_json(plan.to_json())
    assert decisions(again) == decisions(plan) and again.memory_budget == budget
    assert again.estimates == plan.estimates and again.to_json() == plan.to_json()
    first = str(plan).splitlines()[0]
    assert first.endswith(f"checkpointed: 1/4 | kept gathered: 4/4 | memory budget: {fmt_bytes(budget)}")
    assert "4 of 4 blocks keep parameters gathered through backward: layers.3, layers.2, layers.1, layers.0; " \
        "3 of 4 keep activations: layers.3, layers.2, layers.1; next: keep activations of layers.0 needs" in str(plan)
    old = plan.to_json().replace(f'"memory_budget": {budget}', '"memory_budget": null')
    assert WrapPlan.from_json(old).memory_budget is None


def test_the_budgets_note_and_the_table_show_one_peak() -> None:
    """The note's number is the count the budget was fitted to, and the table prints it on a row of that name
    (the table's total sums terms that peak at different moments: a larger number, and labelled so)."""
    budget, _ = budget_for("toy_gpt", 2, 7)
    plan = budgeted("toy_gpt", 2, budget)
    est = plan.estimates["2"]
    assert est.peak == peak(plan, 2) <= budget < est.total
    note = next(n for n in plan.notes if "prefetch depth" in n)
    assert f"peak (by phase) {fmt_bytes(est.peak)} per rank" in note, note
    rows = {line.split("  ")[1]: line.split()[-2:] for line in str(plan).splitlines() if line.startswith("  ")}
    assert rows["peak (by phase)"] == fmt_bytes(est.peak).split() and rows["= total per rank"] == \
        fmt_bytes(est.total).split()


def test_cli_shows_the_budgets_decisions(capsys: pytest.CaptureFixture[str]) -> None:
    budget, _ = budget_for("toy_gpt", 2, 7)  # captured on 2 rows: --input int64[2,SEQ]
    argv = ["--world-size", "2", "--input", f"int64[2,{M.SEQ}]", "--memory-budget", str(budget)]
    assert main(["plan", f"{MODELS}:ToyGPT", *argv]) == 0
    out = capsys.readouterr().out
    assert "N=2: " in out and "checkpointed: 1/4 | kept gathered: 4/4" in out
    assert "note: schedule: memory budget" in out and "3 of 4 keep activations: layers.3, layers.2, layers.1" in out
    assert main(["dump", f"{MODELS}:ToyGPT", *argv]) == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.strip().startswith("layers.")]
    assert [(r[0], r[-2], r[-1]) for r in rows if len(r) > 4] == [
        ("layers.0", "true", "2"), ("layers.1", "false", "2"), ("layers.2", "false", "2"), ("layers.3", "false", "2")]


# ---- the wrapper executes the budget's plan --------------------------------------------------------------
def _budget_body(kept: str) -> dict:
    """Wrap without example inputs (the budget is decided at the first forward) and train beside plain PyTorch."""
    n = bmt.world_size()
    factory, inputs, _ = M.TOY["toy_gpt"]
    (ids,), _ = inputs()
    batch = (torch.cat([ids] * 2),)  # 4 rows, sliced per rank
    rows = 4 // n
    blocks = len(M.TOY["toy_gpt"][2])
    # The smallest and the largest budgets of the prefixes that buy some but not all of the choices
    # (one rank has no gather to save: activations only).
    partial = [budget_for("toy_gpt", n, k, rows) for k in range(1, 2 * blocks + 1)]
    partial = [(b, t) for b, t in partial if 0 < len(t) < 2 * blocks - (blocks if n == 1 else 0)]
    if not partial:  # 4 ranks: keeping everything costs less at the peak than any part of it (the pool)
        partial = [budget_for("toy_gpt", n, 2 * blocks, rows)]
    budget, taken = min(partial, key=lambda bt: bt[0]) if kept == "one choice" else max(partial, key=lambda bt: bt[0])
    wrapped: dict = {}

    def wrap(m: torch.nn.Module) -> torch.nn.Module:
        wrapped["m"] = BMTrainModelWrapper(m, memory_budget=budget)
        wrapped["before"] = decisions(wrapped["m"].plan)
        return wrapped["m"]

    def loss_fn(model: torch.nn.Module, *xs: torch.Tensor) -> torch.Tensor:
        return model(*xs).float().pow(2).mean()

    train_side_by_side(factory, wrap, [batch] * 3, optimizer="sgd", loss_fn=loss_fn)
    model = wrapped["m"]
    bmt.reset_comm_stats()
    loss_fn(model, batch[0].chunk(n)[bmt.rank()]).backward()
    stats = bmt.comm_stats()
    est = model.plan.estimates[str(n)]
    return {"before": wrapped["before"], "after": decisions(model.plan), "memory_budget": model.plan.memory_budget,
            "taken": [(c.kind, c.block) for c in taken], "budget": budget,
            "all_gather": stats.get("all_gather", {}).get("bytes", 0), "est_all_gather": est.comm_all_gather,
            "reduce_scatter": stats.get("reduce_scatter", {}).get("bytes", 0),
            "est_reduce_scatter": est.comm_reduce_scatter,
            "base_all_gather": base_plan("toy_gpt", n, rows).estimates[str(n)].comm_all_gather}


@pytest.mark.parametrize("world_size", [1, 2, 4])
@pytest.mark.parametrize("kept", ["one choice", "parameters and some activations"])
def test_wrapper_trains_like_pytorch_and_communicates_what_the_budget_planned(world_size: int, kept: str) -> None:
    for r in run_distributed(_budget_body, world_size, kept):
        assert all(c and z == 3 for _, c, z in r["before"]), "no activations known before the first forward"
        acts = {b for kind, b in r["taken"] if kind == ACTIVATIONS}
        params = {b for kind, b in r["taken"] if kind == PARAMETERS}
        assert r["after"] == [(g, g not in acts, 2 if g in params else 3) for g in M.TOY["toy_gpt"][2]]
        assert 0 < len(acts) + len(params)
        assert world_size == 4 or any(c or z == 3 for _, c, z in r["after"]), "some, not all"
        assert r["memory_budget"] == r["budget"]
        assert r["all_gather"] == r["est_all_gather"] and r["reduce_scatter"] == r["est_reduce_scatter"], r
        if params and world_size > 1:
            assert r["all_gather"] < r["base_all_gather"], "blocks kept gathered are not gathered again"
        else:
            assert r["est_all_gather"] == r["base_all_gather"]


def _impossible_body() -> str:
    factory = M.TOY["toy_gpt"][0]
    (ids,), _ = M.TOY["toy_gpt"][1]()
    need = peak(base_plan("toy_gpt", bmt.world_size()), bmt.world_size())
    model = BMTrainModelWrapper(copy.deepcopy(factory()), memory_budget=need - 1)  # activations not known yet
    messages = []
    for _ in range(2):  # the first forward stays pending: a second call raises the same
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no hook may fail behind the error
            with pytest.raises(MemoryBudgetError, match=f"Raise memory_budget to at least {need}") as info:
                model(ids)
        messages.append(str(info.value))
    return messages


def test_an_impossible_budget_raises_at_the_first_forward_on_every_rank() -> None:
    rank0, rank1 = run_distributed(_impossible_body, 2)
    assert rank0[0] == rank0[1] and rank1 == [f"rank 0: {m}" for m in rank0], (rank0, rank1)


def _kept_storage_body() -> list[tuple[int, int]]:
    factory, inputs, blocks = M.TOY["toy_gpt"]
    model = BMTrainModelWrapper(factory(), zero_level=2)
    (ids,), _ = inputs()
    seen = []
    for _ in range(3):
        model(ids).float().pow(2).mean().backward()
        storage = model.get_submodule(blocks[0])._bmt_group._dedicated[0].untyped_storage()
        seen.append((storage.data_ptr(), storage.nbytes()))
    return seen


def test_parameters_kept_gathered_reuse_their_storage_every_step() -> None:
    # A fresh allocation over 32 MB page-faults on CPU (60-200 ms for 50 MB here, against 12-16 ms to refill
    # one in place): a kept block that freed its buffer after each backward paid that every step.
    for seen in run_distributed(_kept_storage_body, 2):
        assert seen[0][1] > 0 and len(set(seen)) == 1, seen


# ---- a budget spent on host memory under an allocator that keeps freed tensors ---------------------------
def _budget_warnings(budget: int | None, threshold: str | None) -> list[str]:
    """The allocator warnings of one wrap, with ``THRESHOLD_VAR`` as given in this rank's environment."""
    saved = os.environ.pop(THRESHOLD_VAR, None)
    if threshold is not None:
        os.environ[THRESHOLD_VAR] = threshold
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            BMTrainModelWrapper(M.TOY["toy_gpt"][0](), memory_budget=budget)
    finally:
        os.environ.pop(THRESHOLD_VAR, None)
        if saved is not None:
            os.environ[THRESHOLD_VAR] = saved
    return [str(w.message) for w in caught if THRESHOLD_VAR in str(w.message)]


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the warning is about glibc's heap; this is not glibc")
def test_a_host_budget_under_glibcs_default_allocator_warns_with_the_setting_that_makes_it_exact() -> None:
    (found,) = run_distributed(_budget_warnings, 1, 1 << 40, None)
    assert len(found) == 1, found
    assert EXACT_SETTING in found[0] and "memory_budget=" in found[0] and "docs/design.md" in found[0]
    assert run_distributed(_budget_warnings, 1, 1 << 40, "65536") == [[]]  # the setting: nothing to say
    assert run_distributed(_budget_warnings, 1, None, None) == [[]]  # no budget: nothing is promised


def test_the_count_is_exact_off_glibc_or_with_the_threshold_fixed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(THRESHOLD_VAR, raising=False)
    monkeypatch.setattr(platform, "libc_ver", lambda: ("glibc", "2.36"))
    assert not counts_exactly()
    monkeypatch.setenv(THRESHOLD_VAR, "65536")
    assert counts_exactly()
    monkeypatch.setenv(THRESHOLD_VAR, "0x10000")  # glibc reads hex too
    assert counts_exactly()
    # Exact only at the documented value: above it the heap keeps the tensors under it (1 MiB grew a
    # width-384 model's heap by ~100 MiB a step), below it small tensors take whole pages; garbage is unset.
    for other in ("1048576", "4096", "0", "lots", ""):
        monkeypatch.setenv(THRESHOLD_VAR, other)
        assert not counts_exactly(), other
    monkeypatch.delenv(THRESHOLD_VAR)
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))  # musl, macOS: no glibc heap to warn of
    assert counts_exactly()
